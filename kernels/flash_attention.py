"""Flash attention forward for TPU: online softmax over KV blocks, GQA, causal block skipping.

q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim) with q_heads a
multiple of kv_heads (grouped-query attention). Grid (batch, q_heads, cdiv(q_len, bq),
cdiv(kv_len, bkv)), the KV axis last and "arbitrary". The kernel works transposed (see
``_kernel``): the running max is a (1, bq) row and the accumulator (head_dim + 8, bq) holds oᵀ
with the softmax denominator in its extra rows, all in f32 VMEM scratch. With ``causal=True``
(queries and keys aligned at position 0), KV blocks entirely above the diagonal are skipped: no
compute, and their index map repeats the last needed block, so no DMA; a block on the diagonal
runs as a staircase of query strips, each against only the keys it can see, and (q_len <=
kv_len) each strip writes its output at once: no later key is visible to its queries. Whole
blocks run as column strips too; the strips are software-pipelined in program order.

Any q_len and kv_len: a ragged last query block computes rows that are dropped on store (each row
is independent, so nothing leaks into valid rows); when no bkv divides kv_len, the last KV step
gives the keys past kv_len the mask value and zeroes the values past it (``0 * NaN`` would
poison the sum). That masking is emitted only for ragged kv_len, so shapes that divide compile to
the same program as without it.

Sliding-window (``local_window_size``) and document (``segment_ids``) masks (``_masks``): block
pairs no query sees are skipped, with no compute and, where the index map can tell, no DMA (a
window's by program ids; segment ids' by each block's range of ids, from SMEM tables); pairs
every query sees whole run unmasked and the rest are masked by position and id; a query that
sees no key gives 0. That path is a pallas_call of its own (``flash_attention_masked_*``): the
calls without masks lower to the programs they always did.

Differentiable (``jax.grad``, ``jax.vjp``, under ``jit``, ``checkpoint`` and ``vmap``) through a
custom VJP: when differentiated, the forward also writes each query row's log-sum-exp (a second
output of the same kernel), and the gradient is ``flash_attention_bwd.flash_attention_bwd``, a
tunable kernel of its own whose blocks are resolved from the cache when the gradient is traced.
Without differentiation the program is the one it was before (same lowering, same cache entries).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _masks, _ragged
from pallas_tune.kernels._attention import DTYPES, check_qkv, flash_attention_reference
from pallas_tune.kernels._attention import MASK_VALUE as _MASK_VALUE
from pallas_tune.kernels._masks import SegmentIds
from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd, flash_attention_bwd_args

__all__ = ["DTYPES", "SegmentIds", "flash_attention", "flash_attention_reference"]

_STRIP = 256  # Query columns per stair of the diagonal staircase (best of 128-1024 by the
#                v6e estimate at S=2048: 197,002 cycles against 209,066 / 217,930 / 245,898).
_LAG = 5  # Parts between a part's q kᵀ and its softmax in program order (best of 0-6 by the
#           v6e estimate at S=2048/4096/8192, causal, 2048x2048; see flash_profile.txt).
_SUM_ROWS = 8  # Rows of ones below vᵀ: the MXU sums pᵀ (one sublane tile).


# The public entry; registered as a tunable kernel (search_spaces/flash_attention.toml) at the end
# of the file, once its reference and stand-in exist.
def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    local_window_size: int | tuple[int, int] | None = None,
                    segment_ids: SegmentIds | None = None, bq: int, bkv: int):
    """softmax(q kᵀ · sm_scale) v per head; ``sm_scale=None`` means 1/√head_dim.

    Any sequence lengths and head dim; float32 or bfloat16 (one dtype for q, k and v). Block
    sizes larger than a sequence are clamped to it. ``local_window_size=(left, right)``: the
    query at position i sees the keys i - left to i + right (an int w: (w, w); with
    ``causal=True`` at most i), as in ``jax.nn.dot_product_attention``. ``segment_ids=
    SegmentIds(q, kv)``, integer arrays (batch, q_len) and (batch, kv_len): a query sees only
    the keys with its id (packed documents). A query that sees no key gives 0.

    Raises:
      ValueError: the shapes do not match (see the module docstring), q_heads is not a multiple
        of kv_heads, the dtypes are not one of float32 and bfloat16, or the window or segment
        ids are malformed.
    """
    check_qkv("flash_attention", q, k, v)
    masks = _masks.masks_of(q, k, causal=causal, local_window_size=local_window_size,
                            segment_ids=segment_ids)
    return _forward(q, k, v, causal=causal, sm_scale=sm_scale, bq=bq, bkv=bkv, masks=masks,
                    segment_ids=segment_ids)


# Differentiable through the tunable contract (FlashAttention-2): when differentiated, the same
# forward kernel also saves the log-sum-exp of each query row (``_residuals``), and the backward
# is the tunable ``flash_attention_bwd``, called with no block sizes so that its own are
# resolved from the cache when the gradient is traced (see ``backward=`` below). Without
# differentiation the forward is the one pallas_call below, unchanged (same cache entries).
def _residuals(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
               local_window_size=None, segment_ids=None, bq: int, bkv: int):
    check_qkv("flash_attention", q, k, v)
    masks = _masks.masks_of(q, k, causal=causal, local_window_size=local_window_size,
                            segment_ids=segment_ids)
    o, lse = _forward(q, k, v, causal=causal, sm_scale=sm_scale, bq=bq, bkv=bkv, lse=True,
                      masks=masks, segment_ids=segment_ids)
    return o, (q, k, v, o, lse)


def _forward(q, k, v, *, causal, sm_scale, bq, bkv, lse=False, masks=None, segment_ids=None):
    """The forward pallas_call: o, and with ``lse=True`` also the log-sum-exp of each query
    row's scaled scores, (batch, q_heads, q_len) float32."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bkv = min(bq, sq), min(bkv, sk)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    if masks is not None:
        return _forward_masked(q, k, v, masks, segment_ids, scale=scale, bq=bq, bkv=bkv, lse=lse)
    nk = pl.cdiv(sk, bkv)

    if causal:
        def kv_index(bi, h, i, j):
            last = (i * bq + bq - 1) // bkv  # Repeat the last needed block: no DMA when skipped.
            return (bi, h // group, jnp.minimum(j, last), 0)
    else:
        def kv_index(bi, h, i, j):
            return (bi, h // group, j, 0)

    # Causal with bkv dividing bq: every query column is complete after its strip of the
    # diagonal block (no later key is visible to it), so the strip writes its output there.
    # Only when every query block has a diagonal block (q_len <= kv_len).
    early = causal and _staircase_ok(bq, bkv, sk % bkv) and sq <= sk
    kernel = functools.partial(_kernel, sm_scale=scale, causal=causal, bq=bq, bkv=bkv,
                               kv_tail=sk % bkv, early=early, lse=lse)
    out_shape, out_specs = _outputs(q, bq, lse)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(b, hq, pl.cdiv(sq, bq), nk),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j: (bi, h, i, 0)),
            pl.BlockSpec((None, None, bkv, d), kv_index),
            pl.BlockSpec((None, None, bkv, d), kv_index),
        ],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((1, bq), jnp.float32),
            pltpu.VMEM((d + _SUM_ROWS, bq), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"flash_attention{'_lse' if lse else ''}_{bq}x{bkv}",
    )(q, k, v)
    return (out[0], out[1].reshape(b, hq, sq)) if lse else out


def _outputs(q, bq, lse):
    """The forward's out_shape and out_specs: o, and with ``lse`` its (1, bq) row per block,
    as the kernel holds its softmax statistics."""
    b, hq, sq, d = q.shape
    out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    out_specs = pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j, *_: (bi, h, i, 0))
    if lse:
        out_shape = [out_shape, jax.ShapeDtypeStruct((b, hq, 1, sq), jnp.float32)]
        out_specs = [out_specs,
                     pl.BlockSpec((None, None, 1, bq), lambda bi, h, i, j, *_: (bi, h, 0, i))]
    return out_shape, out_specs


def _forward_masked(q, k, v, masks, segment_ids, *, scale, bq, bkv, lse):
    """The forward with a window or segment ids (``_masks``): the same kernel, on the pairs of
    blocks some query sees (a skipped step's KV index repeats a needed block: no DMA)."""
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv

    def kv_block(bi, h, i, j, *t):
        return bi, _masks.kv_clamp(masks, bq, bkv, bi, i, j, t)

    def kv_index(bi, h, i, j, *t):
        return bi, h // group, kv_block(bi, h, i, j, *t)[1], 0

    out_shape, out_specs = _outputs(q, bq, lse)
    kernel = functools.partial(_kernel, sm_scale=scale, causal=False, bq=bq, bkv=bkv,
                               kv_tail=sk % bkv, early=False, lse=lse)
    out = _masks.pallas_call(
        kernel, masks, segment_ids, (0, 2, 3), per="q",
        grid=(b, hq, pl.cdiv(sq, bq), pl.cdiv(sk, bkv)),
        in_specs=[pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j, *_: (bi, h, i, 0)),
                  pl.BlockSpec((None, None, bkv, d), kv_index),
                  pl.BlockSpec((None, None, bkv, d), kv_index)],
        operands=[q, k, v], q_block=lambda bi, h, i, j, *_: (bi, i), kv_block=kv_block,
        out_shape=out_shape, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((1, bq), jnp.float32),
                        pltpu.VMEM((d + _SUM_ROWS, bq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"flash_attention_masked{'_lse' if lse else ''}_{bq}x{bkv}")
    return (out[0], out[1].reshape(b, hq, sq)) if lse else out


def _kernel(q_ref, k_ref, v_ref, o_ref, *refs, sm_scale, causal, bq, bkv, kv_tail, early,
            lse, blocks=None):
    """Works on transposed scores, sᵀ = k qᵀ (bkv, bq), and a transposed accumulator oᵀ (d, bq).

    On a 256x256 MXU a head_dim of 128 fills half of it in q kᵀ whichever way round; but in
    p v the 128 would be the output width, and vᵀ pᵀ makes it the streamed side instead, with
    the full (bkv, bq) pᵀ as the weights. The softmax statistics are then per column: their
    reductions run down sublanes (element-wise across vregs), not across lanes.
    """
    lse_ref, m_ref, acc_ref = refs if lse else (None, *refs)
    i, j = pl.program_id(2), pl.program_id(3)
    # exp(scale * (s - m)) as exp2(s' - m') with s' = (c q) kᵀ: the scale and exp's own
    # log2(e) multiply the (bq, d) query block once, not each of the (bkv, bq) scores.
    c = sm_scale * math.log2(math.e)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, _MASK_VALUE)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def scores(mask=False, tail=0, lo=0, hi=bq, rows=bkv, diagonal=None, last=False,
               masked=False):
        """sᵀ for the queries in columns [lo, hi) of this block against its first ``rows``
        keys (static bounds: the queries outside see none of the others).

        mask: apply the causal mask by absolute positions (a block that straddles the
        diagonal); diagonal=a: a static triangle instead, key r visible to column lo + c when
        r <= a + c (the keys start at query lo - a); tail: valid keys of a ragged last block;
        last: ignored here (``update`` writes these columns' output after this step);
        masked: what the window and segment ids hide (``blocks``) is -inf."""
        q = (q_ref[lo:hi, :].astype(jnp.float32) * c).astype(q_ref.dtype)
        s = lax.dot_general(k_ref[:rows, :], q, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)  # (rows, hi - lo)
        if diagonal is not None:
            row = lax.broadcasted_iota(jnp.int32, s.shape, 0)
            col = lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(row - col <= diagonal, s, _MASK_VALUE)
        elif mask:
            k_pos = j * bkv + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(q_pos >= k_pos, s, _MASK_VALUE)
        if tail:
            s = _ragged.fill_tail(s, tail, axis=0, value=_MASK_VALUE)
        return blocks.mask(s, lo) if masked else s

    def update(*parts):
        """One online-softmax step for each part (``scores``' keywords; disjoint columns); a
        whole unmasked block is cut into column strips of ``_STRIP`` queries. Software-
        pipelined in program order: each part's q kᵀ is emitted ``_LAG`` parts ahead of its
        softmax and p v, so that the MXU has the next parts' work while the VPU does this
        one's softmax (libtpu's scheduler keeps much of the program order)."""
        if not parts and bq % _STRIP == 0:
            parts = tuple(dict(lo=a, hi=a + _STRIP) for a in range(0, bq, _STRIP))
        parts = parts or ({},)
        tail = parts[0].get("tail", 0)
        v = v_ref[...]
        if tail:  # p is 0 there, but 0 * NaN is not: zero the values read past kv_len.
            v = _ragged.fill_tail(v, tail, axis=0)
        # [vᵀ; 1] pᵀ: the rows below vᵀ are ones, so the MXU also sums pᵀ over keys (the
        # softmax denominator) in f32, instead of the VPU widening and adding every p.
        lhs = jnp.concatenate([v.T, jnp.ones((_SUM_ROWS, v.shape[0]), v.dtype)], axis=0)

        def softmax_pv(s, lo=0, hi=bq, rows=bkv, last=False, **_):
            cols = pl.ds(lo, hi - lo)
            m_prev = m_ref[:, cols]
            m_new = jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True))
            m_ref[:, cols] = m_new
            # The exponent in f32, then p rounded to the MXU's input dtype. On bf16 inputs
            # this is also the faster form by the v6e estimate (S=2048, causal, 2048²: 177,930
            # cycles against 197,002 for exp2 of a bf16 argument), and the more exact one.
            p = jnp.exp2(s - m_new).astype(v_ref.dtype)
            pv = jnp.dot(lhs[:, :rows], p,
                         preferred_element_type=jnp.float32)  # (d + _SUM_ROWS, hi - lo)
            acc = acc_ref[:, cols] * jnp.exp2(m_prev - m_new) + pv
            if last:  # No later key for these queries: write their output now.
                write_out(acc, lo, hi)
            else:
                acc_ref[:, cols] = acc

        ss = {}
        for t in range(len(parts) + _LAG):
            if t < len(parts):
                ss[t] = scores(**parts[t])
            if t >= _LAG:
                softmax_pv(ss.pop(t - _LAG), **parts[t - _LAG])

    write_out = functools.partial(_write_out, o_ref, lse_ref, m_ref, none_seen=blocks is not None)

    # Every query row sees a valid key in KV block 0 (key 0), so l > 0 at the end, even in rows
    # dropped on store. Causal: blocks above the diagonal are skipped, below it need no mask.
    if blocks is not None:  # A window or segment ids: l may be 0 (``none_seen``).
        _dispatch_masked(update, blocks, bq=bq, kv_tail=kv_tail)
    elif not (causal or kv_tail):
        update()
    else:
        _dispatch(update, i, j, causal=causal, bq=bq, bkv=bkv, kv_tail=kv_tail, early=early)

    if not early:
        pl.when(j == pl.num_programs(3) - 1)(lambda: write_out(acc_ref[...], 0, bq))


def _write_out(o_ref, lse_ref, m_ref, acc, lo, hi, *, none_seen):
    """o for query rows [lo, hi) from their accumulator oᵀ (with the sums below it), and
    their lse. none_seen: a row may have summed nothing (l = 0): its o is 0, its lse -inf."""
    d = o_ref.shape[-1]
    if none_seen:
        total = acc[d:d + 1, :]
        o = acc[:d, :] * jnp.where(total > 0, 1.0 / total, 0.0)
    else:
        o = acc[:d, :] * (1.0 / acc[d:d + 1, :])
    o_ref[lo:hi, :] = o.T.astype(o_ref.dtype)
    if lse_ref is not None:  # m and the sum are in log2 units of the scaled scores.
        lse_ref[:, lo:hi] = (m_ref[:, lo:hi] + jnp.log2(acc[d:d + 1, :])) * math.log(2.0)


def _dispatch_masked(update, blocks, *, bq, kv_tail):
    """With a window or segment ids: a pair of blocks no query sees is skipped, a pair every
    query sees whole runs unmasked (in strips, as without masks), the rest is masked by
    position and id (``Blocks.mask``), the ragged last KV block also by ``tail``."""
    run, whole = blocks.run(), blocks.whole()
    last = blocks.j == pl.num_programs(3) - 1
    if kv_tail:
        whole = jnp.logical_and(whole, jnp.logical_not(last))
    pl.when(jnp.logical_and(run, whole))(update)
    strips = range(0, bq, _STRIP) if bq % _STRIP == 0 else [None]

    def masked(tail):
        return [dict(masked=True, tail=tail, **({} if a is None else dict(lo=a, hi=a + _STRIP)))
                for a in strips]

    straddle = jnp.logical_and(run, jnp.logical_not(whole))
    if kv_tail:
        pl.when(jnp.logical_and(straddle, jnp.logical_not(last)))(
            functools.partial(update, *masked(0)))
        pl.when(jnp.logical_and(run, last))(functools.partial(update, *masked(kv_tail)))
    else:
        pl.when(straddle)(functools.partial(update, *masked(0)))


def _staircase_ok(bq, bkv, kv_tail):
    return bq % bkv == 0 and bkv % 128 == 0 and not kv_tail


def _dispatch(update, i, j, *, causal, bq, bkv, kv_tail, early):
    """Runs ``update`` on the blocks that need it, masked only where a mask changes something."""
    if causal and _staircase_ok(bq, bkv, kv_tail):
        return _dispatch_diagonal(update, i, j, bq=bq, bkv=bkv, early=early)
    true, false = jnp.bool_(True), jnp.bool_(False)
    run = j * bkv <= i * bq + bq - 1 if causal else true  # Skip blocks above the diagonal.
    below = j * bkv + bkv - 1 <= i * bq if causal else true  # Wholly below it: no mask.
    last = j == pl.num_programs(3) - 1 if kv_tail else false
    body = jnp.logical_and(run, jnp.logical_not(last))
    pl.when(jnp.logical_and(body, below))(update)
    if causal:
        pl.when(jnp.logical_and(body, jnp.logical_not(below)))(
            functools.partial(update, dict(mask=True)))
    if kv_tail:
        pl.when(jnp.logical_and(run, last))(functools.partial(update, dict(mask=causal,
                                                                        tail=kv_tail)))


def _dispatch_diagonal(update, i, j, *, bq, bkv, early):
    """Causal, with bkv dividing bq: a KV block on the diagonal starts at query column
    ``t * bkv`` of the query block for some static t, so each t gets its own branch that skips
    the columns before it and masks a static triangle; blocks below the diagonal run whole."""
    # Plain comparisons of program ids: with a floor division in these conditions libtpu's
    # static estimate charged every grid step with the branch step 0 takes (the staircase),
    # whatever each step runs (found on HSTU attention; benchmarks/results/hstu_profile.txt).
    first_key, first_query = j * bkv, i * bq
    pl.when(first_key < first_query)(update)  # Wholly below the diagonal.
    for start in range(bq // bkv):
        pl.when(first_key == first_query + start * bkv)(
            functools.partial(_staircase, update, start * bkv, bq=bq, bkv=bkv, early=early))


def _staircase(update, lo, *, bq, bkv, early):
    """A KV block whose first key is query column ``lo``: the diagonal square as column strips,
    each against only the keys up to its last query, then the columns past the square whole.
    Each strip's query columns (the weights of q kᵀ) go through the MXU once, and the strips
    are independent, so one strip's softmax can overlap the next one's matmuls."""
    width = math.gcd(bkv, _STRIP)
    parts = [dict(lo=lo + a, hi=lo + a + width, rows=a + width, diagonal=a, last=early)
             for a in range(0, bkv, width)]
    if lo + bkv < bq:
        parts.append(dict(lo=lo + bkv))
    update(*parts)


def _standin(args, kwargs, config):
    """Fewer batch rows, KV heads and query heads per KV head (identical work each: every query
    head runs its own grid rows, fetching its group's K and V), same tiles (tpu-estimate). At
    32768 tokens the Llama-3.1-8B shape's one KV group (1024 grid steps at 2048 tiles) passes
    22 GB under libtpu's profile; one query head (256 steps) takes 2 GB."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v = args
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    bq, bkv = min(config["bq"], sq), min(config["bkv"], sk)
    per_head = pl.cdiv(sq, bq) * pl.cdiv(sk, bkv)
    (nb, nh, ng), scale = shrink_parallel([b, hkv, hq // hkv], per_head)
    q2 = jax.ShapeDtypeStruct((nb, nh * ng, sq, d), q.dtype)
    kv2 = jax.ShapeDtypeStruct((nb, nh, sk, d), k.dtype)
    return [q2, kv2, kv2], _masks.standin_kwargs(kwargs, nb), scale


flash_attention = pt.tunable(space="flash_attention", reference=flash_attention_reference,
                             standin=_standin, backward=flash_attention_bwd,
                             backward_args=flash_attention_bwd_args,
                             backward_residuals=_residuals,
                             key_optional=("local_window_size", "segment_ids"),
                             # Sharded jit: batch and heads (query heads with their KV heads)
                             # split; queries too, where no causal mask or window ties them to
                             # their positions; keys and head dim kept whole.
                             partition=lambda q, k, v, *, causal=False, local_window_size=None,
                             **_: ("b h S D, b h T D, b h T D -> b h S D" if causal or
                                   local_window_size is not None else
                                   "b h s D, b h T D, b h T D -> b h s D"))(flash_attention)
