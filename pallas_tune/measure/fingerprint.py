"""One identity per program: trace a candidate once, lower it, hash the lowered text.

Candidates that clamp or default to the same tiles compile to the same program and need to be
measured once (tune-jax 0.8 skips them the same way). Two kinds of noise would make equal
programs differ, and are removed before hashing:

- the ``pallas_call`` name, which shipped kernels build from their tile sizes before clamping
  (``matmul_1024x512x512`` and ``matmul_512x512x512`` at M=512 are one program): each call is
  renamed ``pallas_tune_<i>`` in the traced jaxpr, and that renamed program is the one lowered,
  compiled and run, so what is measured is exactly what was hashed;
- debug locations: the default ``as_text()`` omits them, and the Mosaic payload's own
  ``debug_locations`` field is cut out.

Anything else that differs keeps programs apart: a fingerprint may miss a duplicate, never
merge two different programs. Host callbacks are the one thing the text cannot show (their
custom call holds only an index into the Python functions of the module), so a program that
calls back into Python gets a fingerprint of its own, equal to no other.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import jax

__all__ = ["Traced", "digest", "lower", "trace"]

NAME_PREFIX: Final = "pallas_tune_"
_CALLBACK: Final = re.compile(r"callback", re.IGNORECASE)
_DEBUG_LOCATIONS: Final = re.compile(r'(\\22|")debug_locations(\\22|")\s*:\s*(\\22|")[^"\\]*(\\22|")')


@dataclasses.dataclass(frozen=True, slots=True)
class Traced:
    """A candidate traced once: its jaxpr (pallas_calls renamed), the array arguments it takes,
    and how to rebuild its output tree."""

    jaxpr: Any  # ClosedJaxpr, names as traced.
    renamed: Any  # ClosedJaxpr, pallas_calls renamed pallas_tune_<i>.
    arrays: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    renamed_ok: bool

    @staticmethod
    def arrays_for(args: Sequence[Any]) -> list[Any]:
        """The concrete arguments the traced program takes: the array leaves of ``args``."""
        return [x for x in jax.tree_util.tree_leaves(list(args))
                if hasattr(x, "shape") and hasattr(x, "dtype")]

    def function(self, *, renamed: bool = True) -> Callable[..., Any]:
        """The traced program as a function of its array arguments."""
        from jax.extend.core import jaxpr_as_fun

        run = jaxpr_as_fun(self.renamed if renamed else self.jaxpr)
        out_tree = self.out_tree

        def program(*arrays: Any) -> Any:
            return jax.tree_util.tree_unflatten(out_tree, run(*arrays))

        return program


def trace(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Traced:
    """Traces ``fn(*args, **kwargs)`` with abstract array arguments (non-arrays are static).
    Raises whatever tracing raises (the caller's trace phase catches it)."""
    from pallas_tune.feasibility.inspect import array_function

    flat_fn, arrays = array_function(fn, args, kwargs)
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*arrays)
    out_tree = jax.tree_util.tree_structure(out_shape)
    try:
        renamed, ok = _rename(closed), True
    except Exception:  # noqa: BLE001 - an unfamiliar jaxpr: hash it with its names.
        renamed, ok = closed, False
    return Traced(closed, renamed, tuple(arrays), out_tree, ok)


def lower(traced: Traced, *, platforms: Sequence[str] | None = None) -> Any:
    """Lowers the renamed program (``platforms``: e.g. ``("tpu",)`` for a deviceless target)."""
    jitted = jax.jit(traced.function())
    staged = jitted.trace(*traced.arrays)
    return staged.lower(lowering_platforms=tuple(platforms)) if platforms else staged.lower()


def digest(lowered: Any) -> str:
    """A short hex digest of the lowered program's text, without debug locations."""
    text = lowered.as_text()
    text = _DEBUG_LOCATIONS.sub("", text)
    if _CALLBACK.search(text):  # Which Python function it calls is not in the text.
        text += f"\n// host callbacks: unique {uuid.uuid4().hex}"
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def _rename(closed: Any) -> Any:
    counter = [0]
    return closed.replace(jaxpr=_rename_jaxpr(closed.jaxpr, counter))


def _rename_jaxpr(jaxpr: Any, counter: list[int]) -> Any:
    eqns = []
    changed = False
    for eqn in jaxpr.eqns:
        params = eqn.params
        if eqn.primitive.name == "pallas_call":
            params = _renamed_params(params, f"{NAME_PREFIX}{counter[0]}")
            counter[0] += 1
        else:
            params = {k: _rename_value(v, counter) for k, v in params.items()}
        if any(params[k] is not eqn.params[k] for k in params):
            eqn = eqn.replace(params=params)
            changed = True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _rename_value(v: Any, counter: list[int]) -> Any:
    if hasattr(v, "jaxpr") and hasattr(v, "consts"):  # ClosedJaxpr
        inner = _rename_jaxpr(v.jaxpr, counter)
        return v if inner is v.jaxpr else v.replace(jaxpr=inner)
    if hasattr(v, "eqns") and hasattr(v, "invars"):  # Jaxpr
        return _rename_jaxpr(v, counter)
    if isinstance(v, tuple) and v:
        new = tuple(_rename_value(x, counter) for x in v)
        return v if all(a is b for a, b in zip(new, v, strict=True)) else new
    return v


def _renamed_params(params: Mapping[str, Any], name: str) -> dict[str, Any]:
    out = dict(params)
    if isinstance(out.get("name"), str):  # JAX >= 0.5
        out["name"] = name
    info = out.get("name_and_src_info")  # Older JAX: NameAndSrcInfo(name, src_info).
    if info is not None and dataclasses.is_dataclass(info):
        out["name_and_src_info"] = dataclasses.replace(info, name=name, src_info="")
    # The Mosaic lowering names the kernel after its body's debug info ("k_64 at file:line").
    body = out.get("jaxpr")
    debug = getattr(body, "debug_info", None)
    if debug is not None and hasattr(debug, "_replace") and hasattr(debug, "func_src_info"):
        out["jaxpr"] = body.replace(debug_info=debug._replace(func_src_info=name))
    return out
