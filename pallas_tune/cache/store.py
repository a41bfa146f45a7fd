"""TuningCache: where files live, the lookup order, per-entry validation and neighbours by shape.

Layout under each root, per chip directory ``<root>/<chip>/`` (``<stem>`` is
:func:`~pallas_tune.cache.files.kernel_filename` of the kernel name):

- ``<stem>.json``: measured winners; ``<stem>.estimate.json``: compiler or model estimates;
- ``<stem>[.estimate].recovered.json``: winners written while the main file was unreadable
  (read right after it, so no result is lost; merge it back by hand or with a later tool);
- ``<stem>[.estimate].trials.jsonl``: the trial ledger (:mod:`pallas_tune.cache.ledger`);
- ``*.lock`` and ``.tmp-*``: a writer's lock and temp files (readers ignore them).

Lookup order (first valid entry wins): measured before estimates; within each, by root:

1. the user root (``PALLAS_TUNE_CACHE_DIR``, else the platform's user cache directory): what
   you tuned here always wins;
2. the kernel's library caches (``@tunable(cache="DIR")``: a downstream library's tuned caches
   shipped in its wheel), in the order given;
3. the search path ``PALLAS_TUNE_CACHE_PATH`` (directories separated by ``os.pathsep``);
4. the caches shipped in pallas-tune itself.

Only the user root is ever written. A file that cannot be read at all is skipped with a warning (strict mode raises
:class:`CacheFormatError`); a damaged entry is skipped with a warning naming the file, the key
and the reason, and the file's other entries still serve. No file is ever modified by a reader.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pallas_tune import _settings, chips, keys
from pallas_tune.cache import atomic, declared, files, names, reader, writer
from pallas_tune.cache.entries import entry_problem, split_entry
from pallas_tune.errors import CacheFormatError, warn

__all__ = ["Hit", "TuningCache", "default_cache", "reset_default_cache"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Hit:
    """One entry for a key in one file: ``entry`` if it is well-formed, else ``problem``."""

    key: str
    path: str
    kind: str
    entry: dict[str, Any] | None
    problem: str | None


@dataclasses.dataclass(frozen=True, slots=True)
class _Source:
    path: str
    kind: str
    file: files.WinnersFile


def _shipped_root() -> str | None:
    try:
        from importlib import resources

        return str(resources.files("pallas_tune.caches"))
    except (ModuleNotFoundError, TypeError):
        return None


class TuningCache:
    """Reads and writes tuned configs under a user root, with a read-only shipped root behind it.

    Files are read lazily, once per (chip, kernel) and process, and their entries parsed one by
    one when first needed; a write refreshes what this process sees. Thread-safe.
    """

    def __init__(self, user_root: str | None = None, shipped_root: str | None = None,
                 *, use_shipped: bool = True, library_roots: Sequence[str] = ()):
        self._user_root = user_root
        self._library_roots = tuple(os.fspath(r) for r in library_roots)
        self._shipped_root = shipped_root if shipped_root is not None else (
            _shipped_root() if use_shipped else None
        )
        self._loaded: dict[tuple[str, str], list[_Source]] = {}
        self._index: dict[tuple[str, str], dict[str, _Group]] = {}
        self._reported: set[tuple[str, str, str]] = set()
        self._lock = threading.RLock()

    @property
    def user_root(self) -> str:
        return self._user_root or _settings.cache_dir()

    def roots(self) -> list[str]:
        """Where entries are looked up, first match first (see the module docstring)."""
        search = os.environ.get("PALLAS_TUNE_CACHE_PATH", "")
        roots = [self.user_root]
        for r in (*self._library_roots, *(p for p in search.split(os.pathsep) if p),
                  self._shipped_root):
            if r and os.path.abspath(r) not in {os.path.abspath(x) for x in roots}:
                roots.append(r)
        return roots

    def path(self, chip: str, kernel: str, *, kind: str = "measured", root: str | None = None
             ) -> str:
        """The winners file of (chip, kernel, kind) under ``root`` (default: the user root)."""
        _check_kind(kind)
        return os.path.join(root or self.user_root, chips.normalize_chip(chip),
                            names.winners_name(names.kernel_filename(kernel), kind))

    def ledger_path(self, chip: str, kernel: str, *, kind: str = "measured",
                    root: str | None = None) -> str:
        """The trial ledger beside that winners file."""
        _check_kind(kind)
        return os.path.join(root or self.user_root, chips.normalize_chip(chip),
                            names.ledger_name(names.kernel_filename(kernel), kind))

    # ---- reading -------------------------------------------------------------------------

    def _open(self, path: str, chip: str, kernel: str, kind: str, *, legacy: bool = False
              ) -> files.WinnersFile | None:
        """The file at ``path`` if a call of (chip, kernel, kind) serves from it, judged by
        :mod:`~pallas_tune.cache.reader` as ``check`` and ``show`` judge it."""
        try:
            wf = reader.read(path)
        except FileNotFoundError:
            return None
        except CacheFormatError as e:
            problem: str | None = str(e)
        else:
            if legacy and wf.header.get("kernel", kernel) != kernel:
                return None  # The old, non-injective name of another kernel's file.
            problem = reader.header_problem(wf.header, path, chip=chip, kind=kind,
                                            kernel=kernel)
        if problem is not None:
            if _settings.mode() == "strict":
                raise CacheFormatError(problem)
            self._warn_file(path, f"{problem}. It was skipped, as if it held no entries, and "
                                  "left as it is: fix it, or move it away and re-tune.")
            return None
        if wf.schema == 1 and not wf.damage:
            for _, value, _ in wf.items():  # The dispatcher never needs schema 1 trial lists.
                if isinstance(value, dict):
                    value.pop("trials", None)
        return wf

    def _load(self, chip: str, kernel: str) -> list[_Source]:
        chip = chips.normalize_chip(chip)
        sources, roots = [], [r for r in self.roots() if self._is_dir(r)]
        for kind in files.KINDS:
            served = reader.served_names(kernel, kind)  # The names `check` expects, too.
            legacy = names.winners_name(names.legacy_filename(kernel), kind)
            for root in roots:
                d = os.path.join(root, chip)
                for name in served:
                    wf = self._open(os.path.join(d, name), chip, kernel, kind,
                                    legacy=name == legacy and name != served[0])
                    if wf is not None:
                        sources.append(_Source(wf.path, kind, wf))
        return sources

    def _is_dir(self, root: str) -> bool:  # One warning for a root that is something else.
        if not os.path.isdir(root) and os.path.lexists(root):
            self._warn_file(root, f"pallas-tune: the cache directory {root} is not a directory; "
                            "nothing is looked up in it (left as it is). Point "
                            "PALLAS_TUNE_CACHE_DIR (or PALLAS_TUNE_CACHE_PATH) at a directory.")
        return os.path.isdir(root)

    def _sources(self, chip: str, kernel: str) -> list[_Source]:
        k = (chip, kernel)
        with self._lock:
            if k not in self._loaded:
                self._loaded[k] = self._load(chip, kernel)
            return self._loaded[k]

    def _hit(self, src: _Source, key: str) -> Hit | None:
        found = src.file.find(key)
        self._report_damage(src)
        if found is None:
            return None
        value, problem = found
        if problem is None:
            problem = entry_problem(value)
        return Hit(key=key, path=src.path, kind=src.kind,
                   entry=value if problem is None else None, problem=problem)

    def _report_damage(self, src: _Source) -> None:
        if src.file.indexed:
            for damage in src.file.damage:
                self._warn_file(src.path, f"cache file {src.path}: {damage}; its other entries "
                                          "still serve, and the file was left as it is.")

    def lookup_all(self, chip: str, kernel: str, key: str) -> Iterator[Hit]:
        """Every entry for ``key``, in lookup order, well-formed or not (``Hit.problem``)."""
        for src in self._sources(chip, kernel):
            hit = self._hit(src, key)
            if hit is not None:
                yield hit

    def lookup(self, chip: str, kernel: str, key: str) -> tuple[dict[str, Any], str] | None:
        """The first well-formed entry for key and the file it came from, or None. Damaged
        entries on the way are reported (one warning each) and skipped."""
        for hit in self.lookup_all(chip, kernel, key):
            if hit.problem is None:
                return hit.entry, hit.path  # type: ignore[return-value]
            self.report(hit.path, key, hit.problem)
        return None

    def entries(self, chip: str, kernel: str) -> Iterator[tuple[str, dict[str, Any], str]]:
        """(key, entry, path) for every key, each once, in lookup order; damaged entries are
        reported and skipped (a later file's entry for the key may then serve)."""
        seen = set()
        for src in self._sources(chip, kernel):
            for key in src.file.keys():
                if key in seen:
                    continue
                hit = self._hit(src, key)
                if hit is None:
                    continue
                if hit.problem is not None:
                    self.report(hit.path, key, hit.problem)
                    continue
                seen.add(key)
                yield key, hit.entry, hit.path  # type: ignore[misc]

    def neighbours(self, chip: str, kernel: str, key: str) -> Iterator[tuple[float, Hit]]:
        """(distance, hit) for the tuned keys of the same kernel and chip at a finite
        :func:`~pallas_tune.keys.key_distance` from ``key``, nearest first (ties by key;
        ``key`` itself excluded). Keys are grouped by shape signature once per load and their
        dims compared as arrays, so a query never parses entries nor loops over them in Python."""
        sources = self._sources(chip, kernel)
        with self._lock:
            index = self._index.get((chip, kernel))
            if index is None:
                index = self._index[(chip, kernel)] = _shape_index(sources)
        sig, dims = keys.shape_signature(key)
        group = index.get(sig)
        if group is None:
            return
        for d, other, i in group.nearest(dims, exclude=key):
            if math.isfinite(keys.key_distance(key, other)):  # Confirms the signature match.
                hit = self._hit(sources[i], other)
                if hit is not None:
                    yield d, hit

    def trials(self, chip: str, kernel: str, key: str, *, kind: str = "measured"
               ) -> list[dict[str, Any]]:
        """The trial records of the latest tuning run of ``key`` (user root first, then the
        shipped one): from the ledger, or from the entry itself in a schema 1 file. Empty if
        none is recorded. Never on the dispatch path."""
        from pallas_tune.cache import ledger

        for root in self.roots():
            path = self.path(chip, kernel, kind=kind, root=root)
            records, _ = ledger.read(self.ledger_path(chip, kernel, kind=kind, root=root),
                                     key=key)
            if records:
                return list(records[-1].get("trials") or [])
            try:
                raw, st = files.read_raw(path)
                found = files.parse_winners(raw, path, st).find(key)
            except (OSError, CacheFormatError):
                continue
            if found is not None and isinstance(found[0], dict) and isinstance(
                    found[0].get("trials"), list):
                return list(found[0]["trials"])
        return []

    def report(self, path: str, key: str, reason: str, fix: str = "") -> None:
        """Warns once per (file, key, reason) that an entry was skipped, and why."""
        marker = (path, key, reason)
        with self._lock:
            if marker in self._reported:
                return
            self._reported.add(marker)
        warn(f"pallas-tune: skipped the cache entry {key!r} in {path}: {reason}. The file was "
             f"left as it is and its other entries still serve.{' ' + fix if fix else ''}")

    def _warn_file(self, path: str, message: str) -> None:
        marker = (path, "", message)
        with self._lock:
            if marker in self._reported:
                return
            self._reported.add(marker)
        warn(message)

    def invalidate(self) -> None:
        with self._lock:
            self._loaded.clear()
            self._index.clear()

    # ---- writing -------------------------------------------------------------------------

    def check_writable(self, chip: str, kernel: str, *, kind: str = "measured") -> str:
        """Raises :class:`CacheFormatError` unless an entry for (chip, kernel) could be written
        now; returns the directory. The tuner calls it before the first candidate is measured,
        so that an unwritable cache costs no device time."""
        path = self.path(chip, kernel, kind=kind)
        d = os.path.dirname(path)
        try:
            os.makedirs(d, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=d, prefix=f".probe-{atomic.HOST}-{os.getpid()}-",
                                         suffix=".tmp")
            os.close(fd)
            os.unlink(probe)
            for existing in (path + ".lock", self.ledger_path(chip, kernel, kind=kind)):
                if os.path.exists(existing) and not os.access(existing, os.W_OK):
                    raise PermissionError(13, "Permission denied", existing)
        except OSError as e:
            raise CacheFormatError(
                f"cannot write tuned configs to {getattr(e, 'filename', None) or d} "
                f"({e.strerror or e}); set PALLAS_TUNE_CACHE_DIR to a writable directory, or "
                "tune with write=False."
            ) from None
        return d

    def write(self, chip: str, kernel: str, key: str, entry: Mapping[str, Any], *,
              kind: str = "measured") -> str:
        """Merges one entry (as the tuner makes it, ``"trials"`` included) into the user cache.

        An entry a lookup would skip is refused (CacheFormatError naming the field and the
        fix, nothing written): a figure that is not a time (``median_ms`` must be finite,
        > 0 and at most :data:`~pallas_tune.cache.entries.MAX_MS`), a malformed entry, or a
        config that no kernel of that name declared in this process takes (see
        :mod:`pallas_tune.cache.declared`).

        The winner goes to the winners file, its trials and bulky provenance to the ledger. If
        the winners file cannot be merged into, it is left untouched and the entry goes to the
        ``*.recovered.json`` side file (read right after it), with a warning. Returns the path
        written. Raises CacheFormatError if nothing can be written."""
        return self.write_many(chip, kernel, {key: entry}, kind=kind)

    def write_many(self, chip: str, kernel: str, entries: Mapping[str, Mapping[str, Any]], *,
                   kind: str = "measured") -> str:
        """Like :meth:`write`, for several keys in one merge (sweeps, imports, benchmarks)."""
        _check_kind(kind)
        chip = chips.normalize_chip(chip)
        winners, records = {}, []
        for key, entry in entries.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"cache key {key!r} must be a non-empty string")
            declared.refuse_skipped(kernel, key, entry, several=len(entries) > 1)
            winners[key], record = split_entry(key, entry, kind=kind)
            if record is not None:
                records.append(record)
        path = self.path(chip, kernel, kind=kind)
        stem = names.kernel_filename(kernel)
        header = {"schema": files.SCHEMA_VERSION, "kernel": kernel, "chip": chip, "kind": kind,
                  "ledger": names.ledger_name(stem, kind)}
        ledger_path = self.ledger_path(chip, kernel, kind=kind)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            written = self._commit_or_side(path, winners, records, header, ledger_path)
        except OSError as e:
            raise CacheFormatError(
                f"cannot write tuned configs to {path} ({e.strerror or e}); set "
                "PALLAS_TUNE_CACHE_DIR to a writable directory.") from None
        with self._lock:
            self._loaded.pop((chip, kernel), None)
            self._index.pop((chip, kernel), None)
        return written

    def _commit_or_side(self, path: str, winners: dict[str, Any], records: list[dict[str, Any]],
                        header: dict[str, Any], ledger_path: str) -> str:
        try:
            writer.commit(path, winners, records, header=header, ledger_path=ledger_path)
            return path
        except CacheFormatError as e:
            problem = str(e)
        d, kind = os.path.dirname(path), header["kind"]
        stem = names.kernel_filename(header["kernel"])
        side = os.path.join(d, names.recovered_name(stem, kind))
        try:
            writer.commit(side, winners, records, header=header, ledger_path=ledger_path)
        except CacheFormatError:
            side = os.path.join(d, names.recovered_name(stem, kind, files.new_write_id()))
            writer.commit(side, winners, records, header=header, ledger_path=ledger_path)
        warn(f"pallas-tune: {problem}. It was left as it is; the new entries for "
             f"{sorted(winners)} were saved to {side} instead, which is read right after it. "
             f"Fix {path}, or move it away and rename {side} to it.")
        return side


def _check_kind(kind: str) -> None:
    if kind not in files.KINDS:
        raise ValueError(f"kind={kind!r} must be one of {files.KINDS}")


class _Group:
    """The keys of one shape signature, sorted, with their source and their dims as an array
    (None if look-alike dims in static strings make the shapes unreliable)."""

    __slots__ = ("dims", "entries")

    def __init__(self, entries: list[tuple[str, int]]):
        import numpy as np

        self.entries = sorted(entries)
        found = keys.DIM_RE.findall("\n".join(k for k, _ in self.entries))
        rank, rest = divmod(len(found), len(self.entries))
        self.dims = None if rest else np.array(found, dtype=np.float64).reshape(
            len(self.entries), rank)

    def nearest(self, dims: tuple[int, ...], *, exclude: str
                ) -> Iterator[tuple[float, str, int]]:
        import numpy as np

        table = self.dims
        if table is None or table.shape[1] != len(dims):
            return
        q = np.array(dims, dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            diff = np.abs(np.log2(table) - np.log2(q))
        zero = (table <= 0) | (q <= 0)
        dist = np.where(zero, np.where(table == q, 0.0, np.inf), diff).sum(axis=1)
        for j in np.argsort(dist, kind="stable"):
            d = float(dist[j])
            if d == math.inf:
                return
            other, source = self.entries[j]
            if other != exclude:
                yield d, other, source


def _shape_index(sources: list[_Source]) -> dict[str, _Group]:
    groups: dict[str, list[tuple[str, int]]] = {}
    for i, src in enumerate(sources):
        for key in src.file.keys():
            groups.setdefault(keys.DIM_RE.sub("#", key), []).append((key, i))
    return {sig: _Group(entries) for sig, entries in groups.items()}


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
