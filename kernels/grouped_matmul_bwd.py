"""The backward of the MoE grouped matmul: dlhs and drhs, both Pallas kernels.

For out[rows of group g] = lhs[rows of g] @ rhs[g] and the cotangent d (m, n):

- dlhs = gmm(d, rhsᵀ): dlhs[rows of g] = d[rows of g] · rhs[g]ᵀ, a Pallas kernel walking the m
  axis in visits like the forward (one per (group, m-tile) pair that overlaps), grid
  (cdiv(k, dlhs_tk), visits, cdiv(n, dlhs_tn)), the n axis the reduction. rhs's block
  (dlhs_tk, dlhs_tn) is contracted on its last dim in the kernel (an "NT" dot_general), so rhsᵀ
  is never materialized; a ragged n tail is zeroed on the last step only.
- drhs = tgmm(lhsᵀ, d): drhs[g] = lhs[rows of g]ᵀ · d[rows of g], megablox's transposed
  grouped matmul: grid (cdiv(k, drhs_tk), cdiv(n, drhs_tn), visits), the visits (m tiles, by
  group, every group visited at least once so that an empty group's block is written, as zeros)
  the reduction. Each visit adds its group's rows of an (drhs_tm, drhs_tk) lhs block and an
  (drhs_tm, drhs_tn) d block, contracted on the rows in the kernel (a "TN" dot_general: lhsᵀ
  is never materialized), into an f32 accumulator, zeroed at a group's first visit and stored
  at its last. Rows of other groups and past m are masked in both blocks.

A tunable kernel of its own (search_spaces/grouped_matmul_bwd.toml), declared as
``grouped_matmul``'s ``backward=``, with each product's tiles (``dlhs_*``, ``drhs_*``).
group_sizes gets no cotangent (integers). As in the forward, group_sizes must sum to m; rows
past the sum get unspecified dlhs and count in no group's drhs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged

__all__ = ["grouped_matmul_bwd", "grouped_matmul_bwd_args", "grouped_matmul_bwd_reference"]

_NT = (((1,), (1,)), ((), ()))  # (a, c) · (b, c) -> (a, b)
_TN = (((0,), (0,)), ((), ()))  # (c, a) · (c, b) -> (a, b)


# Registered as a tunable kernel (search_spaces/grouped_matmul_bwd.toml) at the end of the file.
def grouped_matmul_bwd(lhs, rhs, group_sizes, d, *, dlhs_tm: int, dlhs_tk: int, dlhs_tn: int,
                       drhs_tm: int, drhs_tk: int, drhs_tn: int):
    """(dlhs, drhs, None): the cotangents of ``grouped_matmul(lhs, rhs, group_sizes)`` for the
    output cotangent d (m, n), in the inputs' dtype. Tiles larger than a dimension are clamped.

    Raises:
      ValueError: the shapes or dtypes do not match the forward's.
    """
    m, k = lhs.shape
    if rhs.ndim != 3 or rhs.shape[1] != k or d.shape != (m, rhs.shape[2]) or \
            group_sizes.shape != rhs.shape[:1] or not lhs.dtype == rhs.dtype == d.dtype:
        raise ValueError(f"grouped_matmul_bwd needs lhs (m, k), rhs (groups, k, n), group_sizes "
                         f"(groups,) and d (m, n) of lhs's dtype; got lhs {lhs.shape} "
                         f"{lhs.dtype}, rhs {rhs.shape} {rhs.dtype}, group_sizes "
                         f"{group_sizes.shape}, d {d.shape} {d.dtype}")
    return (_dlhs(d, rhs, group_sizes, dlhs_tm, dlhs_tk, dlhs_tn),
            _drhs(lhs, d, group_sizes, rhs.shape[0], drhs_tm, drhs_tk, drhs_tn), None)


def _dlhs(d, rhs, group_sizes, tm, tk, tn):
    m, n = d.shape
    k = rhs.shape[1]
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    starts, ends, visit_group, visit_tile, _ = _group_metadata(group_sizes, m, tm)

    def d_map(j, v, nn, starts, ends, group, tile):
        return tile[v], nn

    def rhs_map(j, v, nn, starts, ends, group, tile):
        return group[v], j, nn

    def out_map(j, v, nn, starts, ends, group, tile):
        return tile[v], j

    return pl.pallas_call(
        functools.partial(_kernel, tm=tm, n_tail=n % tn),
        out_shape=jax.ShapeDtypeStruct((m, k), d.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(pl.cdiv(k, tk), visit_group.shape[0], pl.cdiv(n, tn)),
            in_specs=[pl.BlockSpec((tm, tn), d_map),
                      pl.BlockSpec((None, tk, tn), rhs_map)],
            out_specs=pl.BlockSpec((tm, tk), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tk), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name=f"grouped_matmul_bwd_dlhs_{tm}x{tk}x{tn}",
    )(starts, ends, visit_group, visit_tile, d, rhs)


def _group_metadata(group_sizes, m: int, tm: int, *, visit_empty: bool = False):
    """(starts, ends, visit_groups, visit_tiles, valid) for a static number of visits, ordered
    by group: one per (group, m-tile) pair that overlaps (the forward's ``make_group_metadata``;
    kernels/grouped_matmul.py imports this module, so it cannot be imported from there: moving
    it would change the forward's code fingerprint and stale its shipped entries). With
    ``visit_empty`` (tgmm) an empty group is visited once too, at a tile in range, all its rows
    masked. Surplus visits repeat the last real one, with valid 0."""
    groups = group_sizes.shape[0]
    tiles = pl.cdiv(m, tm)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = jnp.minimum(starts // tm, tiles - 1)
    last = jnp.maximum(ends - 1, 0) // tm
    count = jnp.where(sizes > 0, last - first + 1, int(visit_empty))
    csum = jnp.cumsum(count)
    v = jnp.arange(tiles + (2 * groups - 1 if visit_empty else groups - 1), dtype=jnp.int32)
    valid = (v < csum[-1]).astype(jnp.int32)
    v = jnp.minimum(v, csum[-1] - 1)
    group = jnp.searchsorted(csum, v, side="right").astype(jnp.int32)
    tile = first[group] + (v - (csum[group] - count[group]))
    return starts, ends, group, tile.astype(jnp.int32), valid


def _kernel(starts_ref, ends_ref, group_ref, tile_ref, d_ref, rhs_ref, o_ref, acc_ref, *, tm,
            n_tail):
    v, nn = pl.program_id(1), pl.program_id(2)

    @pl.when(nn == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def step(d, rhs):
        acc_ref[...] += jax.lax.dot_general(d, rhs, _NT, preferred_element_type=jnp.float32)

    if n_tail:  # n is ragged: only the last n step reads past it, and only it pays the mask.
        last = nn == pl.num_programs(2) - 1

        @pl.when(jnp.logical_not(last))
        def _full():
            step(d_ref[...], rhs_ref[...])

        @pl.when(last)
        def _tail():
            step(_ragged.fill_tail(d_ref[...], n_tail, axis=1),
                 _ragged.fill_tail(rhs_ref[...], n_tail, axis=1))
    else:
        step(d_ref[...], rhs_ref[...])

    @pl.when(nn == pl.num_programs(2) - 1)
    def _store():  # Only this visit's group's rows; the tile stays resident between visits.
        g, tile = group_ref[v], tile_ref[v]
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        o_ref[...] = jnp.where(mine, acc_ref[...], o_ref[...].astype(jnp.float32)).astype(
            o_ref.dtype)


def _drhs(lhs, d, group_sizes, groups, tm, tk, tn):
    m, k = lhs.shape
    n = d.shape[1]
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    meta = _group_metadata(group_sizes, m, tm, visit_empty=True)

    def lhs_map(kk, nn, v, starts, ends, group, tile, valid):
        return tile[v], kk

    def d_map(kk, nn, v, starts, ends, group, tile, valid):
        return tile[v], nn

    def out_map(kk, nn, v, starts, ends, group, tile, valid):
        return group[v], kk, nn

    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((groups, k, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5,
            grid=(pl.cdiv(k, tk), pl.cdiv(n, tn), meta[2].shape[0]),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map), pl.BlockSpec((tm, tn), d_map)],
            out_specs=pl.BlockSpec((None, tk, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        name=f"grouped_matmul_bwd_drhs_{tm}x{tk}x{tn}",
    )(*meta, lhs, d)


def _tgmm_kernel(starts_ref, ends_ref, group_ref, tile_ref, valid_ref, lhs_ref, d_ref, o_ref,
                 acc_ref, *, tm):
    v, visits = pl.program_id(2), pl.num_programs(2)
    g = group_ref[v]

    @pl.when((v == 0) | (group_ref[jnp.maximum(v - 1, 0)] != g))
    def _init():  # The group's first visit.
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(valid_ref[v] == 1)
    def _add():  # Only this group's rows (others', and rows past m, are zeroed in both).
        rows = tile_ref[v] * tm + jax.lax.broadcasted_iota(jnp.int32, (tm, 1), 0)
        mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        lhs = jnp.where(mine, lhs_ref[...], jnp.zeros((), lhs_ref.dtype))
        d = jnp.where(mine, d_ref[...], jnp.zeros((), d_ref.dtype))
        acc_ref[...] += jax.lax.dot_general(lhs, d, _TN, preferred_element_type=jnp.float32)

    @pl.when((v == visits - 1) | (group_ref[jnp.minimum(v + 1, visits - 1)] != g))
    def _store():  # The group's last visit (surplus visits are its repeats).
        o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def _forward_reference(lhs, rhs, group_sizes):
    """grouped_matmul's reference (kernels/grouped_matmul.py imports this module, so it is not
    imported from there): per-row gather of the group's weights; f32 accumulation."""
    m = lhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")
    row_group = jnp.minimum(row_group, rhs.shape[0] - 1)
    out = jnp.einsum("mk,mkn->mn", lhs, rhs[row_group], preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


def grouped_matmul_bwd_reference(lhs, rhs, group_sizes, d):
    """``jax.vjp`` of the forward's plain-JAX reference, evaluated in f32 and cast back:
    (dlhs, drhs, None). In bfloat16 the vjp of the row gather would sum drhs's per-row terms by
    a bf16 scatter-add (errors of several percent at a few hundred rows per group)."""
    def f32(a):
        return a.astype(jnp.float32)

    _, vjp = jax.vjp(lambda a, b: _forward_reference(a, b, group_sizes), f32(lhs), f32(rhs))
    dlhs, drhs = vjp(f32(d))
    return dlhs.astype(lhs.dtype), drhs.astype(rhs.dtype), None


def grouped_matmul_bwd_args(args, kwargs):
    """The backward's example arguments for ``grouped_matmul(lhs, rhs, group_sizes)``: (lhs,
    rhs, group_sizes, d), d a random cotangent like the output."""
    lhs, rhs, group_sizes = args
    d = jax.random.normal(jax.random.key(1), (lhs.shape[0], rhs.shape[2]), jnp.float32)
    return [lhs, rhs, group_sizes, d.astype(lhs.dtype)], dict(kwargs)


def _inputs(lhs, rhs, group_sizes, d):
    """Tuning inputs from shapes: uneven group sizes (one empty group) summing to m, as the
    forward's, and random lhs, rhs and d."""
    m, g = lhs.shape[0], rhs.shape[0]
    weights = jnp.arange(1, g + 1, dtype=jnp.float32).at[g // 2].set(0.0)
    sizes = jnp.floor(weights / weights.sum() * m).astype(jnp.int32)
    sizes = sizes.at[-1].add(m - sizes.sum())
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return ([jax.random.normal(k1, lhs.shape, jnp.float32).astype(lhs.dtype),
             jax.random.normal(k2, rhs.shape, jnp.float32).astype(rhs.dtype), sizes,
             jax.random.normal(k3, d.shape, jnp.float32).astype(d.dtype)], {})


grouped_matmul_bwd = pt.tunable(space="grouped_matmul_bwd", reference=grouped_matmul_bwd_reference,
                                inputs=_inputs)(grouped_matmul_bwd)
