"""The tuning loop: Optuna TPE (ask/tell) over a declared space, measured candidates, a cache entry.

Never imported on the dispatch path: ``import pallas_tune`` and cached calls do not load Optuna.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import itertools
import logging
import math
import platform
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from pallas_tune import chips, errors
from pallas_tune.errors import NoFeasibleConfigError
from pallas_tune.measure.timing import Measurement, Outcome, TrialRecord, make_inputs, measure
from pallas_tune.space import TrialEncoder

if TYPE_CHECKING:
    import pandas as pd

    from pallas_tune.tunable import TunableKernel

__all__ = ["TUNE_OPTIONS", "TuningResult", "tune"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningResult:
    """What :meth:`TunableKernel.tune` returns."""

    kernel: str
    chip: str
    key: str
    records: tuple[TrialRecord, ...]
    best_record: TrialRecord
    provenance: dict[str, Any]
    cache_path: str | None = None

    @property
    def best(self) -> dict[str, Any]:
        """The winning config."""
        return dict(self.best_record.config)

    @property
    def best_ms(self) -> float:
        """Median time of the winning config, in milliseconds."""
        return self.best_record.median_ms

    @property
    def trials(self) -> pd.DataFrame:
        """One row per trial: the parameters, ``outcome``, ``median_ms``, ``error`` and more."""
        import pandas as pd

        rows = []
        for r in self.records:
            row = {"number": r.number, **{k: _cell(v) for k, v in r.config.items()},
                   "outcome": r.outcome.value, "median_ms": r.median_ms,
                   "spread_ms": r.measurement.spread_ms if r.measurement else math.nan,
                   "compile_ms": r.measurement.compile_ms if r.measurement else math.nan,
                   "max_abs_err": r.max_abs_err if r.max_abs_err is not None else math.nan,
                   "error": r.error}
            rows.append(row)
        return pd.DataFrame(rows)

    def to_entry(self) -> dict[str, Any]:
        """The cache entry: best config, its time, every trial, provenance."""
        return {
            "key": self.key,
            "config": self.best,
            "median_ms": self.best_ms,
            "spread_ms": self.best_record.measurement.spread_ms
            if self.best_record.measurement else None,
            "provenance": self.provenance,
            "trials": [r.to_json() for r in self.records],
        }


def _cell(v: Any) -> Any:
    return str(v) if isinstance(v, tuple) else v


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("pallas-tune", "jax", "jaxlib", "libtpu", "libtpu-nightly", "optuna"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _freeze_key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(config.items()))


TIMERS: Final = ("wallclock", "profiler", "tpu-estimate")


def tune(
    kernel: TunableKernel,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    trials: int = 32,
    seed: int | None = None,
    timer: str = "wallclock",
    repeats: int = 5,
    warmup: int = 1,
    min_time_s: float = 0.0,
    write: bool = True,
    storage: str | None = None,
    study_name: str | None = None,
    chip: str | None = None,
    verbose: bool = False,
    max_attempts: int | None = None,
    feasibility: str = "auto",
    vreg_limit: float | None = None,
    workers: int = 2,
    standin: bool = True,
    estimate_fallback: str | None = None,
    isolate: bool | None = None,
    timeout_s: float | None = None,
    retime_top: int = 3,
    compile_workers: int | None = None,
    warm_start: int = 6,
    patience: int | None = None,
    sampler: str = "gp",
) -> TuningResult:
    """Searches ``kernel.space`` for these arguments and caches the winner.

    The search is an Optuna study. ``sampler="gp"`` (default) proposes, after the warm starts
    (``warm_start``: the declared default, the winners of the nearest tuned shapes, a roofline
    model's picks) and 5 random configs, the candidate of highest expected improvement under a
    Gaussian process fitted to every measurement (:mod:`pallas_tune.search`; spaces of more than
    ``GP_MAX_CANDIDATES`` points use TPE); ``sampler="tpe"`` is Optuna's multivariate TPE.

    Candidates that break the TPU block rules (or fail to trace) are recorded as ``infeasible``
    and never compiled or measured; no config is measured twice. When the space has no more
    points than ``trials``, every point is measured (exhaustive search is then cheaper).
    With ``storage`` (an Optuna storage URL such as ``sqlite:///tune.db``), the study is resumable
    and may be shared by several hosts: configs already measured there are not measured again.

    ``timer``: ``"wallclock"`` runs each candidate on this host's device (interpret mode on a
    CPU) and times calls around ``block_until_ready``; ``"profiler"`` takes device time of the
    kernel's ops from an in-process profiler trace (TPU, GPU), falling back to wall clock (and
    saying so per trial) where the trace has no device events, as on a CPU; ``"tpu-estimate"`` compiles each candidate deviceless for ``chip`` (a TPU) in
    ``workers`` processes and uses the compiler's static cycle estimate (``standin``: on a
    smaller problem with the same tiles where the kernel declares one), converted with the chip
    clock. Estimates are written as cache entries of kind ``estimate``. Before a stand-in is
    trusted, one candidate is estimated both ways; beyond 5% apart, the run compiles full
    problems instead. ``estimate_fallback="roofline"`` uses :mod:`pallas_tune.feasibility.roofline` where
    libtpu returns no estimate (else that is an error naming the libtpu version).

    ``feasibility`` (TPU chips): ``"model"`` rejects candidates the VMEM/SMEM model proves
    infeasible; ``"compile"`` also compiles borderline ones deviceless (libtpu) first; ``"auto"``
    (default) is ``"compile"`` where libtpu is installed and no TPU is attached, else ``"model"``
    (on a TPU the measurement compile itself is the second stage); ``"off"`` checks block rules only.
    ``vreg_limit`` rejects candidates whose largest in-kernel value exceeds that many vector
    register files (spill risk); by default it is only recorded.

    ``isolate`` measures in a worker process (see :mod:`pallas_tune.measure.worker`), with
    ``timeout_s`` per candidate (compile and run): a hang is recorded as ``timeout`` and a crash
    as ``runtime_error``, and tuning goes on. Giving ``timeout_s`` implies ``isolate``. In-process
    measurement (the default) is faster. Before the winner is written, the ``retime_top`` best
    are re-timed interleaved (A B C A B C ...) and the winner is chosen on those times.

    ``compile_workers``: in-process, a batch of that many candidates is compiled concurrently
    (threads, joblib) and then measured one at a time. Default: 1 on a CPU backend (compiling and
    interpreting share the cores), 4 on an accelerator.
    """
    if timer not in TIMERS:
        raise ValueError(f"timer={timer!r} must be one of {TIMERS}.")
    if trials < 1:
        raise ValueError(f"trials={trials} must be at least 1.")
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler={sampler!r} must be one of {SAMPLERS}.")
    import jax

    from pallas_tune.chips import chip_spec

    host_chip = chips.current_chip()
    chip = chips.normalize_chip(chip) if chip else host_chip
    estimating = timer == "tpu-estimate"
    if estimating:
        spec = chip_spec(chip)
        if spec.platform != "tpu":
            raise ValueError(f"timer='tpu-estimate' needs a TPU chip (chip='v6e', ...), not "
                             f"{chip!r}.")
        from pallas_tune.feasibility import compile as _compile

        if not _compile.libtpu_available():
            raise ValueError("timer='tpu-estimate' compiles with libtpu: pip install "
                             "'pallas-tune[tpu]'.")
        if not spec.clock_hz:
            raise ValueError(f"no clock frequency is known for {chip!r}, so its cycle "
                             "estimates cannot be converted to time.")
    elif chip != host_chip:
        raise ValueError(
            f"chip={chip!r}: wall-clock timing here measures {host_chip!r}, so it cannot fill the "
            f"cache of {chip!r}. Tune on that chip, or use timer='tpu-estimate' for TPU chips."
        )
    key = kernel.cache_key(*args, **kwargs)
    interpret = (not estimating) and chips.should_interpret()
    if estimating:
        from pallas_tune.feasibility import inspect as _inspect

        args_c, kwargs_c = _inspect.abstractify(args), dict(kwargs)
    else:
        args_c, kwargs_c = _concrete(kernel, args, kwargs, seed or 0)

    space = kernel.space
    encoder = TrialEncoder(space)
    records: list[TrialRecord] = []
    by_config: dict[tuple[Any, ...], TrialRecord] = {}
    reference_out = None
    if kernel.reference is not None and not estimating:
        reference_out = jax.block_until_ready(kernel.reference(*args_c, **kwargs_c))
    stage = "model" if estimating and feasibility == "auto" else _feasibility_mode(
        feasibility, chip)
    if isolate is None:
        isolate = timeout_s is not None
    if compile_workers is None:
        compile_workers = 1 if (estimating or jax.default_backend() == "cpu") else 4
    n_compile = max(1, compile_workers)
    runner = None
    if isolate and not estimating:
        from pallas_tune._refs import kernel_ref
        from pallas_tune.measure.worker import IsolatedRunner

        runner = IsolatedRunner(kernel_ref(kernel), args_c, kwargs_c, interpret=interpret,
                                timeout_s=timeout_s)
        if reference_out is not None:
            import numpy as np

            runner.set_reference(jax.tree_util.tree_map(np.asarray, reference_out))
    estimator = None
    standin_check: dict[str, Any] = {}
    if estimating:
        from pallas_tune.measure.estimate import Estimator

        estimator = Estimator(workers)
        if standin and kernel.standin is not None:
            standin, standin_check = _check_standin(kernel, estimator, args_c, kwargs_c, chip,
                                                    stage)

    def record(rec: TrialRecord) -> TrialRecord:
        records.append(rec)
        by_config[_freeze_key(rec.config)] = rec
        logger.debug("trial %d %s -> %s %.4g ms", rec.number, rec.config, rec.outcome.value,
                     rec.median_ms)
        if verbose:
            print(f"  [{rec.number:3d}] {rec.config} -> {rec.outcome.value}"
                  + (f" {rec.median_ms:.4g} ms" if rec.outcome is Outcome.OK else
                     f" ({rec.error[:120]})"))
        return rec

    def evaluate_many(configs: Sequence[dict[str, Any]]) -> list[TrialRecord]:
        """Evaluates new configs (filter first; estimates in parallel); returns one record each."""
        nonlocal reference_out
        todo: list[dict[str, Any]] = []
        names: list[str | None] = []  # Profiler event regex per candidate in todo.
        for config in configs:
            fz = _freeze_key(config)
            if fz in by_config or any(_freeze_key(c) == fz for c in todo):
                continue
            rejected, calls = _check(kernel, config, args_c, kwargs_c, chip, stage,
                                     vreg_limit=vreg_limit)
            if rejected is not None:
                outcome, error, detail, vmem = rejected
                record(TrialRecord(number=len(records), config=config, outcome=outcome,
                                   error=error, detail=detail, vmem_bytes=vmem))
            else:
                todo.append(config)
                names.append(_event_regex(calls))
        if estimator is not None and todo:
            for config, r in zip(todo, estimator.map(kernel, args_c, kwargs_c, todo, chip,
                                                     standin=standin), strict=True):
                if r.ok:
                    from pallas_tune.measure.estimate import cycles_to_ms

                    ms = cycles_to_ms(r.cycles, spec.clock_hz)
                    rec = TrialRecord(number=len(records), config=config, outcome=Outcome.OK,
                                      measurement=Measurement(times_ms=(ms,),
                                                              compile_ms=r.compile_s * 1e3),
                                      cycles=r.cycles, vmem_bytes=r.scoped_vmem_bytes,
                                      detail=f"estimate x{r.scale:g}" if r.scale != 1 else "")
                elif r.kind == "no_estimate":
                    if estimate_fallback != "roofline":
                        from pallas_tune.errors import MeasurementError

                        raise MeasurementError(r.message)
                    from pallas_tune.feasibility import inspect as _inspect
                    from pallas_tune.feasibility.roofline import roofline_calls

                    rl = roofline_calls(_inspect.find_pallas_calls(
                        kernel.fn, args_c, {**kwargs_c, **config}), spec)
                    rec = TrialRecord(number=len(records), config=config, outcome=Outcome.OK,
                                      measurement=Measurement(times_ms=(rl.time_ms,),
                                                              compile_ms=r.compile_s * 1e3),
                                      detail="roofline model (libtpu returned no estimate)")
                else:
                    from pallas_tune.feasibility import compile as _compile

                    outcome = (Outcome.INFEASIBLE
                               if r.kind in (*_compile.OOM_KINDS, _compile.BLOCK_RULE)
                               else Outcome.COMPILE_ERROR)
                    rec = TrialRecord(number=len(records), config=config, outcome=outcome,
                                      error=f"compiler: {r.message[:2000]}", detail=r.kind)
                record(rec)
        else:
            precompiled: dict[int, tuple[Any, float]] = {}
            if runner is None and n_compile > 1 and len(todo) > 1:
                import joblib

                from pallas_tune.measure.timing import compile_candidate

                jobs = (joblib.delayed(compile_candidate)(kernel.fn, args_c, {**kwargs_c, **c},
                                                          interpret=interpret) for c in todo)
                done = joblib.Parallel(n_jobs=n_compile, prefer="threads")(jobs)
                precompiled = dict(enumerate(done))
            for i, config in enumerate(todo):
                timing = dict(warmup=warmup, repeats=repeats, min_time_s=min_time_s,
                              timer=timer, event_regex=names[i] if timer == "profiler" else None)
                if runner is not None:
                    outcome, m, out, err, max_err = runner.measure(
                        config, want_output=reference_out is None, **timing)
                else:
                    outcome, m, out, err, max_err = measure(
                        kernel.fn, args_c, {**kwargs_c, **config}, interpret=interpret,
                        reference_out=reference_out, precompiled=precompiled.get(i), **timing)
                if outcome is Outcome.OK and reference_out is None:
                    reference_out = out  # The first good candidate (the default, tried first).
                    if runner is not None:
                        runner.set_reference(out)
                detail = err[1:err.index("]")] if err.startswith("[") else ""
                record(TrialRecord(number=len(records), config=config, outcome=outcome,
                                   measurement=m, error=err, max_abs_err=max_err,
                                   detail=detail))
        return [by_config[_freeze_key(c)] for c in configs]

    start = time.perf_counter()
    batch = estimator.workers if estimator is not None else n_compile
    try:
        if space.size <= trials:
            candidates = list(space.ordered_candidates())
            for i in range(0, len(candidates), max(batch, 1) * 4):
                evaluate_many(candidates[i:i + max(batch, 1) * 4])
            strategy = "exhaustive"
        else:
            strategy = sampler if space.size <= GP_MAX_CANDIDATES else "tpe"
            seeds = warm_start_configs(kernel, args_c, kwargs_c, chip, key, limit=warm_start) \
                if warm_start else [next(space.ordered_candidates())]
            _search(kernel, space, encoder, evaluate_many, records, by_config, trials=trials,
                    seed=seed, storage=storage, chip=chip, key=key, study_name=study_name,
                    max_attempts=max_attempts, batch=batch, warm=seeds, patience=patience,
                    sampler_name=strategy)
        retimed = None
        if not estimating and retime_top > 1:
            retimed = _retime(kernel, records, args_c, kwargs_c, interpret, runner, retime_top,
                              rounds=max(3, repeats))
    finally:
        if estimator is not None:
            estimator.close()
        if runner is not None:
            runner.close()
    elapsed = time.perf_counter() - start

    ok = [r for r in records if r.outcome is Outcome.OK]
    if not ok:
        summary: dict[str, int] = {}
        for r in records:
            summary[r.outcome.value] = summary.get(r.outcome.value, 0) + 1
        first = next((r for r in records if r.error), None)
        raise NoFeasibleConfigError(
            f"tuning {kernel.name!r} for {key!r}: none of {len(records)} candidates succeeded "
            f"({summary}). First error ({first.config if first else ''}): "
            f"{first.error if first else 'n/a'}"
        )
    best = min(ok, key=lambda r: r.median_ms)
    if retimed:
        best = retimed["winner"]
    if estimating:
        provenance = {
            "kind": "estimate",
            "chip": chip,
            "device_kind": spec.device_kind,
            "platform": "tpu",
            "interpret": False,
            "timer": timer,
            "timing_note": ("static cycle estimate of the TPU compiler (deviceless libtpu "
                            f"compile), converted at {spec.clock_hz / 1e9:g} GHz: an estimate, "
                            "not a measurement"),
            "clock_hz": spec.clock_hz,
            "standin": standin,
            "standin_check": standin_check,
        }
        if standin_check.get("unverified"):
            provenance["timing_note"] += ("; on a stand-in problem NOT checked against a full "
                                          "compile (the full problem did not fit in a worker)")
        if any("roofline" in r.detail for r in ok):
            provenance["timer"] = "tpu-estimate+roofline"
            provenance["timing_note"] += "; some candidates by the roofline MODEL (no estimate)"
    else:
        device = jax.devices()[0]
        provenance = {
            "kind": "measured",
            "chip": chip,
            "device_kind": device.device_kind,
            "platform": device.platform,
            "interpret": interpret,
            "timer": timer,
            "timing_note": ("wall clock of interpret-mode execution on the CPU: tracks grid "
                            "steps, not TPU performance") if interpret else "wall clock around "
                            "block_until_ready",
            "warmup": warmup,
            "repeats": repeats,
            "isolated": runner is not None,
            "timeout_s": timeout_s,
        }
        if retimed:
            provenance["retimed_interleaved"] = retimed["table"]
    provenance.update({
        "strategy": strategy,
        "trials_measured": len(ok),
        "tuning_s": round(elapsed, 3),
        "seed": seed,
        "versions": versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    })
    result = TuningResult(kernel=kernel.name, chip=chip, key=key, records=tuple(records),
                          best_record=best, provenance=provenance)
    if write:
        path = kernel.cache.write(chip, kernel.name, key, result.to_entry(),
                                  kind=provenance["kind"])
        result = dataclasses.replace(result, cache_path=path)
    return result


# The tuner options a kernel's .tune() takes out of its keyword arguments: tune()'s own.
TUNE_OPTIONS: Final = tuple(
    n for n, p in inspect.signature(tune).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY and n not in ("trials", "seed"))


def warm_start_configs(kernel: TunableKernel, args: Sequence[Any], kwargs: Mapping[str, Any],
                       chip: str, key: str, *, limit: int = 6) -> list[dict[str, Any]]:
    """Configs worth measuring first: the declared default, the winners of the nearest tuned
    shapes (same kernel and chip, by key distance; only those valid here), then for TPU chips
    the roofline model's best picks. Deduplicated, at most ``limit``."""
    from pallas_tune import keys
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.roofline import roofline_calls

    space = kernel.space
    out: list[dict[str, Any]] = []

    def add(config: Mapping[str, Any]) -> None:
        c = {k: config[k] for k in space.names}
        if c not in out and c in space and len(out) < limit:
            out.append(c)

    add(next(space.ordered_candidates()))
    near = []
    if kernel.key_fn is None:
        for other, entry, _ in kernel.cache.entries(chip, kernel.name):
            d = keys.key_distance(key, other)
            if other != key and math.isfinite(d):
                near.append((d, other, entry))
    from pallas_tune.space import _freeze

    for _, _, entry in sorted(near, key=lambda t: (t[0], t[1]))[:limit]:
        config = {k: _freeze(v) for k, v in entry.get("config", {}).items()}
        if set(config) == set(space.names) and not kernel.violations(config, args, kwargs):
            add(config)
    try:
        spec = chip_spec(chip)
    except ValueError:
        spec = None
    if spec is not None and spec.platform == "tpu" and len(out) < limit and space.size <= 4096:
        ranked = []
        for config in space:
            try:
                calls = _inspect.find_pallas_calls(kernel.fn, args, {**kwargs, **config})
            except Exception:  # noqa: BLE001
                continue
            if _inspect.block_rule_violations(calls):
                continue
            ranked.append((roofline_calls(calls, spec).time_s, config))
        for _, config in sorted(ranked, key=lambda t: t[0])[: limit - len(out)]:
            add(config)
    return out


def _event_regex(calls: Sequence[Any]) -> str | None:
    """A regex for the profiler events of a candidate's pallas_calls (by their names)."""
    import re

    names = dict.fromkeys(c.name for c in calls if c.name)
    return "|".join(re.escape(n) for n in names) or None


def _retime(kernel: TunableKernel, records: list[TrialRecord], args: Sequence[Any],
            kwargs: Mapping[str, Any], interpret: bool, runner: Any, top: int, *, rounds: int
            ) -> dict[str, Any] | None:
    """Re-times the ``top`` best interleaved; returns the winner and a table, or None."""
    from pallas_tune.measure.timing import retime_interleaved

    ok = sorted((r for r in records if r.outcome is Outcome.OK), key=lambda r: r.median_ms)
    if len(ok) < 2:
        return None
    cands = ok[:top]
    configs = [r.config for r in cands]
    try:
        if runner is not None:
            times = runner.retime(configs, rounds)
        else:
            times = retime_interleaved(kernel.fn, args, kwargs, configs, interpret=interpret,
                                       rounds=rounds)
    except Exception:  # noqa: BLE001 - keep the search's ranking if re-timing fails.
        logger.warning("interleaved re-timing failed; keeping the search's ranking",
                       exc_info=True)
        return None
    if not times:
        return None
    import statistics

    medians = [statistics.median(t) for t in times]
    i = min(range(len(cands)), key=lambda j: medians[j])
    table = [{"config": c, "search_median_ms": r.median_ms, "interleaved_median_ms": m,
              "interleaved_ms": t} for c, r, m, t in zip(configs, cands, medians, times,
                                                         strict=True)]
    return {"winner": cands[i], "table": table}


def _check_standin(kernel: TunableKernel, estimator: Any, args: Sequence[Any],
                   kwargs: Mapping[str, Any], chip: str, stage: str
                   ) -> tuple[bool, dict[str, Any]]:
    """Estimates one candidate on the stand-in and in full; trusts the stand-in within 5%.

    Picks the feasible candidate with the smallest stand-in scale above 1 (the cheapest full
    compile that still exercises the scaling)."""
    best = None
    for config in itertools.islice(kernel.space.ordered_candidates(), 512):
        if _check(kernel, config, args, kwargs, chip, stage)[0] is not None:
            continue
        try:
            _, _, scale = kernel.standin(list(args), dict(kwargs), dict(config))
        except Exception:  # noqa: BLE001 - a stand-in that fails is not used.
            return False, {"error": "stand-in raised"}
        if scale > 1 and (best is None or scale < best[1]):
            best = (config, scale)
    if best is None:
        return True, {"note": "no candidate needed a stand-in"}
    config, scale = best
    (scaled,) = estimator.map(kernel, args, kwargs, [config], chip, standin=True)
    (full,) = estimator.map(kernel, args, kwargs, [config], chip, standin=False)
    if scaled.ok and not full.ok and full.kind == "worker_crashed":
        # The full problem does not compile within a worker's memory (the LLO profile of a
        # large grid: 18 GB for a 8192x4096x14336 matmul with 256 tiles), so full compiles
        # cannot stand in for the stand-in either. Keep it, unverified, and say so.
        msg = (f"the full-problem compile of {config} died in its worker ({full.message}); "
               "the stand-in is used UNVERIFIED for this shape")
        errors.warn(msg)
        return True, {"config": config, "scale": scale, "trusted": False, "unverified": True,
                      "error": msg}
    if not (scaled.ok and full.ok):
        return False, {"config": config, "error": "stand-in or full compile failed"}
    err = abs(scaled.cycles - full.cycles) / full.cycles
    return err <= 0.05, {"config": config, "scale": scale, "relative_error": round(err, 4),
                         "trusted": err <= 0.05}


def _search(kernel: TunableKernel, space: Any, encoder: TrialEncoder, evaluate_many: Any,
         records: list[TrialRecord], by_config: dict[tuple[Any, ...], TrialRecord], *,
         trials: int, seed: int | None, storage: str | None, chip: str, key: str,
         study_name: str | None, max_attempts: int | None, batch: int,
         warm: Sequence[Mapping[str, Any]] = (), patience: int | None = None,
         sampler_name: str = "gp") -> None:
    """An Optuna study over the space via ask/tell, ``batch`` candidates in flight at a time.

    ``warm`` configs are enqueued first (in order); with ``patience``, the search stops once that
    many measurements in a row failed to improve the best by more than 1%."""
    import optuna

    optuna.logging.disable_default_handler()
    sampler = _sampler(space, encoder, sampler_name, seed=seed, trials=trials)
    study = optuna.create_study(
        direction="minimize", sampler=sampler, storage=storage,
        study_name=study_name or (f"{kernel.name}|{chip}|{key}" if storage else None),
        load_if_exists=storage is not None)
    _import_prior_trials(study, encoder, records, by_config)
    if not any(t.state.is_finished() for t in study.trials):
        for config in warm:
            study.enqueue_trial(encoder.encode(config), skip_if_exists=True)
    attempts = 0
    limit = max_attempts or max(10 * trials, 100)

    def measured() -> int:
        return sum(r.measurement is not None for r in records)

    def plateaued() -> bool:
        if not patience:
            return False
        times = [r.median_ms for r in records if r.measurement is not None]
        if len(times) <= patience:
            return False
        best_before = min(times[:-patience])
        return min(times[-patience:]) > best_before * 0.99

    # `trials` in total: a resumed study only measures what is missing.
    while (measured() < trials and attempts < limit and len(by_config) < space.size
           and not plateaued()):
        n = max(1, min(batch, trials - measured()))
        asked, configs = [], []
        for _ in range(n):  # Suggest before the next ask, so that one sees this one pending.
            asked.append(study.ask())
            configs.append(encoder.suggest(asked[-1]))
        attempts += n
        seen = [_freeze_key(c) in by_config for c in configs]
        recs = evaluate_many(configs)
        for trial, rec, was_seen in zip(asked, recs, seen, strict=True):
            trial.set_user_attr("outcome", rec.outcome.value)
            if not was_seen and rec.error:
                trial.set_user_attr("error", rec.error[:1000])
            if rec.outcome is Outcome.OK:
                trial.set_user_attr("median_ms", rec.median_ms)
                study.tell(trial, rec.median_ms)
            else:
                # +inf, not FAIL: TPE ignores failed trials and would keep proposing there.
                study.tell(trial, math.inf)


# Spaces up to this size are searched by the GP over every candidate; larger ones by TPE.
GP_MAX_CANDIDATES: Final = 50_000
SAMPLERS: Final = ("gp", "tpe")


def _sampler(space: Any, encoder: TrialEncoder, name: str, *, seed: int | None, trials: int
             ) -> Any:
    """``"gp"``: :class:`pallas_tune.search.CandidateSampler` (a GP's expected improvement over
    every candidate of the space); ``"tpe"`` (and spaces over ``GP_MAX_CANDIDATES``):
    multivariate TPE with constant liar. Both see running trials, so batches spread out."""
    import optuna

    if name == "gp" and space.size <= GP_MAX_CANDIDATES:
        from pallas_tune.search.gp import CandidateSampler

        return CandidateSampler([encoder.encode(c) for c in space], encoder.distributions,
                                values=encoder.values, seed=seed)
    return optuna.samplers.TPESampler(
        seed=seed, multivariate=True, group=False, constant_liar=True,
        n_startup_trials=max(1, min(5, trials // 5)))


def _feasibility_mode(mode: str, chip: str) -> str:
    if mode not in ("auto", "off", "model", "compile"):
        raise ValueError(f"feasibility={mode!r} must be auto, off, model or compile.")
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.chips import chip_spec

    try:
        spec = chip_spec(chip)
    except ValueError:
        return "off"
    if spec.platform != "tpu" or mode == "off":
        return "off"
    if mode == "auto":
        import jax

        on_tpu = jax.default_backend() == "tpu"
        return "compile" if _compile.libtpu_available() and not on_tpu else "model"
    return mode


def _check(kernel: TunableKernel, config: Mapping[str, Any], args: Sequence[Any],
           kwargs: Mapping[str, Any], chip: str, stage: str, *, vreg_limit: float | None = None
           ) -> tuple[tuple[Outcome, str, str, int | None] | None, list[Any]]:
    """Filters a candidate before any measurement: block rules, then (TPU) the VMEM model, then
    (borderline, stage "compile") a deviceless compile.

    Returns (rejection or None when it may be measured, the traced pallas_calls)."""
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model as feasibility
    from pallas_tune.errors import InvalidConfig
    from pallas_tune.chips import chip_spec

    try:
        calls = _inspect.find_pallas_calls(kernel.fn, args, {**kwargs, **config})
    except InvalidConfig as e:
        return (Outcome.INFEASIBLE, f"invalid config: {e}", "invalid_config", None), []
    except Exception as e:  # noqa: BLE001 - a candidate that cannot be traced cannot run.
        return (Outcome.COMPILE_ERROR, f"tracing failed: {type(e).__name__}: {e}", "trace_error",
                None), []
    if stage == "off":
        problems = _inspect.block_rule_violations(calls)
        if problems:
            return (Outcome.INFEASIBLE, "; ".join(problems), _compile.BLOCK_RULE, None), calls
        return None, calls
    spec = chip_spec(chip)
    verdict = feasibility.model_verdict(calls, spec, vreg_limit=vreg_limit)
    if kernel.vmem_estimate is not None and verdict.detail != _compile.BLOCK_RULE:
        est = int(kernel.vmem_estimate(*args, **kwargs, **config))
        verdict = feasibility.with_user_estimate(verdict, est)
    if verdict.status == "infeasible":
        return (Outcome.INFEASIBLE, f"model: {verdict.reason}", verdict.detail,
                verdict.vmem_bytes), calls
    if verdict.status in ("uncertain", "borderline") and stage == "compile":
        result = _compile.compile_deviceless(kernel.fn, args, {**kwargs, **config}, chip=chip)
        if not result.ok:
            outcome = (Outcome.INFEASIBLE if result.kind in (*_compile.OOM_KINDS,
                                                              _compile.BLOCK_RULE)
                       else Outcome.COMPILE_ERROR)
            return (outcome, f"compiler: {result.message[:2000]}", result.kind,
                    verdict.vmem_bytes), calls
    return None, calls


def _import_prior_trials(study: Any, encoder: TrialEncoder,
                         records: list[TrialRecord], by_config: dict[tuple[Any, ...], TrialRecord]
                         ) -> None:
    """Adopts the finished trials of a resumed (stored) study, so nothing is measured twice."""
    for t in study.trials:
        if not t.state.is_finished() or not t.params:
            continue
        try:
            config = encoder.decode(t.params)
        except (KeyError, IndexError):
            continue
        fz = _freeze_key(config)
        if fz in by_config:
            continue
        outcome = Outcome(t.user_attrs.get("outcome", "ok" if t.value is not None else
                                           "runtime_error"))
        m = None
        if outcome is Outcome.OK and t.value is not None:
            m = Measurement(times_ms=(float(t.value),), compile_ms=math.nan)
        rec = TrialRecord(number=len(records), config=config, outcome=outcome, measurement=m,
                          error=t.user_attrs.get("error", "") + " (from the stored study)")
        records.append(rec)
        by_config[fz] = rec


def _concrete(kernel: TunableKernel, args: Sequence[Any], kwargs: Mapping[str, Any],
              seed: int) -> tuple[list[Any], dict[str, Any]]:
    import jax

    needs = any(isinstance(x, jax.ShapeDtypeStruct)
                for x in jax.tree_util.tree_leaves((list(args), dict(kwargs))))
    if not needs:
        return list(args), dict(kwargs)
    if kernel.inputs is not None:
        new_args, new_kwargs = kernel.inputs(*args, **kwargs)
        return list(new_args), dict(new_kwargs)
    return make_inputs(args, seed), dict(kwargs)
