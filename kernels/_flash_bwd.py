"""The block machinery flash attention's backward passes share (``flash_attention_bwd``):
transposed scores with their masks, a block cut into column strips (the causal diagonal as a
staircase of them), the strips software-pipelined in program order, and the dispatch of a grid
step to the branch its block needs (skipped, whole, staircase, masked, ragged).

A module of its own so that the kernel module holds the passes and nothing else.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_tune.kernels._attention import MASK_VALUE

__all__ = ["STRIP", "dispatch", "dispatch_kv_tail", "pipelined", "scores", "strips"]

STRIP = 256  # Query columns per strip of a block (v6e estimate, 8B GQA group at 4096 tokens,
#               causal, 2048 blocks: dK/dV 0.0905 / 0.0929 / 0.0909 ms at 256 / 512 / 128,
#               dQ 0.0664 / 0.0657 / 0.0808; see strips).
_LAG = 1  # Strips between a strip's two score-sized matmuls and its softmax-gradient part in
#           program order (same shape: dQ 0.0664 ms at 0, 0.0607 at 1, 0.0606 at 2).


def scores(k, q, c, *, tri, mask, causal, q0, k0, q_valid=0, k_valid=0, blocks=None, lo=0):
    """sᵀ = k (c q)ᵀ, (keys, queries), in log2 units (c = sm_scale · log2 e, as in the
    forward). tri: the static triangle key - column <= tri; mask: the causal mask by absolute
    positions (first query q0, first key k0) and the valid columns or rows of a ragged block,
    or with ``blocks`` (a window or segment ids) theirs, from column ``lo`` of the block."""
    qs = (q.astype(jnp.float32) * c).astype(q.dtype)
    s = lax.dot_general(k, qs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if mask and blocks is not None:
        return blocks.mask(s, lo)
    if tri is None and not mask:
        return s
    row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
    col = lax.broadcasted_iota(jnp.int32, s.shape, 1)
    if tri is not None:
        ok = row - col <= tri
    elif causal:
        ok = q0 + col >= k0 + row
    else:
        ok = jnp.ones(s.shape, jnp.bool_)
    if q_valid:
        ok = jnp.logical_and(ok, col < q_valid)
    if k_valid:
        ok = jnp.logical_and(ok, row < k_valid)
    return jnp.where(ok, s, MASK_VALUE)


def pipelined(parts, front, back):
    """``back(*strip, *front(*strip))`` for each strip, software-pipelined in program order:
    each strip's ``front`` (its two score-sized matmuls) is emitted ``_LAG`` strips ahead of its
    ``back`` (exp, the element-wise gradient and the accumulating matmuls), so that the MXU has
    the next strip's work while the VPU does this one's (as the forward does)."""
    pending = {}
    for t in range(len(parts) + _LAG):
        if t < len(parts):
            pending[t] = front(*parts[t])
        if t >= _LAG:
            back(*parts[t - _LAG], *pending.pop(t - _LAG))


def strips(bq, bkv, diagonal=None):
    """A (bkv keys, bq queries) block as column strips ``(lo, hi, rows, tri)``: queries
    [lo, hi) against keys [0, rows), masked by the static triangle ``key - column <= tri``
    (column counted from lo) where tri is not None. ``diagonal=D``: the causal block whose first
    query is D positions after its first key (key r visible to column c when r <= D + c);
    strips that see no key are left out, and each strip goes only as far as its last query
    sees. None: every key visible."""
    width = STRIP if bq % STRIP == 0 else bq
    out = []
    for lo in range(0, bq, width):
        hi = lo + width
        if diagonal is None:
            out.append((lo, hi, bkv, None))
            continue
        rows = min(bkv, diagonal + hi)
        if rows > 0:
            out.append((lo, hi, rows, diagonal + lo if rows - 1 > diagonal + lo else None))
    return out


def _diagonals(bq, bkv):
    """The offsets D (first query minus first key) of the blocks that straddle the causal
    diagonal when one block size divides the other (then D is a multiple of the smaller); None
    otherwise."""
    if (bq % bkv and bkv % bq) or min(bq, bkv) % 128:
        return None
    m = min(bq, bkv)
    return list(range(-(bq - m), bkv - 1, m))


def dispatch(body, *, causal, i, j, bq, bkv, tail, is_tail, blocks=None, masked=None):
    """Runs ``body(strips, mask=, tail=)`` where a block is needed: whole below the causal
    diagonal, as a staircase of static triangles on it (one branch per offset, when the block
    sizes divide one another), masked by position otherwise; the ragged last block along the
    reduced axis (static ``tail`` valid positions; 0: none) masked by position. With
    ``blocks`` (a window or segment ids): skipped where no query sees a key, whole where every
    query sees every key, masked otherwise; ``masked`` (with blocks): steps that run masked
    even where every query sees every key (the fused pass's ragged last KV block)."""
    whole = strips(bq, bkv)
    if not (causal or tail) and blocks is None:
        return body(whole)
    first_key, first_query = j * bkv, i * bq
    not_tail = jnp.logical_not(is_tail) if tail else jnp.bool_(True)
    if blocks is not None:
        run, full = blocks.run(), jnp.logical_and(blocks.whole(), not_tail)
        if masked is not None:
            full = jnp.logical_and(full, jnp.logical_not(masked))
        pl.when(jnp.logical_and(run, full))(lambda: body(whole))
        straddle = jnp.logical_and(jnp.logical_and(run, jnp.logical_not(full)), not_tail)
        pl.when(straddle)(lambda: body(whole, mask=True))
    elif causal:
        below = first_key + bkv - 1 <= first_query  # Every key visible to every query.
        run = first_key <= first_query + bq - 1  # Some key visible.
        pl.when(jnp.logical_and(below, not_tail))(lambda: body(whole))
        straddle = jnp.logical_and(jnp.logical_and(run, jnp.logical_not(below)), not_tail)
        diagonals = _diagonals(bq, bkv)
        if diagonals is None:
            pl.when(straddle)(lambda: body(whole, mask=True))
        else:  # Plain comparisons of program ids (see flash_attention._dispatch_diagonal).
            for d in diagonals:
                pl.when(jnp.logical_and(first_query == first_key + d, not_tail))(
                    functools.partial(body, strips(bq, bkv, d)))
    else:
        run = jnp.bool_(True)
        pl.when(not_tail)(lambda: body(whole))
    if tail:
        pl.when(jnp.logical_and(run, is_tail))(lambda: body(whole, mask=True, tail=tail))


def dispatch_kv_tail(body, *, causal, i, j, bq, bkv, q_tail, is_q_tail, kv_tail):
    """The fused pass's ragged last KV block (``kv_tail`` valid keys): every query block that
    sees one of its keys, masked by position (keys past kv_len never reach dQ), the ragged last
    query block (``q_tail``) also by its valid columns."""
    whole = strips(bq, bkv)
    run = j * bkv <= i * bq + bq - 1 if causal else jnp.bool_(True)
    if not q_tail:
        return pl.when(run)(lambda: body(whole, mask=True, kv_valid=kv_tail))
    pl.when(jnp.logical_and(run, jnp.logical_not(is_q_tail)))(
        lambda: body(whole, mask=True, kv_valid=kv_tail))
    pl.when(jnp.logical_and(run, is_q_tail))(
        lambda: body(whole, mask=True, tail=q_tail, kv_valid=kv_tail))

