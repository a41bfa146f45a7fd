"""The one reader of winners files, for the runtime and every tool alike.

A call (:class:`~pallas_tune.cache.store.TuningCache`), ``pallas-tune check`` and ``pallas-tune
show`` (:mod:`pallas_tune.cache.inventory`) all open a winners file here, so that a file the
runtime refuses whole is one the tools report, for the same reason, and an entry it serves is
one they list:

- :func:`read`: the file's bytes (a symbolic link to nothing is unreadable, not absent) and its
  layout (:func:`~pallas_tune.cache.files.parse_winners`: entries after the closing ``}}`` are
  damage to every reader);
- :func:`header_problem`: whether the header is that of the kernel, chip and kind the reader
  looks for (a call looks for one kernel's file by name);
- :func:`read_named`: a file found by name in a chip directory (the tools), judged against what
  its name and directory promise: what a call of the kernel it names would make of it.

Which entries serve is then :func:`~pallas_tune.cache.entries.entry_problem` (any kernel: the
entry's structure and its figures, e.g. a ``median_ms`` that is 0, negative, NaN or huge) and
:meth:`~pallas_tune.runtime.tunable.TunableKernel.entry_problems` (the kernel's names, types
and space), for the runtime and the tools alike; ``cache.write`` and ``merge`` apply the same
two (:mod:`~pallas_tune.cache.declared`, :mod:`~pallas_tune.cache.merge`), so that nothing is
written that a lookup would skip.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pallas_tune import chips
from pallas_tune.cache import files, names
from pallas_tune.errors import CacheFormatError

__all__ = ["header_problem", "named_problem", "read", "read_named", "served_names"]


def read(path: str) -> files.WinnersFile:
    """Reads and parses one winners file. Raises FileNotFoundError when nothing is at ``path``,
    CacheFormatError when the file is refused whole (unreadable, not a winners file)."""
    raw, st = files.read_raw(path)
    return files.parse_winners(raw, path, st)


def header_problem(header: Mapping[str, Any], path: str, *, chip: str, kind: str,
                   kernel: str | None) -> str | None:
    """Why a file read as (``kernel``, ``chip``, ``kind``) is not that (None: it is). A header
    field that is absent agrees (files of older versions); ``kernel=None``: any kernel."""
    found = header.get("kernel", kernel)
    if kernel is not None and found != kernel:
        return f"cache file {path} holds kernel {found!r}, not {kernel!r}"
    got = header.get("chip", chip)
    if chips.normalize_chip(got) != chips.normalize_chip(chip):
        return (f"cache file {path} says chip {got!r}, but lies in the directory of "
                f"{chip!r}: move it to {chips.normalize_chip(got)}/, or fix its header")
    got = header.get("kind", kind)
    if got != kind:
        fix = "fix its header"
        if isinstance(found, str) and got in files.KINDS:
            fix = (f"rename it to {names.winners_name(names.kernel_filename(found), got)}, "
                   "or fix its header")
        return (f"cache file {path} says kind {got!r}, but its name is that of a {kind!r} "
                f"file: {fix}")
    return None


def served_names(kernel: str, kind: str) -> tuple[str, ...]:
    """The file names a call of ``kernel`` reads in a chip directory for ``kind``, in order."""
    stem, old = names.kernel_filename(kernel), names.legacy_filename(kernel)
    out = [names.winners_name(stem, kind)]
    if old != stem:
        out.append(names.winners_name(old, kind))
    out.append(names.recovered_name(stem, kind))
    return tuple(out)


def read_named(path: str) -> files.WinnersFile:
    """A winners or side file found in a chip directory, as a call would take it. Raises
    CacheFormatError naming the problem and its fix when no call would serve from it (see
    :func:`named_problem`), or when it cannot be read."""
    try:
        wf = read(path)
    except FileNotFoundError:
        raise CacheFormatError(f"cache file {path} does not exist (removed meanwhile?)") from None
    problem = named_problem(wf, path)
    if problem is not None:
        raise CacheFormatError(problem)
    return wf


def named_problem(wf: files.WinnersFile, path: str) -> str | None:
    """Why no call would serve from the file read at ``path`` (None: a call of the kernel it
    holds would): its header is not that of its name and directory, or its name is not one a
    call of that kernel reads (a side file with a suffix, a file renamed by hand)."""
    name = os.path.basename(path)
    role_kind = names.classify(name)
    kind = role_kind[1] if role_kind is not None else "measured"
    chip = os.path.basename(os.path.dirname(os.path.abspath(path)))
    kernel = wf.header.get("kernel")
    if isinstance(kernel, str) and name not in served_names(kernel, kind):
        first = served_names(kernel, kind)[0]
        if role_kind is not None and role_kind[0] == "recovered":
            return (f"cache file {path} is a side file no call reads (written while {first} "
                    f"could not be merged into): merge it back with `pallas-tune merge {path}`, "
                    "then remove it")
        return (f"cache file {path} holds kernel {kernel!r}, whose calls read {first}, never "
                "this name: rename it to that")
    return header_problem(wf.header, path, chip=chip, kind=kind, kernel=None)
