"""The layers ``step_tuning.py`` estimates, each written once over its ops (pallas-tune's
tunable kernels by default).

Shapes are per chip. Llama-3.1-70B is the tensor-parallel shard of 8 chips (Megatron style:
8 of 64 query heads, 1 of 8 KV heads, 3584 of 28672 MLP columns); the two all-reduces a TP
layer does are not part of any figure (one chip's compute only).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from pallas_tune.kernels.flash_attention import flash_attention
from pallas_tune.kernels.grouped_matmul import grouped_matmul
from pallas_tune.kernels.matmul import matmul
from pallas_tune.kernels.rms_norm import rms_norm

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Ops:
    """What a layer calls for its matmuls, norms, causal attention and grouped matmuls."""
    mm: Callable[..., Any] = matmul
    norm: Callable[..., Any] = rms_norm
    attn: Callable[..., Any] = lambda q, k, v: flash_attention(q, k, v, causal=True)
    gmm: Callable[..., Any] = grouped_matmul


def _rope(x):  # x (heads, T, 128): rotary embedding in plain JAX.
    half = x.shape[-1] // 2
    freq = 1.0 / (500000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * freq[None]
    cos, sin = jnp.cos(ang).astype(x.dtype), jnp.sin(ang).astype(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], -1)


def _heads(qkv, t, start, n):  # (T, cols) -> (1, n, T, 128), columns [start, start + n*128).
    return qkv[:, start:start + n * 128].reshape(t, n, 128).transpose(1, 0, 2)[None]


def _attention_block(x, n1, wqkv, wo, q_heads: int, kv_heads: int, ops: Ops):
    """x plus causal GQA self-attention of its norm (heads of 128, RoPE on q and k)."""
    t, nq = x.shape[0], q_heads * 128
    qkv = ops.mm(ops.norm(x, n1, eps=1e-5), wqkv)
    q = _rope(_heads(qkv, t, 0, q_heads)[0])[None]
    k = _rope(_heads(qkv, t, nq, kv_heads)[0])[None]
    v = _heads(qkv, t, nq + kv_heads * 128, kv_heads)
    return x + ops.mm(ops.attn(q, k, v)[0].transpose(1, 0, 2).reshape(t, nq), wo)


def llama8b(x, n1, wqkv, wo, n2, wg, wu, wd, ops: Ops = Ops()):
    """One Llama-3.1-8B decoder layer on x (T, 4096): 32 query / 8 KV heads of 128, MLP 14336."""
    x = _attention_block(x, n1, wqkv, wo, 32, 8, ops)
    h = ops.norm(x, n2, eps=1e-5)
    return x + ops.mm(jax.nn.silu(ops.mm(h, wg)) * ops.mm(h, wu), wd)


def llama8b_args(t: int):
    d, f = 4096, 14336
    return (S((t, d), BF), S((d,), BF), S((d, 6144), BF), S((d, d), BF), S((d,), BF),
            S((d, f), BF), S((d, f), BF), S((f, d), BF))


def llama70b_tp8(x, n1, wqkv, wo, n2, wgu, wd, ops: Ops = Ops()):
    """One chip's shard of a Llama-3.1-70B decoder layer under 8-way tensor parallelism, on x
    (T, 8192): 8 query / 1 KV head of 128, fused gate|up of 2 x 3584 columns."""
    x = _attention_block(x, n1, wqkv, wo, 8, 1, ops)  # An all-reduce after (not counted).
    h = ops.norm(x, n2, eps=1e-5)
    gu = ops.mm(h, wgu)
    return x + ops.mm(jax.nn.silu(gu[:, :3584]) * gu[:, 3584:], wd)  # And here.


def llama70b_tp8_args(t: int):
    d = 8192
    return (S((t, d), BF), S((d,), BF), S((d, 1280), BF), S((1024, d), BF), S((d,), BF),
            S((d, 7168), BF), S((3584, d), BF))


def _route(x, router):
    """Top-2 of the router's experts: (token index of each routed row, grouped by expert; the
    rows' gate weights; the group sizes, balanced here)."""
    t, e = x.shape[0], router.shape[1]
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits), 2)
    order = jnp.argsort(experts.reshape(-1))
    gate = weights.reshape(-1)[order][:, None].astype(x.dtype)
    return order // 2, gate, jnp.full((e,), 2 * t // e, jnp.int32)


def moe(x, router, wg, wu, wd, ops: Ops = Ops()):
    """A Mixtral-8x7B MoE MLP on x (T, 4096): top-2 of 8 experts; rows sorted by expert."""
    token, gate, sizes = _route(x, router)
    rows = x[token]  # Each token twice, grouped by expert (balanced sizes assumed here).
    h = jax.nn.silu(ops.gmm(rows, wg, sizes)) * ops.gmm(rows, wu, sizes)
    return jnp.zeros_like(x).at[token].add(ops.gmm(h, wd, sizes) * gate)


def mixtral_tp8(x, n1, wqkv, wo, n2, router, wgu, wd, ops: Ops = Ops()):
    """One chip's shard of a Mixtral-8x7B decoder layer under 8-way tensor parallelism, on x
    (T, 4096): 4 of 32 query heads and 1 of 8 KV heads of 128; every expert's columns split
    8 ways (as ``search_spaces/mixtral_training_grouped_matmul.toml``: a fused w1|w3 of
    2 x 1792 columns, 1792 rows of w2), the router replicated; top-2 of 8 experts."""
    x = _attention_block(x, n1, wqkv, wo, 4, 1, ops)  # An all-reduce after (not counted).
    h = ops.norm(x, n2, eps=1e-5)
    token, gate, sizes = _route(h, router)
    gu = ops.gmm(h[token], wgu, sizes)
    out = ops.gmm(jax.nn.silu(gu[:, :1792]) * gu[:, 1792:], wd, sizes) * gate
    return x + jnp.zeros_like(x).at[token].add(out)  # And here.


def mixtral_tp8_args(t: int):
    d, e = 4096, 8
    return (S((t, d), BF), S((d,), BF), S((d, 768), BF), S((512, d), BF), S((d,), BF),
            S((d, e), BF), S((e, d, 3584), BF), S((e, 1792, d), BF))


def moe_args(t: int):
    d, f, e = 4096, 14336, 8
    return (S((t, d), BF), S((d, e), BF), S((e, d, f), BF), S((e, d, f), BF), S((e, f, d), BF))


REMAT = {"none": None, "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
         "dots_saveable": jax.checkpoint_policies.dots_saveable}


def train(layer: Callable[..., Any], ops: Ops = Ops(), remat: str = "none"
          ) -> Callable[..., Any]:
    """jax.grad of the layer's output sum, over the input and every weight; ``remat``: the
    layer under ``jax.checkpoint`` with that policy ("none": no checkpoint, every residual
    kept for the backward)."""
    def step(x, *weights):
        def loss(*a):
            return layer(*a, ops=ops).astype(jnp.float32).sum()

        if remat != "none":
            loss = jax.checkpoint(loss, policy=REMAT[remat])
        return jax.grad(loss, argnums=tuple(range(1 + len(weights))))(x, *weights)
    return step
