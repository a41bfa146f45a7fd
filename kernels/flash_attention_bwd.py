"""Flash attention backward for TPU (FlashAttention-2): dq, dk, dv from q, k, v, o, lse and do.

The forward (``flash_attention``) saves lse, the log-sum-exp of each query row's scaled scores;
the backward recomputes p = exp(sm_scale · q kᵀ - lse) block by block, with delta = rowsum(dO ∘ O)
computed once beforehand (in XLA: an element-wise product and a sum), and runs two pallas_calls:

- dK/dV: grid (batch, kv_heads, cdiv(kv_len, bkv_dkv), group, cdiv(q_len, bq_dkv)), the last two
  axes "arbitrary": each KV block accumulates dv += pᵀ dO and dk += dsᵀ q over the query blocks
  of every q head sharing its KV head (GQA), ds = p ∘ (dO vᵀ - delta);
- dQ: grid (batch, q_heads, cdiv(q_len, bq_dq), cdiv(kv_len, bkv_dq)), the KV axis last and
  "arbitrary": dq += ds k.

Both work on transposed scores sᵀ = k qᵀ (keys, queries), as the forward does, so that lse and
delta are rows that broadcast down sublanes, and both cut a block into column strips of
``_STRIP`` queries, software-pipelined (``_pipelined``): a (bkv, bq) block is never live whole.
The dQ pass accumulates dqᵀ = kᵀ ds (head_dim, bq), transposing only k, never a score block.
With ``causal=True`` (queries and keys aligned at position 0) blocks wholly above the diagonal
are skipped, with no compute and no DMA (their index map repeats a needed block); where one
block size divides the other, a block on the diagonal runs as a staircase, each strip against
only the keys its last query sees (``_strips``), so a causal backward computes about half the
scores however large its blocks; otherwise straddling blocks are masked by position.

With ``local_window_size`` or ``segment_ids`` (``_masks``) both passes skip the block pairs no
query sees (no compute; where the index map can tell, no DMA: the window's by program ids, the
segments' from SMEM tables of each block's range of ids), run unmasked the pairs every query
sees whole and mask the rest by position and id, as the forward does; a query that saw no key
(lse -inf) gets zero gradients. Without them the passes are the programs they always were.

Any q_len and kv_len: a ragged last block along the axis a pass reduces over (q rows in dK/dV, KV
rows in dQ) has its out-of-bounds rows zeroed and its scores masked on that step only (``0 * NaN``
would poison the sums); along the other axis the rows are independent and dropped on store. The
masking is emitted only for ragged lengths.
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
from pallas_tune.kernels._attention import (MASK_VALUE, check_qkv, flash_attention_reference,
                                            reference_lse)

__all__ = ["flash_attention_bwd", "flash_attention_bwd_args", "flash_attention_bwd_reference"]

_LOG2E = math.log2(math.e)
_STRIP = 256  # Query columns per strip of a block (v6e estimate, 8B GQA group at 4096 tokens,
#               causal, 2048 blocks: dK/dV 0.0905 / 0.0929 / 0.0909 ms at 256 / 512 / 128,
#               dQ 0.0664 / 0.0657 / 0.0808; see _strips).
_LAG = 1  # Strips between a strip's two score-sized matmuls and its softmax-gradient part in
#           program order (same shape: dQ 0.0664 ms at 0, 0.0607 at 1, 0.0606 at 2).


# The public entry; registered as a tunable kernel (search_spaces/flash_attention_bwd.toml) at
# the end of the file, once its reference, inputs and stand-in exist.
def flash_attention_bwd(q, k, v, o, lse, do, *, causal: bool = False,
                        sm_scale: float | None = None, local_window_size=None, segment_ids=None,
                        bq_dq: int, bkv_dq: int, bq_dkv: int, bkv_dkv: int):
    """(dq, dk, dv) of ``flash_attention(q, k, v, causal=, sm_scale=, local_window_size=,
    segment_ids=)`` for the cotangent ``do``.

    o is the forward's output and lse, (batch, q_heads, q_len) float32, the log-sum-exp of each
    query row's scaled scores (the forward saves both when differentiated). dq has q's dtype, dk
    and dv k's; dk and dv sum over the q heads that share a KV head. Any sequence lengths and
    head dim; block sizes larger than a sequence are clamped to it.

    Raises:
      ValueError: shapes or dtypes that ``flash_attention`` would refuse, or o, do, lse not of
        the shapes it produces.
    """
    check_qkv("flash_attention_bwd", q, k, v)
    b, hq, sq, d = q.shape
    if o.shape != q.shape or do.shape != q.shape or lse.shape != (b, hq, sq):
        raise ValueError(f"flash_attention_bwd needs o and do shaped like q {q.shape} and lse "
                         f"{(b, hq, sq)}; got o {o.shape}, do {do.shape}, lse {lse.shape}")
    masks = _masks.masks_of(q, k, causal=causal, local_window_size=local_window_size,
                            segment_ids=segment_ids)
    do = do.astype(q.dtype)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    # Rows (1, q_len) per head, like the kernels' statistics; lse in log2 units (exp2 below).
    lse2 = (lse.astype(jnp.float32) * _LOG2E).reshape(b, hq, 1, sq)
    if masks is not None:  # A query that sees no key (lse -inf): p = exp2(-inf - inf) = 0.
        lse2 = jnp.where(lse2 == -jnp.inf, jnp.inf, lse2)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).reshape(b, hq, 1, sq)
    mask_kw = dict(masks=masks, segment_ids=segment_ids) if masks is not None else {}
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                       bq=min(bq_dkv, sq), bkv=min(bkv_dkv, k.shape[2]), **mask_kw)
    dq = _dq_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                  bq=min(bq_dq, sq), bkv=min(bkv_dq, k.shape[2]), **mask_kw)
    return dq, dk, dv


def _dkv_call(q, k, v, do, lse2, delta, *, scale, causal, bq, bkv, masks=None,
              segment_ids=None):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group, nq = hq // hkv, pl.cdiv(sq, bq)

    def q_block(j, i, bi, tables):  # Skipped q blocks repeat a needed one (no DMA). Causal:
        if masks is not None:  # those before the first that sees KV block j; masks: those
            return _masks.q_clamp(masks, bq, bkv, bi, j, i, tables)  # outside the ones that do.
        return jnp.maximum(i, jnp.minimum(j * bkv // bq, nq - 1)) if causal else i

    def q_index(bi, h, j, g, i, *t):
        return (bi, h * group + g, q_block(j, i, bi, t), 0)

    def row_index(bi, h, j, g, i, *t):
        return (bi, h * group + g, 0, q_block(j, i, bi, t))

    def kv_index(bi, h, j, g, i, *_):
        return (bi, h, j, 0)

    q_spec = pl.BlockSpec((None, None, bq, d), q_index)
    row_spec = pl.BlockSpec((None, None, 1, bq), row_index)
    kv_spec = pl.BlockSpec((None, None, bkv, d), kv_index)
    kernel = functools.partial(_dkv_kernel, c=scale * _LOG2E, scale=scale, causal=causal, bq=bq,
                               bkv=bkv, q_tail=sq % bq)
    call = dict(
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        out_specs=[kv_spec, kv_spec],
        scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")))
    grid = (b, hkv, pl.cdiv(sk, bkv), group, nq)
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    if masks is not None:
        return _masks.pallas_call(kernel, masks, segment_ids, (0, 4, 2), per="kv", grid=grid,
                                  in_specs=in_specs, operands=[q, k, v, do, lse2, delta],
                                  q_block=lambda bi, h, j, g, i, *t: (bi, q_block(j, i, bi, t)),
                                  kv_block=lambda bi, h, j, g, i, *_: (bi, j),
                                  name=f"flash_attention_dkv_masked_{bq}x{bkv}", **call)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs,
                          name=f"flash_attention_dkv_{bq}x{bkv}", **call,
                          )(q, k, v, do, lse2, delta)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc,
                *, c, scale, causal, bq, bkv, q_tail, blocks=None):
    """One KV block against one q head's query block, strip by strip (transposed scores):
    dv += pᵀ dO, dk += dsᵀ q over the keys each strip sees."""
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = jnp.logical_and(g == 0, i == 0)
    last = jnp.logical_and(g == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1)

    @pl.when(first)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    def body(strips, mask=False, tail=0):
        k, v = k_ref[...], v_ref[...]

        def front(lo, hi, rows, tri):
            q, do = q_ref[lo:hi, :], do_ref[lo:hi, :]
            lse, delta = lse_ref[:, lo:hi], delta_ref[:, lo:hi]
            if tail and hi > tail:  # Past q_len: zeros (p is masked to 0; 0 * NaN is not 0).
                q, do = _ragged.fill_tail(q, tail - lo, 0), _ragged.fill_tail(do, tail - lo, 0)
                lse = _ragged.fill_tail(lse, tail - lo, 1)
                delta = _ragged.fill_tail(delta, tail - lo, 1)
            s = _scores(k[:rows], q, c, tri=tri, mask=mask, causal=causal, q0=i * bq + lo,
                        k0=j * bkv, q_valid=tail - lo if tail and hi > tail else 0,
                        blocks=blocks, lo=lo)
            dp = lax.dot_general(v[:rows], do, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return q, do, lse, delta, s, dp

        def back(lo, hi, rows, tri, q, do, lse, delta, s, dp):
            p = jnp.exp2(s - lse)  # (rows, hi - lo)
            dv_acc[:rows, :] += jnp.dot(p.astype(do.dtype), do,
                                        preferred_element_type=jnp.float32)
            ds = p * (dp - delta)
            dk_acc[:rows, :] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)

        _pipelined([st for st in strips if not (tail and st[0] >= tail)], front, back)

    _dispatch(body, causal=causal, i=i, j=j, bq=bq, bkv=bkv, tail=q_tail,
              is_tail=i == pl.num_programs(4) - 1, blocks=blocks)

    @pl.when(last)
    def _write():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_call(q, k, v, do, lse2, delta, *, scale, causal, bq, bkv, masks=None,
             segment_ids=None):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv

    def kv_block(bi, h, i, j, *t):  # Skipped blocks repeat a needed one (no DMA).
        if masks is not None:
            return _masks.kv_clamp(masks, bq, bkv, bi, i, j, t)
        return jnp.minimum(j, (i * bq + bq - 1) // bkv) if causal else j

    def kv_index(bi, h, i, j, *t):
        return (bi, h // group, kv_block(bi, h, i, j, *t), 0)

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j, *_: (bi, h, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda bi, h, i, j, *_: (bi, h, 0, i))
    kv_spec = pl.BlockSpec((None, None, bkv, d), kv_index)
    kernel = functools.partial(_dq_kernel, c=scale * _LOG2E, scale=scale, causal=causal, bq=bq,
                               bkv=bkv, kv_tail=sk % bkv)
    call = dict(
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((d, bq), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")))
    grid = (b, hq, pl.cdiv(sq, bq), pl.cdiv(sk, bkv))
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    if masks is not None:
        return _masks.pallas_call(kernel, masks, segment_ids, (0, 2, 3), per="q", grid=grid,
                                  in_specs=in_specs, operands=[q, k, v, do, lse2, delta],
                                  q_block=lambda bi, h, i, j, *_: (bi, i),
                                  kv_block=lambda bi, h, i, j, *t: (bi, kv_block(bi, h, i, j, *t)),
                                  name=f"flash_attention_dq_masked_{bq}x{bkv}", **call)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs,
                          name=f"flash_attention_dq_{bq}x{bkv}", **call,
                          )(q, k, v, do, lse2, delta)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc, *, c, scale,
               causal, bq, bkv, kv_tail, blocks=None):
    """One query block against one KV block, strip by strip: dqᵀ += kᵀ ds, accumulated
    transposed (head_dim, bq) so that no (keys, queries) block is transposed, only k."""
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    def body(strips, mask=False, tail=0):
        k, v = k_ref[...], v_ref[...]
        if tail:  # Past kv_len: zeros (p is masked to 0 there; 0 * NaN is not 0).
            k, v = _ragged.fill_tail(k, tail, axis=0), _ragged.fill_tail(v, tail, axis=0)
        kt = k.T  # (d, bkv)

        def front(lo, hi, rows, tri):
            q, do = q_ref[lo:hi, :], do_ref[lo:hi, :]
            s = _scores(k[:rows], q, c, tri=tri, mask=mask, causal=causal, q0=i * bq + lo,
                        k0=j * bkv, k_valid=tail, blocks=blocks, lo=lo)
            dp = lax.dot_general(v[:rows], do, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return s, dp

        def back(lo, hi, rows, tri, s, dp):
            p = jnp.exp2(s - lse_ref[:, lo:hi])  # (rows, hi - lo)
            ds = (p * (dp - delta_ref[:, lo:hi])).astype(k.dtype)
            dq_acc[:, lo:hi] += jnp.dot(kt[:, :rows], ds, preferred_element_type=jnp.float32)

        _pipelined(strips, front, back)

    _dispatch(body, causal=causal, i=i, j=j, bq=bq, bkv=bkv, tail=kv_tail,
              is_tail=j == pl.num_programs(3) - 1, blocks=blocks)

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        dq_ref[...] = (dq_acc[...].T * scale).astype(dq_ref.dtype)


def _scores(k, q, c, *, tri, mask, causal, q0, k0, q_valid=0, k_valid=0, blocks=None, lo=0):
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


def _pipelined(strips, front, back):
    """``back(*strip, *front(*strip))`` for each strip, software-pipelined in program order:
    each strip's ``front`` (its two score-sized matmuls) is emitted ``_LAG`` strips ahead of its
    ``back`` (exp, the element-wise gradient and the accumulating matmuls), so that the MXU has
    the next strip's work while the VPU does this one's (as the forward does)."""
    pending = {}
    for t in range(len(strips) + _LAG):
        if t < len(strips):
            pending[t] = front(*strips[t])
        if t >= _LAG:
            back(*strips[t - _LAG], *pending.pop(t - _LAG))


def _strips(bq, bkv, diagonal=None):
    """A (bkv keys, bq queries) block as column strips ``(lo, hi, rows, tri)``: queries
    [lo, hi) against keys [0, rows), masked by the static triangle ``key - column <= tri``
    (column counted from lo) where tri is not None. ``diagonal=D``: the causal block whose first
    query is D positions after its first key (key r visible to column c when r <= D + c);
    strips that see no key are left out, and each strip goes only as far as its last query
    sees. None: every key visible."""
    width = _STRIP if bq % _STRIP == 0 else bq
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


def _dispatch(body, *, causal, i, j, bq, bkv, tail, is_tail, blocks=None):
    """Runs ``body(strips, mask=, tail=)`` where a block is needed: whole below the causal
    diagonal, as a staircase of static triangles on it (one branch per offset, when the block
    sizes divide one another), masked by position otherwise; the ragged last block along the
    reduced axis (static ``tail`` valid positions; 0: none) masked by position. With
    ``blocks`` (a window or segment ids): skipped where no query sees a key, whole where every
    query sees every key, masked otherwise."""
    whole = _strips(bq, bkv)
    if not (causal or tail) and blocks is None:
        return body(whole)
    first_key, first_query = j * bkv, i * bq
    not_tail = jnp.logical_not(is_tail) if tail else jnp.bool_(True)
    if blocks is not None:
        run, full = blocks.run(), jnp.logical_and(blocks.whole(), not_tail)
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
                    functools.partial(body, _strips(bq, bkv, d)))
    else:
        run = jnp.bool_(True)
        pl.when(not_tail)(lambda: body(whole))
    if tail:
        pl.when(jnp.logical_and(run, is_tail))(lambda: body(whole, mask=True, tail=tail))


def flash_attention_bwd_reference(q, k, v, o, lse, do, *, causal: bool = False,
                                  sm_scale: float | None = None, local_window_size=None,
                                  segment_ids=None):
    """(dq, dk, dv) by ``jax.vjp`` of the plain-JAX forward (o and lse are not used)."""
    masks = {} if local_window_size is None and segment_ids is None else dict(
        local_window_size=local_window_size, segment_ids=segment_ids)
    _, vjp = jax.vjp(functools.partial(flash_attention_reference, causal=causal,
                                       sm_scale=sm_scale, **masks), q, k, v)
    return vjp(do.astype(q.dtype))


def flash_attention_bwd_args(args, kwargs, seed: int = 0):
    """Concrete backward arguments for a forward call ``flash_attention(q, k, v, causal=,
    sm_scale=)``: ``((q, k, v, o, lse, do), {"causal", "sm_scale"})`` with o and lse from the
    reference math and do random (fixed seed), so the backward can be tuned for a forward shape.
    ShapeDtypeStruct q, k, v are drawn at random (from the same seed) first. A window and
    segment ids (concrete) are passed on where the forward call has them."""
    q, k, v = args[:3]
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
               if isinstance(x, jax.ShapeDtypeStruct) else x for key, x in zip(keys, (q, k, v)))
    opts = {"causal": bool(kwargs.get("causal", False)), "sm_scale": kwargs.get("sm_scale")}
    opts.update({n: kwargs[n] for n in ("local_window_size", "segment_ids")
                 if kwargs.get(n) is not None})
    o = jax.jit(functools.partial(flash_attention_reference, **opts))(q, k, v)
    lse = jax.jit(functools.partial(reference_lse, **opts))(q, k)
    do = jax.random.normal(keys[3], q.shape, jnp.float32).astype(q.dtype)
    return (q, k, v, o, lse, do), opts


def _inputs(q, k, v, o, lse, do, **kwargs):
    """Tuning inputs from shapes: q, k, v and do at random, o and lse consistent with them."""
    return flash_attention_bwd_args((q, k, v), kwargs)


def _standin(args, kwargs, config):
    """Fewer batch rows and KV-head groups (identical work each), same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k = args[0], args[1]
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bkv = min(config["bq_dkv"], sq), min(config["bkv_dkv"], sk)
    per_head = group * pl.cdiv(sq, bq) * pl.cdiv(sk, bkv)
    (nb, nh), scale = shrink_parallel([b, hkv], per_head)
    qs = jax.ShapeDtypeStruct((nb, nh * group, sq, d), q.dtype)
    kvs = jax.ShapeDtypeStruct((nb, nh, sk, d), k.dtype)
    lse = jax.ShapeDtypeStruct((nb, nh * group, sq), jnp.float32)
    return [qs, kvs, kvs, qs, lse, qs], _masks.standin_kwargs(kwargs, nb), scale




flash_attention_bwd = pt.tunable(space="flash_attention_bwd",
                                 reference=flash_attention_bwd_reference, inputs=_inputs,
                                 standin=_standin,
                                 key_optional=("local_window_size", "segment_ids"),
                                 )(flash_attention_bwd)
