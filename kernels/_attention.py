"""What flash attention's forward (``flash_attention``) and backward (``flash_attention_bwd``)
share: the plain-JAX reference, its log-sum-exp, the mask value and the accepted dtypes.

A module of its own so that the backward does not import the forward module, which imports the
backward for its gradient rule (no import circle).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["DTYPES", "MASK_VALUE", "check_qkv", "flash_attention_reference", "reference_lse"]

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


def _scores(q, k, *, causal, sm_scale):
    """sm_scale · q kᵀ in f32, (batch, q_heads, q_len, kv_len), k repeated over its GQA group;
    causal positions above the diagonal get ``MASK_VALUE``."""
    k = jnp.repeat(k, q.shape[1] // k.shape[1], axis=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        qi = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
        ki = lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
        s = jnp.where(qi >= ki, s, MASK_VALUE)
    return s


def flash_attention_reference(q, k, v, *, causal: bool = False, sm_scale: float | None = None):
    """Plain-JAX attention with the same semantics (f32 softmax)."""
    v = jnp.repeat(v, q.shape[1] // v.shape[1], axis=1)
    p = jax.nn.softmax(_scores(q, k, causal=causal, sm_scale=sm_scale), axis=-1)
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


def reference_lse(q, k, *, causal: bool = False, sm_scale: float | None = None):
    """The per-row log-sum-exp of the scaled scores, (batch, q_heads, q_len) float32: what the
    forward saves for the backward (``p = exp(sm_scale · q kᵀ - lse)``)."""
    return jax.nn.logsumexp(_scores(q, k, causal=causal, sm_scale=sm_scale), axis=-1)
