"""The ``tpu-estimate`` timer: the TPU compiler's own static cycle estimate, on a CPU host.

With ``--xla_jf_dump_static_llo_profile_to=<dir>`` in ``LIBTPU_INIT_ARGS`` when libtpu loads, a
deviceless compile annotates each Pallas kernel's custom call with ``"estimated_cycles"``: the
whole kernel, every grid step, DMA/compute overlap modelled (notes/libtpu-static-cost.md). The
flag adds 1.4-4 ms of compile time per grid step and must be set before libtpu initialises, so
estimates run in worker processes of their own (:mod:`.pool`, each with its own dump directory
and ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``), in parallel, leaving the calling process's libtpu
untouched. Each worker's address space is capped (default: host memory less a reserve, split
between the workers; see ``_memory_limit``), so a runaway compile (seen: a (2048, 2048) f32
attention tile at S=8192 grew past 24 GB) fails in its worker, which is replaced, instead of
taking the host down.

Cost control: a kernel may declare ``standin=`` on ``@tunable``: a function returning a smaller
problem with the same tiles (fewer steps along parallel grid axes) and the factor to scale its
estimate by. The shipped kernels do; :func:`.standin.check` decides whether to trust it, and
benchmarks/estimates/tpu_estimate.py checks the scaled figures against full compiles.

Figures are compiler estimates converted with the chip's clock, never measurements; cache entries
written from them are of kind ``estimate`` and lose to any measured entry.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pallas_tune.measure import candidate as cand
from pallas_tune.measure import pieces, shared, standin
from pallas_tune.measure.correction import corrected_ms
from pallas_tune.measure.evaluate import PoolEvaluator
from pallas_tune.measure.loops import (FLAG, NO_ESTIMATE, NOT_ESTIMABLE, Census, abort_message,
                                      below_floor, blind_fetch_message, describe,
                                      dynamic_loop_message, estimate_flag_missing_message,
                                      floor_message, kernel_census, unfigured_message)
from pallas_tune.measure.pool import Pool
from pallas_tune.measure.pool import worker_memory_limit as _memory_limit
from pallas_tune.measure.records import Measurement, Outcome, TrialRecord
from pallas_tune.measure.standin import shrink_parallel, standin_verdict
from pallas_tune.measure.scale import one_scale
from pallas_tune.measure.unprofiled import MODEL_NAMES, MODEL_TIMERS, UnprofiledCheck, settle

__all__ = ["EstimateEvaluator", "EstimateResult", "EstimateSession", "Estimator",
           "estimate_flag_missing_message", "shrink_parallel",
           "standin_verdict"]

_SESSION: Final = "pallas_tune.measure.estimate:EstimateSession"
_ENV: Final = {"JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
ABORTS_TO_STOP: Final = 3  # Profiler aborts, none estimated yet, before a tune stops.


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EstimateResult:
    ok: bool
    kind: str  # "ok", a compile failure kind (see _compile), NO_ESTIMATE or NOT_ESTIMABLE.
    cycles: int | None = None  # Scaled to the full problem.
    standin_cycles: int | None = None
    scale: float = 1.0
    compile_s: float = 0.0
    scoped_vmem_bytes: int | None = None
    message: str = ""
    ops_without_estimate: int = 0  # Compiled ops whose LLO estimate was 0 (not counted).
    model_cycles: int | None = None  # XLA's cost model, summed over fusions (XLA programs).
    kernels_alone: int = 0  # > 0: the sum of this many kernels, each compiled alone.
    prefetch_kernels: int = 0  # Kernels with scalar-prefetch operands (loops.PREFETCH_NOTE).
    unseen_write_bytes: int = 0  # Output writes the profile leaves out (loops.Census).
    limit_over_chip: int = 0  # A vmem_limit_bytes above the chip's VMEM (loops.LIMIT_NOTE).


def estimate(parts: cand.KernelParts, args: Sequence[Any], kwargs: Mapping[str, Any],
             config: Mapping[str, Any], chip: str, use_standin: bool) -> EstimateResult:
    """Compiles one candidate deviceless (on its stand-in where allowed) for its estimate."""
    from pallas_tune.feasibility import compile as _compile

    scale = 1.0
    if use_standin and parts.standin is not None:
        args, kwargs, scale = parts.standin(list(args), dict(kwargs), dict(config))
        if isinstance(args, pieces.Pieces):  # Static problems, summed (measure.pieces).
            return pieces.estimate_pieces(args, parts, config, chip, estimate, EstimateResult)
    try:
        census = kernel_census(parts.fn, args, {**kwargs, **config}, chip=chip)
    except Exception:  # noqa: BLE001 - the compile below reports the failure by its kind.
        census = Census()
    if census.loops:
        return EstimateResult(ok=False, kind=NO_ESTIMATE, scale=scale,
                              message=dynamic_loop_message(parts.name, census.loops))
    if census.blind_inputs:  # This config only: the tune goes on with the others.
        return EstimateResult(ok=False, kind=NOT_ESTIMABLE, scale=scale,
                              message=blind_fetch_message(parts.name, census.blind_inputs))
    # A program of kernels only is compiled one kernel per program, at a fraction of the
    # memory of profiling them together (see compile_per_call).
    result = (_compile.compile_per_call(parts.fn, args, {**kwargs, **config}, chip=chip)
              or _compile.compile_deviceless(parts.fn, args, {**kwargs, **config}, chip=chip))
    if not result.ok:
        return EstimateResult(ok=False, kind=result.kind, message=result.message,
                              compile_s=result.compile_s, scale=scale)
    if not result.estimated_cycles:  # XLA's cost model, if any, is kept (see xla_row).
        return EstimateResult(ok=False, kind=NO_ESTIMATE, compile_s=result.compile_s,
                              scale=scale, message=estimate_flag_missing_message(),
                              model_cycles=int(round(sum(result.model_cycles) * scale))
                              if result.model_cycles else None)
    low = below_floor(census.floor_flops, result, chip)
    if low:
        return EstimateResult(ok=False, kind=NOT_ESTIMABLE, compile_s=result.compile_s,
                              scale=scale, message=floor_message(parts.name, low))
    cycles = sum(result.estimated_cycles)
    return EstimateResult(ok=True, kind="ok", cycles=int(round(cycles * scale)),
                          standin_cycles=cycles, scale=scale, compile_s=result.compile_s,
                          scoped_vmem_bytes=result.scoped_vmem_bytes,
                          ops_without_estimate=sum(c == 0 for c in result.estimated_cycles),
                          model_cycles=int(round(sum(result.model_cycles) * scale))
                          if result.model_cycles else None,
                          kernels_alone=result.kernels_alone,
                          prefetch_kernels=census.prefetch_kernels,
                          unseen_write_bytes=census.unseen_write_bytes,
                          limit_over_chip=census.limit_over_chip)


class EstimateSession:
    """Estimates candidates in a worker process (never in the caller's: see the module doc).

    With ``parts`` and ``setup`` it serves one tuning run (:meth:`evaluate`); without, any
    kernel by reference (:meth:`estimate_for`, for :class:`Estimator`)."""

    def __init__(self, parts: cand.PartRefs | None = None, setup: cand.Setup | None = None,
                 dump_root: str | None = None, use_standin: bool = True,
                 fallback: str | None = None, profile: bool = True):
        flags = os.environ.get("LIBTPU_INIT_ARGS", "")
        if profile and FLAG not in flags:  # Before libtpu loads: nothing imported jax yet.
            dump = tempfile.mkdtemp(prefix=f"llo-{os.getpid()}-", dir=dump_root)
            os.environ["LIBTPU_INIT_ARGS"] = f"{flags} {FLAG}={dump}".strip()
        self.retarget(parts, setup, use_standin, fallback)

    def retarget(self, parts: cand.PartRefs | None, setup: cand.Setup | None,
                 use_standin: bool = True, fallback: str | None = None,
                 channel: Any = None) -> None:
        """Serves another tuning run (another kernel or shape) in this worker: a pool shared
        by the calls of one :func:`pallas_tune.autotune` starts its workers once."""
        del channel  # Unused.
        from pallas_tune import chips

        self.parts = parts.load() if parts is not None else None
        self.setup = setup
        self.use_standin = use_standin
        self.fallback = fallback
        self.chip = chips.normalize_chip(setup.chip) if setup and setup.chip else None
        self.stage = (cand.resolve_stage(setup.feasibility, self.chip, estimating=True)
                      if setup and self.chip else "off")
        self.args = list(cand.from_wire(list(setup.args))) if setup else []
        self.kwargs = dict(cand.from_wire(dict(setup.kwargs))) if setup else {}

    def info(self, channel: Any = None) -> dict[str, Any]:
        del channel  # Unused.
        from importlib import metadata

        try:
            libtpu = metadata.version("libtpu")
        except metadata.PackageNotFoundError:
            libtpu = "not installed"
        return {"chip": self.chip, "platform": "tpu", "device_kind": "", "interpret": False,
                "stage": self.stage, "backend": "cpu (deviceless)", "libtpu": libtpu}

    def set_standin(self, use: bool, channel: Any = None) -> None:
        del channel  # Unused.
        self.use_standin = use

    def _context(self) -> Any:
        from pallas_tune import chips

        return chips.target(self.chip, abstract_mesh=True)

    def roofline(self, config: Mapping[str, Any], chip: str, fitted: bool = False,
                 channel: Any = None) -> float | None:
        """The roofline model's time of ``config``: the tuner ranks warm starts with it (the
        neighbours' winners, then the space), as it does with a measuring session's."""
        del channel  # Unused.
        assert self.parts is not None
        return cand.roofline_time(self.parts, self.args, self.kwargs, config, chip, fitted)

    def evaluate(self, number: int, config: Mapping[str, Any], best_ms: float, channel: Any
                 ) -> tuple[TrialRecord, None]:
        del best_ms  # Unused: estimates are not timed.
        assert self.parts is not None and self.chip is not None
        prepared = cand.prepare(self.parts, self.args, self.kwargs, number, config,
                                chip=self.chip, stage=self.stage,
                                vreg_limit=self.setup.vreg_limit if self.setup else None,
                                context=self._context, platforms=("tpu",), channel=channel)
        if isinstance(prepared, TrialRecord):
            return prepared, None
        channel.phase("compile")
        r = estimate(self.parts, self.args, self.kwargs, config, self.chip, self.use_standin)
        return self._record(prepared, r, channel.phase_name), None

    def _record(self, p: cand.Prepared, r: EstimateResult, phase: str) -> TrialRecord:
        from pallas_tune.chips import chip_spec
        from pallas_tune.feasibility.roofline import roofline_calls

        common = dict(number=p.number, config=p.config, fingerprint=p.fingerprint, phase=phase,
                      seconds=time.perf_counter() - p.started)
        if r.ok:
            ms, said = cycles_to_ms(r.cycles or 0, chip_spec(self.chip).clock_hz), ""
            if self.setup is not None and self.setup.estimate_correction:
                ms, said = corrected_ms(ms, p.calls, chip_spec(self.chip))
            return TrialRecord(outcome=Outcome.OK, cycles=r.cycles, vmem_bytes=r.scoped_vmem_bytes,
                               measurement=Measurement(times_ms=(ms,), compile_ms=r.compile_s * 1e3,
                                                       timer="tpu-estimate"),
                               detail="; ".join(filter(None, (describe(r), said))), **common)
        if r.kind in (NO_ESTIMATE, NOT_ESTIMABLE) and self.fallback in ("roofline", "model"):
            from pallas_tune.feasibility.fitted import fitted_calls
            spec = chip_spec(self.chip)
            s = (fitted_calls(p.calls, spec) if self.fallback == "model"
                 else roofline_calls(p.calls, spec).time_s)
            return TrialRecord(outcome=Outcome.OK, detail=f"{MODEL_NAMES[self.fallback]} (libtpu "
                               "returned no estimate)", measurement=Measurement(
                                   times_ms=(s * 1e3,), compile_ms=r.compile_s * 1e3,
                                   timer=MODEL_TIMERS[self.fallback]), **common)
        outcome = (Outcome.COMPILE_ERROR if r.kind in (NO_ESTIMATE, NOT_ESTIMABLE)
                   else cand._failure_outcome(r.kind))
        source = "not estimable" if r.kind == NOT_ESTIMABLE else "compiler"
        return TrialRecord(outcome=outcome, error=f"{source}: {r.message[:2000]}", detail=r.kind,
                           **common)

    def standin_scale(self, config: Mapping[str, Any], channel: Any) -> float | str | None:
        """The stand-in's scale for a candidate that passes screening, None for one that does
        not, ``"error"`` if the stand-in function raises."""
        assert self.parts is not None and self.chip is not None
        record = cand.prepare(self.parts, self.args, self.kwargs, -1, config, chip=self.chip,
                              stage=self.stage, vreg_limit=None, context=self._context,
                              platforms=("tpu",), channel=channel, lower=False)
        if isinstance(record, TrialRecord):
            return None
        try:
            return float(self.parts.standin(list(self.args), dict(self.kwargs), dict(config))[2])
        except Exception:  # noqa: BLE001 - a stand-in that fails is not used.
            return "error"

    def estimate(self, config: Mapping[str, Any], standin: bool, channel: Any = None
                 ) -> EstimateResult:
        assert self.parts is not None and self.chip is not None
        if channel is not None:
            channel.phase("compile")
        return estimate(self.parts, self.args, self.kwargs, config, self.chip, standin)

    def estimate_for(self, refs: cand.PartRefs, args: Any, kwargs: Any,
                     config: Mapping[str, Any], chip: str, standin: bool, channel: Any = None
                     ) -> EstimateResult:
        return estimate(refs.load(), cand.from_wire(args), cand.from_wire(kwargs), config, chip,
                        standin)


def _estimate_pool(args: tuple[Any, ...], *, workers: int, main_path: str | None,
                   limits: Mapping[str, float | None] | None, memory_limit: int | None) -> Pool:
    return Pool(_SESSION, args, size=workers, env=_ENV, main_path=main_path, limits=limits,
                memory_limit=_memory_limit(workers, memory_limit))


class EstimateEvaluator(PoolEvaluator):
    """The compiler's estimate for each candidate, ``workers`` compiles in parallel."""

    kind = "estimate"

    def __init__(self, parts: cand.KernelParts, setup: cand.Setup, *, workers: int = 2,
                 limits: Mapping[str, float | None] | None = None, fallback: str | None = None,
                 standin: bool = True, memory_limit_bytes: int | None = -1):
        refs = parts.refs()
        wire = dataclasses.replace(setup, args=cand.to_wire(list(setup.args)),
                                   kwargs=cand.to_wire(dict(setup.kwargs)))
        self.has_standin = standin and parts.standin is not None
        self._reference = (cand.KernelParts.of(parts.reference).refs(), wire
                           ) if parts.reference is not None else None
        dumps: list[str] = []

        def start() -> tuple[Pool, str]:
            dumps.append(tempfile.mkdtemp(prefix="pallas-tune-llo-"))
            return _estimate_pool((refs, wire, dumps[0], self.has_standin, fallback),
                                  workers=workers, main_path=refs.main_path, limits=limits,
                                  memory_limit=memory_limit_bytes), dumps[0]

        pool, reused = shared.acquire((workers, tuple(sorted((limits or {}).items())),
                                       memory_limit_bytes, refs.main_path), start)
        if reused:
            pool.retarget("retarget", refs, wire, self.has_standin, fallback)
        self._pool_kept = shared.active()  # The pool outlives this run: see measure.shared.
        self._dump = "" if self._pool_kept else dumps[0]
        super().__init__(pool, reference=False)
        self.fallback = fallback
        self._name, self._aborts, self._estimated = parts.name, 0, 0
        self._checked: dict[str, tuple[bool | None, str]] = {}  # Abort kind: unprofiled check.
        self._unfigured = 0  # Candidates with no libtpu figure (aborts, VMEM under the flag).
        self._target = (refs, wire)
        self._unprofiled = UnprofiledCheck(
            _SESSION, (None, None, None, False, None, False), env=_ENV,
            main_path=refs.main_path, memory_limit=_memory_limit(1, memory_limit_bytes),
            limits=limits)

    def start(self) -> dict[str, Any]:
        device = super().start()
        if self._pool_kept:  # The first job's info: ask the retargeted session again.
            reply = self.pool.call("info", phase="trace")
            self.device = reply.value if reply.kind == "done" else device
        return self.device

    def _evaluate(self, candidates: Any) -> list[TrialRecord]:
        records = super()._evaluate(candidates)
        missing = next((r for r in records if r.detail == NO_ESTIMATE), None)
        if missing is not None and self.fallback not in ("roofline", "model"):
            from pallas_tune.errors import MeasurementError

            raise MeasurementError(missing.error.removeprefix("compiler: "))
        return [self._settle(r) for r in records]

    def _settle(self, r: TrialRecord) -> TrialRecord:
        """A trial libtpu gave no figure for: see unprofiled.settle. After ``ABORTS_TO_STOP``
        aborts with no estimate yet, the tune stops (each costs a compile and a worker)."""
        refs, wire = self._target
        r, why = settle(r, fallback=self.fallback, model=self._model, checked=self._checked,
                        fits=lambda c: self._unprofiled.fits(refs, wire.args, wire.kwargs, c,
                                                             self.device["chip"]))
        self._unfigured += not r.outcome.timed and (why != "" or r.detail == NOT_ESTIMABLE)
        if not why or r.outcome.timed:
            self._estimated += r.outcome.timed and not why
            return r
        self._aborts += 1
        if self._aborts >= ABORTS_TO_STOP and not self._estimated:
            from pallas_tune.errors import NoFeasibleConfigError
            from pallas_tune.measure.loops import abort_kind

            raise NoFeasibleConfigError(abort_message(
                self._name, why, self._aborts, self._checked[abort_kind(why)][1]) + (
                f"\n{self.pool.logs.note()}" if self.pool.logs.note() else ""))
        return r

    def one_scale(self, records: Sequence[TrialRecord]) -> tuple[list[TrialRecord], dict]:
        """The run's figures on one scale (measure.scale: with the fitted model, each
        candidate ranked by the larger of libtpu's figure and the model's calibrated onto it);
        a pick made among fewer candidates than libtpu was asked for says so (a warning, and
        the note)."""
        changed, note = [], {}
        if self.fallback in MODEL_TIMERS:
            changed, note = one_scale(list(records), lambda configs: [
                s * 1e3 if (s := self._model(c)) else None for c in configs],
                timer=MODEL_TIMERS[self.fallback], bound=self.fallback == "model")
        if self._unfigured and self.fallback not in ("roofline", "model"):
            from pallas_tune import errors

            errors.warn(f"{self._name}: {unfigured_message(self._unfigured, self._aborts)}")
            note["unfigured"] = unfigured_message(self._unfigured, self._aborts)
        return changed, note

    def _model(self, config: Mapping[str, Any]) -> float | None:
        """The fallback's figure (s): the roofline model or (``"model"``) the fitted one."""
        reply = self.pool.call("roofline", dict(config), self.device["chip"],
                               self.fallback == "model", phase="trace")
        return reply.value if reply.kind == "done" else None

    def rerank(self, configs: Sequence[Mapping[str, Any]], rounds: int) -> None:
        del configs, rounds  # Unused: estimates have no run-to-run noise to re-rank.
        return None

    def estimate_reference(self) -> EstimateResult | None:
        """The kernel's reference (XLA) estimated whole, never on a stand-in; None without one.
        ``ops_without_estimate`` > 0: a lower bound (see tuning.finish.xla_estimate)."""
        if self._reference is None:
            return None
        ref, w = self._reference
        reply = self.pool.call("estimate_for", ref, w.args, w.kwargs, {}, w.chip, False,
                               phase="compile")
        if reply.kind == "done":
            return reply.value
        # Died profiled (seen: XLA's ragged_dot): XLA's cost model from an unprofiled compile.
        plain = self._unprofiled.compile(ref, w.args, w.kwargs, {}, w.chip)
        return EstimateResult(
            ok=False, kind=reply.kind, message=reply.message[:500],
            model_cycles=plain.value.model_cycles if plain.kind == "done" else None)

    def check_standin(self, configs: Sequence[Mapping[str, Any]]) -> tuple[bool, dict[str, Any]]:
        """Whether the stand-in may stand in for these candidates (see standin.check)."""
        if not self.has_standin:
            return False, {}
        replies = self.pool.map([("standin_scale", (dict(c),), "trace") for c in configs])
        use, record = standin.check(
            configs, [r.value if r.kind == "done" else None for r in replies], self._estimate)
        self.pool.remember("set_standin", use)
        return use, record

    def _estimate(self, config: Mapping[str, Any], standin: bool) -> EstimateResult:
        reply = self.pool.call("estimate", dict(config), standin, phase="compile")
        if reply.kind == "done":
            return reply.value
        return EstimateResult(ok=False, kind="worker_crashed", message=reply.message[:500])

    def close(self) -> None:
        self._unprofiled.close()
        if self._pool_kept:  # The pool outlives this run (see shared_pools).
            return
        super().close()
        shutil.rmtree(self._dump, ignore_errors=True)


class Estimator:
    """Estimates of any kernel's configs in a pool of worker processes (benchmarks, tests).

    A worker that dies (a compiler abort, its memory limit) costs only its candidate, recorded
    with kind ``worker_crashed``. ``profile=False``: libtpu without its profiling flag (no
    cycles of its own; XLA's cost model, ``model_cycles``, where the program has fusions)."""

    def __init__(self, workers: int = 2, *, memory_limit_bytes: int | None = -1,
                 timeout_s: float | None = None, profile: bool = True):
        self.workers, self._profile = max(1, workers), profile
        self._dump = tempfile.mkdtemp(prefix="pallas-tune-llo-")
        self._options = dict(limits={"compile": timeout_s}, memory_limit=memory_limit_bytes)
        self._pool: Pool | None = None

    def map(self, kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
            configs: Sequence[Mapping[str, Any]], chip: str, *, standin: bool = True
            ) -> list[EstimateResult]:
        refs = cand.KernelParts.of(kernel).refs()
        if self._pool is None:  # Started on first use, importing the script if a part is there.
            self._pool = _estimate_pool((None, None, self._dump, True, None, self._profile),
                                        workers=self.workers, main_path=refs.main_path,
                                        **self._options)
        a, k = cand.to_wire(list(args)), cand.to_wire(dict(kwargs))
        replies = self._pool.map([("estimate_for", (refs, a, k, dict(c), chip, standin), "compile")
                                  for c in configs])
        return [r.value if r.kind == "done" else EstimateResult(
            ok=False, kind="worker_crashed" if r.kind != "error" else "compile_error",
            message=(f"the compile worker died or overran ({r.message[:300]}); candidate "
                     "skipped") if r.kind != "error" else r.message) for r in replies]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
        shutil.rmtree(self._dump, ignore_errors=True)

    def __enter__(self) -> Estimator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def cycles_to_ms(cycles: int, clock_hz: float) -> float:
    return cycles / clock_hz * 1e3
