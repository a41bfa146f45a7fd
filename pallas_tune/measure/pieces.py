"""A stand-in made of several problems: a call's estimate as a weighted sum of libtpu's
estimates of pieces it can read (see :mod:`.estimate`).

libtpu's static profile counts a loop whose trip count is read from memory as a fixed guess
(:mod:`.loops`). Where a kernel's work is a sum of repeated units (grid steps, loop iterations),
each of fixed cost whatever the data, and the tuner holds the call's concrete inputs, the kernel
may instead return :class:`Pieces` from its ``standin=``: the same kernel with static trip counts
at a few small sizes, and a ``combine`` that turns their estimates into the call's figure from the
concrete counts (for instance: the per-step and per-iteration cycles solved from the pieces,
times the steps and iterations the call's lengths give). Each piece is estimated like any
candidate (census, compile, floor), never on a stand-in of its own; the figure is libtpu's,
composed, and the trial's detail says so (``combine``'s note).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Pieces", "estimate_pieces"]


@dataclasses.dataclass(frozen=True)
class Pieces:
    """What a ``standin=`` returns in place of its args: ``problems``, each ``(args, kwargs)``
    for the kernel; ``combine(cycles) -> (cycles, note)`` from their estimates, in order, to the
    call's (raising ``ValueError`` where libtpu's figures for the pieces cannot be combined).
    ``error``: why the call cannot be estimated at all (its concrete inputs break the kernel's
    preconditions): every candidate then fails with it, uncompiled, and the tuner stops on the
    arguments (``tuning.loop``'s fail-fast), naming it."""

    problems: Sequence[tuple[Sequence[Any], dict[str, Any]]]
    combine: Callable[[Sequence[int]], tuple[float, str]]
    error: str = ""


def estimate_pieces(pieces: Pieces, parts: Any, config: Any, chip: str,
                    estimate: Callable[..., Any], result: Callable[..., Any]) -> Any:
    """The call's estimate from its pieces: ``estimate`` (:func:`.estimate.estimate`, passed in:
    this module is below it) estimates each piece in full (an ``EstimateResult``, the type
    ``result``); the first piece that fails is the result (its kind and message, said to be a
    piece's); else the first piece's result with the combined cycles, ``message`` the note."""
    from pallas_tune.measure.loops import NOT_ESTIMABLE

    if pieces.error:
        return result(ok=False, kind=NOT_ESTIMABLE, message=pieces.error)
    results = []
    for i, (args, kwargs) in enumerate(pieces.problems):
        r = estimate(parts, list(args), dict(kwargs), config, chip, False)
        if not r.ok:
            return dataclasses.replace(r, message=f"piece {i + 1} of {len(pieces.problems)} of "
                                       f"the composed estimate: {r.message}")
        results.append(r)
    try:
        cycles, note = pieces.combine([int(r.cycles or 0) for r in results])
    except ValueError as e:
        return dataclasses.replace(results[0], ok=False, kind=NOT_ESTIMABLE, cycles=None,
                                   message=str(e))
    return dataclasses.replace(
        results[0], cycles=int(round(cycles)), standin_cycles=sum(r.cycles or 0 for r in results),
        scale=1.0, compile_s=sum(r.compile_s for r in results), message=note,
        scoped_vmem_bytes=max((r.scoped_vmem_bytes or 0 for r in results), default=0) or None)
