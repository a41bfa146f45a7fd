"""The tuning loop: Optuna TPE (ask/tell) over a declared space, measured candidates, a cache entry.

Never imported on the dispatch path: ``import pallas_tune`` and cached calls do not load Optuna.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import math
import platform
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Final

from pallas_tune import chips
from pallas_tune.errors import NoFeasibleConfigError
from pallas_tune.measure import Measurement, Outcome, TrialRecord, make_inputs, measure

if TYPE_CHECKING:
    import pandas as pd

    from pallas_tune.tunable import TunableKernel

__all__ = ["TUNE_OPTIONS", "TuningResult", "tune"]

logger = logging.getLogger(__name__)

TUNE_OPTIONS: Final = (
    "timer", "repeats", "warmup", "write", "storage", "chip", "verbose", "min_time_s",
    "study_name", "max_attempts", "feasibility", "vreg_limit",
)


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


class _Encoder:
    """Maps configs to Optuna distributions: ordered ints as an integer index, else categorical.

    An integer index over the sorted choices keeps their order, which TPE's Parzen estimators
    exploit (powers of two become log-spaced steps); tuples and strings stay categorical.
    """

    def __init__(self, space: Any):
        self.params = space.params
        self.ordinal = {
            p.name: all(isinstance(c, int | float) and not isinstance(c, bool) for c in p.choices)
            for p in self.params
        }
        self.sorted = {p.name: sorted(p.choices) if self.ordinal[p.name] else list(p.choices)
                       for p in self.params}

    def suggest(self, trial: Any) -> dict[str, Any]:
        out = {}
        for p in self.params:
            choices = self.sorted[p.name]
            if len(choices) == 1:
                out[p.name] = choices[0]
            elif self.ordinal[p.name]:
                out[p.name] = choices[trial.suggest_int(p.name, 0, len(choices) - 1)]
            else:
                out[p.name] = choices[trial.suggest_categorical(p.name, list(range(len(choices))))]
        return out

    def encode(self, config: Mapping[str, Any]) -> dict[str, int]:
        return {p.name: self.sorted[p.name].index(config[p.name]) for p in self.params
                if len(p.choices) > 1}


def _freeze_key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(config.items()))


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
) -> TuningResult:
    """Runs a TPE study over ``kernel.space`` for these arguments and caches the winner.

    Candidates that break the TPU block rules (or fail to trace) are recorded as ``infeasible``
    and never compiled or measured; no config is measured twice. When the space has no more
    points than ``trials``, every point is measured (exhaustive search is then cheaper).
    With ``storage`` (an Optuna storage URL such as ``sqlite:///tune.db``), the study is resumable
    and may be shared by several hosts: configs already measured there are not measured again.

    ``feasibility`` (TPU chips): ``"model"`` rejects candidates the VMEM/SMEM model proves
    infeasible; ``"compile"`` also compiles borderline ones deviceless (libtpu) first; ``"auto"``
    (default) is ``"compile"`` where libtpu is installed and no TPU is attached, else ``"model"``
    (on a TPU the measurement compile itself is the second stage); ``"off"`` checks block rules only.
    ``vreg_limit`` rejects candidates whose largest in-kernel value exceeds that many vector
    register files (spill risk); by default it is only recorded.
    """
    if timer != "wallclock":
        raise ValueError(f"timer={timer!r}: this version implements only 'wallclock'.")
    if trials < 1:
        raise ValueError(f"trials={trials} must be at least 1.")
    import jax
    import optuna

    host_chip = chips.current_chip()
    chip = chips.normalize_chip(chip) if chip else host_chip
    if chip != host_chip and timer == "wallclock":
        raise ValueError(
            f"chip={chip!r}: wall-clock timing here measures {host_chip!r}, so it cannot fill the "
            f"cache of {chip!r}. Tune on that chip, or within pallas_tune.target({chip!r}) with a "
            "timer that models it."
        )
    key = kernel.cache_key(*args, **kwargs)
    interpret = chips.should_interpret()
    concrete_args = _concrete(kernel, args, kwargs, seed or 0)
    args_c, kwargs_c = concrete_args

    space = kernel.space
    encoder = _Encoder(space)
    records: list[TrialRecord] = []
    by_config: dict[tuple[Any, ...], TrialRecord] = {}
    reference_out = None
    if kernel.reference is not None:
        reference_out = jax.block_until_ready(kernel.reference(*args_c, **kwargs_c))

    stage = _feasibility_mode(feasibility, chip)

    def evaluate(config: dict[str, Any]) -> TrialRecord:
        nonlocal reference_out
        fz = _freeze_key(config)
        if fz in by_config:
            return by_config[fz]
        number = len(records)
        rejected = _check(kernel, config, args_c, kwargs_c, chip, stage, vreg_limit=vreg_limit)
        if rejected is not None:
            outcome, error, detail, vmem = rejected
            rec = TrialRecord(number=number, config=config, outcome=outcome, error=error,
                              detail=detail, vmem_bytes=vmem)
        else:
            outcome, m, out, err, max_err = measure(
                kernel.fn, args_c, {**kwargs_c, **config}, interpret=interpret,
                reference_out=reference_out, warmup=warmup, repeats=repeats,
                min_time_s=min_time_s)
            if outcome is Outcome.OK and reference_out is None:
                reference_out = out  # The first good candidate (the default, tried first).
            rec = TrialRecord(number=number, config=config, outcome=outcome, measurement=m,
                              error=err, max_abs_err=max_err)
        records.append(rec)
        by_config[fz] = rec
        logger.debug("trial %d %s -> %s %.4g ms", number, config, rec.outcome.value,
                     rec.median_ms)
        if verbose:
            print(f"  [{number:3d}] {config} -> {rec.outcome.value}"
                  + (f" {rec.median_ms:.4g} ms" if rec.outcome is Outcome.OK else
                     f" ({rec.error[:120]})"))
        return rec

    start = time.perf_counter()
    measured = lambda: sum(r.measurement is not None for r in records)  # noqa: E731
    if space.size <= trials:
        for config in space.ordered_candidates():
            evaluate(config)
        strategy = "exhaustive"
    else:
        strategy = "tpe"
        optuna.logging.disable_default_handler()
        sampler = optuna.samplers.TPESampler(
            seed=seed, multivariate=True, group=False, constant_liar=True,
            n_startup_trials=max(1, min(10, trials // 3)))
        study = optuna.create_study(
            direction="minimize", sampler=sampler, storage=storage,
            study_name=study_name or (f"{kernel.name}|{chip}|{key}" if storage else None),
            load_if_exists=storage is not None)
        _import_prior_trials(study, encoder, space, records, by_config)
        if not any(t.state.is_finished() for t in study.trials):
            default = next(space.ordered_candidates())
            study.enqueue_trial(encoder.encode(default))
        attempts = 0
        limit = max_attempts or max(10 * trials, 100)
        budget = trials  # In total: a resumed study only measures what is missing.
        while measured() < budget and attempts < limit and len(by_config) < space.size:
            attempts += 1
            trial = study.ask()
            config = encoder.suggest(trial)
            seen = _freeze_key(config) in by_config
            rec = evaluate(config)
            trial.set_user_attr("outcome", rec.outcome.value)
            if not seen and rec.error:
                trial.set_user_attr("error", rec.error[:1000])
            if rec.outcome is Outcome.OK:
                trial.set_user_attr("median_ms", rec.median_ms)
                study.tell(trial, rec.median_ms)
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
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
    device = jax.devices()[0]
    provenance = {
        "kind": "measured",
        "chip": chip,
        "device_kind": device.device_kind,
        "platform": device.platform,
        "interpret": interpret,
        "timer": timer,
        "timing_note": ("wall clock of interpret-mode execution on the CPU: tracks grid steps, "
                        "not TPU performance") if interpret else "wall clock around "
                        "block_until_ready",
        "warmup": warmup,
        "repeats": repeats,
        "strategy": strategy,
        "trials_measured": len(ok),
        "tuning_s": round(elapsed, 3),
        "seed": seed,
        "versions": versions(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    result = TuningResult(kernel=kernel.name, chip=chip, key=key, records=tuple(records),
                          best_record=best, provenance=provenance)
    if write:
        path = kernel.cache.write(chip, kernel.name, key, result.to_entry())
        result = dataclasses.replace(result, cache_path=path)
    return result


def _feasibility_mode(mode: str, chip: str) -> str:
    if mode not in ("auto", "off", "model", "compile"):
        raise ValueError(f"feasibility={mode!r} must be auto, off, model or compile.")
    from pallas_tune import _compile
    from pallas_tune.hardware import chip_spec

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
           ) -> tuple[Outcome, str, str, int | None] | None:
    """Filters a candidate before any measurement: block rules, then (TPU) the VMEM model, then
    (borderline, stage "compile") a deviceless compile. Returns None when it may be measured."""
    from pallas_tune import _compile, _inspect, feasibility
    from pallas_tune.hardware import chip_spec

    try:
        calls = _inspect.find_pallas_calls(kernel.fn, args, {**kwargs, **config})
    except Exception as e:  # noqa: BLE001 - a candidate that cannot be traced cannot run.
        return (Outcome.COMPILE_ERROR, f"tracing failed: {type(e).__name__}: {e}", "trace_error",
                None)
    if stage == "off":
        problems = _inspect.block_rule_violations(calls)
        if problems:
            return Outcome.INFEASIBLE, "; ".join(problems), _compile.BLOCK_RULE, None
        return None
    spec = chip_spec(chip)
    verdict = feasibility.model_verdict(calls, spec, vreg_limit=vreg_limit)
    if kernel.vmem_estimate is not None and verdict.detail != _compile.BLOCK_RULE:
        est = int(kernel.vmem_estimate(*args, **kwargs, **config))
        verdict = feasibility._with_estimate(verdict, est)
    if verdict.status == "infeasible":
        return Outcome.INFEASIBLE, f"model: {verdict.reason}", verdict.detail, verdict.vmem_bytes
    if verdict.status == "borderline" and stage == "compile":
        result = _compile.compile_deviceless(kernel.fn, args, {**kwargs, **config}, chip=chip)
        if not result.ok:
            outcome = (Outcome.INFEASIBLE if result.kind in (*_compile.OOM_KINDS,
                                                              _compile.BLOCK_RULE)
                       else Outcome.COMPILE_ERROR)
            return outcome, f"compiler: {result.message[:2000]}", result.kind, verdict.vmem_bytes
    return None


def _import_prior_trials(study: Any, encoder: _Encoder, space: Any,
                         records: list[TrialRecord], by_config: dict[tuple[Any, ...], TrialRecord]
                         ) -> None:
    """Adopts the finished trials of a resumed (stored) study, so nothing is measured twice."""
    for t in study.trials:
        if not t.state.is_finished() or not t.params:
            continue
        config = {}
        try:
            for p in space.params:
                choices = encoder.sorted[p.name]
                config[p.name] = choices[t.params[p.name]] if len(choices) > 1 else choices[0]
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
