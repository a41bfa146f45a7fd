"""Temp files, atomic replacement, and cleaning up after writers that were killed.

A writer writes a whole new file under a temp name that says which host and process owns it
(``.tmp-<host>-<pid>-<random>.json``), syncs it, and renames it over the old one: readers see the
old file or the new one, never half of one. A writer killed before the rename leaves its temp
file; readers never look at dot files, and the next writer removes those of dead processes on
this host, and any older than an hour: only files named exactly as ``temp_path`` (and the
store's write probe) names them, owned by this user, never through a link, so that a user's own
``.tmp-notes`` in a cache directory is never touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import stat
import time
from typing import Final

__all__ = ["HOST", "clean_stale_temps", "fsync_dir", "temp_path", "write_temp"]


HOST: Final = re.sub(r"[^A-Za-z0-9]+", "", socket.gethostname())[:32] or "host"
# Exactly the names we make: temp_path's (12 hex digits, .json), the store's mkstemp probe and
# pallas-tune 0.1's mkstemp temps (8 characters of tempfile's alphabet; no owner, so only old).
_TEMP_RE: Final = re.compile(r"^\.(?:tmp-(?P<host>[A-Za-z0-9]+)-(?P<pid>\d+)-[0-9a-f]{12}\.json"
                             r"|probe-(?P<phost>[A-Za-z0-9]+)-(?P<ppid>\d+)-[a-z0-9_]{8}"
                             r"|tmp-[a-z0-9_]{8}\.json)$")
STALE_TEMP_S: Final = 3600.0


def temp_path(directory: str, suffix: str = ".json") -> str:
    """A fresh temp file name that says which host and process owns it."""
    return os.path.join(directory, f".tmp-{HOST}-{os.getpid()}-{secrets.token_hex(6)}{suffix}")


def write_temp(directory: str, text: str) -> str:
    """Writes ``text`` to a new temp file in ``directory``, synced to disk; returns its path."""
    tmp = temp_path(directory)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # Umask applies.
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _unlink(tmp)
        raise
    return tmp


def fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # Some file systems cannot sync a directory.
            os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_stale_temps(directory: str, *, now: float | None = None) -> list[str]:
    """Removes temp files left by killed writers: those of a dead process on this host, and any
    older than an hour. Returns the names removed. Never raises."""
    removed = []
    now = time.time() if now is None else now
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _TEMP_RE.match(name)
        if not m:
            continue
        path = os.path.join(directory, name)
        host, pid = m.group("host") or m.group("phost"), m.group("pid") or m.group("ppid")
        dead = (host == HOST and pid is not None and int(pid) != os.getpid()
                and not _alive(int(pid)))
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            continue  # A link, a directory, or another user's file: never ours to remove.
        old = now - st.st_mtime > STALE_TEMP_S
        if dead or old:
            _unlink(path)
            removed.append(name)
    return removed
