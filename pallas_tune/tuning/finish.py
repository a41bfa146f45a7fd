"""After the search: the winner's final re-ranking, the result and its provenance, the cache."""

from __future__ import annotations

import datetime
import logging
import math
import platform
import statistics
from collections.abc import Mapping
from typing import Any

from pallas_tune._kernel_hash import FIELD as FINGERPRINT_FIELD
from pallas_tune._kernel_hash import source_changed
from pallas_tune.errors import MeasurementError, NoFeasibleConfigError
from pallas_tune.measure.evaluate import Evaluator
from pallas_tune.measure.loops import LIMIT_NOTE, PREFETCH_NOTE
from pallas_tune.measure.records import Outcome, shortlist, spread
from pallas_tune.tuning import footing, noise
from pallas_tune.tuning.log import TrialLog
from pallas_tune.tuning.options import TuneOptions
from pallas_tune.tuning.plan import Plan
from pallas_tune.tuning.result import TuningResult

__all__ = ["build_result", "default_config", "rerank", "versions", "write", "xla_estimate",
           "xla_wanted"]

logger = logging.getLogger("pallas_tune.tuning")


def default_config(space: Any) -> dict[str, Any] | None:
    """The config a user gets without tuning: the declared default, else the space's first
    point (what the progress display, the result and the report compare against)."""
    return next(iter(space.ordered_candidates()), None)


def _default_record(log: TrialLog, default: Mapping[str, Any] | None) -> Any:
    """The timed record of the default's program (its original when it was a duplicate)."""
    if default is None:
        return None
    for r in log.records:
        if r.config == dict(default):
            if r.duplicate_of is not None:
                r = log.records[r.duplicate_of]
            return r if r.outcome is Outcome.OK else None
    return None


def xla_wanted(kernel: Any, options: TuneOptions, plan: Plan, device: Mapping[str, Any]
               ) -> bool:
    """Whether the final ranking also times (or, for estimates, estimates) the kernel's
    reference (XLA): see ``TuneOptions.xla``. By default on for kernels declaring
    ``fallback="reference"``, except in interpret mode; estimates compare both on the
    compiler's terms, so interpret mode never applies to them."""
    if getattr(kernel, "reference", None) is None:
        return False
    if options.xla is not None:
        return options.xla
    return (getattr(kernel, "fallback", None) == "reference"
            and (plan.estimating or not bool(device.get("interpret"))))


def xla_estimate(evaluator: Any, chip: str) -> dict[str, Any]:
    """The reference's (XLA's) estimate, whole program, no stand-in, as the row that
    :func:`build_result` reads (:func:`pallas_tune.tuning.footing.xla_row`: libtpu's sum, how
    many ops it has no estimate for, XLA's cost model), or ``error`` when the compile gave no
    figure."""
    from pallas_tune.chips import chip_spec

    try:
        r = evaluator.estimate_reference()
    except Exception as e:  # noqa: BLE001 - no XLA figure is a result, not a failed tuning.
        return {"implementation": "xla", "timer": "tpu-estimate",
                "error": f"{type(e).__name__}: {e}"[:500]}
    row = footing.xla_row(r, chip_spec(chip).clock_hz)
    if r is not None and r.ok:
        row["compile_s"] = round(r.compile_s, 3)
    return row


def rerank(evaluator: Evaluator, log: TrialLog, options: TuneOptions,
           default: Mapping[str, Any] | None = None, *, xla: bool = False
           ) -> list[dict[str, Any]] | None:
    """The ``retime_top`` best, and the default when it ran, re-timed interleaved (A B C A B C
    ...), so that drift hits all alike; rows sorted by their median there, the default's
    marked ``"default": True`` (its time compares like with like with the winner's). With
    ``xla``, the kernel's reference is timed in the same rounds, as a row marked
    ``"implementation": "xla"``. None with fewer than two to compare."""
    ok = sorted((r for r in log.records if r.outcome is Outcome.OK and r.duplicate_of is None),
                key=lambda r: r.median_ms)
    top = ok[:options.retime_top]
    base = _default_record(log, default)
    if base is not None and base not in top and top:
        top.append(base)
    if options.retime_top < 2 or len(top) < 2:
        return None
    rounds = max(3, options.repeats)
    configs = [r.config for r in top]
    times = _retime(evaluator, configs, rounds, xla)
    if not times:
        return None
    rows = _rows(top, times, base, xla)
    verdict = noise.judge(rows)
    if verdict is not None and (not verdict["winner_ahead"]
                                or verdict["default_ahead_by"] is False):
        # Within noise: time the same configs again, twice as long, before claiming a rank.
        more = _retime(evaluator, configs, 2 * rounds, xla)
        if more and len(more) == len(times):
            times = [a + b for a, b in zip(times, more, strict=True)]
            rows = [{**row, "retimed": 2} for row in _rows(top, times, base, xla)]
    return rows


def _retime(evaluator: Evaluator, configs: list[Any], rounds: int, xla: bool
            ) -> list[list[float]] | None:
    try:
        return (evaluator.rerank(configs, rounds=rounds, reference=True) if xla
                else evaluator.rerank(configs, rounds=rounds))
    except Exception:  # noqa: BLE001 - keep the search's ranking if re-timing fails.
        logger.warning("interleaved re-timing failed; keeping the search's ranking",
                       exc_info=True)
        return None


def _rows(top: list[Any], times: list[list[float]], base: Any, xla: bool
          ) -> list[dict[str, Any]]:
    rows = [{"trial": r.number, "config": dict(r.config), "search_median_ms": r.median_ms,
             "median_ms": statistics.median(t), "spread_ms": spread(t), "times_ms": list(t),
             **({"default": True} if r is base else {})}
            for r, t in zip(top, times, strict=False)]
    if xla and len(times) == len(top) + 1:
        t = times[-1]
        rows.append({"implementation": "xla", "median_ms": statistics.median(t),
                     "spread_ms": spread(t), "times_ms": list(t)})
    return sorted(rows, key=lambda row: row["median_ms"])


def build_result(kernel: Any, plan: Plan, chip: str, log: TrialLog,
                 ranking: list[dict[str, Any]] | None, *, options: TuneOptions,
                 device: Mapping[str, Any], study: Any, extra: Mapping[str, Any]
                 ) -> TuningResult:
    """The result: the winner (first of the re-ranking, else the search's best), ``best_ms``
    from the same runs that chose it, and how every figure was obtained."""
    best = log.best()
    if best is None:
        summary: dict[str, int] = {}
        for r in log.records:
            summary[r.outcome.value] = summary.get(r.outcome.value, 0) + 1
        first = next((r for r in log.records if r.error), None)
        raise NoFeasibleConfigError(
            f"tuning {kernel.name!r} for {plan.key!r}: none of {len(log.records)} candidates "
            f"succeeded ({summary}). First error ({first.config if first else ''}): "
            f"{first.error if first else 'n/a'}")
    best_ms = best.median_ms
    best_spread = best.measurement.spread_ms if best.measurement else 0.0
    space = extra.get("space", kernel.space)
    base = _default_record(log, default_config(space))
    default_ms = base.median_ms if base is not None else math.nan
    xla_row = extra.get("xla_estimate")
    if ranking:
        first = next(row for row in ranking if "trial" in row)  # The best Pallas config.
        best = log.records[first["trial"]]
        best_ms, best_spread = first["median_ms"], first["spread_ms"]
        xla_row = next((row for row in ranking if row.get("implementation") == "xla"), xla_row)
        # The default's figure from the same interleaved runs, never a search-phase one.
        default_ms = next((row["median_ms"] for row in ranking if row.get("default")),
                          math.nan)
    xla_ms, implementation, xla_note = footing.xla_decision(xla_row, best_ms)
    prov = provenance(plan, chip, options, device, extra)
    if plan.estimating:  # The estimate's best K, for --confirm-top to measure on the chip.
        prov["shortlist"] = shortlist(log.records, kernel.name)
    if space is not kernel.space:  # Clamped: one point per distinct effective config.
        prov["space"] = {"declared": kernel.space.size, "distinct_for_call": space.size}
    notes = {"stopped": log.stopped, "not_searched": extra.get("not_searched"),
             "clamped": "; ".join(_clamp_notes(best.config, space, extra.get("dims") or {}))}
    prov.update({k: v for k, v in notes.items() if v})
    prov.update(ranked_by="interleaved re-ranking" if ranking else "search median",
                strategy=extra.get("strategy"), counts=log.counts(),
                trials_measured=log.timed, tuning_s=round(log.progress().elapsed_s, 3))
    fingerprint = getattr(kernel, "fingerprint", None)
    if fingerprint is not None:  # The code it was tuned on (see pallas_tune._kernel_hash).
        prov[FINGERPRINT_FIELD] = fingerprint
        if getattr(kernel, "version", None) is not None:
            prov["kernel_version"] = kernel.version
        elif (path := source_changed(kernel.fn, fingerprint)) is not None:
            raise MeasurementError(
                f"{path} changed while {kernel.name!r} was being tuned for {plan.key!r}: worker "
                "processes load the kernel's code afresh, so these trials may mix two versions "
                "of it. Nothing was written for this shape; run the sweep again on the code "
                "you mean to ship.")
    if ranking:
        prov["retimed_interleaved"] = ranking
        verdict = noise.judge(ranking)
        if verdict is not None:
            prov["ranking_noise"] = verdict
            if "note" in verdict:
                from pallas_tune import errors

                errors.warn(f"{kernel.name} {plan.key}: {verdict['note']}")
    if best is not None and any(n in (best.detail or "") for n in (PREFETCH_NOTE, LIMIT_NOTE)):
        prov["estimate_caveat"] = best.detail  # What the estimate could not follow.
    if "xla_estimate" in extra:  # The reference's estimate, labelled as one.
        prov["xla"] = {**xla_row, "note": "static estimate of the TPU compiler for the "
                       "reference's whole program (no stand-in), not a measurement"
                       + (f"; {xla_note}" if xla_note else "")}
        if xla_note and "median_ms" in xla_row and implementation == "pallas":
            from pallas_tune import errors

            errors.warn(f"{kernel.name} {plan.key}: {xla_note}")
    return TuningResult(kernel=kernel.name, chip=chip, key=plan.key, records=tuple(log.records),
                        best_record=best, best_ms=best_ms, best_spread_ms=best_spread,
                        ranking=tuple(ranking or ()), provenance=prov, options=options,
                        study=study, default_ms=default_ms, xla_ms=xla_ms,
                        implementation=implementation,
                        xla_partial=int((xla_row or {}).get("partial") or 0)
                        if math.isfinite(xla_ms) else 0,
                        effective=_effective(best.config, extra.get("dims") or {}))


def _clamp_notes(config: Mapping[str, Any], space: Any, dims: Mapping[str, int]
                 ) -> list[str]:
    from pallas_tune import effective

    return effective.clamp_notes(config, space, dims)


def _effective(config: Mapping[str, Any], dims: Mapping[str, int]) -> dict[str, Any] | None:
    """What the winner runs as, when that differs from its config (clamped values)."""
    from pallas_tune import effective

    runs_as = effective.effective(config, dims)
    return runs_as if runs_as != dict(config) else None


def provenance(plan: Plan, chip: str, options: TuneOptions, device: Mapping[str, Any],
               extra: Mapping[str, Any]) -> dict[str, Any]:
    """How the figures were obtained: chip, timer, evaluator, versions, date."""
    common = {"kind": plan.kind, "chip": chip, "timer": options.timer,
              "evaluator": extra.get("evaluator"), "seed": options.seed,
              **({"prior": extra["prior"]} if extra.get("prior") else {}),
              **({"confirmed": extra["confirmed"]} if extra.get("confirmed") else {}),
              "versions": versions(),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    if plan.estimating:
        from pallas_tune.chips import chip_spec
        from pallas_tune.measure.correction import correction_for, describe

        spec = chip_spec(chip)
        prov = {**common, "device_kind": spec.device_kind, "platform": "tpu", "interpret": False,
                "timing_note": ("static cycle estimate of the TPU compiler (deviceless libtpu "
                                f"compile), converted at {spec.clock_hz / 1e9:g} GHz: an "
                                "estimate, not a measurement"),
                "clock_hz": spec.clock_hz, "standin": extra.get("standin"),
                "standin_check": extra.get("standin_check", {}),
                "estimate_correction": describe(spec.name) if options.estimate_correction
                else "off: libtpu's figure as it is"}
        if options.estimate_correction and correction_for(spec.name) is not None:
            prov["timing_note"] += (", plus what it leaves out on the chip (exposed DMA, "
                                    "per-step overhead: estimate_correction)")
        if prov["standin_check"].get("unverified"):
            prov["timing_note"] += ("; on a stand-in problem NOT checked against a full "
                                    "compile (the full problem did not fit in a worker)")
        figures = extra.get("figures") or {}  # measure.unprofiled.one_scale: what they are.
        if figures.get("figure"):
            prov["timer"] = figures["figure"]
            prov["timing_note"] += (f"; {figures['note']}" + (
                " (by a MODEL: each such trial's detail says which, and how calibrated)"
                if figures["figure"] != "tpu-estimate" else ""))
        prov.update({k: figures[k] for k in ("calibration", "unfigured") if k in figures})
        return prov
    interpret = bool(device.get("interpret"))
    from pallas_tune.measure.timing import resolve_timer

    timer = resolve_timer(options.timer, device.get("platform"))
    common["timer"] = timer
    return {**common, "device_kind": device.get("device_kind"),
            "platform": device.get("platform"), "interpret": interpret,
            "timing_note": ("wall clock of interpret-mode execution on the CPU: tracks grid "
                            "steps, not TPU performance") if interpret else
            ("device time from a profiler trace" if timer == "profiler" else
             "wall clock around block_until_ready"),
            "warmup": options.warmup, "repeats": options.repeats,
            "max_time_s": options.max_time_s, "slow_factor": options.slow_factor,
            "isolated": plan.isolate,
            "time_limits_s": options.limits if plan.isolate else None}


def write(kernel: Any, result: TuningResult) -> TuningResult:
    """Writes the result's cache entry; returns the result with ``cache_path`` set."""
    import dataclasses

    path = kernel.cache.write(result.chip, kernel.name, result.key, result.to_entry(),
                              kind=result.provenance["kind"])
    return dataclasses.replace(result, cache_path=path)


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("pallas-tune", "jax", "jaxlib", "libtpu", "libtpu-nightly", "optuna"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out
