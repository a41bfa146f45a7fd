"""Fused RMSNorm: y = x / sqrt(mean(x², -1) + eps) * weight, one row block per grid step.

A reduction-heavy, memory-bound kernel: its only tunable is the number of rows per block. XLA
fuses the plain-JAX version well, so whether Pallas wins at all is an open question that
benchmarks/kernels/kernels.py answers per chip, not this docstring.

Any number of rows: the grid is cdiv(rows, block_rows) and a ragged last block computes rows that
are dropped on store (each row is normalised on its own, so nothing leaks into valid rows). The
reduction is over the whole hidden axis, one full block, so it has no ragged tail.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels.rms_norm_bwd import rms_norm_bwd, rms_norm_bwd_args

__all__ = ["rms_norm", "rms_norm_reference"]

DTYPES = (jnp.float32, jnp.bfloat16)


# The public entry; registered as a tunable kernel (search_spaces/rms_norm.toml) at the end of
# the file, once its reference and stand-in exist.
def rms_norm(x, weight, *, eps: float = 1e-6, block_rows: int):
    """RMSNorm over the last axis of x (..., hidden) with weight (hidden,) → x's shape and dtype.

    Any leading axes (flattened to rows) and any hidden size; x float32 or bfloat16, weight any
    float dtype (applied in f32). ``block_rows`` larger than the row count is clamped to it.

    Raises:
      ValueError: x is a scalar, weight is not (hidden,), or the dtypes are unsupported.
    """
    if x.ndim < 1 or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm needs x (..., hidden) and weight (hidden,); got x {x.shape}, "
                         f"weight {weight.shape}")
    if x.dtype not in DTYPES or not jnp.issubdtype(weight.dtype, jnp.floating):
        raise ValueError(f"rms_norm supports float32 or bfloat16 x and a float weight; got x "
                         f"{x.dtype}, weight {weight.dtype}")
    shape = x.shape
    hidden = shape[-1]
    x2 = x.reshape(-1, hidden)
    rows = x2.shape[0]
    br = min(block_rows, rows)
    out = pl.pallas_call(
        functools.partial(_kernel, eps=eps),
        out_shape=jax.ShapeDtypeStruct(x2.shape, x.dtype),
        grid=(pl.cdiv(rows, br),),
        in_specs=[pl.BlockSpec((br, hidden), lambda i: (i, 0)),
                  pl.BlockSpec((1, hidden), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((br, hidden), lambda i: (i, 0)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        name=f"rms_norm_{br}",
    )(x2, weight.reshape(1, hidden))
    return out.reshape(shape)


def _kernel(x_ref, w_ref, o_ref, *, eps):
    x = x_ref[...].astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    o_ref[...] = (x * inv * w_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _standin(args, kwargs, config):
    """Fewer row blocks (identical work each), same tile (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    x, w = args
    hidden = x.shape[-1]
    rows = x.size // hidden
    br = min(config["block_rows"], rows)
    (nb,), scale = shrink_parallel([pl.cdiv(rows, br)], 1)
    return [jax.ShapeDtypeStruct((min(nb * br, rows), hidden), x.dtype), w], kwargs, scale


def rms_norm_reference(x, weight, *, eps: float = 1e-6):
    """Plain-JAX RMSNorm in f32, cast to x's dtype."""
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * weight.astype(jnp.float32)).astype(x.dtype)


# Differentiable: jax.grad calls rms_norm_bwd (its own tunable kernel and cache entries).
# Under jax.jit on sharded arrays: split along the rows; the normalised axis is kept whole.
rms_norm = pt.tunable(space="rms_norm", reference=rms_norm_reference, standin=_standin,
                      backward=rms_norm_bwd, backward_args=rms_norm_bwd_args,
                      partition="... D, D -> ... D")(rms_norm)
