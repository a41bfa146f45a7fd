"""The per-chip, per-kernel cache of tuned configs: winners files read at trace time, and the
trial ledger beside them. See :mod:`pallas_tune.cache.store` for the layout and lookup order,
:mod:`pallas_tune.cache.files` for the file format, :mod:`pallas_tune.cache.entries` for what an
entry must be (its figures included), :mod:`pallas_tune.cache.declared` for what a write is
checked against, :mod:`pallas_tune.cache.writer` for merges into a file and
:mod:`pallas_tune.cache.merge` for what ``pallas-tune merge`` keeps.
"""

from __future__ import annotations

from typing import Any

from pallas_tune.cache.files import SCHEMA_VERSION
from pallas_tune.cache.names import kernel_filename
from pallas_tune.cache.store import Hit, TuningCache, default_cache, reset_default_cache

__all__ = ["SCHEMA_VERSION", "Hit", "TuningCache", "default_cache", "kernel_filename",
           "read_file", "reset_default_cache"]


def read_file(path: str) -> dict[str, Any]:
    """Reads one winners file whole: its header fields and ``entries`` (every entry parsed).

    Raises OSError, or CacheFormatError if the file or any entry line cannot be parsed (for
    tests, tools and reports; the dispatcher reads entries one by one instead)."""
    from pallas_tune.cache import files
    from pallas_tune.errors import CacheFormatError

    raw, st = files.read_raw(path)
    wf = files.parse_winners(raw, path, st)
    if wf.damage:
        raise CacheFormatError(f"cache file {path}: {wf.damage[0]}")
    entries = {}
    for key, value, problem in wf.items():
        if problem is not None:
            raise CacheFormatError(f"cache file {path}: entry {key!r}: {problem}")
        entries[key] = value
    return {**wf.header, "entries": entries}
