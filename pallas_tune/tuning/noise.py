"""Can these timings rank? The final re-ranking's rows judged against their own noise.

The re-ranking times its configs interleaved, round by round (A B C A B C ...), so two rows
are compared pairwise, round against round: a row is ahead of another when it is faster in
every round, or when the gap between the medians exceeds both rows' interquartile range. A
winner that is not ahead of the runner-up, or of the default, is *within noise*: the tuner says
so (in the result, its provenance and a warning) instead of claiming a ranking or a speed-up
its own runs do not support. :func:`pallas_tune.tuning.finish.rerank` re-times such a top once
more with twice the rounds before judging.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.measure.records import spread

__all__ = ["ahead", "judge", "noisy_rows"]


def ahead(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether times ``a`` are clearly faster than ``b``: paired round by round (as the
    interleaved re-ranking times them), ``a`` wins every round; or the medians' gap exceeds
    both spreads (interquartile ranges; with fewer than 4 runs, the full range)."""
    if not a or not b:
        return False
    if len(a) == len(b) and len(a) >= 3 and all(x < y for x, y in zip(a, b, strict=True)):
        return True
    gap = statistics.median(b) - statistics.median(a)
    return gap > 0 and gap > max(_spread(a), _spread(b))


def _spread(t: Sequence[float]) -> float:
    """The interquartile range; with fewer than 4 runs (none), the full range."""
    return spread(list(t)) if len(t) >= 4 else max(t) - min(t)


def noisy_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Rows whose own runs spread wider than their median: one timing of such a row says
    little (a loaded host, a cold cache, a timer near its resolution)."""
    return [r for r in rows if r.get("spread_ms", 0) > r.get("median_ms", float("inf")) > 0]


def judge(ranking: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """What the ranking can claim, or None when it has fewer than two Pallas rows with times:
    ``winner_ahead`` (of the runner-up), ``default_ahead_by`` (the winner ahead of the default:
    True/False, None where the default is the winner or did not run), ``noisy`` (rows whose
    spread exceeds their median) and a ``note`` for people when something is within noise."""
    rows = [r for r in ranking if "trial" in r and r.get("times_ms")]
    if len(rows) < 2:
        return None
    best, second = rows[0], rows[1]
    default = next((r for r in rows if r.get("default")), None)
    out: dict[str, Any] = {
        "winner_ahead": ahead(best["times_ms"], second["times_ms"]),
        "default_ahead_by": (None if default is None or default is best
                             else ahead(best["times_ms"], default["times_ms"])),
        "noisy": [r["trial"] for r in noisy_rows(rows)],
    }
    notes = []
    if not out["winner_ahead"]:
        notes.append(f"the winner (trial {best['trial']}, {best['median_ms']:.4g} ms) is within "
                     f"noise of the runner-up (trial {second['trial']}, "
                     f"{second['median_ms']:.4g} ms): these timings cannot rank them")
    if out["default_ahead_by"] is False:
        notes.append(f"the default ({default['median_ms']:.4g} ms) is within noise of the "
                     "winner: no speed-up is shown")
    if out["noisy"]:
        notes.append(f"{len(out['noisy'])} of {len(rows)} re-timed configs spread wider than "
                     "their median (a loaded host?)")
    if notes:
        out["note"] = "; ".join(notes) + ". Re-tune on an idle host, or with more repeats."
    return out
