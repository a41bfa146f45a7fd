"""``PALLAS_TUNE_RECORD=FILE``: every cache miss met at trace time, one JSON line each; and
``PALLAS_TUNE_RECEIPTS=FILE``: what every traced call ran, one JSON line per kernel and key.

A program run with it set writes what it would have liked tuned (kernel, ``MODULE:NAME``,
chip, key, the shapes as a ``--shapes`` spec, and what served instead); ``pallas-tune sweep
--from-record FILE`` then tunes exactly those shapes. Called on the dispatcher's slow path only
(once per kernel, chip and key in a process), so unset it costs one dictionary lookup there and
nothing on the hot path.

Recording never blocks nor breaks the program it watches. The file is opened non-blocking
(``O_NONBLOCK``): a FIFO no process reads is not waited for, nor is a full pipe. Written: a
regular file (through a symlink too: the user named it), a character device (``/dev/null``, a
terminal) and a pipe or FIFO some process reads (``/dev/stderr`` under CI, ``>(jq .)``); refused:
a block device (a disk), whatever the open itself refuses (a directory, a socket). A path that is
not written (refused, or any OS error: a missing directory, ``/dev/full``, a read-only file) is
named in one :class:`~pallas_tune.errors.RecordWarning` per process, variable and path; its lines
are dropped and the program runs on.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["miss", "receipt"]

ENV = "PALLAS_TUNE_RECORD"
RECEIPTS_ENV = "PALLAS_TUNE_RECEIPTS"


def miss(kernel: Any, chip: str, key: str, args: Sequence[Any], kwargs: Mapping[str, Any],
         source: str) -> None:
    """Appends one record when ``$PALLAS_TUNE_RECORD`` names a file; never raises."""
    path = os.environ.get(ENV)
    if not path:
        return
    from pallas_tune import keys

    try:
        shapes = keys.call_key(kernel.signature, frozenset(kernel.space.names), args, kwargs)
    except Exception:  # noqa: BLE001  A custom key of statics we cannot write back: skip.
        shapes = None
    fn = kernel.fn
    record = {"kernel": kernel.name, "ref": f"{fn.__module__}:{fn.__qualname__}", "chip": chip,
              "key": key, "shapes": shapes, "served": source,
              "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    _append(path, record, ENV)


def receipt(kernel: Any, chip: str, key: str, config: Any) -> None:
    """When ``$PALLAS_TUNE_RECEIPTS`` names a file, appends what a call of ``kernel`` with
    ``key`` runs: the implementation (``pallas``; the backward's backend where the kernel
    declares one), the config, where it came from (``cache`` and the file, ``nearest`` and
    the tuned key, ``default``, ``model``, ``tuned``) and the process: the answer to "did the
    tuned kernel run?" without reading logs. Once per (kernel, chip, key) and process (the
    dispatcher's memo); calls passing every tuned keyword resolve nothing and write none."""
    path = os.environ.get(RECEIPTS_ENV)
    if not path:
        return
    record = {"kernel": kernel.name, "chip": chip, "key": key,
              "implementation": getattr(config, "implementation", "pallas"),
              "config": dict(config), "source": getattr(config, "source", "?"),
              "origin": getattr(config, "origin", ""), "pid": os.getpid(),
              "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    backward = getattr(kernel, "backward_backend", None)
    if backward:
        record["backward"] = backward
    _append(path, record, RECEIPTS_ENV)


_dropped: set[tuple[str, str]] = set()  # (variable, path) warned about in this process.
_lock = threading.Lock()


def _append(path: str, record: Mapping[str, Any], env: str) -> None:
    """Appends one line to ``path``; never blocks (see the module docstring), never raises."""
    line = (json.dumps(record, default=str) + "\n").encode()
    try:  # One write with O_APPEND: lines of concurrent processes do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
                     | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError as e:
        _drop(env, path, _why_not_opened(path, e))
        return
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISBLK(mode):  # Checked before writing: a disk never gets our lines.
            _drop(env, path, "a block device, not a file")
            return
        written = os.write(fd, line)
        if written < len(line):
            _drop(env, path, f"{written} of {len(line)} bytes written")
    except OSError as e:
        _drop(env, path, "the pipe is full" if e.errno == errno.EAGAIN
              else e.strerror or type(e).__name__)
    finally:
        os.close(fd)


def _why_not_opened(path: str, e: OSError) -> str:
    if e.errno == errno.ENXIO:  # No reader on a FIFO; a socket; a device with no driver.
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = 0
        if stat.S_ISFIFO(mode):
            return "a FIFO no process reads"
        if stat.S_ISSOCK(mode):
            return "a socket, not a file"
    return e.strerror or type(e).__name__


def _drop(env: str, path: str, why: str) -> None:
    """Warns once per process, variable and path that ``path`` is not written."""
    with _lock:
        if (env, path) in _dropped:
            return
        _dropped.add((env, path))
    from pallas_tune.errors import RecordWarning, warn

    what = "receipts" if env == RECEIPTS_ENV else "misses"
    try:
        warn(f"{env}={path}: not written ({why}); {what} of this process are dropped",
             RecordWarning)
    except Exception:  # noqa: BLE001  Warnings made errors (-W error): still never raise.
        pass
