"""MoE grouped matmul: out[rows of group g] = lhs[rows of group g] @ rhs[g].

lhs (m, k), rhs (groups, k, n), integer ``group_sizes`` (groups,) summing to m; empty groups are
allowed and a group may start or end anywhere inside an m tile. As in megablox, the m axis is
walked in "visits": one per (group, m-tile) pair that overlaps, so a tile that straddles a group
boundary is visited once per group, and each visit stores only its group's rows (the output tile
stays resident in VMEM between consecutive visits). The visit table (group id and m-tile id per
visit) is computed in plain JAX from ``group_sizes`` and passed by scalar prefetch, so the grid is
static: (cdiv(n, tn), cdiv(m, tm) + groups - 1, cdiv(k, tk)), with surplus visits repeating the
last one (idempotent).

Any m, k, n: rows and columns past m and n in a ragged last tile are dropped on store (no group
owns rows past m); when no tk divides k, the last k step zeroes the columns of lhs and rows of rhs
past k before its dot (emitted only then, so shapes that divide compile to the same program).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged
from pallas_tune.kernels.grouped_matmul_bwd import grouped_matmul_bwd, grouped_matmul_bwd_args

__all__ = ["grouped_matmul", "grouped_matmul_reference", "make_group_metadata"]

DTYPES = (jnp.float32, jnp.bfloat16)


# The public entry; registered as a tunable kernel (search_spaces/grouped_matmul.toml) at the end
# of the file, once its reference, stand-in and input builder exist.
def grouped_matmul(lhs, rhs, group_sizes, *, tm: int, tk: int, tn: int):
    """Grouped matmul of lhs (m, k) with rhs (groups, k, n) by ``group_sizes`` → (m, n).

    Any m, k, n; lhs and rhs float32 or bfloat16 (one dtype). ``group_sizes`` must sum to m
    (it is traced, so this is not checked): rows past the sum are left unspecified, as in
    megablox. Tiles larger than a dimension are clamped to it.

    Raises:
      ValueError: the shapes do not match, ``group_sizes`` is not an integer vector of one entry
        per group, or the dtypes are not one of float32 and bfloat16.
    """
    if (lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]
            or group_sizes.shape != rhs.shape[:1]):
        raise ValueError(f"grouped_matmul needs lhs (m, k), rhs (groups, k, n) and group_sizes "
                         f"(groups,); got lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                         f"{group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers (int32); got {group_sizes.dtype}")
    if lhs.dtype != rhs.dtype or lhs.dtype not in DTYPES:
        raise ValueError(f"grouped_matmul supports float32 or bfloat16 lhs and rhs of one dtype; "
                         f"got {lhs.dtype}, {rhs.dtype}: cast both to one of these")
    m, k = lhs.shape
    n = rhs.shape[2]
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    starts, ends, visit_group, visit_tile = make_group_metadata(group_sizes, m, tm)
    visits = visit_group.shape[0]

    def lhs_map(j, v, kk, starts, ends, group, tile):
        return tile[v], kk

    def rhs_map(j, v, kk, starts, ends, group, tile):
        return group[v], kk, j

    def out_map(j, v, kk, starts, ends, group, tile):
        return tile[v], j

    return pl.pallas_call(
        functools.partial(_kernel, tm=tm, k_tail=k % tk),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(pl.cdiv(n, tn), visits, pl.cdiv(k, tk)),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map),
                      pl.BlockSpec((None, tk, tn), rhs_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name=f"grouped_matmul_{tm}x{tk}x{tn}",
    )(starts, ends, visit_group, visit_tile, lhs, rhs)


def make_group_metadata(group_sizes, m: int, tm: int):
    """(starts, ends, visit_groups, visit_tiles) for a static number of visits."""
    groups = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tm
    last = jnp.maximum(ends - 1, 0) // tm
    count = jnp.where(sizes > 0, last - first + 1, 0)
    csum = jnp.cumsum(count)
    visits = pl.cdiv(m, tm) + groups - 1
    v = jnp.arange(visits, dtype=jnp.int32)
    v = jnp.minimum(v, csum[-1] - 1)  # Surplus visits repeat the last real one.
    group = jnp.searchsorted(csum, v, side="right").astype(jnp.int32)
    tile = first[group] + (v - (csum[group] - count[group]))
    return starts, ends, group, tile.astype(jnp.int32)


def _kernel(starts_ref, ends_ref, group_ref, tile_ref, lhs_ref, rhs_ref, o_ref, acc_ref, *, tm,
            k_tail):
    v, kk = pl.program_id(1), pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if k_tail:  # k is ragged: only the last k step reads past it, and only it pays the mask.
        last = kk == pl.num_programs(2) - 1

        @pl.when(jnp.logical_not(last))
        def _full():
            acc_ref[...] += jnp.dot(lhs_ref[...], rhs_ref[...],
                                    preferred_element_type=jnp.float32)

        @pl.when(last)
        def _tail():
            lhs = _ragged.fill_tail(lhs_ref[...], k_tail, axis=1)
            rhs = _ragged.fill_tail(rhs_ref[...], k_tail, axis=0)
            acc_ref[...] += jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)
    else:
        acc_ref[...] += jnp.dot(lhs_ref[...], rhs_ref[...], preferred_element_type=jnp.float32)

    @pl.when(kk == pl.num_programs(2) - 1)
    def _store():
        g, tile = group_ref[v], tile_ref[v]
        rows = tile * tm + jax.lax.broadcasted_iota(jnp.int32, acc_ref.shape, 0)
        mine = (rows >= starts_ref[g]) & (rows < ends_ref[g])
        o_ref[...] = jnp.where(mine, acc_ref[...], o_ref[...].astype(jnp.float32)).astype(
            o_ref.dtype)


def _standin(args, kwargs, config):
    """Fewer n tiles (identical work each), same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    lhs, rhs, sizes = args
    g, k, n = rhs.shape
    tn = min(config["tn"], n)
    visits = pl.cdiv(lhs.shape[0], min(config["tm"], lhs.shape[0])) + g - 1
    (nb,), scale = shrink_parallel([pl.cdiv(n, tn)], visits * pl.cdiv(k, min(config["tk"], k)))
    return [lhs, jax.ShapeDtypeStruct((g, k, min(nb * tn, n)), rhs.dtype), sizes], kwargs, scale


def _inputs(lhs, rhs, group_sizes):
    """Tuning inputs: random lhs/rhs and uneven group sizes (one empty group) summing to m."""
    m, g = lhs.shape[0], rhs.shape[0]
    k1, k2 = jax.random.split(jax.random.key(0))
    weights = jnp.arange(1, g + 1, dtype=jnp.float32).at[g // 2].set(0.0)
    sizes = jnp.floor(weights / weights.sum() * m).astype(jnp.int32)
    sizes = sizes.at[-1].add(m - sizes.sum())
    return ([jax.random.normal(k1, lhs.shape, jnp.float32).astype(lhs.dtype),
             jax.random.normal(k2, rhs.shape, jnp.float32).astype(rhs.dtype), sizes], {})


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """Per-row gather of the group's weights; f32 accumulation."""
    m = lhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")
    row_group = jnp.minimum(row_group, rhs.shape[0] - 1)
    out = jnp.einsum("mk,mkn->mn", lhs, rhs[row_group], preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


# Differentiable: jax.grad calls grouped_matmul_bwd (dlhs and drhs, both Pallas kernels; its own
# tunable kernel and cache entries).
grouped_matmul = pt.tunable(space="grouped_matmul", reference=grouped_matmul_reference,
                            standin=_standin, inputs=_inputs, backward=grouped_matmul_bwd,
                            backward_args=grouped_matmul_bwd_args,
                            # Sharded jit: split along n; rows and experts follow the routing
                            # (group_sizes), so they stay whole (experts: shard_map + all-to-all).
                            partition="M K, G K n, G -> M n")(grouped_matmul)
