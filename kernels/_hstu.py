"""What HSTU attention's forward (``hstu_attention``) and backward (``hstu_attention_bwd``)
share: the plain-JAX reference, the relative-bias table and how a block's Toeplitz bias is read
from it, and the block-size rule.

A module of its own so that the backward does not import the forward module, which imports the
backward for its gradient rule (no import circle).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["LANES", "bias_part", "bias_rows", "bias_slice", "bias_table", "blocks",
           "hstu_attention_reference", "relative_bias", "rotated", "table"]

LANES = 128
ROTATED_BYTES = 8 << 20  # VMEM for the resident rotated bias table (``rotated``), at most.


def hstu_attention_reference(q, k, v, rel_bias, *, alpha: float | None = None,
                             norm: float | None = None):
    """Plain-JAX HSTU attention with the same semantics (f32 scores, bf16-style P·V)."""
    s = q.shape[2]
    alpha = 1.0 / math.sqrt(q.shape[-1]) if alpha is None else alpha
    norm = 1.0 / s if norm is None else norm
    scores = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * alpha
    dist = jnp.arange(s)[:, None] - jnp.arange(s)[None, :]
    p = jax.nn.silu(scores + relative_bias(rel_bias, s))
    p = jnp.where(dist >= 0, p, 0.0)
    out = jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return (out * norm).astype(q.dtype)


def relative_bias(rel_bias, s: int):
    """The (s, s) Toeplitz bias B[q, k] = rel_bias[clip(q - k, 0, len - 1)], in f32, built
    from slices, a tile and a reshape: no gather. XLA:TPU runs a gather of that size slowly and
    compiles it slowly (libtpu's estimate of the reference at s = 512 spent 43 s compiling it
    and charged 2.8M cycles); the reference is XLA's candidate against the kernel, so it is
    written as plain XLA code runs best.

    With v[m] = rel_bias[clip(m - (s - 1), 0, len - 1)] (m < 2s - 1) and w = v reversed, row q
    is w[s - 1 - q : 2s - 1 - q]; w tiled and read in rows of 2s - 2 (one less than its
    period) shifts each row one step left."""
    r = rel_bias.astype(jnp.float32)
    n = r.shape[0]
    if s == 1:
        return r[:1].reshape(1, 1)
    v = jnp.concatenate([jnp.broadcast_to(r[0], (s - 1,)), r[:min(s, n)],
                         jnp.broadcast_to(r[n - 1], (max(0, s - n),))])
    period = 2 * s - 1
    flat = jnp.tile(v[::-1], s + 1)[s - 1:s - 1 + s * (period - 1)]
    return flat.reshape(s, period - 1)[:, :s]


def bias_rows(tab_ref, base, *, rows: int, cols: int):
    """The rotated table from which every part of a (rows, cols) bias block is sliced.

    The block is Toeplitz, B[r, c] = tab[base + c - r + rows], with ``base`` a multiple of 128
    or static (see ``table``). The slice L = tab[base : base + W] (W = roundup(rows + cols,
    128)) broadcast to R = 128 rows (all ``rows`` if not a multiple of 128), row ρ rotated by
    ρ - R, gives RW[ρ, m] = L[m - ρ + R], and rows kR .. kR + R of B are the lane-aligned
    slice RW[:, (K-1-k)R:][:, :cols] for K = rows / R (``bias_part``). One rotate per vreg
    of (R, W) for the whole block, not one per vreg of the block (at 2048 x 2048: 512 rotates
    instead of 4,352).
    """
    r = LANES if rows % LANES == 0 else rows
    width = pl.cdiv(rows + cols, LANES) * LANES
    line = tab_ref[:, pl.ds(base, width)]
    return pltpu.roll(jnp.broadcast_to(line, (r, width)), width - r, 1, stride=1, stride_axis=0)


def bias_part(wide, lo: int, hi: int, nrows: int, *, rows: int):
    """Rows [0, nrows) and columns [lo, hi) of the bias block of ``bias_rows``."""
    r = wide.shape[0]
    n = rows // r
    parts = [wide[:, (n - 1 - k) * r + lo:(n - 1 - k) * r + hi] for k in range(nrows // r)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def bias_slice(rot_ref, base, lo: int, hi: int, nrows: int, *, rows: int):
    """``bias_part`` loaded straight from the rotated table of ``rotated`` (rows a multiple of
    128): RW[:, m] = rot[:, base + m], so no rotate in the kernel and no block-wide value."""
    n = rows // LANES
    parts = [rot_ref[:, pl.ds(base + (n - 1 - k) * LANES + lo, hi - lo)]
             for k in range(nrows // LANES)]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def table(rel_bias, *, pad: int, length: int):
    """tab[x] = rel_bias[min(x - pad, nb - 1)] for x >= pad, else 0 (masked anyway): the
    score of key k for query q has bias tab[q - k + pad].

    Built from a broadcast and padding, not a gather: a gather of this size cost more than the
    whole kernel in the v6e estimate (81,551 cycles at 4096 tokens).
    """
    bias = rel_bias.astype(jnp.float32)
    nb = bias.shape[0]
    body = bias[:min(nb, length - pad)]
    rest = jnp.broadcast_to(bias[-1], (length - pad - body.shape[0],))
    return jnp.concatenate([jnp.zeros((pad,), jnp.float32), body, rest])[None, :]


def rotated(table):
    """rot[ρ, y] = tab[y - ρ + 128] (0 where y - ρ + 128 is past the end): the table of
    ``bias_rows`` rotated once for every block, (128, len) and resident in VMEM."""
    n = table.shape[1]
    # ext[i] = tab[i + 128] for -128 <= i < n - 128 (indices mod len(ext)), zero past the end;
    # row r of ext tiled and read with a row length one shorter than ext is ext[y - r], so
    # rot[r, y] = tab[y - r + 128]. No gather: a tile, a reshape and slices.
    ext = jnp.concatenate([table[0, LANES:], jnp.zeros((LANES,), table.dtype),
                           table[0, :LANES]])
    e = ext.shape[0]
    return jnp.tile(ext, LANES)[:LANES * (e - 1)].reshape(LANES, e - 1)[:, :n]


def blocks(seq: int, bq: int, bkv: int) -> tuple[int, int]:
    bq, bkv = min(bq, seq), min(bkv, seq)
    for name, b in (("bq", bq), ("bkv", bkv)):
        if b != seq and b % LANES:
            raise pt.InvalidConfig(f"{name}={b} must be a multiple of {LANES} or cover the "
                                   f"whole sequence ({seq})")
    return bq, bkv


def bias_table(rel_bias, *, seq: int, bq: int, bkv: int):
    """(table, pad, rotated) for blocks (bq, bkv) over ``seq`` rows, as both kernels read it.

    Bias slices start at q_start - k_start + lo - rows + pad: multiples of 128 when pad = bkv
    (mod 128), since blocks are multiples of 128 or cover the sequence (then their start is a
    static 0). Slices end before nq * bq + pad + 128. The table is rotated once outside the
    kernel and resident in VMEM where it fits (at 4096 tokens, 2048x2048, 8,321 fewer estimated
    cycles in the forward's kernel, 4,700 more outside it); else each step rotates its own
    slice (``bias_rows``). Not for one block per sequence: one rotation per (batch, head) costs
    less in the kernel (S=2048, 2048x2048: 77,269 cycles against 80,111).
    """
    nq, nk = pl.cdiv(seq, bq), pl.cdiv(seq, bkv)
    pad = pl.cdiv(bq + bkv, LANES) * LANES + bkv % LANES
    tab = table(rel_bias, pad=pad, length=pl.cdiv(nq * bq + pad + LANES, LANES) * LANES)
    rotate = bkv % LANES == 0 and nq * nk > 1 and LANES * tab.shape[1] * 4 <= ROTATED_BYTES
    return (rotated(tab) if rotate else tab), pad, rotate
