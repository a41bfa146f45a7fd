"""``pallas-tune check --space NAME --chip CHIP``: does a cache hold an entry for every shape of a
shape set? The question to ask before shipping a cache into production, where a shape without an
entry runs the kernel's default config.

Entries are looked up the way the dispatcher looks them up (the same cache key, the same lookup
order over the user, library and shipped roots), so a shape reported covered is one a traced
call of the kernel would find. Nothing is imported beyond the kernels the space files name, and no
file is changed.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pallas_tune.cli.shapes import CLIUsageError, build_call, spec_items

__all__ = ["Coverage", "space_coverage"]


@dataclass
class Coverage:
    """One shape set's coverage on one chip: ``missing`` are (spec, sweep command) pairs."""

    space: str
    kernel: str
    chip: str
    total: int = 0
    kinds: dict[str, int] = field(default_factory=dict)
    code: dict[str, int] = field(default_factory=dict)
    missing: list[tuple[str, str]] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)

    def summary(self) -> str:
        found = self.total - len(self.missing)
        parts = [f"{n} {k}" for k, n in sorted(self.kinds.items())]
        parts += [f"{self.code[s]} {s}" for s in ("current", "stale", "unknown") if self.code.get(s)]
        detail = f" ({', '.join(parts)})" if parts else ""
        return (f"coverage: {self.space} ({self.kernel}) on {self.chip}: {found} of {self.total} "
                f"shapes have an entry{detail}")


def _cache_for(paths: Sequence[str]) -> Any:
    """The cache to look in: the default (user, library and shipped roots, as dispatch sees
    them) when no path is given, else exactly the given cache roots, first first."""
    import os

    from pallas_tune.cache import TuningCache, default_cache

    if not paths:
        return default_cache()
    for p in paths:
        if not os.path.isdir(p):
            raise CLIUsageError(f"--space checks cache roots: {p} is not a directory (give the "
                                "root that holds the chip directories)")
    return TuningCache(paths[0], use_shipped=False, library_roots=paths[1:])


def space_coverage(space_names: Sequence[str], chip: str, paths: Sequence[str],
                   kernel_paths: Sequence[str] = ()) -> list[Coverage]:
    """Per space file, which of its shapes have an entry for ``chip`` in the cache at ``paths``.

    Raises:
      CLIUsageError: a space file is missing, names no kernel or no shapes, or a shape of it
        does not fit its kernel.
    """
    from pallas_tune import _kernel_hash, chips
    from pallas_tune.cli.sweep import load_kernel
    from pallas_tune.errors import SearchSpaceError
    from pallas_tune.space import load_space

    chip = chips.normalize_chip(chip)
    cache = _cache_for(paths)
    out = []
    for name in space_names:
        try:
            loaded = load_space(name)
        except SearchSpaceError as e:
            raise CLIUsageError(str(e)) from None
        if not loaded["kernel"] or not loaded["shapes"]:
            raise CLIUsageError(f"--space {name}: the file names no kernel or no [[shapes]]; "
                                "coverage needs both")
        kernel = load_kernel(loaded["kernel"], kernel_paths)
        cov = Coverage(space=name, kernel=kernel.name, chip=chip)
        for shape in loaded["shapes"]:
            spec = spec_items(shape)
            args, kwargs = build_call(kernel, spec)
            key = kernel.cache_key(*args, **kwargs)
            cov.total += 1
            hit = next((h for h in cache.lookup_all(chip, kernel.name, key)
                        if h.problem is None), None)
            if hit is None:
                cov.missing.append((key, _sweep_command(name, chip, spec)))
                continue
            cov.kinds[hit.kind] = cov.kinds.get(hit.kind, 0) + 1
            recorded, _ = _kernel_hash.recorded(hit.entry.get("provenance"))
            state = _kernel_hash.kernel_state(recorded, kernel)
            cov.code[state] = cov.code.get(state, 0) + 1
            if state == "stale":
                cov.stale.append(f"{hit.path}: entry {key!r}: stale (tuned on other code of "
                                 f"{kernel.name}); re-tune: {_sweep_command(name, chip, spec)}")
        out.append(cov)
    return out


def _sweep_command(space: str, chip: str, spec: str) -> str:
    return (f"pallas-tune sweep --space {shlex.quote(space)} --shapes {shlex.quote(spec)} "
            f"--chip {chip.removeprefix('tpu_')}")
