"""Sliding-window and document (segment-id) masks of flash attention, forward and backward.

A query at position q (queries and keys aligned at position 0, as for ``causal``) sees the key
at position k when all of these hold:

- ``local_window_size=(left, right)``: q - left <= k <= q + right (an int w is (w, w), as in
  ``jax.nn.dot_product_attention``); with ``causal=True`` also k <= q;
- ``segment_ids=SegmentIds(q=..., kv=...)``: the query's and the key's ids are equal
  (documents packed into one sequence; each id's positions need not be contiguous, but blocks
  are skipped only where their ranges of ids cannot meet, so contiguous documents skip most).

The kernels skip a (query block, KV block) pair that no query of it can see, with no compute
and no DMA where the index maps can avoid it: the window's pairs by program ids alone (a band,
like the causal staircase), the segments' by each block's (min, max) id, computed outside the
kernel and read from SMEM (scalar prefetch). A pair every query of which sees every key runs
unmasked; only the pairs that straddle a boundary are masked, by position and id. Masked
scores are -inf (not the finite mask value of the unmasked kernels): with the running max
starting at that finite value, exp(-inf - m) is exactly 0, so a query that sees no key at all
sums nothing: its output is 0 and its log-sum-exp -inf (the backward reads that as "no
probability anywhere", never as NaN).

None of this is emitted without a window or segment ids: the unmasked kernels compile to the
programs they were tuned on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

__all__ = ["TABLES", "Blocks", "Masks", "SegmentIds", "ids32", "kv_clamp", "masks_of",
           "pallas_call", "q_clamp", "segment_tables", "some_query_block_blind", "standin_kwargs",
           "visible"]

TABLES = 6  # SMEM tables of a call with segment ids: q_lo, q_hi, k_lo, k_hi, first, last.


class SegmentIds(NamedTuple):
    """Document ids, ``q`` (batch, q_len) and ``kv`` (batch, kv_len), integers: a query sees
    only the keys with its own id (as splash attention's ``SegmentIds``)."""

    q: Any
    kv: Any


@dataclasses.dataclass(frozen=True)
class Masks:
    """A call's masks, static: the band of key - query offsets a query sees (``left`` keys
    before it, ``right`` after it; None: unbounded), whether segment ids mask, the lengths."""

    left: int | None
    right: int | None
    segments: bool
    sq: int
    sk: int


def _window(local_window_size: Any) -> tuple[int, int]:
    w = local_window_size
    if isinstance(w, int | np.integer) and not isinstance(w, bool | np.bool_):
        w = (w, w)
    if (not isinstance(w, tuple | list) or len(w) != 2 or not all(
            isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_) and x >= 0
            for x in w)):
        raise ValueError(f"local_window_size={local_window_size!r} must be an int >= 0 or a "
                         "(left, right) pair of them")
    return int(w[0]), int(w[1])


def _ids(segment_ids: Any) -> tuple[Any, Any]:
    """The (q, kv) ids of ``segment_ids``, or a ValueError saying what to give instead."""
    if not isinstance(segment_ids, tuple | list) or len(segment_ids) != 2:
        raise ValueError("segment_ids must be SegmentIds(q, kv) (or a (q, kv) pair) of "
                         f"(batch, q_len) and (batch, kv_len) integers; got {segment_ids!r}")
    for name, x in zip(("q", "kv"), segment_ids, strict=True):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            same = " (for self-attention, the same array as q's)" if name == "kv" else ""
            raise ValueError(
                f"segment_ids.{name} is {type(x).__name__}, not an integer array: give both "
                f"ids as arrays{same}, e.g. SegmentIds(jnp.asarray(q_ids, jnp.int32), "
                "jnp.asarray(kv_ids, jnp.int32))")
    return segment_ids[0], segment_ids[1]


def ids32(segment_ids: Any) -> tuple[jax.Array, jax.Array]:
    """The ids as int32, equal exactly where the given ids are equal. Ids of 32 bits or fewer
    are cast (a bijection); 64-bit ids (x64) are replaced by their dense rank among the ids of
    their batch row (q's and kv's together): a cast would wrap ids at or past 2**31 onto
    others, making two documents one. The rank keeps order, so blocks skip as before."""
    qs, ks = (jnp.asarray(x) for x in segment_ids)
    if max(qs.dtype.itemsize, ks.dtype.itemsize) <= 4:
        return qs.astype(jnp.int32), ks.astype(jnp.int32)
    both = jnp.concatenate([qs.astype(jnp.int64), ks.astype(jnp.int64)], axis=1)
    order = jnp.argsort(both, axis=1)
    ranked = jnp.take_along_axis(both, order, axis=1)
    step = jnp.concatenate([jnp.zeros_like(ranked[:, :1], jnp.int32),
                            (ranked[:, 1:] != ranked[:, :-1]).astype(jnp.int32)], axis=1)
    rows = jnp.arange(both.shape[0])[:, None]
    rank = jnp.zeros(both.shape, jnp.int32).at[rows, order].set(jnp.cumsum(step, axis=1))
    return rank[:, :qs.shape[1]], rank[:, qs.shape[1]:]


def masks_of(q: Any, k: Any, *, causal: bool, local_window_size: Any, segment_ids: Any
             ) -> Masks | None:
    """The call's :class:`Masks`, or None without a window and segment ids (the unmasked
    kernels). Raises ValueError for a bad window or segment ids of the wrong shape or dtype."""
    if local_window_size is None and segment_ids is None:
        return None
    left = right = None
    if local_window_size is not None:
        left, right = _window(local_window_size)
        far = max(q.shape[2], k.shape[2])  # Past every position a window bounds nothing.
        left, right = min(left, far), min(right, far)
    if causal:
        right = 0 if right is None else min(right, 0)
    if segment_ids is not None:
        qs, ks = _ids(segment_ids)
        want = ((q.shape[0], q.shape[2]), (k.shape[0], k.shape[2]))
        if (tuple(qs.shape), tuple(ks.shape)) != want or not all(
                jnp.issubdtype(x.dtype, jnp.integer) for x in (qs, ks)):
            raise ValueError(f"segment_ids must be integer arrays shaped {want[0]} and {want[1]};"
                             f" got {qs.shape}:{qs.dtype} and {ks.shape}:{ks.dtype}")
    return Masks(left, right, segment_ids is not None, q.shape[2], k.shape[2])


def _ranges(ids: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Each block's (min, max) id, (batch, blocks); a ragged last block's padding repeats
    its last id."""
    b, s = ids.shape
    n = pl.cdiv(s, block)
    x = jnp.pad(ids, ((0, 0), (0, n * block - s)), mode="edge").reshape(b, n, block)
    return x.min(-1), x.max(-1)


def segment_tables(segment_ids: Any, bq: int, bkv: int, *, per: str) -> list[jax.Array]:
    """The SMEM tables of a call with segment ids, flat int32 (batch-major): each query and
    each KV block's (min, max) id, then, for each block along ``per`` ("q": query blocks; "kv":
    KV blocks), the first and the last block of the other axis whose ids can meet its own."""
    qs, ks = ids32(segment_ids)
    q_lo, q_hi = _ranges(qs, bq)
    k_lo, k_hi = _ranges(ks, bkv)
    meet = (q_lo[:, :, None] <= k_hi[:, None, :]) & (k_lo[:, None, :] <= q_hi[:, :, None])
    if per == "kv":
        meet = jnp.swapaxes(meet, 1, 2)
    n, some = meet.shape[2], meet.any(-1)
    first = jnp.where(some, jnp.argmax(meet, -1), 0)
    last = jnp.where(some, n - 1 - jnp.argmax(meet[..., ::-1], -1), 0)
    return [x.reshape(-1).astype(jnp.int32) for x in (q_lo, q_hi, k_lo, k_hi, first, last)]


def pallas_call(kernel: Any, masks: Masks, segment_ids: Any, axes: tuple[int, int, int], *,
                per: str, grid: tuple[int, ...], in_specs: list[Any], operands: list[Any],
                q_block: Any, kv_block: Any, out_specs: Any, scratch_shapes: list[Any],
                **call: Any) -> Any:
    """``pl.pallas_call`` of a masked kernel, ``kernel(*operand refs, *out and scratch refs,
    blocks=)`` (a partial with ``bq`` and ``bkv``), which gets each step's :class:`Blocks`
    (``axes``: the grid axes of the batch, query block and KV block). Segment ids add their
    SMEM tables (scalar prefetch, one row per block along ``per``) and two id blocks: the
    queries' as a row (1, bq), the keys' as a column (bkv, 1), as the transposed scores (keys,
    queries) read them; ``q_block(*grid ids, *tables) -> (batch, query block)`` and
    ``kv_block`` alike give the blocks each step reads."""
    bq, bkv = kernel.keywords["bq"], kernel.keywords["bkv"]
    tables = []
    if masks.segments:
        qs, ks = ids32(segment_ids)
        tables = segment_tables((qs, ks), bq, bkv, per=per)
        operands = [*operands, qs[:, None, :], ks[:, :, None]]

        def q_ids(*a):
            bi, i = q_block(*a)
            return bi, 0, i

        in_specs = [*in_specs, pl.BlockSpec((None, 1, bq), q_ids),
                    pl.BlockSpec((None, bkv, 1), lambda *a: (*kv_block(*a), 0))]
    n_inputs = len(operands) - (2 if masks.segments else 0)
    return pl.pallas_call(
        functools.partial(_with_blocks, kernel, masks, axes, n_inputs),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(tables), grid=grid,
                                               in_specs=in_specs, out_specs=out_specs,
                                               scratch_shapes=scratch_shapes), **call,
    )(*tables, *operands)


def _with_blocks(kernel: Any, masks: Masks, axes: tuple[int, int, int], n_inputs: int,
                 *refs: Any) -> None:
    """The kernel's refs in order (SMEM tables first, the id blocks after the operands), and
    its :class:`Blocks`."""
    t = TABLES if masks.segments else 0
    n_ids = 2 if masks.segments else 0
    tables, inputs = refs[:t], refs[t:t + n_inputs]
    ids, rest = refs[t + n_inputs:t + n_inputs + n_ids], refs[t + n_inputs + n_ids:]
    bi, i, j = (pl.program_id(a) for a in axes)
    kernel(*inputs, *rest, blocks=Blocks(masks, kernel.keywords["bq"], kernel.keywords["bkv"],
                                         bi, i, j, tables, ids))


def _span(first_pos: Any, last_pos: Any, before: int | None, after: int | None, block: int,
          n: int) -> tuple[Any, Any]:
    """The blocks (of ``block`` positions, ``n`` of them) that positions [first_pos, last_pos]
    can see when each sees ``before`` positions before it and ``after`` after (None: all)."""
    lo = 0 if before is None else jnp.minimum(
        lax.div(jnp.maximum(first_pos - before, 0), block), n - 1)
    hi = n - 1 if after is None else jnp.minimum(lax.div(last_pos + after, block), n - 1)
    return lo, hi


def some_query_block_blind(masks: Masks, bq: int) -> bool:
    """Whether a query block may see no key at all (statically: always with segment ids; with
    a window only, whether some block's reach misses every key)."""
    if masks.segments:
        return True
    for q0 in range(0, masks.sq, bq):
        q1 = min(q0 + bq, masks.sq) - 1
        lo = 0 if masks.left is None else max(q0 - masks.left, 0)
        hi = masks.sk - 1 if masks.right is None else min(q1 + masks.right, masks.sk - 1)
        if lo > hi:
            return True
    return False


def kv_clamp(masks: Masks, bq: int, bkv: int, bi: Any, i: Any, j: Any,
             tables: tuple[Any, ...] = ()) -> Any:
    """For index maps: step ``j`` clamped to the KV blocks that query block ``i`` can see, so
    that a skipped step repeats a needed block (no DMA)."""
    nq, nk = pl.cdiv(masks.sq, bq), pl.cdiv(masks.sk, bkv)
    q0 = i * bq
    lo, hi = _span(q0, jnp.minimum(q0 + bq - 1, masks.sq - 1), masks.left, masks.right, bkv, nk)
    if tables:
        lo, hi = jnp.maximum(lo, tables[4][bi * nq + i]), jnp.minimum(hi, tables[5][bi * nq + i])
    return jnp.minimum(jnp.maximum(j, lo), hi)


def q_clamp(masks: Masks, bq: int, bkv: int, bi: Any, j: Any, i: Any,
            tables: tuple[Any, ...] = ()) -> Any:
    """For index maps: step ``i`` clamped to the query blocks that see KV block ``j``."""
    nq, nk = pl.cdiv(masks.sq, bq), pl.cdiv(masks.sk, bkv)
    k0 = j * bkv
    lo, hi = _span(k0, jnp.minimum(k0 + bkv - 1, masks.sk - 1), masks.right, masks.left, bq, nq)
    if tables:
        lo, hi = jnp.maximum(lo, tables[4][bi * nk + j]), jnp.minimum(hi, tables[5][bi * nk + j])
    return jnp.minimum(jnp.maximum(i, lo), hi)


class Blocks:
    """Inside a kernel, at query block ``i`` and KV block ``j`` of batch row ``bi``: whether
    the pair runs at all, whether it runs unmasked, and the mask of a straddling one. The
    conditions are plain comparisons of program ids and SMEM scalars (no division: see
    flash_attention._dispatch_diagonal)."""

    def __init__(self, masks: Masks, bq: int, bkv: int, bi: Any, i: Any, j: Any,
                 tables: tuple[Any, ...] = (), ids: tuple[Any, ...] = ()):
        self.m, self.bq, self.bkv, self.i, self.j, self.ids = masks, bq, bkv, i, j, ids
        self.bi, self.tables = bi, tables
        self.q0, self.k0 = i * bq, j * bkv
        self.q1 = jnp.minimum(self.q0 + bq - 1, masks.sq - 1)
        self.k1 = jnp.minimum(self.k0 + bkv - 1, masks.sk - 1)
        self.seg = None
        if tables:
            qr, kr = bi * pl.cdiv(masks.sq, bq) + i, bi * pl.cdiv(masks.sk, bkv) + j
            self.seg = tuple(t[r] for t, r in zip(tables[:4], (qr, qr, kr, kr), strict=True))

    def q_block(self) -> Any:
        """The query block this step's query index map reads (:func:`q_clamp`, for a grid
        whose KV axis is outer): ``i`` itself where the pair runs."""
        return q_clamp(self.m, self.bq, self.bkv, self.bi, self.j, self.i, self.tables)

    def run(self) -> Any:
        """Some query of the pair sees some key (else it is skipped)."""
        m, ok = self.m, jnp.bool_(True)
        if m.right is not None:
            ok = jnp.logical_and(ok, self.k0 - self.q1 <= m.right)
        if m.left is not None:
            ok = jnp.logical_and(ok, self.q0 - self.k1 <= m.left)
        if self.seg is not None:
            q_lo, q_hi, k_lo, k_hi = self.seg
            ok = jnp.logical_and(ok, jnp.logical_and(q_lo <= k_hi, k_lo <= q_hi))
        return ok

    def whole(self) -> Any:
        """Every query of the pair sees every key (no mask; the caller excludes ragged
        blocks along the axis it reduces over)."""
        m, ok = self.m, jnp.bool_(True)
        if m.right is not None:
            ok = jnp.logical_and(ok, self.k1 - self.q0 <= m.right)
        if m.left is not None:
            ok = jnp.logical_and(ok, self.q1 - self.k0 <= m.left)
        if self.seg is not None:
            q_lo, q_hi, k_lo, k_hi = self.seg
            one = jnp.logical_and(jnp.logical_and(q_lo == q_hi, k_lo == k_hi), q_lo == k_lo)
            ok = jnp.logical_and(ok, one)
        return ok

    def mask(self, s: jax.Array, q_off: int = 0) -> jax.Array:
        """Scores sᵀ (keys of this KV block from its first, queries from column ``q_off`` of
        this query block) with what no query sees set to -inf: the band, ids, and positions
        past either length."""
        rows, cols = s.shape
        ids = ()
        if self.ids:  # The queries' ids as a row, the keys' as a column.
            ids = (self.ids[0][:, q_off:q_off + cols], self.ids[1][:rows, :])
        ok = visible(self.m, s.shape, self.q0 + q_off, self.k0, ids,
                     ragged=(self.m.sq % self.bq != 0, self.m.sk % self.bkv != 0))
        return jnp.where(ok, s, -jnp.inf)


def visible(m: Masks, shape: tuple[int, int], q_first: Any, k_first: Any,
            ids: tuple[Any, ...] = (), ragged: tuple[bool, bool] = (True, True)) -> jax.Array:
    """(keys, queries) booleans: which key sees which query, keys from position ``k_first``
    down the rows and queries from ``q_first`` across the columns; ``ids``: the queries' ids
    (a row) and the keys' (a column); ``ragged``: whether positions past q_len, kv_len occur
    (they see nothing)."""
    key = k_first + lax.broadcasted_iota(jnp.int32, shape, 0)
    query = q_first + lax.broadcasted_iota(jnp.int32, shape, 1)
    ok = jnp.ones(shape, jnp.bool_)
    if ragged[0]:
        ok = jnp.logical_and(ok, query < m.sq)
    if ragged[1]:
        ok = jnp.logical_and(ok, key < m.sk)
    if m.right is not None:
        ok = jnp.logical_and(ok, key - query <= m.right)
    if m.left is not None:
        ok = jnp.logical_and(ok, query - key <= m.left)
    if ids:
        ok = jnp.logical_and(ok, ids[1] == ids[0])
    return ok


def standin_kwargs(kwargs: dict[str, Any], batch: int) -> dict[str, Any]:
    """A stand-in's keywords (``measure.estimate``): segment ids cut to its first ``batch``
    rows, like its q, k and v."""
    ids = kwargs.get("segment_ids")
    if ids is None:
        return kwargs
    cut = [jax.ShapeDtypeStruct((batch, *x.shape[1:]), x.dtype)
           if isinstance(x, jax.ShapeDtypeStruct) else x[:batch] for x in ids]
    return {**kwargs, "segment_ids": SegmentIds(*cut)}
