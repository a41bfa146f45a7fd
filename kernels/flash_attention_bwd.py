"""Flash attention backward for TPU (FlashAttention-2): dq, dk, dv from q, k, v, o, lse and do.

The forward (``flash_attention``) saves lse, the log-sum-exp of each query row's scaled scores;
the backward recomputes p = exp(sm_scale · q kᵀ - lse) block by block, with delta = rowsum(dO ∘ O)
computed once beforehand (in XLA: an element-wise product and a sum), and runs two pallas_calls:

- dK/dV: grid (batch, kv_heads, cdiv(kv_len, bkv_dkv), group, cdiv(q_len, bq_dkv)), the last two
  axes "arbitrary": each KV block accumulates dv += pᵀ dO and dk += dsᵀ q over the query blocks
  of every q head sharing its KV head (GQA), ds = p ∘ (dO vᵀ - delta);
- dQ: grid (batch, q_heads, cdiv(q_len, bq_dq), cdiv(kv_len, bkv_dq)), the KV axis last and
  "arbitrary": dq += ds k.

``fused=True`` runs the dK/dV pass alone and has it accumulate dq too, from the ds it already
has: five score-sized matmuls per block pair instead of the two passes' seven (the dQ pass
recomputes s and dO vᵀ). The dq of every query block of the KV head's group is accumulated in
f32 VMEM, (group · q_len · head_dim · 4 bytes: 16 MiB for Llama-3.1-8B at 8192 tokens), so the
KV axis turns "arbitrary" and the call raises its VMEM limit by that much; a query block's dq is
written out at its last visit (its output block is written back at every step, so each block's
last write is the one that stays). Where that does not fit the chip, the feasibility check
refuses the config and the two passes run. bq_dq and bkv_dq do not matter then.

Both work on transposed scores sᵀ = k qᵀ (keys, queries), as the forward does, so that lse and
delta are rows that broadcast down sublanes, and both cut a block into column strips of
``STRIP`` queries, software-pipelined (``_flash_bwd``): a (bkv, bq) block is never live whole.
The dQ pass accumulates dqᵀ = kᵀ ds (head_dim, bq), transposing only k, never a score block.
With ``causal=True`` (queries and keys aligned at position 0) blocks wholly above the diagonal
are skipped, with no compute and no DMA (their index map repeats a needed block); where one
block size divides the other, a block on the diagonal runs as a staircase, each strip against
only the keys its last query sees, so a causal backward computes about half the scores however
large its blocks; otherwise straddling blocks are masked by position.

With ``local_window_size`` or ``segment_ids`` (``_masks``) both passes skip the block pairs no
query sees (no compute; where the index map can tell, no DMA: the window's by program ids, the
segments' from SMEM tables of each block's range of ids), run unmasked the pairs every query
sees whole and mask the rest by position and id, as the forward does; a query that saw no key
(lse -inf) gets zero gradients. Without them the passes are the programs they always were.

Any q_len and kv_len: a ragged last block along the axis a pass reduces over (q rows in dK/dV, KV
rows in dQ and in the fused pass) has its out-of-bounds rows zeroed and its scores masked on that
step only (``0 * NaN`` would poison the sums); along the other axis the rows are independent and
dropped on store. The masking is emitted only for ragged lengths.
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
from pallas_tune.kernels import _flash_bwd, _masks, _ragged
from pallas_tune.kernels._attention import check_qkv, flash_attention_reference, reference_lse

__all__ = ["flash_attention_bwd", "flash_attention_bwd_args", "flash_attention_bwd_reference"]

_LOG2E = math.log2(math.e)
_MiB = 1 << 20
_SCOPED_VMEM = 32 * _MiB  # What the unfused dK/dV pass compiles within (the default limit).
_MAX_VMEM = 100 * _MiB  # The fused pass's limit at most: below v6e's and v5e's 128 MiB.


# The public entry; registered as a tunable kernel (search_spaces/flash_attention_bwd.toml) at
# the end of the file, once its reference, inputs and stand-in exist.
def flash_attention_bwd(q, k, v, o, lse, do, *, causal: bool = False,
                        sm_scale: float | None = None, local_window_size=None, segment_ids=None,
                        bq_dq: int, bkv_dq: int, bq_dkv: int, bkv_dkv: int, fused: bool):
    """(dq, dk, dv) of ``flash_attention(q, k, v, causal=, sm_scale=, local_window_size=,
    segment_ids=)`` for the cotangent ``do``.

    o is the forward's output and lse, (batch, q_heads, q_len) float32, the log-sum-exp of each
    query row's scaled scores (the forward saves both when differentiated). dq has q's dtype, dk
    and dv k's; dk and dv sum over the q heads that share a KV head. Any sequence lengths and
    head dim; block sizes larger than a sequence are clamped to it. ``fused``: one pass
    computes all three (see the module docstring); bq_dq and bkv_dq are then unused.

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
    if fused:
        dk, dv, dq = _dkv_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                               bq=min(bq_dkv, sq), bkv=min(bkv_dkv, k.shape[2]), fused=True,
                               **mask_kw)
        if masks is not None and _masks.some_query_block_blind(masks, min(bq_dkv, sq)):
            # A query block no key reaches is never a step's block: its dq is never written.
            # Its queries' lse is -inf (no key seen), and their dq is 0.
            dq = jnp.where(lse[..., None] == -jnp.inf, jnp.zeros((), dq.dtype), dq)
        return dq, dk, dv
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                       bq=min(bq_dkv, sq), bkv=min(bkv_dkv, k.shape[2]), **mask_kw)
    dq = _dq_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                  bq=min(bq_dq, sq), bkv=min(bkv_dq, k.shape[2]), **mask_kw)
    return dq, dk, dv


def _dkv_call(q, k, v, do, lse2, delta, *, scale, causal, bq, bkv, fused=False, masks=None,
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
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    scratch = [pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)]
    params = dict(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary",
                                       "arbitrary"))
    name = f"flash_attention_dkv{'_masked' if masks is not None else ''}_{bq}x{bkv}"
    if fused:  # dq of the whole group in VMEM: the KV axis accumulates into it.
        kernel = functools.partial(kernel, fused=True, kv_tail=sk % bkv, sq=sq, nq=nq,
                                   nk=pl.cdiv(sk, bkv))
        out_shape.append(jax.ShapeDtypeStruct(q.shape, q.dtype))
        scratch += [pltpu.VMEM((group * nq, d, bq), jnp.float32), pltpu.VMEM((d, bkv), k.dtype)]
        params = dict(dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary",
                                           "arbitrary"),
                      vmem_limit_bytes=_fused_vmem_limit(group * nq, d, bq, bkv, q.dtype))
        name = name.replace("dkv", "fused")
    call = dict(out_shape=out_shape, out_specs=[kv_spec, kv_spec] + [q_spec] * fused,
                scratch_shapes=scratch, compiler_params=pltpu.CompilerParams(**params))
    grid = (b, hkv, pl.cdiv(sk, bkv), group, nq)
    in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
    if masks is not None:
        return _masks.pallas_call(kernel, masks, segment_ids, (0, 4, 2), per="kv", grid=grid,
                                  in_specs=in_specs, operands=[q, k, v, do, lse2, delta],
                                  q_block=lambda bi, h, j, g, i, *t: (bi, q_block(j, i, bi, t)),
                                  kv_block=lambda bi, h, j, g, i, *_: (bi, j), name=name, **call)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, name=name, **call,
                          )(q, k, v, do, lse2, delta)


def _fused_vmem_limit(rows, d, bq, bkv, dtype):
    """The fused pass's VMEM limit: the unfused pass's, plus its dq accumulator (f32, rows of
    (d, bq) padded to (8, 128) tiles), kᵀ and its dq output's two buffers; at most _MAX_VMEM."""
    pad = lambda n, m: -(-n // m) * m  # noqa: E731
    item = jnp.dtype(dtype).itemsize
    need = (rows * pad(d, 8) * pad(bq, 128) * 4 + pad(d, 16) * pad(bkv, 128) * item
            + 2 * pad(bq, 16) * pad(d, 128) * item)
    return min(_MAX_VMEM, pad(_SCOPED_VMEM + need, _MiB))


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, c, scale, causal, bq,
                bkv, q_tail, fused=False, kv_tail=0, sq=0, nq=0, nk=0, blocks=None):
    """One KV block against one q head's query block, strip by strip (transposed scores):
    dv += pᵀ dO, dk += dsᵀ q over the keys each strip sees; ``fused``: also dqᵀ += kᵀ ds, into
    the accumulator row of (q head in the group, query block)."""
    if fused:
        dk_ref, dv_ref, dq_ref, dk_acc, dv_acc, dq_acc, kt_ref = refs
    else:
        (dk_ref, dv_ref, dk_acc, dv_acc), dq_ref = refs, None
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = jnp.logical_and(g == 0, i == 0)
    last = jnp.logical_and(g == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1)
    is_kv_tail = j == nk - 1 if fused else None

    @pl.when(first)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)
        if fused:  # kᵀ once per KV block, for every step's dq (rows past kv_len zeroed).
            k = k_ref[...]
            if kv_tail:
                k = jnp.where(is_kv_tail, _ragged.fill_tail(k, kv_tail, axis=0), k)
            kt_ref[...] = k.T

    if fused:
        row = g * nq + i
        _init_dq(dq_acc, row, j, blocks)

    def body(strips, mask=False, tail=0, kv_valid=0):
        k, v = k_ref[...], v_ref[...]
        if fused and kv_tail:  # Past kv_len: zeros (0 * NaN is not 0 in dq).
            k = jnp.where(is_kv_tail, _ragged.fill_tail(k, kv_tail, axis=0), k)
            v = jnp.where(is_kv_tail, _ragged.fill_tail(v, kv_tail, axis=0), v)

        def front(lo, hi, rows, tri):
            q, do = q_ref[lo:hi, :], do_ref[lo:hi, :]
            lse, delta = lse_ref[:, lo:hi], delta_ref[:, lo:hi]
            if tail and hi > tail:  # Past q_len: zeros (p is masked to 0; 0 * NaN is not 0).
                q, do = _ragged.fill_tail(q, tail - lo, 0), _ragged.fill_tail(do, tail - lo, 0)
                lse = _ragged.fill_tail(lse, tail - lo, 1)
                delta = _ragged.fill_tail(delta, tail - lo, 1)
            s = _flash_bwd.scores(k[:rows], q, c, tri=tri, mask=mask, causal=causal,
                                  q0=i * bq + lo, k0=j * bkv,
                                  q_valid=tail - lo if tail and hi > tail else 0,
                                  k_valid=kv_valid, blocks=blocks, lo=lo)
            dp = lax.dot_general(v[:rows], do, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return q, do, lse, delta, s, dp

        def back(lo, hi, rows, tri, q, do, lse, delta, s, dp):
            p = jnp.exp2(s - lse)  # (rows, hi - lo)
            dv_acc[:rows, :] += jnp.dot(p.astype(do.dtype), do,
                                        preferred_element_type=jnp.float32)
            ds = p * (dp - delta)
            if fused:  # Cast once, for dk and dq (the unfused pass casts inside its dot).
                ds = ds.astype(q.dtype)
            dk_acc[:rows, :] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)
            if fused:
                dq_acc[row, :, lo:hi] += jnp.dot(kt_ref[:, :rows], ds,
                                                 preferred_element_type=jnp.float32)

        _flash_bwd.pipelined([st for st in strips if not (tail and st[0] >= tail)], front, back)

    is_q_tail = i == pl.num_programs(4) - 1
    run = functools.partial(_flash_bwd.dispatch, body, causal=causal, i=i, j=j, bq=bq, bkv=bkv,
                            tail=q_tail, is_tail=is_q_tail, blocks=blocks)
    if not (fused and kv_tail):
        run()
    elif blocks is not None:  # The masks mask keys past kv_len; never unmasked there.
        run(masked=is_kv_tail)
    else:
        pl.when(jnp.logical_not(is_kv_tail))(run)
        pl.when(is_kv_tail)(lambda: _flash_bwd.dispatch_kv_tail(
            body, causal=causal, i=i, j=j, bq=bq, bkv=bkv, q_tail=q_tail, is_q_tail=is_q_tail,
            kv_tail=kv_tail))

    @pl.when(last)
    def _write():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)

    if fused:
        pl.when(_dq_final(causal, i, j, bq=bq, bkv=bkv, sq=sq, nk=nk, blocks=blocks))(
            lambda: _write_dq(dq_ref, dq_acc, row, scale))


def _init_dq(dq_acc, row, j, blocks):
    """Zeroes the fused pass's dq accumulator before its first use: a row at KV block 0, which
    every query block sees without masks; with masks, every row at the KV head's first step."""
    if blocks is None:
        @pl.when(j == 0)
        def _zero_row():
            dq_acc[row] = jnp.zeros(dq_acc.shape[1:], jnp.float32)
        return

    def zero(r, carry):
        dq_acc[r] = jnp.zeros(dq_acc.shape[1:], jnp.float32)
        return carry

    @pl.when(jnp.logical_and(j == 0, row == 0))
    def _zero_all():
        lax.fori_loop(0, dq_acc.shape[0], zero, 0)


def _dq_final(causal, i, j, *, bq, bkv, sq, nk, blocks):
    """When the fused pass writes a query block's dq: plain and causal, at its last KV block
    (then no later step adds to it); with masks, at every step whose dq block is its own (not
    a skipped step's repeat of a neighbour's), so that the last write-back of each block holds
    its whole sum wherever the tables put its last visit."""
    if blocks is not None:
        return blocks.q_block() == i
    final = j == nk - 1
    if causal:  # The next KV block starts after this query block's last query.
        final = jnp.logical_or(final, (j + 1) * bkv > jnp.minimum(i * bq + bq - 1, sq - 1))
    return final


def _write_dq(dq_ref, dq_acc, row, scale):
    dq_ref[...] = (dq_acc[row].T * scale).astype(dq_ref.dtype)


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
            s = _flash_bwd.scores(k[:rows], q, c, tri=tri, mask=mask, causal=causal,
                                  q0=i * bq + lo, k0=j * bkv, k_valid=tail, blocks=blocks, lo=lo)
            dp = lax.dot_general(v[:rows], do, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)
            return s, dp

        def back(lo, hi, rows, tri, s, dp):
            p = jnp.exp2(s - lse_ref[:, lo:hi])  # (rows, hi - lo)
            ds = (p * (dp - delta_ref[:, lo:hi])).astype(k.dtype)
            dq_acc[:, lo:hi] += jnp.dot(kt[:, :rows], ds, preferred_element_type=jnp.float32)

        _flash_bwd.pipelined(strips, front, back)

    _flash_bwd.dispatch(body, causal=causal, i=i, j=j, bq=bq, bkv=bkv, tail=kv_tail,
                        is_tail=j == pl.num_programs(3) - 1, blocks=blocks)

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        dq_ref[...] = (dq_acc[...].T * scale).astype(dq_ref.dtype)


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
    """Fewer batch rows, KV heads and query heads per KV head (identical work each; a query
    head's share of the dK/dV pass is its run of the group axis), same tiles (tpu-estimate).
    Fused, the dq accumulator holds the group's rows, but the pass raises its VMEM limit by
    exactly that (``_fused_vmem_limit``): a stand-in with fewer heads has the full problem's
    headroom (to the MiB), except where the limit is capped, where the group is kept."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k = args[0], args[1]
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bkv = min(config["bq_dkv"], sq), min(config["bkv_dkv"], sk)

    def steps(bq, bkv):
        return pl.cdiv(sq, min(bq, sq)) * pl.cdiv(sk, min(bkv, sk))

    per_head, fused = steps(bq, bkv), config.get("fused")
    if fused and _fused_vmem_limit(group * pl.cdiv(sq, bq), d, bq, bkv, q.dtype) == _MAX_VMEM:
        (nb, nh), scale = shrink_parallel([b, hkv], group * per_head)  # Capped: the group.
        ng = group
    else:
        if not fused:
            per_head = min(per_head, steps(config["bq_dq"], config["bkv_dq"]))
        (nb, nh, ng), scale = shrink_parallel([b, hkv, group], per_head)
    qs = jax.ShapeDtypeStruct((nb, nh * ng, sq, d), q.dtype)
    kvs = jax.ShapeDtypeStruct((nb, nh, sk, d), k.dtype)
    lse = jax.ShapeDtypeStruct((nb, nh * ng, sq), jnp.float32)
    return [qs, kvs, kvs, qs, lse, qs], _masks.standin_kwargs(kwargs, nb), scale


flash_attention_bwd = pt.tunable(space="flash_attention_bwd",
                                 reference=flash_attention_bwd_reference, inputs=_inputs,
                                 standin=_standin,
                                 key_optional=("local_window_size", "segment_ids"),
                                 )(flash_attention_bwd)
