"""Tunable adapters for the Pallas TPU ops that JAX itself ships: called, not copied.

- :func:`flash_attention`: ``jax.experimental.pallas.ops.tpu.flash_attention`` (its
  ``BlockSizes``: block_q, block_k_major, block_k).
- :func:`splash_attention`: ``...ops.tpu.splash_attention`` forward (block_q, block_kv,
  block_kv_compute), causal or full mask, one kernel per batch row (vmapped).
- :func:`megablox_gmm`: ``...ops.tpu.megablox.gmm`` tiling (tm, tk, tn).

On a CPU host they run in interpret mode like every tunable kernel. Paged and ragged paged
attention take page tables and ragged metadata that no generic shape spec describes; they are
not adapted here.
"""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as _fa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _masks

import pallas_tune as pt
from pallas_tune.kernels.flash_attention import flash_attention_reference
from pallas_tune.kernels.grouped_matmul import _inputs as _group_inputs
from pallas_tune.kernels.grouped_matmul import grouped_matmul_reference

__all__ = ["flash_attention", "megablox_gmm", "splash_attention"]

# The megablox package re-exports the function `gmm` under its module's name; take the module.
_gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

_BLOCKS = [128, 256, 512, 1024]


def _mha_reference(q, k, v, *, causal=False, sm_scale=None):
    return flash_attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)


@pt.tunable(block_q=_BLOCKS, block_k_major=_BLOCKS, block_k=[128, 256, 512],
            default={"block_q": 128, "block_k_major": 128, "block_k": 128},
            reference=_mha_reference, name="jax.ops.tpu.flash_attention")
def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    block_q: int, block_k_major: int, block_k: int):
    """JAX's TPU flash attention (q, k, v: batch, heads, seq, head_dim; equal head counts)."""
    s_q, s_k = q.shape[2], k.shape[2]
    bq, bkm, bk = min(block_q, s_q), min(block_k_major, s_k), min(block_k, s_k)
    if bkm % bk:
        raise pt.InvalidConfig(f"block_k={bk} must divide block_k_major={bkm}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    sizes = _fa.BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1)
    return _fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes)


@pt.tunable(block_q=_BLOCKS, block_kv=_BLOCKS, block_kv_compute=[128, 256, 512],
            default={"block_q": 128, "block_kv": 128, "block_kv_compute": 128},
            reference=_mha_reference, name="jax.ops.tpu.splash_attention")
def splash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                     block_q: int, block_kv: int, block_kv_compute: int):
    """JAX's splash attention forward (q, k, v: batch, heads, seq, head_dim)."""
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    bq, bkv, bkvc = min(block_q, s_q), min(block_kv, s_k), min(block_kv_compute, s_k)
    if bkv % bkvc:
        raise pt.InvalidConfig(f"block_kv_compute={bkvc} must divide block_kv={bkv}")
    head = _masks.CausalMask((s_q, s_k)) if causal else _masks.FullMask((s_q, s_k))
    mask = _masks.MultiHeadMask([head] * h)
    sizes = _splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc)
    kernel = _splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    return jax.vmap(kernel)(q * jnp.asarray(scale, q.dtype), k, v)


@pt.tunable(tm=[128, 256, 512], tk=[128, 256, 512, 1024], tn=[128, 256, 512, 1024],
            default={"tm": 128, "tk": 128, "tn": 128}, reference=grouped_matmul_reference,
            inputs=_group_inputs, name="jax.ops.tpu.megablox.gmm")
def megablox_gmm(lhs, rhs, group_sizes, *, tm: int, tk: int, tn: int):
    """JAX's megablox grouped matmul: lhs (m, k), rhs (groups, k, n), group_sizes (groups,)."""
    m, k = lhs.shape
    n = rhs.shape[2]
    tiling = (min(tm, m), min(tk, k), min(tn, n))
    return _gmm.gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, tiling=tiling)
