"""What a writer checks an entry against: the rule every reader applies, and the kernels of that
name declared in this process.

A call skips an entry that :func:`~pallas_tune.cache.entries.entry_fault` refuses (its
structure, its figures) or that its kernel's
:meth:`~pallas_tune.runtime.tunable.TunableKernel.entry_problems` refuses (names, types, the
declared space). ``TuningCache.write`` (and so the tuner, ``autotune``'s results, ``merge``,
``recheck-xla``) refuses both with :func:`write_faults`, the same two functions, so that nothing
is written that a lookup would skip. The cache is written by kernel *name*; the kernels
``@tunable`` declares register here (weakly: a kernel that is gone is forgotten), and an entry
is refused when every live kernel of its name refuses it. A name no kernel of this process has
gets the entry checks only: there is no space to check the config against.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from pallas_tune.cache.entries import FIGURES, Fault, entry_fault, figures_fault
from pallas_tune.cache.files import sanitize
from pallas_tune.errors import CacheFormatError

__all__ = ["EntryChecker", "declare", "kernels_named", "refuse_skipped", "write_faults"]


class EntryChecker(Protocol):
    """A kernel as a writer sees it (:class:`~pallas_tune.runtime.tunable.TunableKernel`)."""

    name: str

    def entry_problems(self, entry: Mapping[str, Any]) -> list[str]: ...


_DECLARED: dict[str, weakref.WeakSet[Any]] = {}
_LOCK = threading.Lock()


def declare(kernel: EntryChecker) -> None:
    """Registers a kernel under its name (at declaration; never on the hot path)."""
    with _LOCK:
        _DECLARED.setdefault(kernel.name, weakref.WeakSet()).add(kernel)


def kernels_named(name: str) -> list[EntryChecker]:
    """The live kernels of this process declared as ``name``."""
    with _LOCK:
        found = _DECLARED.get(name)
        return list(found) if found is not None else []


def write_faults(name: str, entry: Any, kernels: Iterable[EntryChecker] | None = None
                 ) -> list[Fault]:
    """Why a lookup of kernel ``name`` would skip ``entry`` once written (empty: it would not):
    its figures as given (a NaN is not a time, though a writer would turn it into null), then
    the rest of the entry as it would be written, against
    :func:`~pallas_tune.cache.entries.entry_fault` and against ``kernels`` (default:
    :func:`kernels_named`); the first fault of each, so that a figure's does not hide the
    config's."""
    faults = []
    if isinstance(entry, Mapping):
        figure = figures_fault(entry)
        if figure is not None:
            faults.append(figure)
        # The rest is checked without the figures, so that one fault does not hide another.
        entry = {k: v for k, v in sanitize(dict(entry)).items() if k not in FIGURES}
    fault = entry_fault(entry)
    if fault is not None:
        return [*faults, fault]
    kernels = kernels_named(name) if kernels is None else list(kernels)
    refusals = [k.entry_problems(entry) for k in kernels]
    if refusals and all(refusals):
        params = getattr(getattr(kernels[0], "space", None), "names", None)
        faults.append(Fault(
            "config not in the kernel's space", f"its config {'; '.join(refusals[0])}",
            f"Write a config of {name}'s space: exactly its parameters"
            f"{f' {list(params)}' if params else ''}, each a declared choice (a value of the "
            'declared type outside the choices only with "outside_space": true).'))
    return faults


def refuse_skipped(kernel: str, key: str, entry: Any, *, several: bool = False) -> None:
    """Raises CacheFormatError, naming every fault and its fix, if a lookup of ``kernel``
    would skip ``entry`` (:func:`write_faults`); ``several``: the write holds other entries,
    none of which is written either."""
    faults = write_faults(kernel, entry)
    if not faults:
        return
    fixes = " ".join(dict.fromkeys(f.fix for f in faults if f.fix))
    raise CacheFormatError(
        f"cache entry {key!r} of kernel {kernel!r} was not written"
        f"{' (nor any other entry of this write)' if several else ''}: a lookup would skip it "
        f"({'; '.join(f.detail for f in faults)}). {fixes}".rstrip())
