"""Cache keys: a call's arguments as a short, human-readable, canonical string.

The default key of ``matmul(x, y)`` is ``"x=1024x1024:bfloat16,y=1024x1024:bfloat16"``: one
``name=dims:dtype`` item per array argument, in signature order, then ``name=value`` for each static
(non-array, non-tuned) argument, defaults applied. The same syntax is what ``pallas-tune sweep
--shapes`` accepts, so a key printed in a warning can be pasted into the command that fills it.
"""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["KeyFn", "call_key", "format_value", "key_distance", "normalize_static", "parse_key",
           "shape_signature", "split_statics"]

KeyFn = Callable[..., Any]

_ARRAY_RE = re.compile(r"^(?P<dims>(\d+(x\d+)*)?|scalar):(?P<dtype>[A-Za-z0-9_]+)$")


def _is_array(v: Any) -> bool:
    return hasattr(v, "shape") and hasattr(v, "dtype")


_DTYPE_NAMES: dict[Any, str] = {}  # numpy's dtype.name costs ~4 µs; keys are built per trace.


def _array_str(v: Any) -> str:
    dims = "x".join(map(str, v.shape)) or "scalar"
    dtype = v.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = getattr(dtype, "name", str(dtype))
    return f"{dims}:{name}"


def normalize_static(v: Any, like: Any = None) -> Any:
    """One spelling per static value, so equal values make equal keys. A number takes the type
    of the parameter's default (``like``): with ``alpha=2.0`` declared, ``alpha=2`` is keyed
    ``alpha=2.0``; with ``groups=1``, ``groups=1.0`` is ``groups=1``. Without a numeric default
    a whole float is the int it equals. Bools, non-whole floats, inf and nan are kept."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return v
    if isinstance(like, float) and not isinstance(like, bool):
        return float(v) if abs(v) < 2**53 else v
    if isinstance(v, float) and v.is_integer() and abs(v) < 2.0**53:
        return int(v)
    return v


def _is_static_scalar(v: Any) -> bool:
    return v is None or isinstance(v, bool | int | float | str)


def format_value(v: Any, like: Any = None) -> str:
    """Formats one argument for a key; arrays as ``dims:dtype``, simple statics as JSON
    (normalized by :func:`normalize_static` to the type of ``like``, the default)."""
    if _is_array(v):
        return _array_str(v)
    if isinstance(v, tuple | list) and v and any(_is_array(x) for x in v):
        # Arrays beside other values (SegmentIds(q, None)): the arrays by shape, never by data.
        return "(" + ";".join(_array_str(x) if _is_array(x) else format_value(x) for x in v) + ")"
    v = normalize_static(v, like)
    if _is_static_scalar(v):
        return json.dumps(v)
    if isinstance(v, tuple | list) and all(_is_static_scalar(normalize_static(x)) for x in v):
        return json.dumps([normalize_static(x) for x in v], separators=(",", ":"))
    if callable(v):
        return getattr(v, "__qualname__", type(v).__qualname__)
    text = repr(v)
    if " at 0x" in text:  # An address would make the key differ in every process.
        return type(v).__qualname__
    return text


def call_key(
    sig: inspect.Signature, tuned: frozenset[str], args: Sequence[Any], kwargs: Mapping[str, Any],
    only: frozenset[str] | None = None, optional: frozenset[str] = frozenset(),
) -> str:
    """The default key: array shapes and dtypes, then static non-tuned argument values; with
    ``only`` (``@tunable(key=["x", "y", "causal"])``, like Triton's ``key=``), just the
    arguments named there: the others do not change which config is best. A parameter named
    in ``optional`` (``@tunable(key_optional=[...])``) is left out while its value is its
    default: a feature a kernel gained after its caches were keyed (a mask) keys only the calls
    that use it, and the calls without it keep their keys and entries."""
    bound = sig.bind_partial(*args, **kwargs)
    bound.apply_defaults()
    arrays, statics = [], []
    for name, value in bound.arguments.items():
        if name in tuned or (only is not None and name not in only):
            continue
        if name in optional and value is sig.parameters[name].default:
            continue
        param = sig.parameters[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            for i, v in enumerate(value):
                (arrays if _is_array(v) else statics).append((f"{name}{i}", v))
            continue
        if param.kind is inspect.Parameter.VAR_KEYWORD:
            for k, v in sorted(value.items()):
                if k not in tuned:
                    (arrays if _is_array(v) else statics).append((k, v))
            continue
        is_arrays = _is_array(value) or (
            isinstance(value, tuple | list) and value and all(_is_array(x) for x in value)
        )
        (arrays if is_arrays else statics).append((name, value))
    defaults = {n: p.default for n, p in sig.parameters.items()}
    return ",".join(f"{n}={format_value(v, defaults.get(n))}" for n, v in arrays + statics)


def custom_key(value: Any) -> str:
    """Canonical string for the value a user ``key=`` callable returns."""
    if isinstance(value, str):
        return value

    def default(o: Any) -> Any:
        if _is_array(o):
            return _array_str(o)
        if isinstance(o, tuple | set | frozenset):
            return list(o)
        return repr(o)

    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=default)


def _split_items(text: str) -> list[str]:
    """Splits on commas that are outside brackets and quotes."""
    items, depth, quote, cur = [], 0, False, []
    for ch in text:
        if ch == '"':
            quote = not quote
        elif not quote and ch in "([{":
            depth += 1
        elif not quote and ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0 and not quote:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def parse_value(text: str, *, nested: bool = False) -> Any:
    """Parses one ``--shapes`` value: ``dims:dtype`` → ("array", dims, dtype), a parenthesized
    ``;``-list of them → ("arrays", (...)), else a static. Lists do not nest (a key read from a
    file may be 3,000 parentheses deep: one level is parsed, the rest is a static string)."""
    m = _ARRAY_RE.match(text)
    if m:
        dims = m.group("dims")
        shape = () if dims in ("", "scalar") else tuple(int(d) for d in dims.split("x"))
        return ("array", shape, m.group("dtype"))
    if not nested and text.startswith("(") and text.endswith(")"):
        return ("arrays", tuple(parse_value(t, nested=True) for t in text[1:-1].split(";")))
    try:
        return ("static", json.loads(text))
    except (json.JSONDecodeError, RecursionError):  # A static nested past Python's stack.
        low = text.lower()
        if low in ("true", "false"):
            return ("static", low == "true")
        if low in ("none", "null"):
            return ("static", None)
        return ("static", text)


def parse_key(text: str) -> dict[str, Any]:
    """Parses ``"x=1024x1024:bfloat16,causal=true"`` into {name: parsed value} (see parse_value)."""
    out: dict[str, Any] = {}
    for item in _split_items(text):
        if "=" not in item:
            raise ValueError(
                f"shape item {item!r} is not of the form name=DIMS:DTYPE or name=VALUE, e.g. "
                "x=1024x1024:bfloat16 or causal=true"
            )
        name, value = item.split("=", 1)
        out[name.strip()] = parse_value(value.strip())
    return out


def key_distance(a: str, b: str) -> float:
    """Distance between two default keys: inf unless names, ranks, dtypes and statics agree;
    otherwise the sum of |log2| ratios of the array dims."""
    try:
        pa, pb = parse_key(a), parse_key(b)
    except (ValueError, RecursionError):  # RecursionError: json.loads of a deep static.
        return math.inf
    if pa.keys() != pb.keys():
        return math.inf
    dist = 0.0
    for name, va in pa.items():
        vb = pb[name]
        if va[0] != vb[0]:
            return math.inf
        if va[0] == "static":
            if va != vb:
                return math.inf
            continue
        pairs = [(va, vb)] if va[0] == "array" else list(zip(va[1], vb[1], strict=False))
        if va[0] == "arrays" and len(va[1]) != len(vb[1]):
            return math.inf
        for x, y in pairs:
            if x[0] != "array" or y[0] != "array" or x[2] != y[2] or len(x[1]) != len(y[1]):
                return math.inf
            for dx, dy in zip(x[1], y[1], strict=True):
                if dx <= 0 or dy <= 0:
                    if dx != dy:
                        return math.inf
                    continue
                dist += abs(math.log2(dx) - math.log2(dy))  # Exact for ints of any size.
    return dist


def split_statics(key: str) -> tuple[str, dict[str, str]]:
    """A default key's array items (as one string, in order) and its static items (name →
    value text): ``"x=8x128:float32,alpha=2"`` → ``("x=8x128:float32", {"alpha": "2"})``.
    Keys whose array items are equal are calls on the same shapes; the dispatcher falls back to
    such a key's entry when no entry has the call's static values."""
    arrays, statics = [], {}
    for item in _split_items(key):
        name, _, value = item.partition("=")
        if parse_value(value.strip())[0] == "static":
            statics[name.strip()] = value.strip()
        else:
            arrays.append(item)
    return ",".join(arrays), statics


# One dim of an array item in a default key: after `=`, `(`, `;` or `x`, before `x` or `:dtype`.
# Quoted static strings could hold look-alikes; callers confirm with key_distance.
DIM_RE = re.compile(r"(?<=[=(;x])\d+(?=[x:])")


def shape_signature(key: str) -> tuple[str, tuple[int, ...]]:
    """A key with its array dims replaced by ``#``, and those dims: keys at a finite
    :func:`key_distance` share the signature (the converse is confirmed by key_distance).

    Two C-level regular-expression passes, so a cache can index thousands of keys by shape:
    ``"x=8x128:float32,c=true"`` → ``("x=#x#:float32,c=true", (8, 128))``.
    """
    return DIM_RE.sub("#", key), tuple(map(int, DIM_RE.findall(key)))
