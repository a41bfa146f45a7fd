"""What ``@tunable`` declares, checked when it is declared: the space (a space file's, with the
decorator's choices, default, constraints and clamps on top), the cache name, ``key=`` names
and a library's own cache directories. Nothing here runs on the hot path."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from pallas_tune.cache import TuningCache
from pallas_tune.constraints import as_constraints
from pallas_tune.errors import SearchSpaceError
from pallas_tune.space import SearchSpace, load_space

__all__ = ["Declared", "declared_space", "default_name", "key_names", "library_cache"]


class Declared(Protocol):
    """What the dispatcher reads of a declared kernel (:class:`~pallas_tune.runtime.tunable.
    TunableKernel` is one), so that :mod:`~pallas_tune.runtime.dispatch` needs nothing above it."""

    name: str
    fn: Callable[..., Any]
    space: SearchSpace
    cache: TuningCache
    key_fn: Callable[..., Any] | None
    reference: Callable[..., Any] | None
    signature: inspect.Signature

    @property
    def fingerprint(self) -> str | None: ...

    def _warn_once(self, key: str, message: str, *, topic: str = "miss") -> None: ...

    def _tune_from_trace(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any: ...


def key_names(fn: Callable[..., Any], names: Any, tuned: frozenset[str], *,
              optional: bool = False) -> frozenset[str]:
    """Validates ``key=[...]``: names of the function's non-tuned parameters; with
    ``optional``, ``key_optional=[...]``: such names with a default (none is fine)."""
    params = inspect.signature(fn).parameters
    if optional:
        bad = [n for n in names if isinstance(n, str) and (
            n not in params or n in tuned or params[n].default is inspect.Parameter.empty)]
        if isinstance(names, str) or not all(isinstance(n, str) for n in names) or bad:
            raise SearchSpaceError(
                f"key_optional={names!r}: name non-tuned parameters of "
                f"{getattr(fn, '__qualname__', fn)} with a default; {bad or names!r} are not.")
        return frozenset(names)
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise SearchSpaceError(f"key={names!r} must be a callable or a list of parameter names, "
                               "e.g. key=[\"x\", \"y\", \"causal\"].")
    bad = [n for n in names if n not in params or n in tuned]
    if bad or not names:
        raise SearchSpaceError(
            f"key={list(names)!r}: {bad or 'no names'} {'are' if len(bad) != 1 else 'is'} not "
            f"non-tuned parameters of {getattr(fn, '__qualname__', fn)}; name some of "
            f"{[n for n in params if n not in tuned]}.")
    return frozenset(names)


def main_module_name() -> str:
    """The name the ``__main__`` module would have if imported: ``pkg.tune`` for ``python -m
    pkg.tune``, ``tune`` for ``python tune.py`` (the file's stem), so that a kernel defined in
    a script is named, and cached, the same whether the script is run or imported (by another
    script, or by ``pallas-tune sweep tune:matmul --path DIR``). ``__main__`` where there is no
    file (an interactive session, a notebook, ``python -c``): give such kernels ``name=``."""
    import sys

    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if name and name != "__main__":
        return name  # type: ignore[no-any-return]
    stem = os.path.splitext(os.path.basename(getattr(main, "__file__", None) or ""))[0]
    return stem if stem.isidentifier() and stem != "__main__" else "__main__"


def default_name(fn: Callable[..., Any]) -> str:
    """``module.qualname``; a kernel of the ``__main__`` module is named by the module the
    script would be when imported (:func:`main_module_name`): ``tune.matmul``."""
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "")
    module = getattr(fn, "__module__", None) or ""
    if module == "__main__":
        module = main_module_name()
    if not qualname or "<" in qualname:
        raise SearchSpaceError(
            f"@tunable on {module}.{qualname or fn!r}: a kernel defined inside a function or as "
            "a lambda has no unique name (every kernel a factory makes would share "
            f"{module}.{qualname!s}'s cache entries); pass an explicit name=, e.g. "
            "name=f\"mylib.attention_{variant}\".")
    return f"{module}.{qualname}"


def library_cache(cache: Any) -> TuningCache | None:
    if cache is None or isinstance(cache, TuningCache):
        return cache
    dirs = [cache] if isinstance(cache, str | os.PathLike) else list(cache)
    for d in dirs:
        if not isinstance(d, str | os.PathLike):
            raise SearchSpaceError(f"cache={cache!r} must be a directory, a list of them or a "
                                   "TuningCache.")
    return TuningCache(library_roots=[os.fspath(d) for d in dirs])


def declared_space(f: Callable[..., Any], space: Any, choices: Mapping[str, Sequence[Any]],
                    default: Mapping[str, Any] | None, constraints: Any,
                    clamp: Mapping[str, Any] | None) -> tuple[SearchSpace, str | None]:
    """The space ``@tunable`` declares: a space file's (or object's) parameters, default,
    constraints and clamps, with the decorator's own added on top; and the file's
    ``fallback``."""
    extra = {c.name: c for c in as_constraints(constraints)}
    base: dict[str, Sequence[Any]] = {}
    base_default = None
    base_constraints: dict[str, Any] = {}
    base_clamps: dict[str, Any] = {}
    file_fallback = None
    if isinstance(space, str | SearchSpace):
        if isinstance(space, str):
            data = load_space(space)
            loaded, file_fallback = data["space"], data["fallback"]
        else:
            loaded = space
        base = {p.name: p.choices for p in loaded.params}
        base_default = loaded.default
        base_constraints = {c.name: c for c in loaded.constraints}
        base_clamps = dict(loaded.clamps)
    elif space is not None:
        raise SearchSpaceError(f"space={space!r} must be a SearchSpace or a file name.")
    merged = {**base, **choices}
    if not merged:
        raise SearchSpaceError(
            f"@tunable on {getattr(f, '__qualname__', f)} declares no parameters; pass e.g. "
            "bm=[128, 256]."
        )
    return SearchSpace.from_choices(
        merged, default=default if default is not None else base_default,
        constraints=tuple({**base_constraints, **extra}.values()),
        clamps={**base_clamps, **(clamp or {})}), file_fallback
