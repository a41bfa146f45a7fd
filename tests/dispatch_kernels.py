"""Kernels for the dispatch and hostile-cache tests (importable as ``dispatch_kernels``).

``rowsum`` is a reduction over column blocks: a column block that does not divide the columns
reads padding (NaN in interpret mode) into the sum, so a wrongly served config shows in the
numbers, not only in a flag. Its constraint says so, which is what catches such a config however
the block rules evolve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import pallas_tune as pt


def _rowsum_kernel(x_ref, o_ref):
    @pl.when(pl.program_id(1) == 0)
    def _init():
        o_ref[...] = jnp.zeros_like(o_ref)

    o_ref[...] += jnp.sum(x_ref[...], axis=1, keepdims=True)


@pt.tunable(br=[8, 16], bc=[128, 256], default={"br": 8, "bc": 256},
            constraints={"bc_divides_cols": "x.shape[1] % bc == 0"}, name="tests.rowsum")
def rowsum(x, *, br, bc):
    """Row sums of x (R, C) as (R, 1), tiled (br, bc); the column axis is the reduction."""
    r, c = x.shape
    return pl.pallas_call(
        _rowsum_kernel,
        out_shape=jax.ShapeDtypeStruct((r, 1), x.dtype),
        grid=(pl.cdiv(r, br), pl.cdiv(c, bc)),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((br, 1), lambda i, j: (i, 0)),
        name="rowsum",
    )(x)


def rowsum_unchecked(x, *, br, bc):
    return rowsum.fn(x, br=br, bc=bc)


def rowsum_reference(x):
    return jnp.sum(x, axis=1, keepdims=True)


def data(shape=(16, 384)):
    return (jnp.arange(shape[0] * shape[1], dtype=jnp.float32).reshape(shape) % 7) - 3.0


@pt.tunable(b=[8, 64], c=list(range(8)), default={"b": 8, "c": 0}, name="tests.picky")
def picky(x, *, b, c):
    """Refuses (while traced) any b larger than x's rows: invalid configs show only by tracing."""
    if b > x.shape[0]:
        raise pt.InvalidConfig(f"b={b} must not exceed the {x.shape[0]} rows of x")
    return x + c


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@pt.tunable(br=[8, 64, 1024, 4096], default={"br": 4096}, name="tests.wide_copy")
def wide_copy(x, *, br):
    """x copied in row blocks of br full-width rows: at 8192 float32 columns the default's
    blocks (128 MiB each, double-buffered in and out) cannot fit any TPU's VMEM."""
    r, c = x.shape
    return pl.pallas_call(
        _copy_kernel,
        out_shape=jax.ShapeDtypeStruct((r, c), x.dtype),
        grid=(pl.cdiv(r, br),),
        in_specs=[pl.BlockSpec((br, c), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((br, c), lambda i: (i, 0)),
        name="wide_copy",
    )(x)
