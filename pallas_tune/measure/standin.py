"""Stand-ins for the ``tpu-estimate`` timer: a smaller problem with the same tiles, whose
estimate, scaled, stands for the full problem's (see :mod:`.estimate`). Kernels build theirs
with :func:`shrink_parallel`; the tuner decides whether to trust one with
:func:`standin_verdict`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.measure.loops import NOT_ESTIMABLE

__all__ = ["shrink_parallel", "standin_verdict", "unverified"]


def standin_verdict(config: Mapping[str, Any], scale: float, scaled: Any,
                    full: Any) -> tuple[bool, dict[str, Any]]:
    """Whether to use the stand-in, from one candidate estimated both ways; and the record."""
    if not full.ok and full.kind == "worker_crashed":
        # The full problem does not compile within a worker's memory (the LLO profile of a
        # large grid: 18 GB for a 8192x4096x14336 matmul with 256 tiles), so full compiles
        # cannot stand in for the stand-in either (nor where the stand-ins tried died too).
        # Keep it, unverified, and say so.
        return unverified(config, scale, f"the {'full-problem' if scaled.ok else 'stand-in'} "
                          f"compile of {dict(config)} died in its worker ({full.message})")
    if scaled.ok and not full.ok and full.kind == NOT_ESTIMABLE:
        # The full problem has no static estimate at any config (splash's mask tables, which
        # the profile reads as 0): the stand-in is the only figure, checked by its method alone.
        return True, {"config": dict(config), "scale": scale, "trusted": False,
                      "unverifiable": True,
                      "note": f"the full problem has no static estimate ({full.message[:200]}); "
                              "the stand-in is used, checked only by its method"}
    if not (scaled.ok and full.ok):
        return False, {"config": dict(config), "error": "stand-in or full compile failed"}
    err = abs((scaled.cycles or 0) - (full.cycles or 0)) / max(1, full.cycles or 0)
    return err <= 0.05, {"config": dict(config), "scale": scale,
                         "relative_error": round(err, 4), "trusted": err <= 0.05}


def unverified(config: Mapping[str, Any], scale: float, why: str
               ) -> tuple[bool, dict[str, Any]]:
    """The stand-in kept though no full compile could check it (``why``), warned and
    labelled (the entry's timing note says so)."""
    from pallas_tune import errors

    msg = f"{why}; the stand-in is used UNVERIFIED"
    errors.warn(msg)
    return True, {"config": dict(config), "scale": scale, "trusted": False, "unverified": True,
                  "error": msg}


def shrink_parallel(blocks: Sequence[int], other_steps: int, target_steps: int = 128
                    ) -> tuple[list[int], float]:
    """Fewer blocks along parallel grid axes (identical work per block), keeping at least
    ``target_steps`` grid steps in all. Returns the new block counts and the scale factor."""
    new = list(blocks)
    full = other_steps
    for b in blocks:
        full *= b
    for i in range(len(new)):
        rest = other_steps
        for j, b in enumerate(new):
            if j != i:
                rest *= b
        need = -(-target_steps // max(1, rest))
        new[i] = max(1, min(new[i], need))
    steps = other_steps
    for b in new:
        steps *= b
    return new, full / steps
