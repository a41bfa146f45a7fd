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
What the kernel does per step, from the v6e compiler's static profile
(benchmarks/profiles/hstu_profile.py, benchmarks/results/hstu_profile.txt):

- It works transposed, like flash_attention: sᵀ = k qᵀ (bkv, bq) and oᵀ += vᵀ pᵀ (hidden, bq),
  so at hidden dim 128 the 128 is the MXU's streamed side and the full pᵀ tile its weights.
- KV blocks wholly above the diagonal are skipped: no compute, and their index map repeats the
  last needed block, so no DMA either. Blocks wholly below it run unmasked. When bkv divides bq
  and the sequence, a block on the diagonal runs as a staircase of 256-column query strips,
  each against only the keys it can see, with a static triangle mask; the others (ragged
  sequences) mask by absolute positions. Blocks wholly below it run as 256-column strips too
  when bkv >= 1024.
- Software pipelining: strip n's q kᵀ is emitted with strip n-2's bias and SiLU and strip
  n-4's vᵀ pᵀ, so that the MXU has work while the VPU runs.
- alpha is applied to the (bq, d) query block, not to the scores; norm to the output.
- The bias block is Toeplitz (constant along diagonals). It is built once per step from a
  128-lane-aligned slice of the table, broadcast to 128 rows and rotated with a per-row stride
  (``pltpu.roll(..., stride=1)``); every 128-key chunk of every strip is then a lane-aligned
  slice of that one rotated array. No gather, and one rotate per vreg of a (128, bq + bkv)
  array rather than per vreg of the block. Where it fits in VMEM (``_hstu.ROTATED_BYTES``) the
  whole table is rotated once outside the kernel instead (``_hstu.bias_table``: a tile and a
  reshape)
  and stays resident: every bias part is then a lane-aligned load, with no rotates and no
  block-wide bias value to spill in the kernel.

Every sequence length is accepted: keys past the end of a ragged last block get zero weight
and their values are zeroed, so padding garbage cannot reach the output; queries past the end
are columns of their own, dropped on store.
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
from pallas_tune.kernels import _hstu
from pallas_tune.kernels._hstu import LANES as _LANES
from pallas_tune.kernels._hstu import hstu_attention_reference
from pallas_tune.kernels.hstu_attention_bwd import hstu_attention_bwd, hstu_attention_bwd_args

__all__ = ["hstu_attention", "hstu_attention_reference"]

_STRIP = 256  # Query columns per stair of a diagonal block (as in flash_attention).
_LAG = 2  # Software pipelining of ``update``'s parts (best of 0-3 by the v6e estimate).


def _kernel(tab_ref, q_ref, k_ref, v_ref, o_ref, acc_ref, *, bq, bkv, nq, nk, seq, pad, alpha,
            norm, rotated):
    """Works on transposed scores sᵀ = k qᵀ (bkv, bq) and accumulates oᵀ = vᵀ pᵀ (dv, bq).

    On the 256x256 MXU an attention dim of 128 fills half of it in q kᵀ whichever way round;
    in p v a hidden dim of 128 would be the output width, in vᵀ pᵀ it is the streamed side and
    the full pᵀ tile is the MXU's weights (benchmarks/results/attention_mxu_floor.txt).
    """
    i, j = pl.program_id(2), pl.program_id(3)
    # Static where one block covers the sequence (blocks that are not multiples of 128).
    q_start = i * bq if nq > 1 else 0
    k_start = j * bkv if nk > 1 else 0
    tail = seq % bkv if nk > 1 else 0

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def scores(lo=0, hi=bq, rows=bkv, **_):
        """sᵀ for the query columns [lo, hi) of the block against its first ``rows`` keys."""
        q = (q_ref[lo:hi, :].astype(jnp.float32) * alpha).astype(q_ref.dtype)
        return jax.lax.dot_general(k_ref[:rows, :], q, (((1,), (1,)), ((), ())),
                                   preferred_element_type=jnp.float32)  # (rows, hi - lo)

    def probs(s, wide, lo=0, hi=bq, rows=bkv, mask=False, diagonal=None, **_):
        """pᵀ = silu(sᵀ + biasᵀ) ⊙ mask in v's dtype.

        mask: causal and sequence-end mask by absolute positions; diagonal=a: a static triangle
        instead (key r visible to column lo + c when r <= a + c)."""
        s = s + wide(lo, hi, rows)
        # f32: sigmoid is one EUP op (and an add), as cheap as tanh; in bf16 it crashes
        # libtpu 0.0.50.1's LLO type check, and bf16 tanh was no faster by the estimate.
        p = s * jax.nn.sigmoid(s)
        if diagonal is not None:
            row = jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            col = jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            p = jnp.where(row - col <= diagonal, p, jnp.zeros_like(p))
        elif mask:
            k_pos = k_start + jax.lax.broadcasted_iota(jnp.int32, s.shape, 0)
            q_pos = q_start + lo + jax.lax.broadcasted_iota(jnp.int32, s.shape, 1)
            p = jnp.where((q_pos >= k_pos) & (k_pos < seq), p, jnp.zeros_like(p))
        return p.astype(v_ref.dtype)

    def update(*parts):
        """acc[:, cols] += vᵀ pᵀ for each part (``probs``' keywords; disjoint columns), emitted
        software-pipelined so that the MXU has other parts' work while the VPU does one's."""
        parts = parts or ({},)
        v = v_ref[...]
        if tail and any(part.get("mask") for part in parts):
            row = k_start + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
            v = jnp.where(row < seq, v, jnp.zeros_like(v))  # Padding rows may hold NaN.
        vt = v.T
        # The bias of the whole block, once (q_start - k_start is static on the diagonal).
        off = parts[0].get("off", q_start - k_start)
        base = off - bkv + pad
        base = base if isinstance(base, int) else pl.multiple_of(base, _LANES)
        if rotated:  # tab_ref holds the rotated table: slices of it are the block's bias.
            wide = functools.partial(_hstu.bias_slice, tab_ref, base, rows=bkv)
        else:
            wide = functools.partial(_hstu.bias_part,
                                     _hstu.bias_rows(tab_ref, base, rows=bkv, cols=bq), rows=bkv)
        ss, ps = {}, {}
        for n in range(len(parts) + 2 * _LAG):  # Part n's q kᵀ, n - LAG's SiLU, n - 2 LAG's vᵀ pᵀ.
            if n < len(parts):
                ss[n] = scores(**parts[n])
            if 0 <= n - _LAG < len(parts):
                ps[n - _LAG] = probs(ss.pop(n - _LAG), wide, **parts[n - _LAG])
            if 0 <= n - 2 * _LAG < len(parts):
                part = parts[n - 2 * _LAG]
                cols = pl.ds(part.get("lo", 0), part.get("hi", bq) - part.get("lo", 0))
                acc_ref[:, cols] += jnp.dot(vt[:, :part.get("rows", bkv)], ps.pop(n - 2 * _LAG),
                                            preferred_element_type=jnp.float32)

    # Branch conditions are plain comparisons of products: libtpu's static estimate follows
    # them per grid step, but with a floor division in them it charged every step with the
    # branch of step 0 (benchmarks/results/hstu_profile.txt).
    if bq % bkv == 0 and bkv % _LANES == 0 and not tail:
        # Wholly below the diagonal: for bkv >= 1024, 256-column strips software-pipelined like
        # the staircase's (v6e estimate, 2048x2048: S=4096 149,096 cycles against 151,109 as
        # one part; at 2048x256 they cost 10% more: benchmarks/results/hstu_profile.txt).
        strips = [{"lo": c, "hi": c + _STRIP} for c in range(0, bq, _STRIP)]
        _when(k_start + bkv <= q_start, functools.partial(
            update, *(strips if bq % _STRIP == 0 and bkv >= 1024 else [])))
        for start in range(0, bq, bkv):
            _when(k_start == q_start + start,
                  functools.partial(_staircase, update, start, bq=bq, bkv=bkv))
    else:
        below = k_start + bkv - 1 <= q_start  # Every key of the block precedes every query.
        inside = k_start + bkv <= seq
        needed = k_start <= q_start + bq - 1  # Some key is at or before some query.
        whole = jnp.logical_and(below, inside)
        pl.when(whole)(update)
        pl.when(jnp.logical_and(needed, jnp.logical_not(whole)))(
            functools.partial(update, dict(mask=True)))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] * norm).T.astype(o_ref.dtype)


def _when(condition, body):
    """pl.when that also takes a static condition (one block covering the sequence)."""
    if isinstance(condition, bool):
        if condition:
            body()
    else:
        pl.when(condition)(body)


def _staircase(update, lo, *, bq, bkv):
    """A KV block whose first key is query column ``lo``: the diagonal square as column strips,
    each against only the keys up to its last query (static triangle masks), then the columns
    past the square whole."""
    width = math.gcd(bkv, _STRIP)
    parts = [dict(lo=lo + a, hi=lo + a + width, rows=a + width, diagonal=a, off=-lo)
             for a in range(0, bkv, width)]
    if lo + bkv < bq:
        parts.append(dict(lo=lo + bkv, off=-lo))
    update(*parts)


def _standin(args, kwargs, config):
    """Fewer (batch, head) rows, identical work each, same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v, rel_bias = args
    b, h, s, _ = q.shape
    bq, bkv = _hstu.blocks(s, config["bq"], config["bkv"])
    (nb, nh), scale = shrink_parallel([b, h], pl.cdiv(s, bq) * pl.cdiv(s, bkv))
    shape = lambda x: jax.ShapeDtypeStruct((nb, nh, s, x.shape[-1]), x.dtype)  # noqa: E731
    return [shape(q), shape(k), shape(v), rel_bias], kwargs, scale


# Its gradient is hstu_attention_bwd's two Pallas passes (dK/dV with the bias table's gradient,
# then dQ), a tunable kernel of its own resolved when the gradient is traced.
@pt.tunable(space="hstu_attention", reference=hstu_attention_reference, standin=_standin,
            backward=hstu_attention_bwd, backward_args=hstu_attention_bwd_args,
            partition="b h S D, b h S D, b h S E, R -> b h S E")  # Sharded jit: batch, heads.
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
    bq, bkv = _hstu.blocks(s, bq, bkv)
    nq, nk = pl.cdiv(s, bq), pl.cdiv(s, bkv)
    table, pad, rotated = _hstu.bias_table(rel_bias, seq=s, bq=bq, bkv=bkv)

    def kv_index(bi, hi, i, j):
        last = (i * bq + bq - 1) // bkv  # Repeat the last needed block: no DMA when skipped.
        return (bi, hi, jnp.minimum(j, last), 0)

    kernel = functools.partial(_kernel, bq=bq, bkv=bkv, nq=nq, nk=nk, seq=s, pad=pad,
                               alpha=alpha, norm=norm, rotated=rotated)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(v.shape[:3] + (v.shape[-1],), q.dtype),
        grid=(b, h, nq, nk),
        in_specs=[
            pl.BlockSpec(table.shape, lambda bi, hi, i, j: (0, 0),
                         pipeline_mode=pl.Buffered(1)),  # Fetched once: one buffer.
            pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0)),
            pl.BlockSpec((None, None, bkv, d), kv_index),
            pl.BlockSpec((None, None, bkv, v.shape[-1]), kv_index),
        ],
        out_specs=pl.BlockSpec((None, None, bq, v.shape[-1]), lambda bi, hi, i, j: (bi, hi, i, 0)),
        scratch_shapes=[pltpu.VMEM((v.shape[-1], bq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"hstu_attention_{bq}x{bkv}",
    )(table, q, k, v)

