"""``PALLAS_TUNE_RECORD=FILE``: every cache miss met at trace time, one JSON line each; and
``PALLAS_TUNE_RECEIPTS=FILE``: what every traced call ran, one JSON line per kernel and key.

A program run with it set writes what it would have liked tuned (kernel, ``MODULE:NAME``,
chip, key, the shapes as a ``--shapes`` spec, and what served instead); ``pallas-tune sweep
--from-record FILE`` then tunes exactly those shapes. Called on the dispatcher's slow path only
(once per kernel, chip and key in a process), so unset it costs one dictionary lookup there and
nothing on the hot path.
"""

from __future__ import annotations

import datetime
import json
import os
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
    _append(path, record)


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
    record = {"kernel": kernel.name, "chip": chip, "key": key, "implementation": "pallas",
              "config": dict(config), "source": getattr(config, "source", "?"),
              "origin": getattr(config, "origin", ""), "pid": os.getpid(),
              "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}
    backward = getattr(kernel, "backward_backend", None)
    if backward:
        record["backward"] = backward
    _append(path, record)


def _append(path: str, record: Mapping[str, Any]) -> None:
    line = (json.dumps(record, default=str) + "\n").encode()
    try:  # One write with O_APPEND: lines of concurrent processes do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass  # Recording must never break the program it watches.
