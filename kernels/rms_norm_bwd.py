"""The backward of the fused RMSNorm: dx and dweight in one Pallas pass over row blocks.

For y = x · inv · w with inv = rsqrt(mean(x², -1) + eps) and the cotangent g:

    dx = inv · (g·w) − x · inv³ · mean(g·w·x, -1)        dweight = Σ_rows g · x · inv

A tunable kernel of its own (search_spaces/rms_norm_bwd.toml: ``block_rows``), declared as
``rms_norm``'s ``backward=``. dweight is a sum across row blocks: each grid step writes its
block's partial sum (f32) to its own row of a (blocks, 1, hidden) output, and XLA sums the
partials. So the grid axis stays "parallel" (megacore chips split it) instead of accumulating
in a resident block along an "arbitrary" axis. A ragged last block's rows past the end (NaN in
interpret mode) are selected away before the partial sum, on that block only, and only for
shapes that leave a remainder; its dx rows are dropped on store.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["rms_norm_bwd", "rms_norm_bwd_args", "rms_norm_bwd_reference"]


# Registered as a tunable kernel (search_spaces/rms_norm_bwd.toml) at the end of the file.
def rms_norm_bwd(x, weight, g, *, eps: float = 1e-6, block_rows: int):
    """(dx, dweight) of ``rms_norm(x, weight, eps=eps)`` for the cotangent g (x's shape and
    dtype); dx in x's dtype, dweight in weight's. ``block_rows`` is clamped to the row count.

    Raises:
      ValueError: the shapes or dtypes do not match the forward's.
    """
    if x.ndim < 1 or weight.shape != x.shape[-1:] or g.shape != x.shape or g.dtype != x.dtype:
        raise ValueError(f"rms_norm_bwd needs x (..., hidden), weight (hidden,) and g of x's "
                         f"shape and dtype; got x {x.shape} {x.dtype}, weight {weight.shape}, "
                         f"g {g.shape} {g.dtype}")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or not jnp.issubdtype(weight.dtype,
                                                                        jnp.floating):
        raise ValueError(f"rms_norm_bwd supports float32 or bfloat16 x and a float weight; got "
                         f"x {x.dtype}, weight {weight.dtype}")
    hidden = x.shape[-1]
    x2, g2 = x.reshape(-1, hidden), g.reshape(-1, hidden)
    rows = x2.shape[0]
    br = min(block_rows, rows)
    blocks = pl.cdiv(rows, br)
    row = pl.BlockSpec((br, hidden), lambda i: (i, 0))
    dx, partial = pl.pallas_call(
        functools.partial(_kernel, eps=eps, tail=rows % br),
        out_shape=(jax.ShapeDtypeStruct(x2.shape, x.dtype),
                   jax.ShapeDtypeStruct((blocks, 1, hidden), jnp.float32)),
        grid=(blocks,),
        in_specs=[row, pl.BlockSpec((1, hidden), lambda i: (0, 0)), row],
        out_specs=(row, pl.BlockSpec((1, 1, hidden), lambda i: (i, 0, 0))),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        name=f"rms_norm_bwd_{br}",
    )(x2, weight.reshape(1, hidden), g2)
    return dx.reshape(x.shape), partial.sum(axis=(0, 1)).astype(weight.dtype)


def _kernel(x_ref, w_ref, g_ref, dx_ref, dw_ref, *, eps, tail):
    x = x_ref[...].astype(jnp.float32)
    g = g_ref[...].astype(jnp.float32)
    gw = g * w_ref[...].astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    dot = jnp.mean(gw * x, axis=-1, keepdims=True)
    dx_ref[...] = (inv * gw - x * (inv * inv * inv) * dot).astype(dx_ref.dtype)
    contrib = g * x * inv
    if tail:  # Ragged rows: the last block's rows past the end hold padding (NaN when interpreted).
        last = pl.program_id(0) == pl.num_programs(0) - 1
        valid = jnp.where(last, tail, contrib.shape[0])
        position = lax.broadcasted_iota(jnp.int32, contrib.shape, 0)
        contrib = jnp.where(position < valid, contrib, 0.0)
    dw_ref[...] = jnp.sum(contrib, axis=0, keepdims=True)[None]


def _forward_reference(x, weight, *, eps=1e-6):
    """rms_norm's reference (kernels/rms_norm.py imports this module, so not imported from it)."""
    xf = x.astype(jnp.float32)
    inv = lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * weight.astype(jnp.float32)).astype(x.dtype)


def rms_norm_bwd_reference(x, weight, g, *, eps: float = 1e-6):
    """``jax.vjp`` of the forward's plain-JAX reference: (dx, dweight)."""
    _, vjp = jax.vjp(functools.partial(_forward_reference, eps=eps), x, weight)
    return tuple(vjp(g))


def rms_norm_bwd_args(args, kwargs):
    """The backward's example arguments for ``rms_norm(x, weight, eps=...)``: (x, weight, g),
    g a random cotangent like x, and the forward's keywords (for ``tune(..., grad=True)``)."""
    x, weight = args
    g = jax.random.normal(jax.random.key(1), x.shape, jnp.float32).astype(x.dtype)
    return [x, weight, g], dict(kwargs)


def _inputs(x, weight, g, **kwargs):
    """Tuning inputs from shapes: random x and g, a weight near 1 (any are valid). Declared so
    that sweeps over large shapes pass them on abstractly (see tuning.grad)."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    w = 1 + 0.1 * jax.random.normal(k2, weight.shape, jnp.float32)
    return [jax.random.normal(k1, x.shape, jnp.float32).astype(x.dtype), w.astype(weight.dtype),
            jax.random.normal(k3, g.shape, jnp.float32).astype(g.dtype)], kwargs


rms_norm_bwd = pt.tunable(space="rms_norm_bwd", reference=rms_norm_bwd_reference,
                          inputs=_inputs)(rms_norm_bwd)
