"""HSTU pointwise attention forward for TPU: SiLU instead of softmax, relative position bias, causal.

The attention of HSTU (Zhai et al., "Actions Speak Louder than Words", 2024; Meta's
generative-recommenders) for q, k: (batch, heads, seq, attn_dim) and v: (batch, heads, seq,
hidden_dim)::

    out = (silu(alpha · q kᵀ + rab) ⊙ causal) v · norm,   rab[i, j] = rel_bias[min(i - j, nb - 1)]

with ``rel_bias`` a learned table of ``nb`` buckets shared by all heads (HSTU's relative
position bias; distances past the table use its last bucket), ``alpha`` default 1/√attn_dim and
``norm`` default 1/seq (HSTU divides by the sequence length).

There is no softmax, so no running max or denominator: each KV block adds its (SiLU ⊙ mask) V to
an f32 accumulator. Grid (batch, heads, q blocks, kv blocks), the KV axis last and "arbitrary".
What the kernel does per step, from the v6e compiler's static profile (see
benchmarks/results/model_shapes.md):

- KV blocks wholly above the diagonal are skipped: no compute, and their index map repeats the
  last needed block, so no DMA either.
- Only blocks that cross the diagonal or the end of the sequence build a mask; blocks wholly
  below the diagonal run unmasked (two code paths chosen per step with ``pl.when``).
- alpha is applied to the (bq, d) query block, not to the (bq, bkv) scores; norm to the output.
- The bias block is a Toeplitz matrix (constant along diagonals). It is built in VMEM from a
  slice of the table, 128 query rows at a time: the row slice is broadcast and rotated with a
  per-row stride (``pltpu.roll(..., stride=1)``), one vector rotate per register, instead of a
  gather. The table is laid out in the wrapper so every slice starts on a 128-lane boundary.

Every sequence length is accepted: rows past the end of a ragged last block are masked (their
keys get zero weight and their values are zeroed, so padding garbage cannot reach the output).
Block sizes must be multiples of 128 or cover the whole sequence; larger ones are clamped.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["hstu_attention", "hstu_attention_reference"]

_LANES = 128


def hstu_attention_reference(q, k, v, rel_bias, *, alpha: float | None = None,
                             norm: float | None = None):
    """Plain-JAX HSTU attention with the same semantics (f32 scores, bf16-style P·V)."""
    s = q.shape[2]
    alpha = 1.0 / math.sqrt(q.shape[-1]) if alpha is None else alpha
    norm = 1.0 / s if norm is None else norm
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * alpha
    dist = jnp.arange(s)[:, None] - jnp.arange(s)[None, :]
    rab = rel_bias.astype(jnp.float32)[jnp.clip(dist, 0, rel_bias.shape[0] - 1)]
    p = jax.nn.silu(scores + rab)
    p = jnp.where(dist >= 0, p, 0.0)
    out = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out * norm).astype(q.dtype)


def _bias_block(tab_ref, start, *, bq, bkv):
    """The (bq, bkv) Toeplitz bias block whose reversed-table slice starts at lane ``start``.

    Built 128 query rows at a time (or all bq if fewer or odd): each row slice is broadcast and
    rotated with a per-row stride. Slices are ``width`` = roundup(rows + bkv - 1, 128) lanes and
    start at multiples of 128 (the wrapper lays the table out so), so no lane shifts are needed
    to load them.
    """
    rows = _LANES if bq % _LANES == 0 else bq
    width = pl.cdiv(rows + bkv - 1, _LANES) * _LANES
    parts = []
    for r0 in range(0, bq, rows):
        first = pl.multiple_of(start + bq - r0 - rows, _LANES)
        line = tab_ref[:, pl.ds(first, width)]
        grid = jnp.broadcast_to(line, (rows, width))
        # Row r is rotated right by (width - rows + 1 + r): t[r, c] = line[c - r + rows - 1]
        # (no wrap-around: 0 <= c - r + rows - 1 < width).
        parts.append(pltpu.roll(grid, width - rows + 1, 1, stride=1, stride_axis=0)[:, :bkv])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _kernel(tab_ref, q_ref, k_ref, v_ref, o_ref, acc_ref, *, bq, bkv, nq, seq, alpha, norm):
    i, j = pl.program_id(2), pl.program_id(3)
    q_start, k_start = i * bq, j * bkv
    tile_start = (nq - 1 - i) * bq + k_start  # Table slice of the whole (bq, bkv) block.

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def update(r0: int, nr: int, nc: int, masked: bool):
        """acc[r0:r0+nr] += (silu(alpha q kᵀ + rab) ⊙ mask) v over the block's first nc keys."""
        q = (q_ref[r0:r0 + nr, :].astype(jnp.float32) * alpha).astype(q_ref.dtype)
        k, v = k_ref[:nc, :], v_ref[:nc, :]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
        s = s + _bias_block(tab_ref, tile_start + bq - nr - r0, bq=nr, bkv=nc)
        p = s * jax.nn.sigmoid(s)
        if masked:
            q_pos = q_start + r0 + jax.lax.broadcasted_iota(jnp.int32, (nr, nc), 0)
            k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, (nr, nc), 1)
            p = jnp.where((q_pos >= k_pos) & (k_pos < seq), p, 0.0)
            row = k_start + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
            v = jnp.where(row < seq, v, jnp.zeros_like(v))  # Padding rows may hold NaN.
        acc_ref[r0:r0 + nr, :] += jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    below = k_start + bkv - 1 <= q_start  # Every key of the block precedes every query.
    inside = k_start + bkv <= seq
    needed = k_start <= q_start + bq - 1  # Some key is at or before some query.
    pl.when(below & inside)(lambda: update(0, bq, bkv, False))
    half = bq // 2
    if bq == bkv and half >= _LANES and half % _LANES == 0:
        # A diagonal block: its first half of queries sees only the first half of keys (a
        # quarter of the block's MXU work saved; -25% on the 2048-token blocks' estimate).
        diagonal = (i == j) & inside

        @pl.when(diagonal)
        def _diagonal():
            update(0, half, half, True)
            update(half, half, bkv, True)

        rest = needed & jnp.logical_not(below & inside) & jnp.logical_not(diagonal)
    else:
        rest = needed & jnp.logical_not(below & inside)
    pl.when(rest)(lambda: update(0, bq, bkv, True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] * norm).astype(o_ref.dtype)


def _reversed_table(rel_bias, *, dmax: int, length: int):
    """ext[m] = rel_bias[min(dmax - m, nb - 1)] for dmax - m >= 0, else 0 (masked anyway).

    Built from a flip, a broadcast and padding, not a gather: a gather of this size cost more
    than the whole kernel in the v6e estimate (81,551 cycles at 4096 tokens).
    """
    bias = rel_bias.astype(jnp.float32)
    nb = bias.shape[0]
    clamped = max(0, dmax - nb + 1)  # Distances dmax .. nb-1 use the last bucket.
    table = jnp.concatenate([jnp.broadcast_to(bias[-1], (clamped,)),
                             jnp.flip(bias[:min(nb, dmax + 1)])])
    return jnp.pad(table, (0, length - table.shape[0]))[None, :]


def _blocks(seq: int, bq: int, bkv: int) -> tuple[int, int]:
    bq, bkv = min(bq, seq), min(bkv, seq)
    for name, b in (("bq", bq), ("bkv", bkv)):
        if b != seq and b % _LANES:
            raise pt.InvalidConfig(f"{name}={b} must be a multiple of {_LANES} or cover the "
                                   f"whole sequence ({seq})")
    return bq, bkv


def _standin(args, kwargs, config):
    """Fewer (batch, head) rows, identical work each, same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v, rel_bias = args
    b, h, s, _ = q.shape
    bq, bkv = _blocks(s, config["bq"], config["bkv"])
    (nb, nh), scale = shrink_parallel([b, h], pl.cdiv(s, bq) * pl.cdiv(s, bkv))
    shape = lambda x: jax.ShapeDtypeStruct((nb, nh, s, x.shape[-1]), x.dtype)  # noqa: E731
    return [shape(q), shape(k), shape(v), rel_bias], kwargs, scale


@pt.tunable(space="hstu_attention", reference=hstu_attention_reference, standin=_standin)
def hstu_attention(q, k, v, rel_bias, *, alpha: float | None = None, norm: float | None = None,
                   bq: int, bkv: int):
    """Causal HSTU attention; see the module docstring. ``rel_bias``: (num_buckets,), any float.

    Raises:
      ValueError: mismatched shapes or an empty bias table.
    """
    b, h, s, d = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape} (q and k "
                         "must be equal; v must share batch, heads and sequence)")
    if rel_bias.ndim != 1 or rel_bias.shape[0] < 1:
        raise ValueError(f"rel_bias must be a non-empty 1-D table, got shape {rel_bias.shape}")
    alpha = 1.0 / math.sqrt(d) if alpha is None else float(alpha)
    norm = 1.0 / s if norm is None else float(norm)
    bq, bkv = _blocks(s, bq, bkv)
    nq, nk = pl.cdiv(s, bq), pl.cdiv(s, bkv)
    # Table slices start at (nq-1-i)*bq + j*bkv + (bq - r0 - rows) for row chunks r0 of 128
    # (or of the whole block when it is one odd-sized tile): multiples of 128, because blocks
    # are multiples of 128 or single tiles (i = 0 or j = 0).
    rows = _LANES if bq % _LANES == 0 else bq
    width = pl.cdiv(rows + bkv - 1, _LANES) * _LANES
    length = (nq - 1) * bq + (nk - 1) * bkv + bq - rows + width
    table = _reversed_table(rel_bias, dmax=nq * bq - 1, length=length)

    def kv_index(bi, hi, i, j):
        last = (i * bq + bq - 1) // bkv  # Repeat the last needed block: no DMA when skipped.
        return (bi, hi, jnp.minimum(j, last), 0)

    kernel = functools.partial(_kernel, bq=bq, bkv=bkv, nq=nq, seq=s, alpha=alpha, norm=norm)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(v.shape[:3] + (v.shape[-1],), q.dtype),
        grid=(b, h, nq, nk),
        in_specs=[
            pl.BlockSpec((1, length), lambda bi, hi, i, j: (0, 0)),
            pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0)),
            pl.BlockSpec((None, None, bkv, d), kv_index),
            pl.BlockSpec((None, None, bkv, v.shape[-1]), kv_index),
        ],
        out_specs=pl.BlockSpec((None, None, bq, v.shape[-1]), lambda bi, hi, i, j: (bi, hi, i, 0)),
        scratch_shapes=[pltpu.VMEM((bq, v.shape[-1]), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"hstu_attention_{bq}x{bkv}",
    )(table, q, k, v)

