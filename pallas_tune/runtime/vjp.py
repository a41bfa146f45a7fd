"""Gradients of a tunable kernel: the ``jax.custom_vjp`` around its call (issue 27).

A forward kernel declares its backward with ``@tunable(backward=..., backward_args=...)``:

- ``backward=BWD``, a :class:`~pallas_tune.runtime.tunable.TunableKernel` of its own (own name,
space,
  cache entries, reference): the gradient's rule calls ``BWD(*residuals, g, **kwargs)`` with
  **no tile keywords**, so BWD's config is resolved from the cache when the gradient is traced,
  through the same validity check and fallback order as every kernel call. ``kwargs`` are the
  forward's own non-tuned keywords (``eps``, ``causal``, ...); the forward's tiles never reach
  it. ``residuals`` are the forward's positional arguments, unless the kernel declares
  ``backward_residuals``. BWD returns one cotangent per positional argument of the forward (a
  tuple; None for an argument without one, e.g. integer group sizes).
- ``backward="xla"``: no backward kernel; the rule is ``jax.vjp`` of the kernel's plain-JAX
  ``reference``, recomputed from the inputs (XLA's own autodiff, declared as such so that it is
  never presented as a tuned kernel).

``backward_residuals(*args, **kwargs_and_config) -> (out, residuals)``, optional, runs the
forward when it is differentiated and returns its output and what BWD takes before ``g`` (e.g.
flash attention's ``(q, k, v, o, lse)``). Positional arguments that are not arrays and every
keyword are not differentiated (no cotangent is returned for them). A keyword whose value is an
array or a tuple of arrays (flash attention's ``segment_ids``) is an operand of the custom VJP
all the same, not a closed-over constant, so that ``jax.checkpoint``, ``jit`` and ``vmap`` can
trace it; BWD receives it among ``kwargs``. Every other keyword is static.

The declaration is checked when decorated (:func:`check_signatures`): a backward that cannot
take the residuals and the cotangent, or the forward's non-tuned keywords, is refused then,
not at the first ``jax.grad``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune import _vma, chips

__all__ = ["BACKENDS", "call_with_vjp", "check_declaration", "check_signatures"]

BACKENDS = ("pallas", "xla")


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def interpreting() -> Any:
    """Interpret mode where kernels are interpreted on this host; else nothing."""
    return chips.interpret_mode() if chips.should_interpret() else contextlib.nullcontext()


def call_plain(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
               config: Mapping[str, Any]) -> Any:
    """``fn(*args, **kwargs, **config)`` for a kernel with no backward declared here (or its
    reference), interpreted where kernels are on this host, typed inside a shard_map."""
    with interpreting():
        if _vma.checking():
            return _vma.typed_vjp_call(fn, *args, **kwargs, **config)
        return fn(*args, **kwargs, **config)


def call_with_vjp(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                  config: Mapping[str, Any]) -> Any:
    """``kernel.fn(*args, **kwargs, **config)`` with the kernel's declared backward as its VJP.

    The custom_vjp is made per call (at trace time: a few µs, nothing in the compiled program);
    its static parts (non-array positional arguments, keywords, the forward's config) are closed
    over, the arrays are its differentiated arguments."""
    import jax

    where = [i for i, a in enumerate(args) if _is_array(a)]
    static = {i: a for i, a in enumerate(args) if not _is_array(a)}
    # Array keywords: operands of the custom_vjp after the positional arrays (never cotangents).
    held = {k: v for k, v in kwargs.items() if _is_array(v) or (
        isinstance(v, tuple | list) and v and all(_is_array(x) for x in v))}
    leaves, tree = jax.tree_util.tree_flatten(held)
    n = len(where)

    def full(arrays: Sequence[Any]) -> list[Any]:
        out, it = [], iter(arrays)
        for i in range(len(args)):
            out.append(static[i] if i in static else next(it))
        return out

    def keywords(operands: Sequence[Any]) -> Mapping[str, Any]:
        return {**kwargs, **tree.unflatten(operands[n:])} if held else kwargs

    @jax.custom_vjp
    def call(*operands: Any) -> Any:
        with interpreting():
            return _vma.typed_call(kernel.fn, *full(operands[:n]), **keywords(operands),
                                   **config)

    def fwd(*operands: Any) -> tuple[Any, Any]:
        arrays, kw = operands[:n], keywords(operands)
        with interpreting():
            if kernel.backward_residuals is not None:
                out, res = _vma.typed_call(kernel.backward_residuals, *full(arrays), **kw,
                                           **config)
            else:
                out = _vma.typed_call(kernel.fn, *full(arrays), **kw, **config)
                res = tuple(arrays)
        return out, ((res, operands[n:]) if held else res)  # Residuals must be arrays.

    def bwd(residuals: Any, g: Any) -> tuple[Any, ...]:
        kw = kwargs
        if held:
            residuals, kept = residuals
            kw = keywords((None,) * n + tuple(kept))
        if kernel.backward_backend == "xla":
            grads = _xla_backward(kernel.reference, full(residuals), kw, g, where)
        else:
            if kernel.backward_residuals is None:
                residuals = full(residuals)
            grads = _select(kernel.name, kernel.backward(*residuals, g, **kw), len(args), where)
        return (*grads, *[None] * len(leaves))

    call.defvjp(fwd, bwd)
    return call(*[args[i] for i in where], *leaves)


def _xla_backward(reference: Callable[..., Any], args: list[Any], kwargs: Mapping[str, Any],
                  g: Any, where: Sequence[int]) -> tuple[Any, ...]:
    """``jax.vjp`` of the reference with respect to the array arguments; integer arrays get
    None (no cotangent)."""
    import jax
    import jax.numpy as jnp

    diff = [i for i in where if jnp.issubdtype(args[i].dtype, jnp.inexact)]

    def ref(*xs: Any) -> Any:
        full = list(args)
        for i, x in zip(diff, xs, strict=True):
            full[i] = x
        return reference(*full, **kwargs)

    _, vjp = jax.vjp(ref, *[args[i] for i in diff])
    grads = dict(zip(diff, vjp(g), strict=True))
    return tuple(grads.get(i) for i in where)


def _select(name: str, grads: Any, n_args: int, where: Sequence[int]) -> tuple[Any, ...]:
    """The backward's cotangents of the array arguments (it returns one per argument)."""
    if not isinstance(grads, tuple | list):
        grads = (grads,)
    if len(grads) != n_args:
        raise ValueError(f"{name}: its backward returned {len(grads)} cotangent(s) for "
                         f"{n_args} positional argument(s); return one per argument (None "
                         "for an argument without one).")
    return tuple(grads[i] for i in where)


def check_declaration(name: str, backward: Any, backward_args: Any, residuals: Any) -> str | None:
    """The backend a declaration names ("pallas", "xla" or None); raises on a bad one."""
    from pallas_tune.errors import SearchSpaceError

    if backward is None:
        if backward_args is not None or residuals is not None:
            raise SearchSpaceError(f"{name}: backward_args= and backward_residuals= need a "
                                   "backward= kernel.")
        return None
    if isinstance(backward, str):
        if backward != "xla":
            raise SearchSpaceError(f"{name}: backward={backward!r} must be a @tunable kernel or "
                                   "\"xla\" (jax.vjp of the reference).")
        if backward_args is not None or residuals is not None:
            raise SearchSpaceError(f"{name}: backward=\"xla\" has no backward kernel to tune; "
                                   "drop backward_args= and backward_residuals=.")
        return "xla"
    if not hasattr(backward, "space") or not hasattr(backward, "cache_key"):
        raise SearchSpaceError(f"{name}: backward={backward!r} must be a @pallas_tune.tunable "
                               "kernel (its own name, space and cache entries) or \"xla\".")
    if backward_args is not None and not callable(backward_args):
        raise SearchSpaceError(f"{name}: backward_args={backward_args!r} must be a function "
                               "(args, kwargs) -> (backward args, backward kwargs).")
    return "pallas"


def check_signatures(name: str, forward: Callable[..., Any], tuned: frozenset[str],
                     backward: Any, residuals: Any) -> None:
    """At declaration, what the gradient would otherwise find at its first trace: the backward
    takes the forward's positional arguments and the cotangent (unless ``backward_residuals``
    says what it takes) and every non-tuned keyword of the forward."""
    import inspect

    from pallas_tune.errors import SearchSpaceError

    fwd = inspect.signature(forward).parameters.values()
    bwd = list(inspect.signature(backward.fn).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if residuals is None and not any(p.kind is p.VAR_POSITIONAL for p in bwd):
        n_fwd = sum(p.kind in positional for p in fwd)
        takes = [p for p in bwd if p.kind in positional]
        required = sum(p.default is p.empty for p in takes)
        if not required <= n_fwd + 1 <= len(takes):
            raise SearchSpaceError(
                f"{name}: its backward {backward.name} takes {len(takes)} positional "
                f"argument(s), but the gradient passes the forward's {n_fwd} and the cotangent; "
                "declare backward_residuals= for other residuals (e.g. the output, a "
                "log-sum-exp).")
    if not any(p.kind is p.VAR_KEYWORD for p in bwd):
        names = {p.name for p in bwd}
        missing = [p.name for p in fwd if p.kind is p.KEYWORD_ONLY and p.name not in tuned
                   and p.name not in names]
        if missing:
            raise SearchSpaceError(f"{name}: its backward {backward.name} does not take the "
                                   f"forward's keyword(s) {missing}, which the gradient passes "
                                   "on to it.")
