"""Tunable adapters for the Pallas TPU ops that JAX itself ships: called, not copied.

- :func:`flash_attention`: ``jax.experimental.pallas.ops.tpu.flash_attention`` (its
  ``BlockSizes``: block_q, block_k_major, block_k).
- :func:`splash_attention`: ``...ops.tpu.splash_attention`` forward (block_q, block_kv,
  block_kv_compute), causal or full mask, GQA, one kernel per batch row (vmapped).
- :func:`megablox_gmm`: ``...ops.tpu.megablox.gmm`` tiling (tm, tk, tn).

Each adapter checks what its upstream kernel accepts (read from its source and tried in interpret
mode and in deviceless v6e compiles, JAX 0.12) before tracing it, and raises ``ValueError`` for
inputs no config can run and ``pallas_tune.InvalidConfig`` for a config that does not fit the
shapes; the messages name the fix, often ``pallas_tune.kernels``' own kernel, which takes any
shape. On a CPU host they run in interpret mode like every tunable kernel. Paged and ragged paged
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
_DTYPES = (jnp.float32, jnp.bfloat16)  # Mosaic rejects float16 loads; megablox takes only these.
_LANES, _SUBLANES = 128, 8  # The TPU block rule: last two block dims multiples, or the full dims.


def _mha_reference(q, k, v, *, causal=False, sm_scale=None):
    return flash_attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)


@pt.tunable(block_q=_BLOCKS, block_k_major=_BLOCKS, block_k=[128, 256, 512],
            default={"block_q": 128, "block_k_major": 128, "block_k": 128},
            reference=_mha_reference, name="jax.ops.tpu.flash_attention")
def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    block_q: int, block_k_major: int, block_k: int):
    """JAX's TPU flash attention: q, k, v (batch, heads, seq, head_dim), equal head counts.

    Accepts any q_len; kv_len divisible by the (clamped) block_k_major and block_k; block_k a
    multiple of 128 unless it spans kv_len; head_dim ≤ 128 or a multiple of 128 unless one
    block spans kv_len; float32 or bfloat16.
    """
    _check_attention("JAX's flash_attention", q, k, v, gqa=False)
    s_q, s_k, d = q.shape[2], k.shape[2], q.shape[3]
    bq, bkm, bk = min(block_q, s_q), min(block_k_major, s_k), min(block_k, s_k)
    _check_tile("block_q", bq, "q_len", s_q, _SUBLANES)
    if s_k % bkm or s_k % bk:
        raise pt.InvalidConfig(
            f"block_k_major={bkm} and block_k={bk} must divide kv_len={s_k} in JAX's "
            "flash_attention: choose blocks that divide it, or use "
            "pallas_tune.kernels.flash_attention (any kv_len)")
    if bkm % bk:
        raise pt.InvalidConfig(f"block_k={bk} must divide block_k_major={bkm}")
    if bk != s_k and bk % _LANES:
        raise pt.InvalidConfig(f"block_k={bk} must be a multiple of {_LANES} unless it spans "
                               f"kv_len={s_k}")
    if bk != s_k and d > _LANES and d % _LANES:
        raise pt.InvalidConfig(
            f"head_dim={d} must be a multiple of {_LANES} in JAX's flash_attention when kv_len="
            f"{s_k} takes more than one block (block_k={bk}): use block_k ≥ kv_len, or "
            "pallas_tune.kernels.flash_attention (any head_dim)")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    sizes = _fa.BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1)
    return _fa.flash_attention(q, k, v, causal=causal, sm_scale=scale, block_sizes=sizes)


@pt.tunable(block_q=_BLOCKS, block_kv=_BLOCKS, block_kv_compute=[128, 256, 512],
            default={"block_q": 128, "block_kv": 128, "block_kv_compute": 128},
            reference=_mha_reference, name="jax.ops.tpu.splash_attention")
def splash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                     block_q: int, block_kv: int, block_kv_compute: int):
    """JAX's splash attention forward: q (batch, q_heads, q_len, head_dim), k and v (batch,
    kv_heads, kv_len, head_dim), q_heads a multiple of kv_heads.

    Accepts q_len divisible by the (clamped) block_q; kv_len a multiple of 128 divisible by
    block_kv, itself divisible by block_kv_compute (a multiple of 128); any head_dim; float32 or
    bfloat16.
    """
    _check_attention("JAX's splash_attention", q, k, v, gqa=True)
    b, h, s_q, d = q.shape
    s_k = k.shape[2]
    if s_k % _LANES:
        raise ValueError(
            f"JAX's splash_attention needs kv_len to be a multiple of {_LANES} (its "
            f"block_kv_compute must be); got kv_len={s_k}: use "
            "pallas_tune.kernels.flash_attention (any kv_len)")
    bq, bkv, bkvc = min(block_q, s_q), min(block_kv, s_k), min(block_kv_compute, s_k)
    _check_tile("block_q", bq, "q_len", s_q, _SUBLANES)
    for name, block, dim_name, dim in (("block_q", bq, "q_len", s_q),
                                       ("block_kv", bkv, "kv_len", s_k)):
        if dim % block:
            raise pt.InvalidConfig(
                f"{name}={block} must divide {dim_name}={dim} in JAX's splash_attention: choose "
                "a block that divides it, or use pallas_tune.kernels.flash_attention (any "
                "length)")
    if bkv % bkvc or bkvc % _LANES:
        raise pt.InvalidConfig(f"block_kv_compute={bkvc} must be a multiple of {_LANES} that "
                               f"divides block_kv={bkv}")
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
    """JAX's megablox grouped matmul: lhs (m, k), rhs (groups, k, n), int32 group_sizes
    (groups,) summing to m.

    Accepts m divisible by the (clamped) tm; any k and n; float32 or bfloat16 (one dtype).
    """
    if (lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]
            or group_sizes.shape != rhs.shape[:1]):
        raise ValueError(f"megablox gmm needs lhs (m, k), rhs (groups, k, n) and group_sizes "
                         f"(groups,); got lhs {lhs.shape}, rhs {rhs.shape}, group_sizes "
                         f"{group_sizes.shape}")
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"megablox gmm needs int32 group_sizes; got {group_sizes.dtype}: "
                         "pass group_sizes.astype(jnp.int32)")
    if lhs.dtype != rhs.dtype or lhs.dtype not in _DTYPES:
        raise ValueError(f"megablox gmm takes float32 or bfloat16 lhs and rhs (here of one "
                         f"dtype); got {lhs.dtype}, {rhs.dtype}: cast both to one of these")
    m, k = lhs.shape
    n = rhs.shape[2]
    tm, tk, tn = min(tm, m), min(tk, k), min(tn, n)
    if m % tm:
        raise pt.InvalidConfig(
            f"tm={tm} must divide m={m} in JAX's megablox gmm: choose a tm that divides m, pad "
            "lhs with rows no group owns and slice the output, or use "
            "pallas_tune.kernels.grouped_matmul (any m)")
    _check_tile("tm", tm, "m", m, _SUBLANES)
    _check_tile("tk", tk, "k", k, _LANES)
    _check_tile("tn", tn, "n", n, _LANES)
    return _gmm.gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype,
                    tiling=(tm, tk, tn))


def _check_attention(name: str, q, k, v, *, gqa: bool) -> None:
    """ValueError for attention inputs the upstream kernel ``name`` cannot take."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{name} needs q (batch, heads, q_len, head_dim) and k, v (batch, "
                         f"heads, kv_len, head_dim); got q {q.shape}, k {k.shape}, v {v.shape}")
    (b, hq, _, d), (bk, hkv, _, dk) = q.shape, k.shape
    if (bk, dk) != (b, d):
        raise ValueError(f"{name}: batch and head_dim must match; got q {q.shape}, k {k.shape}")
    if gqa and hq % hkv:
        raise ValueError(f"{name}: q_heads={hq} must be a multiple of kv_heads={hkv}")
    if not gqa and hq != hkv:
        raise ValueError(
            f"{name} needs as many k/v heads as q heads; got q_heads={hq}, kv_heads={hkv}: "
            f"repeat k and v (jnp.repeat(k, {max(1, hq // hkv)}, axis=1)), or use "
            "splash_attention or pallas_tune.kernels.flash_attention, which take GQA")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in _DTYPES:
        raise ValueError(f"{name} takes float32 or bfloat16 q, k, v of one dtype; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}: cast them to one of these")


def _check_tile(name: str, tile: int, dim_name: str, dim: int, multiple: int) -> None:
    """The TPU block rule for one tile: a multiple of ``multiple``, or the whole dimension."""
    if tile != dim and tile % multiple:
        raise pt.InvalidConfig(f"{name}={tile} must be a multiple of {multiple} or equal "
                               f"{dim_name}={dim} (the TPU block rule)")
