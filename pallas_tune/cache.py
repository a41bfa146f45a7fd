"""The per-chip, per-kernel JSON cache of tuned configs.

Layout: ``<root>/<chip>/<kernel>.json`` for measured entries and ``<kernel>.estimate.json`` for
entries from a cost model or compiler estimate. Lookup order (first hit wins):

1. measured entries in the user cache directory (``PALLAS_TUNE_CACHE_DIR``, else the platform's
   user cache directory),
2. measured entries shipped inside the installed package (``pallas_tune/caches``),
3. estimate entries, user then shipped; so an estimate never beats a measurement.

A file is a JSON object ``{"schema": 1, "kernel": ..., "chip": ..., "kind": ..., "entries":
{key: entry}}``; an entry holds the best config, its median time, every trial and its provenance.
Writes take a lock file, re-read the file, merge and atomically replace it, so concurrent writers
never lose each other's entries. A malformed file is never overwritten: readers warn and skip it
(strict mode raises), writers save their entry to a side file and warn.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Final

from pallas_tune import _settings
from pallas_tune.errors import CacheFormatError, warn

__all__ = ["SCHEMA_VERSION", "TuningCache", "default_cache", "kernel_filename"]

SCHEMA_VERSION: Final = 1
KINDS: Final = ("measured", "estimate")
_REQUIRED_ENTRY_FIELDS: Final = ("config",)


def kernel_filename(kernel: str) -> str:
    """A file-name-safe form of a kernel name (``pkg.mod.fn`` stays as it is)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", kernel).strip("._") or "kernel"


def _shipped_root() -> str | None:
    try:
        from importlib import resources

        return str(resources.files("pallas_tune.caches"))
    except (ModuleNotFoundError, TypeError):
        return None


def validate_file_data(data: Any, path: str) -> dict[str, Any]:
    """Checks the structure of a parsed cache file; raises CacheFormatError naming the problem."""
    if not isinstance(data, dict):
        raise CacheFormatError(f"cache file {path} does not hold a JSON object.")
    schema = data.get("schema")
    if schema != SCHEMA_VERSION:
        raise CacheFormatError(
            f"cache file {path} has schema {schema!r}; this pallas-tune reads schema "
            f"{SCHEMA_VERSION}. Re-tune with `pallas-tune sweep`, or upgrade pallas-tune."
        )
    entries = data.get("entries")
    if not isinstance(entries, dict):
        raise CacheFormatError(f"cache file {path} has no `entries` object.")
    for key, entry in entries.items():
        if not isinstance(entry, dict) or not all(f in entry for f in _REQUIRED_ENTRY_FIELDS):
            raise CacheFormatError(
                f"cache file {path}: entry {key!r} is not an object with a `config`."
            )
        if not isinstance(entry["config"], dict):
            raise CacheFormatError(f"cache file {path}: entry {key!r} has a non-object config.")
    return data


def read_file(path: str) -> dict[str, Any]:
    """Reads and validates one cache file. Raises OSError or CacheFormatError."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CacheFormatError(
            f"cache file {path} is not valid JSON ({e}); it may be truncated. It was left as it "
            "is: fix it, or move it away and re-tune with `pallas-tune sweep`."
        ) from None
    return validate_file_data(data, path)


class TuningCache:
    """Reads and writes tuned configs under a user root, with a read-only shipped root behind it.

    Files are loaded lazily, once per (chip, kernel) and process; a write refreshes what this
    process sees. Thread-safe.
    """

    def __init__(self, user_root: str | None = None, shipped_root: str | None = None,
                 *, use_shipped: bool = True):
        self._user_root = user_root
        self._shipped_root = shipped_root if shipped_root is not None else (
            _shipped_root() if use_shipped else None
        )
        self._loaded: dict[tuple[str, str], list[tuple[str, dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    @property
    def user_root(self) -> str:
        return self._user_root or _settings.cache_dir()

    def roots(self) -> list[str]:
        roots = [self.user_root]
        if self._shipped_root and os.path.abspath(self._shipped_root) != os.path.abspath(
            roots[0]
        ):
            roots.append(self._shipped_root)
        return roots

    def path(self, chip: str, kernel: str, *, kind: str = "measured", root: str | None = None
             ) -> str:
        suffix = ".json" if kind == "measured" else f".{kind}.json"
        return os.path.join(root or self.user_root, chip, kernel_filename(kernel) + suffix)

    # ---- reading -------------------------------------------------------------------------

    def _load(self, chip: str, kernel: str) -> list[tuple[str, dict[str, Any]]]:
        """[(path, entries)] in lookup order; unreadable files are skipped with a warning."""
        sources = []
        for kind in KINDS:
            for root in self.roots():
                path = self.path(chip, kernel, kind=kind, root=root)
                if not os.path.exists(path):
                    continue
                try:
                    data = read_file(path)
                except (OSError, CacheFormatError) as e:
                    if _settings.mode() == "strict":
                        raise CacheFormatError(str(e)) from None
                    warn(f"{e} Falling back as if it held no entries.")
                    continue
                sources.append((path, data["entries"]))
        return sources

    def _sources(self, chip: str, kernel: str) -> list[tuple[str, dict[str, Any]]]:
        k = (chip, kernel)
        with self._lock:
            if k not in self._loaded:
                self._loaded[k] = self._load(chip, kernel)
            return self._loaded[k]

    def lookup(self, chip: str, kernel: str, key: str) -> tuple[dict[str, Any], str] | None:
        """The entry for key and the file it came from, or None."""
        for path, entries in self._sources(chip, kernel):
            entry = entries.get(key)
            if entry is not None:
                return entry, path
        return None

    def entries(self, chip: str, kernel: str) -> Iterator[tuple[str, dict[str, Any], str]]:
        """(key, entry, path) for every key, each once, in lookup order."""
        seen = set()
        for path, entries in self._sources(chip, kernel):
            for key, entry in entries.items():
                if key not in seen:
                    seen.add(key)
                    yield key, entry, path

    def invalidate(self) -> None:
        with self._lock:
            self._loaded.clear()

    def scan(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """(path, root, data) for every cache file under every root, for ``pallas-tune show``.

        Unreadable files yield data ``{"error": message}``."""
        for root in self.roots():
            if not os.path.isdir(root):
                continue
            for chip in sorted(os.listdir(root)):
                d = os.path.join(root, chip)
                if not os.path.isdir(d):
                    continue
                for name in sorted(os.listdir(d)):
                    if not name.endswith(".json") or ".recovered-" in name:
                        continue
                    path = os.path.join(d, name)
                    try:
                        yield path, root, read_file(path)
                    except (OSError, CacheFormatError) as e:
                        yield path, root, {"error": str(e)}

    # ---- writing -------------------------------------------------------------------------

    def check_writable(self, chip: str, kernel: str, *, kind: str = "measured") -> str:
        """Raises :class:`CacheFormatError` unless an entry for (chip, kernel) could be written
        now; returns the directory. The tuner calls it before the first candidate is measured,
        so that an unwritable cache costs no device time."""
        d = os.path.dirname(self.path(chip, kernel, kind=kind))
        try:
            os.makedirs(d, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=d, prefix=".probe-", suffix=".tmp")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise CacheFormatError(
                f"cannot write tuned configs to {d} ({e.strerror or e}); set "
                "PALLAS_TUNE_CACHE_DIR to a writable directory, or tune with write=False."
            ) from None
        return d

    def write(self, chip: str, kernel: str, key: str, entry: Mapping[str, Any], *,
              kind: str = "measured") -> str:
        """Merges one entry into the user cache file, atomically. Returns the path written.

        If the existing file is unreadable it is left untouched and the entry goes to a
        ``*.recovered-*.json`` side file, whose path is returned (with a warning).
        """
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r} must be one of {KINDS}")
        import filelock

        path = self.path(chip, kernel, kind=kind)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        entry = dict(entry)
        with filelock.FileLock(path + ".lock", timeout=120):
            data: dict[str, Any] = {
                "schema": SCHEMA_VERSION, "kernel": kernel, "chip": chip, "kind": kind,
                "entries": {},
            }
            if os.path.exists(path):
                try:
                    data = read_file(path)
                except (OSError, CacheFormatError) as e:
                    side = f"{path[:-5]}.recovered-{os.getpid()}-{int(time.time())}.json"
                    data["entries"] = {key: entry}
                    _atomic_write_json(side, data)
                    warn(
                        f"{e} The new entry for {key!r} was saved to {side} instead; merge it "
                        f"by hand or move {path} away and rename {side} to it."
                    )
                    return side
            data["entries"][key] = entry
            data["entries"] = dict(sorted(data["entries"].items()))
            _atomic_write_json(path, data)
        with self._lock:
            self._loaded.pop((chip, kernel), None)
        return path


def _atomic_write_json(path: str, data: Mapping[str, Any]) -> None:
    d = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=False, default=_json_default)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a cache is shared like any file.
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _json_default(o: Any) -> Any:
    if isinstance(o, tuple | set | frozenset):
        return list(o)
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:
        pass
    return repr(o)


_DEFAULT: TuningCache | None = None


def default_cache() -> TuningCache:
    """The process-wide cache (roots from ``PALLAS_TUNE_CACHE_DIR`` read at first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = TuningCache()
    return _DEFAULT


def reset_default_cache() -> None:
    """Forgets the process-wide cache, so the next use re-reads the environment and files."""
    global _DEFAULT
    _DEFAULT = None
