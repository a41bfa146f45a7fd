"""Small differentiable tunable kernels for the gradient contract's tests (plain JAX, no Pallas:
fast), importable as ``grad_kernels`` with tests/ on sys.path."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_tune as pt

CALLS: list[dict] = []  # What the backward was called with (keywords), for the tests.


def scaled_reference(x, n, *, factor=2.0):
    return x * factor + n.astype(x.dtype)


def scaled_bwd_reference(x, n, g, *, factor=2.0):
    _, vjp = jax.vjp(lambda x: scaled_reference(x, n, factor=factor), x)
    return vjp(g)[0], None


@pt.tunable(name="tests.scaled_bwd", c=[1, 2, 4], default={"c": 2},
            reference=scaled_bwd_reference)
def scaled_bwd(x, n, g, *, factor=2.0, c):
    """One cotangent per forward argument: x's, and None for the integer n."""
    CALLS.append({"factor": factor, "c": c})
    return (g * factor).astype(x.dtype), None


def scaled_bwd_args(args, kwargs):
    x, n = args
    return [x, n, jnp.ones_like(x)], dict(kwargs)


@pt.tunable(name="tests.scaled", b=[1, 2], default={"b": 1}, reference=scaled_reference,
            backward=scaled_bwd, backward_args=scaled_bwd_args)
def scaled(x, n, *, factor=2.0, b):
    return x * factor + n.astype(x.dtype)


def _square_residuals(x, *, b):
    out = x * x
    return out, (x, out)


@pt.tunable(name="tests.square_bwd", c=[1, 2], default={"c": 1})
def square_bwd(x, out, g, *, c):
    """Takes the forward's output as a residual (backward_residuals)."""
    return (2 * x * g + 0 * out,)


@pt.tunable(name="tests.square", b=[1, 2], default={"b": 1}, backward=square_bwd,
            backward_residuals=_square_residuals)
def square(x, *, b):
    return x * x


@pt.tunable(name="tests.cube", b=[1, 2], default={"b": 1},
            reference=lambda x: x ** 3, backward="xla")
def cube(x, *, b):
    return x * x * x


@pt.tunable(name="tests.shifted_bwd", c=[1, 2], default={"c": 1})
def shifted_bwd(x, g, *, offset=None, c):
    """Takes the forward's keyword array ``offset`` (an operand of the custom VJP)."""
    return (g if offset is None else g * offset,)


@pt.tunable(name="tests.shifted", b=[1, 2], default={"b": 1}, backward=shifted_bwd,
            key_optional=["offset"])
def shifted(x, *, offset=None, b):
    """x times a keyword array (not differentiated), keyed only when given."""
    return x if offset is None else x * offset
