"""The backward of the tiled matmul: dx = g @ yᵀ and dy = xᵀ @ g, two tiled Pallas products.

A tunable kernel of its own (search_spaces/matmul_bwd.toml), declared as ``matmul``'s
``backward=``: ``jax.grad`` through ``matmul`` calls ``matmul_bwd(x, y, g)`` with no tile
keywords, so its tiles come from its own cache entries, whatever the forward's config.

Each tile name says which of the forward's dimensions it tiles (bm: M, bn: N, bk: K), with a
prefix for the product it belongs to:

- dx (M, K) = g (M, N) · y (K, N) contracted over N: grid (M/dx_bm, K/dx_bk, N/dx_bn), the N axis
  the reduction ("arbitrary", last). y's block (dx_bk, dx_bn) is contracted on its last dim in the
  kernel (dot_general, an "NT" product), so yᵀ is never materialized.
- dy (K, N) = x (M, K) · g (M, N) contracted over M: grid (K/dy_bk, N/dy_bn, M/dy_bm), the M axis
  the reduction. x's block (dy_bm, dy_bk) is contracted on its first dim in the kernel (a "TN"
  product), so xᵀ is never materialized.

Any M, K, N: ragged output blocks are dropped on store; the reduction's ragged tail (N for dx, M
for dy) is zeroed on the last step only (both operands: the padding is NaN in interpret mode),
as in the forward. f32 accumulation in VMEM scratch; outputs in the input dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged

__all__ = ["matmul_bwd", "matmul_bwd_args", "matmul_bwd_reference"]

_NT = (((1,), (1,)), ((), ()))  # (a, c) · (b, c) -> (a, b)
_TN = (((0,), (0,)), ((), ()))  # (c, a) · (c, b) -> (a, b)
_SEMANTICS = ("parallel", "parallel", "arbitrary")


# Registered as a tunable kernel (search_spaces/matmul_bwd.toml) at the end of the file.
def matmul_bwd(x: jax.Array, y: jax.Array, g: jax.Array, *, dx_bm: int, dx_bn: int, dx_bk: int,
               dy_bm: int, dy_bn: int, dy_bk: int) -> tuple[jax.Array, jax.Array]:
    """``(g @ y.T, x.T @ g)`` for x (M, K), y (K, N) and the cotangent g (M, N), one dtype
    (float32 or bfloat16): the gradients of ``x @ y``. Blocks larger than a dimension are
    clamped to it.

    Raises:
      ValueError: the shapes do not chain or the dtypes differ or are unsupported.
    """
    if x.ndim != 2 or y.ndim != 2 or g.ndim != 2 or x.shape[1] != y.shape[0] or \
            g.shape != (x.shape[0], y.shape[1]):
        raise ValueError(f"matmul_bwd needs x (M, K), y (K, N), g (M, N); got x {x.shape}, "
                         f"y {y.shape}, g {g.shape}")
    if not x.dtype == y.dtype == g.dtype or x.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"matmul_bwd supports float32 or bfloat16 operands of one dtype; got "
                         f"x {x.dtype}, y {y.dtype}, g {g.dtype}")
    (m, k), n = x.shape, y.shape[1]
    dx = _product(g, y, (m, k), _NT, blocks=(min(dx_bm, m), min(dx_bk, k), min(dx_bn, n)),
                  lhs_block=lambda i, j, c: (i, c), rhs_block=lambda i, j, c: (j, c),
                  transposed=False, name="matmul_bwd_dx")
    dy = _product(x, g, (k, n), _TN, blocks=(min(dy_bk, k), min(dy_bn, n), min(dy_bm, m)),
                  lhs_block=lambda i, j, c: (c, i), rhs_block=lambda i, j, c: (c, j),
                  transposed=True, name="matmul_bwd_dy")
    return dx, dy


def _product(a, b, out_shape, dims, *, blocks, lhs_block, rhs_block, transposed, name):
    """out (P, Q) = a · b contracted over C as ``dims`` says; blocks (bp, bq, bc); grid
    (P/bp, Q/bq, C/bc). ``transposed``: the contraction is the operands' first axis (TN), else
    their last (NT)."""
    bp, bq, bc = blocks
    c = a.shape[0] if transposed else a.shape[1]
    axis = 0 if transposed else 1
    a_block = (bc, bp) if transposed else (bp, bc)
    b_block = (bc, bq) if transposed else (bq, bc)
    return pl.pallas_call(
        functools.partial(_kernel, dims=dims, tail=c % bc, axis=axis),
        out_shape=jax.ShapeDtypeStruct(out_shape, a.dtype),
        grid=(pl.cdiv(out_shape[0], bp), pl.cdiv(out_shape[1], bq), pl.cdiv(c, bc)),
        in_specs=[pl.BlockSpec(a_block, lhs_block), pl.BlockSpec(b_block, rhs_block)],
        out_specs=pl.BlockSpec((bp, bq), lambda i, j, cc: (i, j)),
        scratch_shapes=[pltpu.VMEM((bp, bq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=_SEMANTICS),
        name=f"{name}_{bp}x{bq}x{bc}",
    )(a, b)


def _kernel(a_ref, b_ref, o_ref, acc_ref, *, dims, tail, axis):
    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(a, b):
        acc_ref[...] += jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

    if tail:  # The contraction is ragged: only its last step masks (both operands: NaN padding).
        last = pl.program_id(2) == pl.num_programs(2) - 1

        @pl.when(jnp.logical_not(last))
        def _full():
            step(a_ref[...], b_ref[...])

        @pl.when(last)
        def _tail():
            step(_ragged.fill_tail(a_ref[...], tail, axis=axis),
                 _ragged.fill_tail(b_ref[...], tail, axis=axis))
    else:
        step(a_ref[...], b_ref[...])

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _forward_reference(x, y):
    """matmul's reference (kernels/matmul.py imports this module, so not imported from it)."""
    return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


def matmul_bwd_reference(x: jax.Array, y: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
    """``jax.vjp`` of the forward's plain-JAX reference: (dx, dy)."""
    _, vjp = jax.vjp(_forward_reference, x, y)
    return tuple(vjp(g))


def matmul_bwd_args(args, kwargs):
    """The backward's example arguments for a forward call ``matmul(x, y)``: (x, y, g), with g
    a random cotangent of the output's shape and dtype (for ``tune(..., grad=True)``)."""
    x, y = args
    g = jax.random.normal(jax.random.key(1), (x.shape[0], y.shape[1]), jnp.float32)
    return [x, y, g.astype(x.dtype)], dict(kwargs)


def _inputs(x, y, g):
    """Tuning inputs from shapes: any x, y and g are valid backward arguments (random normal).
    Declared so that sweeps over large shapes pass them on abstractly (see tuning.grad)."""
    keys = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(kk, a.shape, jnp.float32).astype(a.dtype)
            for kk, a in zip(keys, (x, y, g), strict=True)], {}


def _standin(args, kwargs, config):
    """A smaller problem with the same tiles, for tpu-estimate (whose cost grows with grid steps:
    the full 4096-token problems with 256 tiles took over 10 minutes and 19 GB to estimate).
    Each of M, K, N is a grid axis of both products (K parallel in both; M parallel in dx and
    the reduction of dy; N the other way round), so fewer blocks along any of them scale both
    products' step counts by one factor; K is shrunk first (parallel in both, so no output
    block loses its store), then M and N, each only where its blocks divide it. The tuner
    checks the stand-in against one full compile before trusting it (within 5%)."""
    from pallas_tune.measure.estimate import shrink_parallel

    x, y, g = args
    (m, k), n = x.shape, y.shape[1]
    units, counts, ratio = [], [], [1.0, 1.0]
    for dim, names in ((k, ("dx_bk", "dy_bk")), (m, ("dx_bm", "dy_bm")), (n, ("dx_bn", "dy_bn"))):
        blocks = [min(config[nm], dim) for nm in names]
        unit = math.lcm(*blocks)
        whole = dim % unit == 0
        units.append(unit if whole else dim)
        counts.append(dim // unit if whole else 1)
        for i, b in enumerate(blocks):
            ratio[i] *= (unit if whole else pl.cdiv(dim, b) * b) / b
    new, scale = shrink_parallel(counts, int(min(ratio)))
    k2, m2, n2 = (min(c * u, d) for c, u, d in zip(new, units, (k, m, n), strict=True))
    shapes = ((m2, k2), (k2, n2), (m2, n2))
    return [jax.ShapeDtypeStruct(s, a.dtype) for s, a in zip(shapes, args, strict=True)], \
        kwargs, scale


matmul_bwd = pt.tunable(space="matmul_bwd", reference=matmul_bwd_reference,
                        inputs=_inputs, standin=_standin)(matmul_bwd)
