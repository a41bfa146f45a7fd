"""A resolved config: the tunable parameters' values, and where they came from.

Kept apart from :mod:`pallas_tune.space` (which re-exports it) so that the hot path's result
type is a small module of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["Config"]

_SOURCES = ("cache", "nearest", "default", "model", "explicit", "tuned")


def _freeze(value: Any) -> Any:
    """Turns lists (e.g. from TOML or JSON) into tuples, recursively, so values are hashable."""
    if isinstance(value, list | tuple):
        return tuple(_freeze(v) for v in value)
    return value


class Config(Mapping[str, Any]):
    """A frozen, hashable mapping of tunable parameter to value.

    ``source`` says where it came from: ``"cache"`` (exact cache hit), ``"nearest"`` (the config of
    the nearest tuned shape), ``"default"`` (declared default or first valid point of the space),
    ``"explicit"`` (every parameter passed by the caller) or ``"tuned"`` (just tuned).
    ``origin`` optionally names the cache key or file behind it. ``implementation``:
    ``"pallas"``, or ``"xla"`` where the cache entry found the kernel's reference faster for
    these shapes (the call then runs the reference; the config is kept, and is valid).
    """

    __slots__ = ("_dict", "_items", "implementation", "origin", "source")

    def __init__(self, items: Mapping[str, Any], *, source: str = "default", origin: str = "",
                 implementation: str = "pallas"):
        if source not in _SOURCES:
            raise ValueError(f"source={source!r} must be one of {_SOURCES}")
        self._dict = {k: _freeze(v) for k, v in items.items()}
        self._items = tuple(sorted(self._dict.items()))
        self.source = source
        self.origin = origin
        self.implementation = implementation

    def __getitem__(self, key: str) -> Any:
        return self._dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._dict)

    def __hash__(self) -> int:
        return hash(self._items)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._dict.items())
        xla = "; implementation='xla'" if self.implementation == "xla" else ""
        return f"Config({body}; source={self.source!r}{xla})"

    def replace(self, **updates: Any) -> Config:
        # Keywords given explicitly choose a Pallas config: the kernel runs.
        return Config({**self._dict, **updates}, source=self.source, origin=self.origin,
                      implementation="pallas" if updates else self.implementation)

    def to_dict(self) -> dict[str, Any]:
        return dict(self._dict)
