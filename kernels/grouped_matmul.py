"""MoE grouped matmul: out[rows of group g] = lhs[rows of group g] @ rhs[g].

lhs (m, k), rhs (groups, k, n), int32 ``group_sizes`` (groups,) summing to m; empty groups are
allowed. As in megablox, the m axis is walked in "visits": one per (group, m-tile) pair that
overlaps, so a tile that straddles a group boundary is visited once per group, and each visit
stores only its group's rows (the output tile stays resident in VMEM between consecutive visits).
The visit table (group id and m-tile id per visit) is computed in plain JAX from ``group_sizes``
and passed by scalar prefetch, so the grid is static: (n/tn, m/tm + groups - 1, k/tk), with
surplus visits repeating the last one (idempotent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["grouped_matmul", "grouped_matmul_reference", "make_group_metadata"]


def grouped_matmul_reference(lhs, rhs, group_sizes):
    """Per-row gather of the group's weights; f32 accumulation."""
    m = lhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    row_group = jnp.searchsorted(ends, jnp.arange(m), side="right")
    row_group = jnp.minimum(row_group, rhs.shape[0] - 1)
    out = jnp.einsum("mk,mkn->mn", lhs, rhs[row_group], preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


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
    visits = m // tm + groups - 1
    v = jnp.arange(visits, dtype=jnp.int32)
    v = jnp.minimum(v, csum[-1] - 1)  # Surplus visits repeat the last real one.
    group = jnp.searchsorted(csum, v, side="right").astype(jnp.int32)
    tile = first[group] + (v - (csum[group] - count[group]))
    return starts, ends, group, tile.astype(jnp.int32)


def _kernel(starts_ref, ends_ref, group_ref, tile_ref, lhs_ref, rhs_ref, o_ref, acc_ref, *, tm):
    v, kk = pl.program_id(1), pl.program_id(2)

    @pl.when(kk == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

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
    visits = lhs.shape[0] // min(config["tm"], lhs.shape[0]) + g - 1
    (nb,), scale = shrink_parallel([n // tn], visits * (k // min(config["tk"], k)))
    return [lhs, jax.ShapeDtypeStruct((g, k, nb * tn), rhs.dtype), sizes], kwargs, scale


def _inputs(lhs, rhs, group_sizes):
    """Tuning inputs: random lhs/rhs and uneven group sizes (one empty group) summing to m."""
    m, g = lhs.shape[0], rhs.shape[0]
    k1, k2 = jax.random.split(jax.random.key(0))
    weights = jnp.arange(1, g + 1, dtype=jnp.float32).at[g // 2].set(0.0)
    sizes = jnp.floor(weights / weights.sum() * m).astype(jnp.int32)
    sizes = sizes.at[-1].add(m - sizes.sum())
    return ([jax.random.normal(k1, lhs.shape, jnp.float32).astype(lhs.dtype),
             jax.random.normal(k2, rhs.shape, jnp.float32).astype(rhs.dtype), sizes], {})


@pt.tunable(space="grouped_matmul", reference=grouped_matmul_reference, standin=_standin,
            inputs=_inputs)
def grouped_matmul(lhs, rhs, group_sizes, *, tm: int, tk: int, tn: int):
    """Grouped matmul of lhs (m, k) with rhs (groups, k, n) by ``group_sizes`` → (m, n)."""
    m, k = lhs.shape
    g, k2, n = rhs.shape
    if k != k2 or group_sizes.shape != (g,):
        raise ValueError(f"shapes do not match: lhs {lhs.shape}, rhs {rhs.shape}, "
                         f"group_sizes {group_sizes.shape}")
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    if m % tm or k % tk or n % tn:
        raise ValueError(f"tiles (tm={tm}, tk={tk}, tn={tn}) must divide (m={m}, k={k}, n={n})")
    starts, ends, visit_group, visit_tile = make_group_metadata(group_sizes, m, tm)
    visits = visit_group.shape[0]

    def lhs_map(j, v, kk, starts, ends, group, tile):
        return tile[v], kk

    def rhs_map(j, v, kk, starts, ends, group, tile):
        return group[v], kk, j

    def out_map(j, v, kk, starts, ends, group, tile):
        return tile[v], j

    return pl.pallas_call(
        functools.partial(_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(n // tn, visits, k // tk),
            in_specs=[pl.BlockSpec((tm, tk), lhs_map),
                      pl.BlockSpec((None, tk, tn), rhs_map)],
            out_specs=pl.BlockSpec((tm, tn), out_map),
            scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        name=f"grouped_matmul_{tm}x{tk}x{tn}",
    )(starts, ends, visit_group, visit_tile, lhs, rhs)
