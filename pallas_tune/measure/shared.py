"""Worker pools shared by the tuning runs of one program (:func:`pallas_tune.autotune`).

A tuning run opens a pool of compile workers, and each worker loads JAX and libtpu (seconds);
a program's calls are many runs. Within :func:`shared_pools`, a run asks :func:`acquire` for
a pool by what its workers must share (worker count, limits, main script): the first run
starts it, later runs retarget its workers (``Pool.retarget``), and the pools close, and their
scratch directories go, when the block ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import shutil
from collections.abc import Callable, Hashable, Iterator
from typing import Any

__all__ = ["acquire", "shared_pools"]

_POOLS: contextvars.ContextVar[dict[Hashable, tuple[Any, str]] | None] = contextvars.ContextVar(
    "pallas_tune_shared_pools", default=None)


@contextlib.contextmanager
def shared_pools() -> Iterator[None]:
    """Pools acquired inside are shared, and closed on exit (nested blocks: the outermost)."""
    if _POOLS.get() is not None:
        yield
        return
    pools: dict[Hashable, tuple[Any, str]] = {}
    token = _POOLS.set(pools)
    try:
        yield
    finally:
        _POOLS.reset(token)
        for pool, scratch in pools.values():
            pool.close()
            shutil.rmtree(scratch, ignore_errors=True)


def active() -> bool:
    """Whether pools are shared here."""
    return _POOLS.get() is not None


def acquire(key: Hashable, start: Callable[[], tuple[Any, str]]) -> tuple[Any, bool]:
    """The shared pool for ``key`` and whether it was already open, or ``start()``'s new
    ``(pool, scratch directory)`` (kept for later runs where pools are shared)."""
    pools = _POOLS.get()
    if pools is not None and key in pools:
        return pools[key][0], True
    pool, scratch = start()
    if pools is not None:
        pools[key] = (pool, scratch)
    return pool, False
