"""Fused RMSNorm: y = x / sqrt(mean(x², -1) + eps) * weight, one row block per grid step.

A reduction-heavy, memory-bound kernel: its only tunable is the number of rows per block. XLA
fuses the plain-JAX version well, so whether Pallas wins at all is an open question that
benchmarks/kernels.py answers per chip, not this docstring.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["rms_norm", "rms_norm_reference"]


def rms_norm_reference(x, weight, *, eps: float = 1e-6):
    xf = x.astype(jnp.float32)
    inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * inv * weight.astype(jnp.float32)).astype(x.dtype)


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
    (nb,), scale = shrink_parallel([rows // br], 1)
    return [jax.ShapeDtypeStruct((nb * br, hidden), x.dtype), w], kwargs, scale


@pt.tunable(space="rms_norm", reference=rms_norm_reference, standin=_standin)
def rms_norm(x, weight, *, eps: float = 1e-6, block_rows: int):
    """RMSNorm over the last axis of x (rows, hidden); weight (hidden,). Leading axes allowed."""
    shape = x.shape
    hidden = shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {weight.shape} != ({hidden},)")
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
