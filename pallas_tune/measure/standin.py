"""Stand-ins for the ``tpu-estimate`` timer: a smaller problem with the same tiles, whose
estimate, scaled, stands for the full problem's (see :mod:`.estimate`). Kernels build theirs
with :func:`shrink_parallel`; the tuner decides whether to trust one with :func:`check`
(which candidates to check) and :func:`standin_verdict` (what one check says)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune.measure.loops import NO_ESTIMATE, NOT_ESTIMABLE

__all__ = ["check", "shrink_parallel", "standin_verdict", "unverified"]

TRIES = 3  # Candidates whose stand-in fails before the check stops trying.


def check(configs: Sequence[Mapping[str, Any]], scales: Sequence[Any],
          estimate: Callable[[Mapping[str, Any], bool], Any]) -> tuple[bool, dict[str, Any]]:
    """Whether to use the stand-in, and the record: one candidate estimated on its stand-in
    and in full (``estimate(config, standin)``), trusted within 5% (else every candidate is
    compiled in full). ``scales``: each config's stand-in scale (None where it has none,
    ``"error"`` where the stand-in raised).

    Tries the configs by smallest scale above 1 (the cheapest full compile that exercises the
    scaling), up to ``TRIES`` while a stand-in fails (dies in its worker, e.g. 128 tiles beside
    1024 ones, or fails to compile at that config: 32768-row matmuls, where one such config
    had turned the stand-in off and sent every candidate to full compiles that died). Where
    none completes a check the stand-in is kept and labelled unverified; a candidate that
    compiles on its stand-in and fails in full turns it off."""
    ranked = []
    for config, scale in zip(configs, scales, strict=True):
        if scale == "error":
            return False, {"error": "stand-in raised"}
        if scale is not None and scale != 1:  # Shrunk (> 1), or transformed (splash).
            ranked.append((scale, len(ranked), dict(config)))
    if not ranked:
        return True, {"note": "no candidate needed a stand-in"}
    failed = []
    for scale, _, config in sorted(ranked)[:TRIES]:
        scaled = estimate(config, True)
        if not scaled.ok:  # Says nothing of the method (this config, or too big): next.
            failed.append(_failure(config, "stand-in", scaled))
            continue
        full = estimate(config, False)
        if full.ok or full.kind in ("worker_crashed", NOT_ESTIMABLE, NO_ESTIMATE):
            use, record = standin_verdict(config, scale, scaled, full)
            return use, {**record, **({"passed_over": failed} if failed else {})}
        # Compiles on its stand-in, fails in full: the stand-in hides a failure.
        return False, {"error": "a candidate compiled on its stand-in and failed in full",
                       "passed_over": failed + [_failure(config, "full", full)]}
    # No check completed (stand-ins that failed or died): kept, UNVERIFIED, as where the full
    # problem is too big (standin_verdict).
    last = failed[-1]
    use, record = unverified(last["config"], scale, (
        f"the stand-in compile of {last['config']} failed ({last['kind']}: "
        f"{last['message'][:200]}), as did {len(failed) - 1} tried before it"))
    return use, {**record, "passed_over": failed}


def _failure(config: Mapping[str, Any], which: str, r: Any) -> dict[str, Any]:
    return {"config": dict(config), "compile": which, "kind": r.kind,
            "message": r.message[:300]}


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
    if scaled.ok and not full.ok and full.kind in (NOT_ESTIMABLE, NO_ESTIMATE):
        # The full problem has no static estimate at any config (splash's mask tables, which
        # the profile reads as 0; ragged paged attention's loops over lengths, composed from
        # static pieces): the stand-in is the only figure, checked by its method alone.
        return True, {"config": dict(config), "scale": scale, "trusted": False,
                      "unverifiable": True,
                      **({"method": scaled.message[:600]} if scaled.message else {}),
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
