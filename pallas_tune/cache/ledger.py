"""The trial ledger: every tuning run's full record, one JSON line each, beside the winners.

``<stem>.trials.jsonl`` (``<stem>.estimate.trials.jsonl`` for estimates) is append-only: a
writer adds one line per tuned shape, ``{"key", "kind", "written", "config", "median_ms",
"provenance", "trials": [...]}``, under the winners file's lock. Nothing on the dispatch path
reads it; ``pallas-tune show --trials`` and reports do. A writer killed mid-line leaves a partial
line: readers skip lines that do not parse (or are over ``PALLAS_TUNE_MAX_FILE_MB``, never held
whole), and the next writer starts on a fresh line.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator, Sequence
from typing import Any

from pallas_tune import _settings
from pallas_tune.cache.files import dumps

__all__ = ["append", "read", "read_newest"]


def append(path: str, records: Sequence[dict[str, Any]]) -> None:
    """Appends sanitized records, one line each, and syncs. Raises OSError."""
    if not records:
        return
    data = "".join(dumps(r) + "\n" for r in records).encode("ascii")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_NONBLOCK", 0),
                 0o666)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        size = st.st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # A killed writer's partial line: end it, never extend it.
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def read(path: str, *, key: str | None = None) -> tuple[list[dict[str, Any]], int]:
    """The records of a ledger (oldest first), only those of ``key`` if given, and how many
    lines were skipped as unreadable. A missing file has no records. Raises OSError."""
    records, bad, _ = read_newest(path, None, key=key)
    return records, bad


def read_newest(path: str, limit: int | None, *, key: str | None = None
                ) -> tuple[list[dict[str, Any]], int, bool]:
    """Like :func:`read`, of at most the last ``limit`` bytes of the file (None: all of it):
    records are appended, so these are the newest. Also returns whether older bytes were left
    unread. Raises OSError."""
    records, bad = [], 0
    cut = [False]
    for record in _lines(path, limit, cut):
        if record is None:
            bad += 1
        elif key is None or record.get("key") == key:
            records.append(record)
    return records, bad, cut[0]


def _lines(path: str, limit: int | None = None, cut: list[bool] | None = None
           ) -> Iterator[dict[str, Any] | None]:
    try:  # Non-blocking, then checked: a FIFO (even one swapped in after a stat) is no ledger.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        yield None
        return
    cap = _settings.max_file_bytes()  # Per line: a ledger is history, and may grow past it.
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        if limit is not None and size > limit:
            f.seek(size - limit - 1)
            if f.read(1) != b"\n":
                f.readline(limit)  # Starts mid-record: from the next whole line on.
            if cut is not None:
                cut[0] = True
        while raw := f.readline(cap + 1):
            if len(raw) > cap and not raw.endswith(b"\n"):
                while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                    pass  # Skip the rest of a line over the limit without holding it.
                yield None
                continue
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (ValueError, RecursionError):
                yield None
                continue
            if isinstance(record, dict) and isinstance(record.get("key"), str) and isinstance(
                    record.get("trials", []), list):
                yield record
            else:
                yield None
