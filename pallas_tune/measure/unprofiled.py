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

from collections.abc import Mapping
from typing import Any, Final

from pallas_tune.feasibility.compile import VMEM_PHYSICAL, VMEM_SCOPED
from pallas_tune.measure.pool import Pool

__all__ = ["VMEM_KINDS", "UnprofiledCheck", "settle"]

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


def settle(r: Any, *, fallback: str | None, model: Any, fits: Any) -> tuple[Any, str]:
    """What an estimate trial becomes when libtpu could not give its figure: a config whose
    worker the profiler aborted, or whose profiled compile ran out of VMEM but that compiles
    without the flag (``fits(config)``), is not refused as infeasible: with the roofline
    fallback it gets the model's figure (``model(config)``, seconds), labelled; else it is
    not estimable, and says why. Returns the record and, for an abort, its cause ("" else)."""
    import dataclasses

    from pallas_tune.measure.loops import NOT_ESTIMABLE, profiler_abort
    from pallas_tune.measure.records import Measurement, Outcome

    why = profiler_abort(r.error or "") if r.detail == "worker_crashed" else ""
    if why:
        label = f"libtpu's static profile aborted: {why}"
    elif r.detail in VMEM_KINDS:
        ok, said = fits(r.config)
        if not ok:
            return r, ""
        label = f"out of VMEM only with libtpu's profiling flag: it {said}"
    else:
        return r, ""
    seconds = model(r.config) if fallback in ("roofline", "model") else None
    if seconds is not None:
        name = "fitted model" if fallback == "model" else "roofline model"
        return dataclasses.replace(
            r, outcome=Outcome.OK, error="", detail=f"{name} ({label})",
            measurement=Measurement(times_ms=(seconds * 1e3,), compile_ms=0.0,
                                    timer="roofline")), why
    if why:
        return r, why
    return dataclasses.replace(
        r, outcome=Outcome.COMPILE_ERROR, detail=NOT_ESTIMABLE,
        error=f"not estimable: {label}; --estimate-fallback model (or roofline) ranks it by "
              "a model"), ""
