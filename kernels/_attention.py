"""What flash attention's forward (``flash_attention``) and backward (``flash_attention_bwd``)
share: the plain-JAX reference (with the masks of ``_masks``), its log-sum-exp, the mask value
and the accepted dtypes.

A module of its own so that the backward does not import the forward module, which imports the
backward for its gradient rule (no import circle).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_tune.kernels import _masks
from pallas_tune.kernels._masks import SegmentIds

__all__ = ["DTYPES", "MASK_VALUE", "SegmentIds", "check_qkv", "flash_attention_reference",
           "reference_lse"]

DTYPES = (jnp.float32, jnp.bfloat16)
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def check_qkv(name: str, q, k, v) -> None:
    """ValueError unless q (batch, q_heads, q_len, head_dim) and k, v (batch, kv_heads, kv_len,
    head_dim) fit: q_heads a multiple of kv_heads, one dtype, float32 or bfloat16."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{name} needs q (batch, q_heads, q_len, head_dim) and k, v "
                         f"(batch, kv_heads, kv_len, head_dim); got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}")
    b, hq, _, d = q.shape
    bk_, hkv, _, dk = k.shape
    if (bk_, dk) != (b, d):
        raise ValueError(f"batch and head_dim must match: q {q.shape}, k {k.shape}, v {v.shape}")
    if hq % hkv:
        raise ValueError(f"q_heads={hq} must be a multiple of kv_heads={hkv} (GQA)")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise ValueError(f"{name} supports float32 or bfloat16 q, k, v of one dtype; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}: cast them to one of these")


def _scores(q, k, *, causal, sm_scale, local_window_size=None, segment_ids=None):
    """sm_scale · q kᵀ in f32, (batch, q_heads, q_len, kv_len), k repeated over its GQA group;
    causal positions above the diagonal get ``MASK_VALUE``; with a window or segment ids, every
    position a query does not see gets -inf instead (see ``_masks``)."""
    masks = _masks.masks_of(q, k, causal=causal, local_window_size=local_window_size,
                            segment_ids=segment_ids)
    k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if masks is not None:
        seen = _masks.visible(masks, s.shape[-1:-3:-1], 0, 0, ragged=(False, False)).T
        if segment_ids is not None:
            qs, ks = segment_ids
            seen = jnp.logical_and(seen, qs[:, None, :, None] == ks[:, None, None, :])
        return jnp.where(seen, s, -jnp.inf)
    if causal:
        qi = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
        ki = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
        s = jnp.where(qi >= ki, s, MASK_VALUE)
    return s


def _probs(s):
    """softmax over the last axis where some score is finite; rows of -inf only (a query that
    sees no key) are 0, with finite gradients."""
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def flash_attention_reference(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                              local_window_size=None, segment_ids=None):
    """Plain-JAX attention with the same semantics (f32 softmax; a query that sees no key,
    under a window or segment ids, gives 0)."""
    s = _scores(q, k, causal=causal, sm_scale=sm_scale, local_window_size=local_window_size,
                segment_ids=segment_ids)
    v = jnp.repeat(v, q.shape[1] // v.shape[1], axis=1)
    masked = local_window_size is not None or segment_ids is not None
    p = _probs(s) if masked else jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


def reference_lse(q, k, *, causal: bool = False, sm_scale: float | None = None,
                  local_window_size=None, segment_ids=None):
    """The per-row log-sum-exp of the scaled scores, (batch, q_heads, q_len) float32: what the
    forward saves for the backward (``p = exp(sm_scale · q kᵀ - lse)``); -inf for a query that
    sees no key."""
    return jax.nn.logsumexp(_scores(q, k, causal=causal, sm_scale=sm_scale,
                                    local_window_size=local_window_size,
                                    segment_ids=segment_ids), axis=-1)
