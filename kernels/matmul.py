"""Tiled matmul with f32 accumulation: the reference tunable kernel.

Grid (cdiv(M, bm), cdiv(N, bn), cdiv(K, bk)); the K axis is the reduction ("arbitrary", last).
The accumulator lives in VMEM scratch; the output tile is written on the last K step. Any M, K, N:
ragged M and N blocks are dropped on store; when no bk divides K, the last K step zeroes the
columns of x and rows of y past K before its dot (emitted only then, so shapes that divide compile
to the same program as without it; benchmarks/kernels/ragged.py measures the cost).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged
from pallas_tune.kernels.matmul_bwd import matmul_bwd, matmul_bwd_args

__all__ = ["matmul", "matmul_reference"]

DTYPES = (jnp.float32, jnp.bfloat16)  # Mosaic rejects f16 and int8 x int8 -> f32 dots.


# The public entry; registered as a tunable kernel (search_spaces/matmul.toml) at the end of the
# file, once its reference and stand-in exist.
def matmul(
    x: jax.Array,
    y: jax.Array,
    *,
    bm: int,
    bn: int,
    bk: int,
    buffering: int,
    semantics: tuple[str, str, str],
    vmem_limit_bytes: int = 0,
) -> jax.Array:
    """``x @ y`` for x (M, K) and y (K, N) of one dtype (float32 or bfloat16) → (M, N).

    Tiled (bm, bk) × (bk, bn); any M, K, N. Block sizes larger than a dimension are clamped to
    it (a full dimension always meets the TPU block rule), so small problems run with any config.
    ``vmem_limit_bytes`` is the scoped VMEM the kernel may use (``pltpu.CompilerParams``); 0
    leaves the chip's default (32 MiB on v6e), and the program is then the one the kernel
    compiled to before the limit was tunable. Large tiles (2048 rows) need a raised limit.

    Raises:
      ValueError: x or y is not 2-D, the inner dimensions differ, or the dtypes are not one of
        float32 and bfloat16.
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[0]:
        raise ValueError(f"matmul needs x (M, K) and y (K, N); got x {x.shape}, y {y.shape}")
    if x.dtype != y.dtype or x.dtype not in DTYPES:
        raise ValueError(f"matmul supports float32 or bfloat16 operands of one dtype; got x "
                         f"{x.dtype}, y {y.dtype}: cast both to bfloat16 or float32")
    (m, k), n = x.shape, y.shape[1]
    bm, bn, bk = min(bm, m), min(bn, n), min(bk, k)
    buffered = functools.partial(pl.BlockSpec, pipeline_mode=pl.Buffered(buffering))
    return pl.pallas_call(
        functools.partial(_kernel, k_tail=k % bk),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[
            buffered((bm, bk), lambda i, j, kk: (i, kk)),
            buffered((bk, bn), lambda i, j, kk: (kk, j)),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=tuple(semantics),
                                             vmem_limit_bytes=vmem_limit_bytes or None),
        name=f"matmul_{bm}x{bn}x{bk}",
    )(x, y)


def _kernel(x_ref, y_ref, o_ref, acc_ref, *, k_tail):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if k_tail:  # K is ragged: only the last K step reads past it, and only it pays for the mask.
        last = pl.program_id(2) == pl.num_programs(2) - 1

        @pl.when(jnp.logical_not(last))
        def _full():
            acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

        @pl.when(last)
        def _tail():
            x = _ragged.fill_tail(x_ref[...], k_tail, axis=1)
            y = _ragged.fill_tail(y_ref[...], k_tail, axis=0)
            acc_ref[...] += jnp.dot(x, y, preferred_element_type=jnp.float32)
    else:
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
    (mb, nb), scale = shrink_parallel([pl.cdiv(m, bm), pl.cdiv(n, bn)], pl.cdiv(k, bk))
    return [jax.ShapeDtypeStruct((min(mb * bm, m), k), x.dtype),
            jax.ShapeDtypeStruct((k, min(nb * bn, n)), y.dtype)], kwargs, scale


def matmul_reference(x: jax.Array, y: jax.Array) -> jax.Array:
    """Plain-JAX matmul with f32 accumulation, cast to the input dtype."""
    return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


# Differentiable: jax.grad calls matmul_bwd (its own tunable kernel and cache entries).
# Under jax.jit on sharded arrays: split along m and n; the contracted k is kept whole.
matmul = pt.tunable(space="matmul", reference=matmul_reference, standin=_standin,
                    backward=matmul_bwd, backward_args=matmul_bwd_args,
                    partition="m K, K n -> m n")(matmul)
