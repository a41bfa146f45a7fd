"""A call's arguments at the kernel's boundary, on the hot path: static values as Python values.

A kernel's *static* parameters are the non-tuned ones that take a plain Python value, which
picks the program and is part of the cache key (``sm_scale``, ``eps``, ``causal``, a window
size): those whose default is a bool, int, float or str, or whose annotation names only such
types (``float | None``, ``int | tuple[int, int] | None``, ``Literal[...]``). The other
parameters are operands (arrays) or left as the caller gives them.

- A numpy scalar (``np.float64(0.125)``, ``1 / np.sqrt(d)``) or a concrete JAX scalar
  (``jnp.float32(0.125)``) given for a static parameter is its Python value (``.item()``), so
  the call runs and is keyed exactly as the call with that Python value; a tuple of them
  (``local_window_size=(np.int64(4), 4)``) is a tuple of Python values. Tuned keywords given
  explicitly (``bm=np.int64(128)``) are made Python values the same way.
- A traced value (under ``jax.jit``, ``grad`` or ``vmap``) or an array of more than one element
  where a static value is needed is refused at once with a :class:`TypeError` naming the
  parameter, not after every config of the space was refused.
- A numpy integer array of 64 bits with JAX's x64 off holding a value outside int32 (JAX would
  wrap it to int32 silently: two different segment ids could become one) is refused with a
  :class:`ValueError` naming the parameter.

Python values pass through one ``type()`` test each: the check costs a set intersection per call.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["Statics", "explicit", "fast_part", "plain_config", "python_value", "static_params"]

_PLAIN = frozenset({bool, int, float, str, type(None)})
_NDARRAY = np.ndarray
_SCALAR_WORDS = frozenset({"bool", "int", "float", "str", "None", "NoneType", "tuple", "Tuple",
                           "list", "List", "Optional", "Union", "Literal", "Sequence"})
_VALUE_WORDS = frozenset({"bool", "int", "float", "str", "Literal"})
_QUOTED = re.compile(r"\"[^\"]*\"|'[^']*'")
_WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9.]*")


def _annotation_is_static(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    words = {w.rsplit(".", 1)[-1] for w in _WORD.findall(_QUOTED.sub("", text))}
    return bool(words) and words <= _SCALAR_WORDS and bool(words & _VALUE_WORDS)


def static_params(sig: inspect.Signature, tuned: frozenset[str]
                  ) -> tuple[frozenset[str], dict[int, str]]:
    """The static parameters of a signature (see the module docstring), and the positions of
    those that can be given positionally."""
    names, positions = set(), {}
    for i, (name, p) in enumerate(sig.parameters.items()):
        if name in tuned or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        d = p.default
        if (type(d) in _PLAIN and d is not None) or _annotation_is_static(p.annotation):
            names.add(name)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                positions[i] = name
    return frozenset(names), positions


def python_value(kernel: str, name: str, v: Any) -> Any:
    """The Python value of ``v`` given for the static parameter ``name`` of ``kernel``."""
    t = type(v)
    if t in _PLAIN:
        return v
    if t is tuple or t is list:
        return t(python_value(kernel, name, x) for x in v)
    item = getattr(v, "item", None)
    if item is None or not hasattr(v, "shape"):
        return v  # Another object (a callable, a named tuple of values): the kernel decides.
    import jax

    if isinstance(v, jax.core.Tracer):
        raise TypeError(
            f"{kernel}: {name} is a static parameter (its value picks the compiled program and "
            f"the cache key), but a traced value reached it ({getattr(v, 'aval', t.__name__)}): "
            f"it comes from an argument of a function under jax.jit, grad or vmap. Pass a "
            f"Python or numpy value: close over it, or mark that argument static "
            f"(jax.jit(f, static_argnames=...)).")
    if getattr(v, "size", 1) != 1:
        raise TypeError(f"{kernel}: {name} is a static parameter and takes a Python value; got "
                        f"an array of shape {tuple(v.shape)}. Pass a Python number.")
    return item()


class Statics:
    """The static parameters of one kernel, and their normalization on each call."""

    __slots__ = ("kernel", "names", "params", "positions")

    def __init__(self, kernel: str, sig: inspect.Signature, tuned: frozenset[str]):
        self.kernel = kernel
        self.names, self.positions = static_params(sig, tuned)
        self.params = list(sig.parameters)  # Positional arguments' names, for messages.

    def apply(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Sequence[Any]:
        """Makes ``kwargs`` (in place) and the returned ``args`` Python values where static,
        and refuses 64-bit host integers JAX would wrap. One ``type()`` test per argument."""
        for name, v in kwargs.items():
            t = type(v)
            if t in _PLAIN:
                continue
            if name in self.names:
                kwargs[name] = python_value(self.kernel, name, v)  # Same keys: safe in a loop.
            elif t is _NDARRAY:
                _wide(self.kernel, name, v)
            elif isinstance(v, tuple | list):
                fields = getattr(v, "_fields", None)  # A named tuple: SegmentIds(q, kv).
                for j, x in enumerate(v):
                    if type(x) is _NDARRAY:
                        _wide(self.kernel, f"{name}.{fields[j]}" if fields else f"{name}[{j}]", x)
        if self.positions:
            for i, name in self.positions.items():
                if i < len(args) and type(args[i]) not in _PLAIN:
                    args = list(args)
                    args[i] = python_value(self.kernel, name, args[i])
        for v in args:
            if type(v) is _NDARRAY:
                i = next(j for j, x in enumerate(args) if x is v)
                _wide(self.kernel, self.params[i] if i < len(self.params) else f"argument {i}", v)
        return args


def fast_part(v: Any) -> Any:
    """An argument as the memo keys of the hot path hold it: arrays by shape and dtype."""
    shape = getattr(v, "shape", None)
    if shape is not None:
        return (shape, v.dtype)
    if isinstance(v, list | tuple):
        return tuple(fast_part(x) for x in v)
    return v


def explicit(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
             config: Mapping[str, Any]) -> dict[str, Any]:
    """Tuned keywords the caller gave (with the resolved rest): through the one validity check
    (``kernel.violations``), as a cache entry's config is, and refused with its reasons, once
    per distinct config and call shapes (``kernel._checked`` memoizes those that passed)."""
    checked = kernel._checked
    config = plain_config(kernel.name, {**{n: config[n] for n in kernel.space.names
                                           if n in config}, **config})
    try:
        mark = (tuple(map(fast_part, args)), tuple(sorted(
            (k, fast_part(v)) for k, v in kwargs.items())), tuple(sorted(config.items())))
        if mark in checked:
            return config
    except TypeError:  # Unhashable: checked on every call.
        mark = None
    problems = kernel.violations(config, args, kwargs)
    if problems:
        from pallas_tune.errors import InvalidConfig

        raise InvalidConfig(
            f"{kernel.name}: the tuned keywords {config} cannot run the call "
            f"{kernel.cache_key(*args, **kwargs)!r}: {'; '.join(problems)}. Pass values the "
            "kernel accepts, or leave the tuned keywords out to use the tuned config.")
    if mark is not None:
        checked.add(mark)  # A set's add is atomic under the GIL.
    return config


def plain_config(kernel: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """Explicit tuned keywords with numpy or concrete JAX scalars made Python values."""
    return {k: v if type(v) in _PLAIN else python_value(kernel, k, v)
            for k, v in config.items()}


def _wide(kernel: str, where: str, v: Any) -> None:
    """Refuses a 64-bit numpy integer array JAX (x64 off) would wrap to int32."""
    dtype = getattr(v, "dtype", None)
    if dtype is None or dtype.kind not in "iu" or dtype.itemsize < 8 or not getattr(v, "size", 0):
        return
    import jax

    if jax.config.jax_enable_x64:
        return  # JAX keeps 64 bits; the kernel sees them.
    lo, hi = int(np.min(v)), int(np.max(v))
    narrow = "uint32" if dtype.kind == "u" else "int32"  # What JAX makes of it.
    if lo < -(2**31) or hi >= (2**32 if dtype.kind == "u" else 2**31):
        raise ValueError(
            f"{kernel}: {where} is an {dtype} array with values from {lo} to {hi}, outside "
            f"{narrow}; with JAX's x64 off it would be wrapped to {narrow} silently (two "
            "different ids could become one). Renumber the values into int32 range (for ids "
            "only equality matters: np.unique(ids, return_inverse=True)[1]), or enable "
            "jax_enable_x64.")
