"""Before the loop: what is tuned for which chip, and which evaluator does the work."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.measure.candidate import KernelParts, Setup, to_wire
from pallas_tune.measure.evaluate import Evaluator
from pallas_tune.tuning.options import TuneOptions

__all__ = ["Plan", "make_plan", "open_evaluator", "settle_chip"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """The decisions a run starts from: the cache key, the kind of figures (``measured`` or
    ``estimate``), whether candidates run in workers, and the setup every candidate shares."""

    key: str
    kind: str
    isolate: bool
    parts: KernelParts
    setup: Setup

    @property
    def estimating(self) -> bool:
        return self.kind == "estimate"


def make_plan(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
              options: TuneOptions) -> Plan:
    """Checks what can be checked before any process starts (no device is touched here)."""
    from pallas_tune.measure.timing import TimingPolicy

    estimating = options.timer == "tpu-estimate"
    chip = _estimate_chip(options.chip) if estimating else _normalized(options.chip)
    setup = Setup(args=tuple(args), kwargs=dict(kwargs), seed=options.seed or 0, chip=chip,
                  feasibility=options.feasibility, vreg_limit=options.vreg_limit,
                  estimate_correction=options.estimate_correction,
                  timing=TimingPolicy(timer=options.timer, warmup=options.warmup,
                                      repeats=options.repeats, min_time_s=options.min_time_s,
                                      max_time_s=options.max_time_s,
                                      slow_factor=options.slow_factor))
    return Plan(key=kernel.cache_key(*args, **kwargs), kind="estimate" if estimating else
                "measured", isolate=estimating or _isolate(options), parts=KernelParts.of(kernel),
                setup=setup)


def _normalized(chip: str | None) -> str | None:
    from pallas_tune.chips import normalize_chip

    return normalize_chip(chip) if chip else None


def _estimate_chip(chip: str | None) -> str:
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import compile as _compile

    if chip is None:
        raise ValueError("timer='tpu-estimate' needs a TPU chip: pass chip='v6e' (or another "
                         "TPU).")
    try:
        spec = chip_spec(chip)
    except ValueError as e:
        raise ValueError(f"timer='tpu-estimate' needs a TPU chip: {e}") from None
    if spec.platform != "tpu":
        raise ValueError(f"timer='tpu-estimate' needs a TPU chip (chip='v6e', ...), not "
                         f"{spec.name!r}.")
    if not _compile.libtpu_available():
        raise ValueError("timer='tpu-estimate' compiles with libtpu: pip install "
                         "'pallas-tune[tpu]'.")
    if not spec.clock_hz:
        raise ValueError(f"no clock frequency is known for {spec.name!r}, so its cycle "
                         "estimates cannot be converted to time.")
    return spec.name


def _isolate(options: TuneOptions) -> bool:
    """Workers where a device measures (see :class:`TuneOptions`); never onto a TPU this
    process already holds (a TPU serves one process)."""
    from pallas_tune import errors
    from pallas_tune.measure.evaluate import host_platform

    chosen = options.isolated_by_choice
    platform, initialised = host_platform()
    isolate = chosen if chosen is not None else platform in ("tpu", "gpu")
    if isolate and initialised and platform == "tpu":
        msg = ("this process already uses the TPU, which serves one process at a time, so "
               "worker processes cannot measure on it")
        if chosen:
            raise ValueError(f"isolate=True: {msg}. Tune from a process that has not touched "
                             "the TPU (pass jax.ShapeDtypeStruct inputs, or use pallas-tune "
                             "sweep), or pass isolate=False.")
        errors.warn(f"{msg}; measuring in this process, without isolation. Tune from a fresh "
                    "process (pallas-tune sweep) to isolate candidates.")
        return False
    return isolate


def open_evaluator(plan: Plan, options: TuneOptions) -> Evaluator:
    """The started evaluator for this plan (in-process, worker processes, or estimates)."""
    from pallas_tune.measure.evaluate import InProcessEvaluator, PoolEvaluator

    if plan.estimating:
        from pallas_tune.measure.estimate import EstimateEvaluator

        evaluator: Evaluator = EstimateEvaluator(
            plan.parts, plan.setup, workers=options.workers, limits=options.limits,
            fallback=options.estimate_fallback, standin=options.standin,
            memory_limit_bytes=(-1 if options.worker_memory_gb is None
                                else int(options.worker_memory_gb * (1 << 30))))
    elif plan.isolate:
        from pallas_tune.measure.pool import Pool

        refs = plan.parts.refs()
        wire = dataclasses.replace(plan.setup, args=tuple(to_wire(list(plan.setup.args))),
                                   kwargs=to_wire(dict(plan.setup.kwargs)))
        pool = Pool("pallas_tune.measure.session:MeasureSession", (refs, wire),
                    limits=options.limits, main_path=refs.main_path)
        evaluator = PoolEvaluator(pool, reference=plan.parts.reference is not None)
    else:
        import jax

        from pallas_tune.measure.session import MeasureSession

        workers = options.compile_workers or (1 if jax.default_backend() == "cpu" else 4)
        evaluator = InProcessEvaluator(MeasureSession(plan.parts, plan.setup),
                                       compile_workers=workers)
    try:
        evaluator.start()
    except BaseException:
        evaluator.close()
        raise
    return evaluator


def settle_chip(plan: Plan, device: Mapping[str, Any]) -> str:
    """The chip whose cache this run fills: the target for estimates, else the host's chip as
    the evaluator found it (a measurement cannot fill another chip's cache)."""
    if plan.estimating:
        return plan.setup.chip  # type: ignore[return-value]
    host = device["chip"]
    if plan.setup.chip and plan.setup.chip != host:
        raise ValueError(
            f"chip={plan.setup.chip!r}: wall-clock timing here measures {host!r}, so it cannot "
            f"fill the cache of {plan.setup.chip!r}. Tune on that chip, or use "
            "timer='tpu-estimate' for TPU chips.")
    return host
