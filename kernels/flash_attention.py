"""Flash attention forward for TPU: online softmax over KV blocks, GQA, causal block skipping.

q: (batch, q_heads, q_len, head_dim); k, v: (batch, kv_heads, kv_len, head_dim) with q_heads a
multiple of kv_heads (grouped-query attention). Grid (batch, q_heads, cdiv(q_len, bq),
cdiv(kv_len, bkv)), the KV axis last and "arbitrary". Running max, denominator and accumulator
live in f32 VMEM scratch. With ``causal=True`` (queries and keys aligned at position 0), KV blocks
entirely above the diagonal are skipped: no compute, and their index map repeats the last needed
block, so no DMA.

Any q_len and kv_len: a ragged last query block computes rows that are dropped on store (each row
is independent, so nothing leaks into valid rows); when no bkv divides kv_len, the last KV step
gives the keys past kv_len the mask value and zeroes the values past it (``0 * NaN`` would
poison the sum). That masking is emitted only for ragged kv_len, so shapes that divide compile to
the same program as without it.
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

__all__ = ["flash_attention", "flash_attention_reference"]

DTYPES = (jnp.float32, jnp.bfloat16)
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_STAT_LANES = 128  # m and l are kept lane-broadcast, (bq, 128), as in JAX's own TPU kernels.


# The public entry; registered as a tunable kernel (search_spaces/flash_attention.toml) at the end
# of the file, once its reference and stand-in exist.
def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    bq: int, bkv: int):
    """softmax(q kᵀ · sm_scale) v per head; ``sm_scale=None`` means 1/√head_dim.

    Any sequence lengths and head dim; float32 or bfloat16 (one dtype for q, k and v). Block
    sizes larger than a sequence are clamped to it.

    Raises:
      ValueError: the shapes do not match (see the module docstring), q_heads is not a multiple
        of kv_heads, or the dtypes are not one of float32 and bfloat16.
    """
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"flash_attention needs q (batch, q_heads, q_len, head_dim) and k, v "
                         f"(batch, kv_heads, kv_len, head_dim); got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    b, hq, sq, d = q.shape
    bk_, hkv, sk, dk = k.shape
    if (bk_, dk) != (b, d):
        raise ValueError(f"batch and head_dim must match: q {q.shape}, k {k.shape}, v {v.shape}")
    if hq % hkv:
        raise ValueError(f"q_heads={hq} must be a multiple of kv_heads={hkv} (GQA)")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise ValueError(f"flash_attention supports float32 or bfloat16 q, k, v of one dtype; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}: cast them to one of these")
    group = hq // hkv
    bq, bkv = min(bq, sq), min(bkv, sk)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    nk = pl.cdiv(sk, bkv)

    if causal:
        def kv_index(bi, h, i, j):
            last = (i * bq + bq - 1) // bkv  # Repeat the last needed block: no DMA when skipped.
            return (bi, h // group, jnp.minimum(j, last), 0)
    else:
        def kv_index(bi, h, i, j):
            return (bi, h // group, j, 0)

    kernel = functools.partial(_kernel, sm_scale=scale, causal=causal, bq=bq, bkv=bkv,
                               kv_tail=sk % bkv)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, hq, pl.cdiv(sq, bq), nk),
        in_specs=[
            pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j: (bi, h, i, 0)),
            pl.BlockSpec((None, None, bkv, d), kv_index),
            pl.BlockSpec((None, None, bkv, d), kv_index),
        ],
        out_specs=pl.BlockSpec((None, None, bq, d), lambda bi, h, i, j: (bi, h, i, 0)),
        scratch_shapes=[
            pltpu.VMEM((bq, _STAT_LANES), jnp.float32),
            pltpu.VMEM((bq, _STAT_LANES), jnp.float32),
            pltpu.VMEM((bq, d), jnp.float32),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"flash_attention_{bq}x{bkv}",
    )(q, k, v)


def _kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *, sm_scale, causal, bq, bkv,
            kv_tail):
    i, j = pl.program_id(2), pl.program_id(3)
    # exp(scale * (s - m)) as exp2(c * (s - m)): one multiply per score instead of two (the
    # scale, then exp's own log2(e)); the max is taken on unscaled scores (scale > 0).
    c = sm_scale * math.log2(math.e)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, _MASK_VALUE)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    def update(mask=False, tail=0):
        """One online-softmax step over this KV block. mask: apply the causal mask (blocks that
        straddle the diagonal); tail: valid keys of a ragged last block (0: all are valid)."""
        s = lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
        if mask:
            q_pos = i * bq + lax.broadcasted_iota(jnp.int32, s.shape, 0)
            k_pos = j * bkv + lax.broadcasted_iota(jnp.int32, s.shape, 1)
            s = jnp.where(q_pos >= k_pos, s, _MASK_VALUE)
        if tail:
            s = _ragged.fill_tail(s, tail, axis=1, value=_MASK_VALUE)
        m_prev = m_ref[:, :1]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        # bf16 inputs: the exponent in bf16 (the MXU takes p in bf16 anyway; v6e's VPU and EUP
        # work on bf16 natively), the row sum accumulated in f32 from the p actually used.
        p = jnp.exp2(((s - m_new) * c).astype(v_ref.dtype))
        alpha = jnp.exp2((m_prev - m_new) * c)
        l_new = alpha * l_ref[:, :1] + jnp.sum(p.astype(jnp.float32), axis=1, keepdims=True)
        v = v_ref[...]
        if tail:  # p is 0 there, but 0 * NaN is not: zero the values read past kv_len.
            v = _ragged.fill_tail(v, tail, axis=0)
        pv = jnp.dot(p, v, preferred_element_type=jnp.float32)
        acc_ref[...] = acc_ref[...] * alpha + pv
        m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)

    # Every query row sees a valid key in KV block 0 (key 0), so l > 0 at the end: even the rows
    # of a ragged last query block, which are dropped on store, never divide by zero.
    # Causal: blocks above the diagonal are skipped, blocks wholly below it need no mask.
    if not (causal or kv_tail):
        update()
    else:
        _dispatch(update, i, j, causal=causal, bq=bq, bkv=bkv, kv_tail=kv_tail)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        o_ref[...] = (acc_ref[...] / l_ref[:, :1]).astype(o_ref.dtype)


def _dispatch(update, i, j, *, causal, bq, bkv, kv_tail):
    """Runs ``update`` on the blocks that need it, masked only where a mask changes something."""
    true, false = jnp.bool_(True), jnp.bool_(False)
    run = j * bkv <= i * bq + bq - 1 if causal else true  # Skip blocks above the diagonal.
    below = j * bkv + bkv - 1 <= i * bq if causal else true  # Wholly below it: no mask.
    last = j == pl.num_programs(3) - 1 if kv_tail else false
    body = jnp.logical_and(run, jnp.logical_not(last))
    pl.when(jnp.logical_and(body, below))(update)
    if causal:
        pl.when(jnp.logical_and(body, jnp.logical_not(below)))(
            functools.partial(update, mask=True))
    if kv_tail:
        pl.when(jnp.logical_and(run, last))(functools.partial(update, mask=causal,
                                                              tail=kv_tail))


def _standin(args, kwargs, config):
    """Fewer batch rows and KV-head groups (identical work each), same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v = args
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    bq, bkv = min(config["bq"], sq), min(config["bkv"], sk)
    per_head = group * pl.cdiv(sq, bq) * pl.cdiv(sk, bkv)
    (nb, nh), scale = shrink_parallel([b, hkv], per_head)
    q2 = jax.ShapeDtypeStruct((nb, nh * group, sq, d), q.dtype)
    kv2 = jax.ShapeDtypeStruct((nb, nh, sk, d), k.dtype)
    return [q2, kv2, kv2], kwargs, scale


def flash_attention_reference(q, k, v, *, causal: bool = False, sm_scale: float | None = None):
    """Plain-JAX attention with the same semantics (f32 softmax)."""
    group = q.shape[1] // k.shape[1]
    k = jnp.repeat(k, group, axis=1)
    v = jnp.repeat(v, group, axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        qi = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
        ki = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
        s = jnp.where(qi >= ki, s, _MASK_VALUE)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


flash_attention = pt.tunable(space="flash_attention", reference=flash_attention_reference,
                             standin=_standin)(flash_attention)
