"""Feasibility without libtpu's profiling flag: the estimate never refuses what the chip runs.

The flag that makes libtpu annotate its static estimate also changes allocation: at
tpu-inference's int8 matmul (4096 x 8192 by 128 x 8192, blocks (2048, 128, 8192), the block
sizes a real v6e ran best) the profiled compile reports "Used 165.12M of 127.94M vmem", while
the same program compiles in 67.8 MiB of scoped VMEM without it
(benchmarks/results/estimate_fidelity.md). So a config whose estimate compile runs out of VMEM
is compiled once more in a worker whose libtpu never saw the flag: only a config that fails
there too is infeasible; one that fits gets no estimate (or the model's figure, with the
roofline fallback) and says why.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

from pallas_tune.feasibility.compile import VMEM_PHYSICAL, VMEM_SCOPED
from pallas_tune.measure.loops import NOT_ESTIMABLE
from pallas_tune.measure.pool import Pool
from pallas_tune.measure.records import Measurement, Outcome

__all__ = ["MODEL_NAMES", "MODEL_TIMERS", "VMEM_KINDS", "UnprofiledCheck", "settle"]

# A fallback's figure, named: the trial's detail and its Measurement.timer.
MODEL_NAMES: Final = {"model": "fitted model", "roofline": "roofline model"}
MODEL_TIMERS: Final = {"model": "fitted-model", "roofline": "roofline-model"}

VMEM_KINDS: Final = (VMEM_SCOPED, VMEM_PHYSICAL)  # The compile's out-of-VMEM failure kinds.


class UnprofiledCheck:
    """Compiles configs of one kernel and call deviceless without the profiling flag, in a
    worker of its own, started on first use. ``session``: the estimate session's reference;
    ``args``: its arguments, made to skip the flag (see EstimateSession's ``profile``)."""

    def __init__(self, session: str, args: tuple[Any, ...], *, env: Mapping[str, str],
                 main_path: str | None, memory_limit: int | None,
                 limits: Mapping[str, float | None] | None):
        self._spec = (session, args, dict(env), main_path, memory_limit, dict(limits or {}))
        self._pool: Pool | None = None

    def fits(self, refs: Any, args: Any, kwargs: Any, config: Mapping[str, Any], chip: str
             ) -> tuple[bool | None, str]:
        """Whether ``config`` compiles without the flag (None: the check itself failed), and
        what the compile said."""
        from pallas_tune.measure.loops import NO_ESTIMATE

        reply = self.compile(refs, args, kwargs, config, chip)
        if reply.kind != "done":
            return None, reply.message[-500:]
        r = reply.value
        if r.ok or r.kind == NO_ESTIMATE:  # Compiled: no cycles, as no flag asked for them.
            vmem = (f" in {r.scoped_vmem_bytes / 2**20:.1f} MiB of scoped VMEM"
                    if r.scoped_vmem_bytes else "")
            return True, f"compiles without the profiling flag{vmem}"
        return (False if r.kind in VMEM_KINDS else None), r.message[:500]

    def compile(self, refs: Any, args: Any, kwargs: Any, config: Mapping[str, Any], chip: str
                ) -> Any:
        """The worker's reply to compiling ``refs`` with ``config`` without the flag: its
        ``value`` (an EstimateResult) carries no libtpu cycles, but XLA's own cost model
        (``model_cycles``) where the program has XLA fusions."""
        if self._pool is None:
            session, sargs, env, main_path, memory_limit, limits = self._spec
            self._pool = Pool(session, sargs, size=1, env=env, main_path=main_path,
                              memory_limit=memory_limit, limits=limits)
            self._pool.start()
        return self._pool.call("estimate_for", refs, args, kwargs, dict(config), chip, False,
                               phase="compile")

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def settle(r: Any, *, fallback: str | None, model: Any, fits: Any,
           checked: dict[str, tuple[bool | None, str]] | None = None) -> tuple[Any, str]:
    """What an estimate trial becomes when libtpu could not give its figure: a config whose
    compile worker died of a profiler abort (:func:`.loops.profiler_abort`: a known text, or a
    fatal signal) or whose profiled compile ran out of VMEM, where the same program compiles
    without the flag (``fits(config)``), is not refused as infeasible: with a fallback it gets
    the model's figure (``model(config)``, seconds), labelled (:func:`.scale.one_scale` puts it
    on one scale with libtpu's); else it is not estimable, and says why. An abort is
    checked without the flag once per kind of abort (``checked``: the tuning run's memo); where
    that compile fails too, it is the compiler's failure, not the profiler's, and the record
    says so. Returns the record and, for an abort, its cause ("" else)."""
    from pallas_tune.measure.loops import abort_kind, profiler_abort

    checked = {} if checked is None else checked
    why = profiler_abort(r.error or "") if r.detail == "worker_crashed" else ""
    if why:
        kind = abort_kind(why)
        if kind not in checked:
            checked[kind] = fits(r.config)
        ok, said = checked[kind]
        if not ok:
            return dataclasses.replace(r, error=(
                f"{r.error}\nnot a profiler abort: the same program without the profiling flag "
                f"does not compile either ({'the check failed: ' if ok is None else ''}"
                f"{said[:300]})")), ""
        label = f"libtpu's static profile aborted: {why}; checked once: the same program {said}"
    elif r.detail in VMEM_KINDS:
        ok, said = fits(r.config)
        if not ok:
            return r, ""
        label = f"out of VMEM only with libtpu's profiling flag: it {said}"
    else:
        return r, ""
    seconds = model(r.config) if fallback in ("roofline", "model") else None
    if seconds is not None:
        return dataclasses.replace(
            r, outcome=Outcome.OK, error="", detail=f"{MODEL_NAMES[fallback]} ({label})",
            measurement=Measurement(times_ms=(seconds * 1e3,), compile_ms=0.0,
                                    timer=MODEL_TIMERS[fallback])), why
    if why:
        return dataclasses.replace(r, error=f"{r.error}\n{label}"), why
    return dataclasses.replace(
        r, outcome=Outcome.COMPILE_ERROR, detail=NOT_ESTIMABLE,
        error=f"not estimable: {label}; --estimate-fallback model ranks it by a model, "
              "calibrated onto libtpu's figures"), ""
