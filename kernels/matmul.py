"""Tiled matmul with f32 accumulation: the reference tunable kernel.

Grid (M/bm, N/bn, K/bk); the K axis is the reduction ("arbitrary", last). The accumulator lives in
VMEM scratch; the output tile is written on the last K step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["matmul", "matmul_reference"]


def matmul_reference(x: jax.Array, y: jax.Array) -> jax.Array:
    """Plain-JAX matmul with f32 accumulation, cast to the input dtype."""
    return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


def _matmul_kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _standin(args, kwargs, config):
    """Fewer (bm, bn) output blocks, same tiles: each block is the same work (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    x, y = args
    (m, k), n = x.shape, y.shape[1]
    bm, bn, bk = min(config["bm"], m), min(config["bn"], n), min(config["bk"], k)
    (mb, nb), scale = shrink_parallel([m // bm, n // bn], k // bk)
    return [jax.ShapeDtypeStruct((mb * bm, k), x.dtype),
            jax.ShapeDtypeStruct((k, nb * bn), y.dtype)], kwargs, scale


@pt.tunable(space="matmul", reference=matmul_reference, standin=_standin)
def matmul(
    x: jax.Array,
    y: jax.Array,
    *,
    bm: int,
    bn: int,
    bk: int,
    buffering: int,
    semantics: tuple[str, str, str],
) -> jax.Array:
    """``x @ y`` for x (M, K) and y (K, N), tiled (bm, bk) × (bk, bn).

    Block sizes larger than a dimension are clamped to it, so small problems run with any config.
    """
    (m, k), (k2, n) = x.shape, y.shape
    if k != k2:
        raise ValueError(f"inner dimensions differ: x is {x.shape}, y is {y.shape}")
    bm, bn, bk = min(bm, m), min(bn, n), min(bk, k)
    buffered = functools.partial(pl.BlockSpec, pipeline_mode=pl.Buffered(buffering))
    return pl.pallas_call(
        _matmul_kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[
            buffered((bm, bk), lambda i, j, kk: (i, kk)),
            buffered((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=tuple(semantics)),
        name=f"matmul_{bm}x{bn}x{bk}",
    )(x, y)
