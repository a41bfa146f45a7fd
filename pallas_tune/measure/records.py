"""What evaluating one candidate produces: an :class:`Outcome`, a :class:`Measurement`, a
:class:`TrialRecord`. Plain data, picklable (worker processes send them back as they are)."""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
from typing import Any, Final

__all__ = ["Measurement", "Outcome", "TrialRecord", "describe_tally", "tally"]


class Outcome(str, enum.Enum):
    """How a trial ended. ``slow``: timed, but stopped early for being clearly slower than the
    best so far (its median is of the runs seen)."""

    OK = "ok"
    SLOW = "slow"
    INFEASIBLE = "infeasible"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MISMATCH = "mismatch"

    @property
    def timed(self) -> bool:
        """Whether the candidate ran correctly and has a time (``ok`` or ``slow``)."""
        return self in (Outcome.OK, Outcome.SLOW)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    """Timed runs of one program, in milliseconds."""

    times_ms: tuple[float, ...]
    compile_ms: float
    timer: str = "wallclock"  # What produced times_ms (a profiler timer may fall back).

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.inf

    @property
    def spread_ms(self) -> float:
        """Interquartile range of the timed runs (0 with fewer than 4 runs)."""
        return spread(self.times_ms)


def spread(times: tuple[float, ...] | list[float]) -> float:
    """Interquartile range (0 with fewer than 4 values)."""
    if len(times) < 4:
        return 0.0
    q = statistics.quantiles(times, n=4)
    return q[2] - q[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrialRecord:
    """One evaluated candidate.

    ``fingerprint`` identifies the lowered program (after clamping and defaulting); a candidate
    whose program was already evaluated is not run again: it carries ``duplicate_of`` (that
    trial's number) and that trial's outcome and measurement. ``phase`` is where the candidate's
    evaluation ended (``trace``, ``check``, ``compile``, ``run``), ``seconds`` how long it took.
    """

    number: int
    config: dict[str, Any]
    outcome: Outcome
    measurement: Measurement | None = None
    error: str = ""
    max_abs_err: float | None = None
    detail: str = ""  # Failure kind, e.g. vmem_scoped_oom, block_rule, smem_oom, worker_crashed.
    vmem_bytes: int | None = None  # Model (or compiler) VMEM figure, where known.
    cycles: int | None = None  # Compiler cycle estimate (tpu-estimate timer).
    fingerprint: str | None = None
    duplicate_of: int | None = None
    phase: str = ""
    seconds: float = 0.0

    @property
    def median_ms(self) -> float:
        """The median of the timed runs (``inf`` for a candidate that was not timed)."""
        return self.measurement.median_ms if self.measurement else math.inf

    @property
    def spent_device_time(self) -> bool:
        """Whether this trial ran its program (not a duplicate, not rejected before running)."""
        return self.duplicate_of is None and self.measurement is not None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"number": self.number, "config": self.config,
                               "outcome": self.outcome.value}
        m = self.measurement
        if m is not None:
            out.update(median_ms=m.median_ms, spread_ms=m.spread_ms, times_ms=list(m.times_ms),
                       compile_ms=m.compile_ms, timer=m.timer)
        optional = {"max_abs_err": self.max_abs_err, "error": self.error, "detail": self.detail,
                    "vmem_bytes": self.vmem_bytes, "estimated_cycles": self.cycles,
                    "fingerprint": self.fingerprint, "duplicate_of": self.duplicate_of,
                    "phase": self.phase}
        out.update({k: v for k, v in optional.items() if v not in (None, "")})
        if self.duplicate_of is not None:  # Its times are the original's: say so, don't repeat.
            for k in ("times_ms", "compile_ms"):
                out.pop(k, None)
        return out


TALLY_ORDER = ("timed", "infeasible", "failed", "duplicates")


def tally(trials: Any) -> dict[str, int]:
    """The one vocabulary every count shown to a user is in (live display, final line, show,
    report, result): of ``trials`` (pairs ``(outcome value, is a duplicate)``), how many were
    ``timed`` (ran correctly: ok or slow), ``infeasible`` (rejected before running),
    ``failed`` (compile or runtime error, timeout, wrong numbers) and ``duplicates`` (the same
    program as an earlier trial: no device time), and their total ``trials``. Each trial is in
    exactly one of the four."""
    out = dict.fromkeys(("trials", *TALLY_ORDER), 0)
    for outcome, duplicate in trials:
        out["trials"] += 1
        if duplicate:
            out["duplicates"] += 1
        elif outcome in (Outcome.OK.value, Outcome.SLOW.value):
            out["timed"] += 1
        elif outcome == Outcome.INFEASIBLE.value:
            out["infeasible"] += 1
        else:
            out["failed"] += 1
    return out


def describe_tally(t: dict[str, int]) -> str:
    """``12 trials: 6 timed, 1 infeasible, 1 failed, 4 duplicates`` (zero counts left out;
    ``1 trial: 1 duplicate``)."""
    parts = [f"{t[k]} {k[:-1] if k.endswith('s') and t[k] == 1 else k}" for k in TALLY_ORDER
             if t.get(k)]
    n = t.get("trials", 0)
    return f"{n} trial{'' if n == 1 else 's'}" + (": " + ", ".join(parts) if parts else "")



# The estimate's shortlist: how many of its best configs a tpu-estimate entry keeps for
# ``--confirm-top`` to measure on the chip. On the one sample of real-hardware winners drawn at
# random within strata (benchmarks/results/estimate_fidelity.md: tpu-inference's quantized
# matmul, 30 v6e int8 and 12 v7 float8 keys), ranked over each key's whole space with libtpu's
# figures of the full programs (or extrapolated from two stand-ins), a tune's figure
# (``--estimate-fallback model``) held the winner in its top 5 on 40 of the 42 keys (K95), in
# its top 12 on all 42 (the last: 12th, on v6e) and in its top 3 on 36. 15 is kept: it held
# the worst key before the 7x keys were compiled with v7's VMEM limit (15th then), and a
# margin over one sample costs seconds on the chip. libtpu's figure alone reaches no K95 there.
# Per kernel where a sample has measured it (none of pallas-tune's own yet).
DEFAULT_SHORTLIST_K: Final = 15
SHORTLIST_K: Final[dict[str, int]] = {}


def shortlist(records: Any, kernel: str) -> dict[str, Any] | None:
    """The best ``k`` distinct configs of an estimate run (``k`` for ``kernel`` as above), by
    the figure each was ranked by, with those figures and where ``k`` comes from; None when
    nothing ranked."""
    k = SHORTLIST_K.get(kernel, DEFAULT_SHORTLIST_K)
    ranked = sorted((r for r in records if r.outcome is Outcome.OK and r.duplicate_of is None),
                    key=lambda r: r.median_ms)[:k]
    if not ranked:
        return None
    return {"k": k, "k_from": (f"measured for {kernel}" if kernel in SHORTLIST_K else
                               "default, not measured for this kernel: a top 12 held the "
                               "real-hardware winner on 42 of a stratified sample of 42 keys "
                               "of another quantized matmul (a top 5 on 40, 95%), ranked as "
                               "--estimate-fallback model ranks; 15 for margin"),
            "configs": [dict(r.config) for r in ranked],
            "figures_ms": [r.median_ms for r in ranked],
            "figures": [r.measurement.timer for r in ranked]}
