"""Flash attention backward for TPU (FlashAttention-2): dq, dk, dv from q, k, v, o, lse and do.

The forward (``flash_attention``) saves lse, the log-sum-exp of each query row's scaled scores;
the backward recomputes p = exp(sm_scale · q kᵀ - lse) block by block, with delta = rowsum(dO ∘ O)
computed once beforehand (in XLA: an element-wise product and a sum), and runs two pallas_calls:

- dK/dV: grid (batch, kv_heads, cdiv(kv_len, bkv_dkv), group, cdiv(q_len, bq_dkv)), the last two
  axes "arbitrary": each KV block accumulates dv += pᵀ dO and dk += dsᵀ q over the query blocks
  of every q head sharing its KV head (GQA), ds = p ∘ (dO vᵀ - delta);
- dQ: grid (batch, q_heads, cdiv(q_len, bq_dq), cdiv(kv_len, bkv_dq)), the KV axis last and
  "arbitrary": dq += ds k.

Both work on transposed scores sᵀ = k qᵀ (bkv, bq), as the forward does, so that lse and delta
are (1, bq) rows that broadcast down sublanes. With ``causal=True`` (queries and keys aligned at
position 0) blocks wholly above the diagonal are skipped, with no compute and no DMA (their index
map repeats a needed block), and only blocks that straddle it are masked.

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
from pallas_tune.kernels import _ragged
from pallas_tune.kernels._attention import (MASK_VALUE, check_qkv, flash_attention_reference,
                                            reference_lse)

__all__ = ["flash_attention_bwd", "flash_attention_bwd_args", "flash_attention_bwd_reference"]

_LOG2E = math.log2(math.e)


# The public entry; registered as a tunable kernel (search_spaces/flash_attention_bwd.toml) at
# the end of the file, once its reference, inputs and stand-in exist.
def flash_attention_bwd(q, k, v, o, lse, do, *, causal: bool = False,
                        sm_scale: float | None = None, bq_dq: int, bkv_dq: int, bq_dkv: int,
                        bkv_dkv: int):
    """(dq, dk, dv) of ``flash_attention(q, k, v, causal=, sm_scale=)`` for the cotangent ``do``.

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
    do = do.astype(q.dtype)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    # Rows (1, q_len) per head, like the kernels' statistics; lse in log2 units (exp2 below).
    lse2 = (lse.astype(jnp.float32) * _LOG2E).reshape(b, hq, 1, sq)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1).reshape(b, hq, 1, sq)
    dk, dv = _dkv_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                       bq=min(bq_dkv, sq), bkv=min(bkv_dkv, k.shape[2]))
    dq = _dq_call(q, k, v, do, lse2, delta, scale=scale, causal=causal,
                  bq=min(bq_dq, sq), bkv=min(bkv_dq, k.shape[2]))
    return dq, dk, dv


def _dkv_call(q, k, v, do, lse2, delta, *, scale, causal, bq, bkv):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group, nq = hq // hkv, pl.cdiv(sq, bq)

    def q_block(j, i):  # Causal: the q blocks before the first that sees KV block j repeat it.
        return jnp.maximum(i, jnp.minimum(j * bkv // bq, nq - 1)) if causal else i

    def q_index(bi, h, j, g, i):
        return (bi, h * group + g, q_block(j, i), 0)

    def row_index(bi, h, j, g, i):
        return (bi, h * group + g, 0, q_block(j, i))

    def kv_index(bi, h, j, g, i):
        return (bi, h, j, 0)

    q_spec = pl.BlockSpec((None, None, bq, d), q_index)
    row_spec = pl.BlockSpec((None, None, 1, bq), row_index)
    kv_spec = pl.BlockSpec((None, None, bkv, d), kv_index)
    kernel = functools.partial(_dkv_kernel, c=scale * _LOG2E, scale=scale, causal=causal, bq=bq,
                               bkv=bkv, q_tail=sq % bq)
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        grid=(b, hkv, pl.cdiv(sk, bkv), group, nq),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=[kv_spec, kv_spec],
        scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32), pltpu.VMEM((bkv, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
        name=f"flash_attention_dkv_{bq}x{bkv}",
    )(q, k, v, do, lse2, delta)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk_acc, dv_acc,
                *, c, scale, causal, bq, bkv, q_tail):
    """One KV block against one q head's query block: dv += pᵀ dO, dk += dsᵀ q (transposed)."""
    j, g, i = pl.program_id(2), pl.program_id(3), pl.program_id(4)
    first = jnp.logical_and(g == 0, i == 0)
    last = jnp.logical_and(g == pl.num_programs(3) - 1, i == pl.num_programs(4) - 1)

    @pl.when(first)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)

    def step(mask=False, tail=0):
        q, do = q_ref[...], do_ref[...]
        lse, delta = lse_ref[...], delta_ref[...]
        if tail:  # Past q_len: zeros (p is masked to 0 there; 0 * NaN is not 0).
            q, do = _ragged.fill_tail(q, tail, axis=0), _ragged.fill_tail(do, tail, axis=0)
            lse, delta = _ragged.fill_tail(lse, tail, axis=1), _ragged.fill_tail(delta, tail, 1)
        s = _scores(k_ref[...], q, c, mask=mask, causal=causal, i=i, j=j, bq=bq, bkv=bkv,
                    q_tail=tail)
        p = jnp.exp2(s - lse)  # (bkv, bq)
        dv_acc[...] += jnp.dot(p.astype(do.dtype), do, preferred_element_type=jnp.float32)
        dp = lax.dot_general(v_ref[...], do, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)  # (bkv, bq)
        ds = p * (dp - delta)
        dk_acc[...] += jnp.dot(ds.astype(q.dtype), q, preferred_element_type=jnp.float32)

    # Causal: a q block sees KV block j when its last query reaches the block's first key.
    _dispatch(step, causal=causal, tail=q_tail, is_tail=i == pl.num_programs(4) - 1,
              run=i * bq + bq - 1 >= j * bkv, below=i * bq >= j * bkv + bkv - 1)

    @pl.when(last)
    def _write():
        dk_ref[...] = (dk_acc[...] * scale).astype(dk_ref.dtype)
        dv_ref[...] = dv_acc[...].astype(dv_ref.dtype)


def _dq_call(q, k, v, do, lse2, delta, *, scale, causal, bq, bkv):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv

    def kv_index(bi, h, i, j):  # Causal: skipped blocks repeat the last needed one (no DMA).
        return (bi, h // group, jnp.minimum(j, (i * bq + bq - 1) // bkv) if causal else j, 0)

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j: (bi, h, i, 0))
    row_spec = pl.BlockSpec((None, None, 1, bq), lambda bi, h, i, j: (bi, h, 0, i))
    kv_spec = pl.BlockSpec((None, None, bkv, d), kv_index)
    kernel = functools.partial(_dq_kernel, c=scale * _LOG2E, scale=scale, causal=causal, bq=bq,
                               bkv=bkv, kv_tail=sk % bkv)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, hq, pl.cdiv(sq, bq), pl.cdiv(sk, bkv)),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"flash_attention_dq_{bq}x{bkv}",
    )(q, k, v, do, lse2, delta)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, dq_acc, *, c, scale,
               causal, bq, bkv, kv_tail):
    """One query block against one KV block: dq += ds k, from sᵀ (bkv, bq)."""
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    def step(mask=False, tail=0):
        k, v = k_ref[...], v_ref[...]
        if tail:  # Past kv_len: zeros (p is masked to 0 there; 0 * NaN is not 0).
            k, v = _ragged.fill_tail(k, tail, axis=0), _ragged.fill_tail(v, tail, axis=0)
        do = do_ref[...]
        s = _scores(k, q_ref[...], c, mask=mask, causal=causal, i=i, j=j, bq=bq, bkv=bkv,
                    kv_tail=tail)
        p = jnp.exp2(s - lse_ref[...])  # (bkv, bq)
        dp = lax.dot_general(v, do, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_ref[...])).astype(k.dtype)
        dq_acc[...] += lax.dot_general(ds, k, (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)  # (bq, d)

    # Causal: KV block j is seen by this query block when its first key is at most the last query.
    _dispatch(step, causal=causal, tail=kv_tail, is_tail=j == pl.num_programs(3) - 1,
              run=j * bkv <= i * bq + bq - 1, below=j * bkv + bkv - 1 <= i * bq)

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def _scores(k, q, c, *, mask, causal, i, j, bq, bkv, q_tail=0, kv_tail=0):
    """sᵀ = k (c q)ᵀ, (bkv, bq), in log2 units (c = sm_scale · log2 e, as in the forward); with
    ``mask``, the causal mask and the valid rows or columns of a ragged block by position."""
    qs = (q.astype(jnp.float32) * c).astype(q.dtype)
    s = lax.dot_general(k, qs, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    if mask:
        k_pos = lax.broadcasted_iota(jnp.int32, s.shape, 0)
        q_pos = lax.broadcasted_iota(jnp.int32, s.shape, 1)
        ok = (i * bq + q_pos >= j * bkv + k_pos) if causal else jnp.ones(s.shape, jnp.bool_)
        if q_tail:
            ok = jnp.logical_and(ok, q_pos < q_tail)
        if kv_tail:
            ok = jnp.logical_and(ok, k_pos < kv_tail)
        s = jnp.where(ok, s, MASK_VALUE)
    return s


def _dispatch(step, *, causal, tail, is_tail, run, below):
    """Runs ``step`` where a block is needed, masked only where a mask changes something: run,
    the block has a visible score (causal); below, every score is visible; is_tail, the ragged
    last block along the reduced axis (static ``tail`` valid rows; 0: none)."""
    if not (causal or tail):
        return step()
    true, false = jnp.bool_(True), jnp.bool_(False)
    run = run if causal else true
    below = below if causal else true
    is_tail = is_tail if tail else false
    body = jnp.logical_and(run, jnp.logical_not(is_tail))
    pl.when(jnp.logical_and(body, below))(step)
    if causal:
        pl.when(jnp.logical_and(body, jnp.logical_not(below)))(functools.partial(step, True))
    if tail:
        pl.when(jnp.logical_and(run, is_tail))(functools.partial(step, True, tail))


def flash_attention_bwd_reference(q, k, v, o, lse, do, *, causal: bool = False,
                                  sm_scale: float | None = None):
    """(dq, dk, dv) by ``jax.vjp`` of the plain-JAX forward (o and lse are not used)."""
    _, vjp = jax.vjp(functools.partial(flash_attention_reference, causal=causal,
                                       sm_scale=sm_scale), q, k, v)
    return vjp(do.astype(q.dtype))


def flash_attention_bwd_args(args, kwargs, seed: int = 0):
    """Concrete backward arguments for a forward call ``flash_attention(q, k, v, causal=,
    sm_scale=)``: ``((q, k, v, o, lse, do), {"causal", "sm_scale"})`` with o and lse from the
    reference math and do random (fixed seed), so the backward can be tuned for a forward shape.
    ShapeDtypeStruct q, k, v are drawn at random (from the same seed) first."""
    q, k, v = args[:3]
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
               if isinstance(x, jax.ShapeDtypeStruct) else x for key, x in zip(keys, (q, k, v)))
    opts = {"causal": bool(kwargs.get("causal", False)), "sm_scale": kwargs.get("sm_scale")}
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
    return [qs, kvs, kvs, qs, lse, qs], kwargs, scale


flash_attention_bwd = pt.tunable(space="flash_attention_bwd",
                                 reference=flash_attention_bwd_reference, inputs=_inputs,
                                 standin=_standin)(flash_attention_bwd)
