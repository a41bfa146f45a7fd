"""Every option of a tuning run, in one frozen dataclass, validated once.

``pallas_tune.tune``, ``kernel.tune`` and ``pallas-tune sweep`` all build a
:class:`TuneOptions`; this docstring is where each option is documented.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from pallas_tune.errors import TuneOptionError

__all__ = ["PHASES", "SAMPLERS", "TIMERS", "TuneOptions"]

TIMERS: Final = ("auto", "wallclock", "profiler", "tpu-estimate")
SAMPLERS: Final = ("gp", "tpe")
FEASIBILITY: Final = ("auto", "off", "model", "compile")
PHASES: Final = ("trace", "compile", "run")
# Default time limit of each phase of a candidate in a worker (seconds). The "check" phase (a
# deviceless compile of a candidate the VMEM model is unsure about) has the compile limit.
DEFAULT_LIMITS: Final = {"trace": 120.0, "compile": 600.0, "run": 300.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuneOptions:
    """How a kernel is tuned. Build it with keywords; every value is checked here.

    Search
      trials: distinct programs to measure (32; at most 100,000). Candidates that are
        rejected before running, and candidates whose lowered program was already measured
        (``duplicate_of``), do not count. When the space has no more points than ``trials``,
        every point is evaluated.
      seed: seeds the sampler and the random inputs made for ``ShapeDtypeStruct`` arguments
        (0 to 2**32 - 1).
      sampler: ``"gp"`` (default: a Gaussian process's expected improvement over every
        candidate; TPE over 50,000 points) or ``"tpe"`` (Optuna's multivariate TPE).
      warm_start: how many warm configs to try first (6): the declared default, the winners of
        the nearest tuned shapes, and for TPU chips the roofline model's picks. 0: only the
        default.
      warm_configs: configs of your own to evaluate first, right after the declared default
        (always evaluated first: it is the baseline of every speed-up) and before the warm
        starts (they do not count against ``warm_start``): the config you run today, or
        another library's defaults, so that the tuned result is never worse than it by the
        run's own timer. More of them than ``trials - 1`` warns: the last are not evaluated.
        Each must be a point of the call's space (a mapping of every parameter to one of its
        values).
      transfer: learn from the trials this kernel measured at other shapes and chips (the
        trial ledgers beside the caches): they give the GP sampler its prior mean (True).
        Estimates inform estimates; a measured run also learns from the compiler's estimates
        for the same chip (its own key's first). The result's provenance names them
        (``prior``).
      confirm_top: measure only the compiler estimate's best this many configs for this
        chip and key (from its ``tpu-estimate`` ledger), and keep the fastest measured (0:
        off). The provenance lists them with their estimates (``confirmed``).
      patience: stop once this many measured trials in a row improved the best by under 1%.
      max_attempts: most candidates to ask the sampler for (default ``max(10 * trials, 100)``).
      storage, study_name: an Optuna storage (URL such as ``sqlite:///tune.db`` or
        ``postgresql://...``, or a storage object) and study name (default
        ``"<kernel>|<chip>|<key>|kernel=<fingerprint>"``, without the last part when the
        kernel's code fingerprint is unknown): the study is then resumable and may be shared
        by several hosts; configs and programs already evaluated there are not evaluated
        again. Changed kernel code gets a study of its own.

    Timing
      timer: ``"auto"`` (default: ``"profiler"`` where a GPU or TPU measures, ``"wallclock"``
        in CPU interpret mode), ``"wallclock"`` (around ``block_until_ready``), ``"profiler"``
        (device time from a ``jax.profiler`` trace of the candidate's whole program; falls
        back to wall clock, per trial and saying so, without device events) or
        ``"tpu-estimate"`` (the TPU compiler's static cycle estimate, deviceless; needs
        libtpu and a TPU ``chip``; written as cache entries of kind ``estimate``).
      chip: the chip to tune for (default: this host's). Another chip needs ``tpu-estimate``.
        A known chip (``pallas_tune.chips.known_chips()``), or a TPU, NVIDIA or AMD one.
      warmup: untimed calls before timing (1; the first is the correctness check).
      repeats: timed runs per candidate (5), cut short by ``max_time_s`` and ``slow_factor``.
      min_time_s: keep timing until this much time has passed (0).
      max_time_s: stop timing a candidate after this much time (1.0 s; at least one run).
      slow_factor: stop timing a candidate once the fastest of two runs is over this many times
        the best so far, and record it as ``slow`` (2.0; None: never).
      retime_top: re-time this many of the best, interleaved, to choose the winner (3; 0 or 1:
        the search's best wins). ``best_ms`` is the median of that final re-ranking.
      xla: also time the kernel's reference (plain JAX, compiled by XLA) in that final
        re-ranking, with the same timer; where it is faster the cache entry says so and calls
        run the reference. Default (None): on where a device measures (TPU, GPU) for kernels
        declaring ``fallback="reference"``, off in CPU interpret mode (whose timings say
        nothing of a kernel against XLA). With ``tpu-estimate`` the reference's whole program
        is estimated (never on a stand-in), on by default for the same kernels; where libtpu
        gives some of its ops no estimate the figure is a lower bound, recorded as
        ``xla_partial``, and never makes XLA win. True: for any kernel with a reference, also
        in interpret mode.

    Isolation and resources
      isolate: evaluate every candidate (trace, screening, compile, run) in a worker process
        with a time limit per phase: a hang or a crash becomes the trial's outcome. Default
        (None): on where a device measures (TPU, GPU), off for CPU interpret-mode runs.
        ``tpu-estimate`` always uses workers.
      timeout_s: time limit of each phase in a worker: one number for every phase, or a
        mapping over ``trace``, ``compile``, ``run`` (defaults 120, 600 and 300 s). Giving it
        implies ``isolate`` unless that is set.
      workers: worker processes for ``tpu-estimate`` compiles (2; at most 4 per CPU, or 8).
        Measurement uses one.
      compile_workers: in-process, compile a batch in this many threads, then measure one at
        a time (default 1 on a CPU backend, 4 on an accelerator).
      worker_memory_gb: address-space cap of each ``tpu-estimate`` compile worker, in GiB; a
        compile past it fails as that trial's outcome instead of taking the host's memory
        (default None: the host's memory less a reserve, split between the workers).

    Screening
      feasibility: ``"auto"`` (default; on TPU chips ``"compile"`` where libtpu is installed and
        no TPU measures, else ``"model"``; on other chips the block rules only), ``"model"``
        (block rules and the VMEM/SMEM model), ``"compile"`` (also a deviceless compile of what
        the model is unsure about), ``"off"`` (nothing but the trace itself).
      vreg_limit: reject candidates whose largest in-kernel value exceeds this many vector
        register files (spill risk); by default only recorded.
      standin: for ``tpu-estimate``, estimate on the kernel's declared stand-in problem, once
        one candidate has shown it within 5% of the full problem (True).
      estimate_fallback: where libtpu gives a config no estimate (its profiler aborts, its
        profile cannot follow the program, or only the profiling flag makes it run out of
        VMEM), rank it by a model, labelled as such: ``"model"`` (pallas-tune's fitted model,
        feasibility.fitted: on v6e and 7x its constants fitted to published real-TPU winners,
        elsewhere to libtpu's v6e estimates) or ``"roofline"`` (the plain roofline
        model), calibrated onto libtpu's figures (pallas_tune.measure.scale). With ``"model"``
        every candidate is ranked by the larger of libtpu's figure and the calibrated model's
        (on real-TPU winners it ranked better than libtpu's alone), and where libtpu figures
        fewer than 3 candidates, by the model alone. Default None: libtpu's figure only, and a
        tune whose first candidates all get none stops and says why.
      estimate_correction: add to libtpu's v6e estimate two terms it may leave out on the chip
        (exposed DMA at the chip's bandwidth, per-step overhead;
        :mod:`pallas_tune.measure.correction`); trials keep libtpu's own cycles. False by
        default: checked against real-v6e winners on keys it was not fitted on, it ranks them
        no better than libtpu's figure as it is (benchmarks/results/estimate_fidelity.md).

    Training
      grad: also tune the kernel's backward (``@tunable(backward=...)``) for the backward's
        arguments made from these (``backward_args``), against its own reference, after the
        forward; the result's ``backward`` holds its result (False). A ``"xla"`` backward has
        nothing to tune; a kernel without a backward is an error.

    Output
      write: write the winner to the user cache (True).
      callbacks: functions called as ``callback(record, progress)`` after every trial (a
        :class:`~pallas_tune.measure.records.TrialRecord` and a
        :class:`~pallas_tune.tuning.result.Progress`); from the API only.
    """

    trials: int = 32
    seed: int | None = None
    sampler: str = "gp"
    warm_start: int = 6
    warm_configs: tuple[Mapping[str, Any], ...] = ()
    transfer: bool = True
    confirm_top: int = 0
    patience: int | None = None
    max_attempts: int | None = None
    storage: Any = None
    study_name: str | None = None
    timer: str = "auto"
    chip: str | None = None
    warmup: int = 1
    repeats: int = 5
    min_time_s: float = 0.0
    max_time_s: float = 1.0
    slow_factor: float | None = 2.0
    retime_top: int = 3
    xla: bool | None = None
    isolate: bool | None = None
    timeout_s: float | Mapping[str, float] | None = None
    workers: int = 2
    compile_workers: int | None = None
    worker_memory_gb: float | None = None
    feasibility: str = "auto"
    vreg_limit: float | None = None
    standin: bool = True
    estimate_fallback: str | None = None
    estimate_correction: bool = False
    grad: bool = False
    write: bool = True
    callbacks: tuple[Callable[..., Any], ...] = ()

    def __post_init__(self) -> None:
        for name, (low, high) in _COUNTS.items():
            if getattr(self, name) is not None or name not in _OPTIONAL:
                _whole(self, name, low, high() if callable(high) else high)
        _choice(self, "sampler", SAMPLERS)
        _choice(self, "timer", TIMERS)
        _choice(self, "feasibility", FEASIBILITY)
        _choice(self, "estimate_fallback", (None, "roofline", "model"))
        _number(self, "min_time_s", 0.0)
        _number(self, "max_time_s", 0.0, strict=True)
        if self.max_time_s < self.min_time_s:
            raise TuneOptionError(f"max_time_s={self.max_time_s} is below min_time_s="
                                  f"{self.min_time_s}; raise max_time_s or lower min_time_s.")
        if self.slow_factor is not None:
            _number(self, "slow_factor", 1.0, strict=True)
        if self.vreg_limit is not None:
            _number(self, "vreg_limit", 0.0, strict=True)
        if self.worker_memory_gb is not None:
            _number(self, "worker_memory_gb", 0.0, strict=True)
        for name in ("isolate", "xla"):
            if getattr(self, name) not in (None, True, False):
                raise TuneOptionError(f"{name}={getattr(self, name)!r} must be True, False or "
                                      "None (automatic).")
        for name in ("standin", "write", "grad"):
            if not isinstance(getattr(self, name), bool):
                raise TuneOptionError(f"{name}={getattr(self, name)!r} must be True or False.")
        for name in ("chip", "study_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise TuneOptionError(f"{name}={value!r} must be a non-empty string or None.")
        self._check_chip()
        self._check_storage()
        object.__setattr__(self, "timeout_s", _limits(self.timeout_s))
        callbacks = (self.callbacks,) if callable(self.callbacks) else tuple(self.callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TuneOptionError(f"callbacks holds {cb!r}, which is not callable; pass "
                                      "functions taking (record, progress).")
        object.__setattr__(self, "callbacks", callbacks)
        object.__setattr__(self, "warm_configs", _configs(self.warm_configs))

    def _check_chip(self) -> None:
        from pallas_tune import chips

        if self.chip is not None and not chips.recognized(self.chip):
            raise TuneOptionError(
                f"chip={self.chip!r} is not a chip pallas-tune knows; give one of "
                f"{chips.known_chips()} (short names such as 'v6e' or a device_kind such as "
                "'TPU v6 lite' work too), or None for this host's.")

    def _check_storage(self) -> None:
        s = self.storage
        if isinstance(s, str):
            from pallas_tune.tuning.storage import check_url

            check_url(s)
        elif s is not None and not hasattr(s, "create_new_study"):
            raise TuneOptionError(f"storage={s!r} must be an Optuna storage URL such as "
                                  "'sqlite:///tune.db' or a storage object.")

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each option's documentation, read from this class's docstring (the CLI's help)."""
        import inspect
        import re

        out: dict[str, str] = {}
        names: list[str] = []
        for line in (inspect.getdoc(cls) or "").splitlines():
            entry = re.match(r"^  (\w+(?:, \w+)*): (.*)$", line)
            if entry:
                names = entry.group(1).split(", ")
                for n in names:
                    out[n] = entry.group(2)
            elif line.startswith("    ") and names:
                for n in names:
                    out[n] += " " + line.strip()
            else:
                names = []
        return out

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names (what ``kernel.tune`` takes out of its keyword arguments)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def build(cls, options: TuneOptions | None = None, **overrides: Any) -> TuneOptions:
        """``options`` with ``overrides`` applied (a fresh default when ``options`` is None).
        Unknown names raise :class:`TuneOptionError` naming the close matches."""
        unknown = sorted(set(overrides) - set(cls.names()))
        if unknown:
            import difflib

            hints = {u: difflib.get_close_matches(u, cls.names(), n=1) for u in unknown}
            detail = ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                               for u, h in hints.items())
            raise TuneOptionError(f"unknown tuning option(s) {detail}; the options are the "
                                  "fields of pallas_tune.TuneOptions.")
        if options is None:
            return cls(**overrides)
        if not isinstance(options, TuneOptions):
            raise TuneOptionError(f"options={options!r} must be a TuneOptions.")
        return dataclasses.replace(options, **overrides) if overrides else options

    @property
    def limits(self) -> dict[str, float]:
        """The time limit of each phase in a worker, in seconds."""
        limits = dict(self.timeout_s)  # type: ignore[arg-type]
        limits["check"] = limits["compile"]
        return limits

    @property
    def isolated_by_choice(self) -> bool | None:
        """``isolate`` as given, or True where ``timeout_s`` was given (None: automatic)."""
        if self.isolate is not None:
            return self.isolate
        return True if self.timeout_s != DEFAULT_LIMITS else None


def _max_workers() -> int:
    import os

    return max(8, 4 * (os.cpu_count() or 1))


# Whole-number options: (lowest, highest or a function of the host giving it). The highest are
# far past any real use; they stop a typo (an extra three zeros) from starting 10**9 processes
# or a study that never ends.
_COUNTS: Final[dict[str, tuple[int, int | Callable[[], int]]]] = {
    "trials": (1, 100_000), "warm_start": (0, 1000), "warmup": (0, 1000),
    "repeats": (1, 100_000), "retime_top": (0, 1000), "workers": (1, _max_workers),
    "seed": (0, 2**32 - 1), "patience": (1, 1_000_000), "max_attempts": (1, 10_000_000),
    "compile_workers": (1, _max_workers), "confirm_top": (0, 10_000),
}
_OPTIONAL: Final = ("seed", "patience", "max_attempts", "compile_workers")


def _whole(o: TuneOptions, name: str, low: int, high: int) -> None:
    v = getattr(o, name)
    if isinstance(v, bool) or not isinstance(v, int) or not low <= v <= high:
        raise TuneOptionError(f"{name}={v!r} must be a whole number from {low} to {high}.")


def _number(o: TuneOptions, name: str, low: float, *, strict: bool = False) -> None:
    v = getattr(o, name)
    bad = (isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
           or (v <= low if strict else v < low))
    if bad:
        raise TuneOptionError(f"{name}={v!r} must be a finite number {'>' if strict else '>='} "
                              f"{low:g}.")


def _choice(o: TuneOptions, name: str, allowed: tuple[Any, ...]) -> None:
    v = getattr(o, name)
    if v not in allowed:
        raise TuneOptionError(f"{name}={v!r} must be one of {allowed}.")


def _configs(value: Any) -> tuple[dict[str, Any], ...]:
    """``warm_configs`` as a tuple of plain dicts (one mapping alone counts as one config).
    Whether each is a point of the space is checked where the space is known (the tune)."""
    configs = (value,) if isinstance(value, Mapping) else value
    if isinstance(configs, str | bytes) or not isinstance(configs, Sequence):
        raise TuneOptionError(f"warm_configs={value!r} must be a list of configs (mappings of "
                              "parameter names to values), e.g. [{'bq': 512, 'bkv': 512}].")
    for i, c in enumerate(configs):
        if not isinstance(c, Mapping) or not c or not all(isinstance(k, str) for k in c):
            raise TuneOptionError(f"warm_configs[{i}]={c!r} must be a non-empty mapping of "
                                  "parameter names to values, e.g. {'bq': 512, 'bkv': 512}.")
    return tuple(dict(c) for c in configs)


def _limits(value: Any) -> dict[str, float]:
    if value is None:
        return dict(DEFAULT_LIMITS)
    if isinstance(value, Mapping):
        unknown = set(value) - set(PHASES)
        if unknown:
            raise TuneOptionError(f"timeout_s names {sorted(unknown)}; the phases are {PHASES}.")
        limits = {**DEFAULT_LIMITS, **value}
    else:
        limits = dict.fromkeys(PHASES, value)
    for phase, v in limits.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0 or math.isnan(v):
            raise TuneOptionError(f"timeout_s for {phase} = {v!r} must be a number of seconds "
                                  "> 0.")
    return {k: float(v) for k, v in limits.items()}
