"""Merging entries into a winners file without losing anyone's, and holding the lock briefly.

A write reads the file, merges, renders and syncs a temp file *outside* the lock; then, under the
lock, checks that the file is still the one it read (inode, size, mtime and the header's random
``write_id``), appends the ledger lines and renames the temp file over it. A writer that lost the
race starts again (three times, then does everything under the lock). So the lock is held for a
stat, a short read, an append and a rename, whatever the file's size, and concurrent writers
still never lose each other's entries. Files without a ``write_id`` (hand-edited, schema 1) are
merged entirely under the lock.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from pallas_tune.cache import atomic, files, ledger
from pallas_tune.cache.entries import upgrade_schema1
from pallas_tune.errors import CacheFormatError, warn

__all__ = ["commit"]

LOCK_TIMEOUT_S: Final = 120.0
OPTIMISTIC_TRIES: Final = 3


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Base:
    entries: dict[str, Any]
    migrated: list[dict[str, Any]]  # Ledger records of schema 1 trials moved out of the file.
    identity: tuple[Any, ...] | None  # None: the file does not exist.


def _read_base(path: str, *, kernel: str, kind: str) -> _Base:
    """The entries of the file as it is now, every one kept (damaged ones verbatim). Raises
    CacheFormatError when the file cannot be merged into without losing something."""
    try:
        raw, st = files.read_raw(path)
    except FileNotFoundError:
        return _Base(entries={}, migrated=[], identity=None)
    except OSError as e:
        raise CacheFormatError(f"cache file {path} cannot be read ({e.strerror or e})") from None
    wf = files.parse_winners(raw, path, st)
    if wf.damage:
        raise CacheFormatError(f"cache file {path} is damaged: {wf.damage[0]}")
    if wf.header.get("kernel", kernel) != kernel:
        raise CacheFormatError(
            f"cache file {path} holds kernel {wf.header['kernel']!r}, not {kernel!r}")
    if wf.header.get("kind", kind) != kind:  # Measured figures never go into an estimates file.
        raise CacheFormatError(
            f"cache file {path} holds {wf.header['kind']!r} figures, not {kind!r} ones")
    if wf.schema == files.SCHEMA_VERSION:
        texts = wf.raw_texts()
        if texts is not None:
            try:  # A file of ours: copy its entry lines without decoding and re-encoding them.
                files.strict_check(raw, f"cache file {path}")
                return _Base(entries=dict(texts), migrated=[], identity=wf.identity)
            except CacheFormatError:
                pass  # NaN or the like inside: re-encode every entry below.
    entries, migrated = {}, []
    for key, value, problem in wf.items():
        if problem is not None:
            raise CacheFormatError(f"cache file {path}: entry {key!r}: {problem}")
        if wf.schema == 1:
            value, record = upgrade_schema1(key, value, kind=kind)
            if record is not None:
                migrated.append(record)
        entries[key] = files.sanitize(value)
    return _Base(entries=entries, migrated=migrated, identity=wf.identity)


def _identity_now(path: str) -> tuple[Any, ...] | None:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(65536)
    except FileNotFoundError:
        return None
    nl = head.find(b"\n")
    write_id = None
    if nl > 0:
        try:
            header = files.loads(head[:nl].decode("utf-8") + "}}", "header")
            write_id = header.get("write_id") if isinstance(header, dict) else None
        except (CacheFormatError, UnicodeDecodeError):
            pass
    return files.file_identity(st, write_id)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    import filelock

    lock = filelock.FileLock(path + ".lock", timeout=LOCK_TIMEOUT_S)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise CacheFormatError(
            f"another process held the lock {path}.lock for {LOCK_TIMEOUT_S:.0f} s; if no "
            "pallas-tune writer runs, delete the lock file and try again") from None
    try:
        yield
    finally:
        lock.release()


def _render(base: _Base, winners: Mapping[str, Any], *, header: Mapping[str, Any]) -> str:
    merged = {**base.entries, **winners}
    return files.render_winners({**header, "write_id": files.new_write_id()}, merged)


def _publish(tmp: str, path: str, ledger_path: str, records: Sequence[dict[str, Any]]) -> None:
    """Under the lock: the ledger first (a crash after it leaves a duplicate record, never a
    winner without its history), then the rename."""
    try:
        ledger.append(ledger_path, records)
    except OSError as e:
        warn(f"pallas-tune: could not append the trial history to {ledger_path} "
             f"({e.strerror or e}); the winners are written without it.")
    os.replace(tmp, path)
    directory = os.path.dirname(path)
    atomic.fsync_dir(directory)
    atomic.clean_stale_temps(directory)


def commit(path: str, winners: Mapping[str, Any], records: Sequence[dict[str, Any]], *,
           header: Mapping[str, Any], ledger_path: str) -> None:
    """Merges sanitized ``winners`` into the file at ``path`` and appends ``records`` to the
    ledger. Raises CacheFormatError if the file cannot be merged into (the caller then writes a
    side file) and OSError if the directory cannot be written."""
    directory = os.path.dirname(path)
    kernel, kind = header["kernel"], header["kind"]
    for _ in range(OPTIMISTIC_TRIES):
        base = _read_base(path, kernel=kernel, kind=kind)
        if base.identity is not None and base.identity[3] is None:
            break  # No write_id to compare: merge under the lock.
        tmp: str | None = atomic.write_temp(directory, _render(base, winners, header=header))
        try:
            with _locked(path):
                if _identity_now(path) == base.identity:
                    _publish(tmp, path, ledger_path, [*base.migrated, *records])
                    tmp = None
                    return
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    with _locked(path):
        base = _read_base(path, kernel=kernel, kind=kind)
        tmp = atomic.write_temp(directory, _render(base, winners, header=header))
        try:
            _publish(tmp, path, ledger_path, [*base.migrated, *records])
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
