"""What ``pallas-tune merge`` keeps: per (chip, kernel, kind, key), the fastest entry a call
would serve; an entry a call would skip never replaces anything, and each one is counted with
its reason.

An entry of an input file is judged by the rule every reader applies
(:func:`~pallas_tune.cache.entries.entry_fault`: its structure, its figures) and by the one
every writer applies (:func:`~pallas_tune.cache.declared.write_faults`: the kernel's space,
where a kernel of that name is declared) and, where the command can trace the kernel at the
key's shapes, by what a call at those shapes refuses; so merge never writes what a lookup would
skip, and a poisoned time (0, negative, NaN, huge) never beats a real one. The entry it competes
with in the target cache is the one a call would serve there: an entry a call skips blocks
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pallas_tune.cache import declared, files
from pallas_tune.cache.entries import Fault, entry_fault

__all__ = ["CallProblems", "better", "current", "file_fault", "input_fault", "summary"]


def file_fault(header: Mapping[str, Any]) -> Fault | None:
    """Why no entry of a readable winners file can be merged (None: its entries can be)."""
    kernel = header.get("kernel")
    if not isinstance(kernel, str) or not kernel:
        return Fault("file names no kernel", 'its header names no kernel (add "kernel": NAME)')
    kind = header.get("kind", "measured")
    if kind not in files.KINDS:
        return Fault("file of an unknown kind",
                     f"its header says kind {kind!r}, not one of {list(files.KINDS)}")
    return None


CallProblems = Callable[[Any, str, Any], list[str]]
"""``(kernel, key, config)``: why a call of ``kernel`` at ``key``'s shapes refuses ``config``
(traced, as a call does; empty where it serves it, or where ``key`` names no shapes)."""


def input_fault(kernel: str, key: str, value: Any, problem: str | None, *,
                kernels: Iterable[declared.EntryChecker] | None = None,
                call_problems: CallProblems | None = None) -> Fault | None:
    """Why the entry ``value`` read for ``key`` (``problem``: why it could not be parsed) is
    not merged (None: it may be): what a reader refuses, what a writer would refuse, and,
    with ``call_problems``, what a call at ``key``'s shapes refuses. ``kernels``: the kernels
    of that name to check against (default: those declared in this process)."""
    if problem is not None:
        return Fault("entry unreadable", problem)
    if not key:
        return Fault("key empty", "the key is empty")
    fault = entry_fault(value)
    if fault is not None:
        return fault
    kernels = declared.kernels_named(kernel) if kernels is None else list(kernels)
    faults = declared.write_faults(kernel, value, kernels)
    if faults:
        return faults[0]
    if call_problems is not None and kernels:
        refusals = [call_problems(k, key, value["config"]) for k in kernels
                    if not k.entry_problems(value)]
        if refusals and all(refusals):
            return Fault("config invalid at its key's shapes",
                         f"invalid for a call with its key's shapes: {refusals[0][0]}")
    return None


def better(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> bool:
    """Whether ``b`` replaces ``a``, both entries a call serves (``a`` None: there is none):
    ``b`` is faster, or ``a`` has no time (null: not measured) and ``b`` has one."""
    if a is None:
        return True
    ta, tb = a.get("median_ms"), b.get("median_ms")
    if tb is None:
        return False
    return ta is None or tb < ta


def current(cache: Any, chip: str, kernel: str, kind: str, key: str, *,
            kernels: Iterable[declared.EntryChecker] | None = None,
            call_problems: CallProblems | None = None) -> dict[str, Any] | None:
    """The entry of ``kind`` a call would serve for ``key`` from ``cache`` (a
    :class:`~pallas_tune.cache.TuningCache`), first in lookup order; entries a call skips
    (judged as :func:`input_fault` judges an input's) are passed over: they block nothing."""
    kernels = None if kernels is None else list(kernels)
    for hit in cache.lookup_all(chip, kernel, key):
        if hit.kind == kind and input_fault(kernel, key, hit.entry, hit.problem, kernels=kernels,
                                            call_problems=call_problems) is None:
            return hit.entry  # type: ignore[no-any-return]
    return None


def summary(written: int, skips: Mapping[str, int], slower: int) -> str:
    """``1 entries written, 2 skipped: 1 median_ms <= 0, 1 median_ms not finite; 1 not faster
    than the entry already there``: every input entry counted once, each skip with its
    reason (most frequent first)."""
    skipped = sum(skips.values())
    text = f"{written} entries written, {skipped} skipped"
    if skipped:
        text += ": " + ", ".join(f"{n} {why}" for why, n in sorted(
            skips.items(), key=lambda item: (-item[1], list(skips).index(item[0]))))
    if slower:
        text += f"; {slower} not faster than the entry already there"
    return text
