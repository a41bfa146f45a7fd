"""MoE grouped matmul with 8-bit expert weights, for serving: out[rows of group g] = lhs[rows of g]
@ (rhs_q[g] · rhs_scale[g]).

lhs (m, k) bfloat16; rhs_q (groups, k, n) int8 or float8_e4m3fn; rhs_scale (groups, n), one scale
per expert and output channel; integer ``group_sizes`` (groups,) summing to m. The walk is
:mod:`pallas_tune.kernels.grouped_matmul`'s (one visit per (group, m-tile) pair, the visit table
by scalar prefetch, each visit storing only its group's rows); here each rhs block stays 8-bit in
HBM, is widened to bf16 in VMEM, and the visit's expert scale is applied to the f32 accumulator
when the visit stores. Any m, k, n (ragged tiles dropped on store, a ragged last k step masked).

Inputs are checked once, before a config is resolved or a candidate traced (as
:func:`pallas_tune.kernels.quantized_matmul.quantized_matmul`'s): what no config can run raises
``ValueError``.

Forward only: quantized experts are frozen weights. Its gradient with respect to lhs is XLA's
(``backward="xla"``: ``jax.vjp`` of the reference); the 8-bit weights get none.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged
from pallas_tune.kernels.grouped_matmul import make_group_metadata
from pallas_tune.kernels.quantized_matmul import WEIGHT_DTYPES, inputs_checked, shapes_of

__all__ = ["quantized_grouped_matmul", "quantized_grouped_matmul_reference"]


def _check(lhs, rhs_q, rhs_scale, group_sizes):
    shapes = shapes_of("quantized_grouped_matmul", lhs=lhs, rhs_q=rhs_q, rhs_scale=rhs_scale,
                       group_sizes=group_sizes)
    ls, rs, ss, gs = (shapes[n] for n in ("lhs", "rhs_q", "rhs_scale", "group_sizes"))
    if len(ls) != 2 or len(rs) != 3 or ls[1] != rs[1] or gs != rs[:1]:
        raise ValueError(f"quantized_grouped_matmul needs lhs (m, k), rhs_q (groups, k, n) and "
                         f"group_sizes (groups,); got lhs {ls}, rhs_q {rs}, group_sizes {gs}")
    if ss != (rs[0], rs[2]):
        raise ValueError(f"quantized_grouped_matmul needs one scale per expert and output "
                         f"channel, rhs_scale {(rs[0], rs[2])}; got {ss}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers (int32); got {group_sizes.dtype}")
    if lhs.dtype != jnp.bfloat16:
        raise ValueError(f"quantized_grouped_matmul takes bfloat16 lhs; got {lhs.dtype}: cast "
                         "it to bfloat16")
    if rhs_q.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"quantized_grouped_matmul takes int8 or float8_e4m3fn experts; got "
                         f"{rhs_q.dtype} (for bfloat16 experts use "
                         "pallas_tune.kernels.grouped_matmul)")


def _check_call(lhs, rhs_q, rhs_scale, group_sizes, **_):
    """:func:`_check` on a call's arguments (tuned keywords and tuning options aside)."""
    _check(lhs, rhs_q, rhs_scale, group_sizes)


# The public entry; registered as a tunable kernel (search_spaces/quantized_grouped_matmul.toml)
# at the end of the file.
def quantized_grouped_matmul(lhs, rhs_q, rhs_scale, group_sizes, *, tm: int, tk: int, tn: int):
    """Grouped matmul of lhs (m, k) bfloat16 with 8-bit experts rhs_q (groups, k, n) scaled by
    rhs_scale (groups, n), by ``group_sizes`` → (m, n) bfloat16. ``group_sizes`` must sum to m
    (traced, so not checked). Tiles larger than a dimension are clamped to it.

    Raises:
      ValueError: before any config is resolved: an argument that is not an array, an empty
        axis (no rows, experts, k or n), shapes that do not match, non-integer group sizes,
        lhs not bfloat16, or experts neither int8 nor float8_e4m3fn.
    """
    _check(lhs, rhs_q, rhs_scale, group_sizes)
    m, k = lhs.shape
    groups, _, n = rhs_q.shape
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    starts, ends, visit_group, visit_tile = make_group_metadata(group_sizes, m, tm)
    scale = rhs_scale.astype(jnp.float32).reshape(groups, 1, n)

    def lhs_map(j, v, kk, starts, ends, group, tile):
        return tile[v], kk

    def rhs_map(j, v, kk, starts, ends, group, tile):
        return group[v], kk, j

    def scale_map(j, v, kk, starts, ends, group, tile):
        return group[v], 0, j

    def out_map(j, v, kk, starts, ends, group, tile):
        return tile[v], j

    return pl.pallas_call(
        functools.partial(_kernel, tm=tm, k_tail=k % tk),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(pl.cdiv(n, tn), visit_group.shape[0], pl.cdiv(k, tk)),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map),
                      pl.BlockSpec((None, tk, tn), rhs_map),
                      pl.BlockSpec((None, 1, tn), scale_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name=f"qgmm_{jnp.dtype(rhs_q.dtype).name}_{tm}x{tk}x{tn}",
    )(starts, ends, visit_group, visit_tile, lhs, rhs_q, scale)


def _kernel(starts_ref, ends_ref, group_ref, tile_ref, lhs_ref, rhs_ref, scale_ref, o_ref,
            acc_ref, *, tm, k_tail):
    v, kk = pl.program_id(1), pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def product(lhs, rhs):
        return jnp.dot(lhs, rhs.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    if k_tail:  # k is ragged: only the last k step reads past it, and only it pays the mask.
        last = kk == pl.num_programs(2) - 1

        @pl.when(jnp.logical_not(last))
        def _full():
            acc_ref[...] += product(lhs_ref[...], rhs_ref[...])

        @pl.when(last)
        def _tail():
            acc_ref[...] += product(_ragged.fill_tail(lhs_ref[...], k_tail, axis=1),
                                    _ragged.fill_tail(rhs_ref[...], k_tail, axis=0))
    else:
        acc_ref[...] += product(lhs_ref[...], rhs_ref[...])

    @pl.when(kk == pl.num_programs(2) - 1)
    def _store():
        g, tile = group_ref[v], tile_ref[v]
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        scaled = acc_ref[...] * scale_ref[...]
        o_ref[...] = jnp.where(mine, scaled, o_ref[...].astype(jnp.float32)).astype(o_ref.dtype)


def _standin(args, kwargs, config):
    """Fewer n tiles (identical work each), same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    lhs, rhs_q, rhs_scale, sizes = args
    g, k, n = rhs_q.shape
    tn = min(config["tn"], n)
    visits = pl.cdiv(lhs.shape[0], min(config["tm"], lhs.shape[0])) + g - 1
    (nb,), scale = shrink_parallel([pl.cdiv(n, tn)], visits * pl.cdiv(k, min(config["tk"], k)))
    n2 = min(nb * tn, n)
    return [lhs, jax.ShapeDtypeStruct((g, k, n2), rhs_q.dtype),
            jax.ShapeDtypeStruct((g, n2), rhs_scale.dtype), sizes], kwargs, scale


def _inputs(lhs, rhs_q, rhs_scale, group_sizes):
    """Tuning inputs: normal lhs, experts over the 8-bit range, scales near 1/64, uneven group
    sizes (one empty group) summing to m."""
    m, g = lhs.shape[0], rhs_q.shape[0]
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    weights = jnp.arange(1, g + 1, dtype=jnp.float32).at[g // 2].set(0.0)
    sizes = jnp.floor(weights / weights.sum() * m).astype(jnp.int32)
    sizes = sizes.at[-1].add(m - sizes.sum())
    w = jax.random.randint(k2, rhs_q.shape, -127, 128).astype(jnp.float32)
    if jnp.dtype(rhs_q.dtype) != jnp.dtype(jnp.int8):
        w = w / 16.0
    s = (jax.random.uniform(k3, rhs_scale.shape, jnp.float32) + 0.5) / 64.0
    return ([jax.random.normal(k1, lhs.shape, jnp.float32).astype(lhs.dtype),
             w.astype(rhs_q.dtype), s.astype(rhs_scale.dtype), sizes], {})


def quantized_grouped_matmul_reference(lhs, rhs_q, rhs_scale, group_sizes):
    """XLA: each row's expert dequantized and gathered; f32 accumulation."""
    _check(lhs, rhs_q, rhs_scale, group_sizes)
    m = lhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"),
                            rhs_q.shape[0] - 1)
    out = jax.lax.ragged_dot(lhs, rhs_q.astype(jnp.bfloat16), group_sizes.astype(jnp.int32),
                             preferred_element_type=jnp.float32)
    return (out * rhs_scale.astype(jnp.float32)[row_group]).astype(lhs.dtype)


quantized_grouped_matmul = inputs_checked(pt.tunable(
    space="quantized_grouped_matmul", reference=quantized_grouped_matmul_reference,
    standin=_standin, inputs=_inputs, backward="xla",
    partition="M K, G K n, G n, G -> M n")(quantized_grouped_matmul), _check_call)  # Sharded jit.
