"""Tunable adapters for the Pallas TPU ops that JAX itself ships: called, not copied.

- :func:`flash_attention`: ``jax.experimental.pallas.ops.tpu.flash_attention`` (its
  ``BlockSizes``: block_q, block_k_major, block_k).
- :func:`splash_attention`: ``...ops.tpu.splash_attention`` forward (block_q, block_kv,
  block_kv_compute), causal or full mask, GQA, one kernel per batch row (vmapped).
- :func:`megablox_gmm`: ``...ops.tpu.megablox.gmm`` tiling (tm, tk, tn).

The two attention adapters are differentiable, each gradient a tunable kernel of its own called
with no blocks from a ``jax.custom_vjp`` rule, so that its blocks are resolved from the cache
when the gradient is traced: :func:`flash_attention_bwd` (upstream's backward BlockSizes: its
dK/dV and dQ kernels through upstream's own VJP rule, on the residuals o, l, m that upstream's
forward saves) and :func:`splash_attention_bwd` (splash's backward BlockSizes and
``use_fused_bwd_kernel``; splash keeps its residuals private, so this one recomputes upstream's
forward before upstream's VJP). :func:`megablox_gmm` likewise, its gradient
:func:`megablox_gmm_bwd` with tilings of its own for dlhs (gmm against rhs transposed) and drhs
(``tgmm``). Without differentiation the forwards lower as before.

Each adapter checks what its upstream kernel accepts (read from its source and tried in interpret
mode and in deviceless v6e compiles, JAX 0.12) before tracing it, and raises ``ValueError`` for
inputs no config can run and ``pallas_tune.InvalidConfig`` for a config that does not fit the
shapes; the messages name the fix, often ``pallas_tune.kernels``' own kernel, which takes any
shape. On a CPU host they run in interpret mode like every tunable kernel. Paged and ragged paged
attention take page tables and ragged metadata that no generic shape spec describes; they are
not adapted here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as _fa
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as _splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as _masks

import pallas_tune as pt
from pallas_tune import chips
from pallas_tune.kernels import _splash as _standin
from pallas_tune.kernels._attention import flash_attention_reference
from pallas_tune.kernels.flash_attention_bwd import (flash_attention_bwd_args,
                                                     flash_attention_bwd_reference)
from pallas_tune.kernels.grouped_matmul import _inputs as _group_inputs
from pallas_tune.kernels.grouped_matmul import grouped_matmul_reference

__all__ = ["flash_attention", "flash_attention_bwd", "megablox_gmm", "megablox_gmm_bwd",
           "splash_attention", "splash_attention_bwd"]

# The megablox package re-exports the function `gmm` under its module's name; take the module.
_gmm = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")

_BLOCKS = [128, 256, 512, 1024]
# Splash's sequence blocks: up to 4096, as flash_attention's (MaxText's long-context configs use
# 2048), so that a comparison of the two tuned kernels gives each the same range.
_SPLASH_BLOCKS = [*_BLOCKS, 2048, 4096]
_DTYPES = (jnp.float32, jnp.bfloat16)  # Mosaic rejects float16 loads; megablox takes only these.
_LANES, _SUBLANES = 128, 8  # The TPU block rule: last two block dims multiples, or the full dims.
_FA_BWD_BLOCKS = ("block_q_major_dkv", "block_q_dkv", "block_k_major_dkv", "block_k_dkv",
                  "block_q_dq", "block_k_major_dq", "block_k_dq")


def _attention_rule(causal: bool) -> str:
    """Sharded jit (pallas_tune.runtime.partition): batch and heads split (query heads with
    their KV heads); queries too where no causal mask ties them to their positions."""
    return ("b h S D, b h T D, b h T D -> b h S D" if causal
            else "b h s D, b h T D, b h T D -> b h s D")


def _mha_reference(q, k, v, *, causal=False, sm_scale=None):
    return flash_attention_reference(q, k, v, causal=causal, sm_scale=sm_scale)


@pt.tunable(block_q=_BLOCKS, block_k_major=_BLOCKS, block_k=[128, 256, 512],
            default={"block_q": 128, "block_k_major": 128, "block_k": 128},
            reference=_mha_reference, name="jax.ops.tpu.flash_attention",
            partition=lambda *a, causal=False, **_: _attention_rule(causal))
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
    sizes = _fa.BlockSizes(block_q=bq, block_k_major=bkm, block_k=bk, block_b=1)
    return _flash(q, k, v, causal, sm_scale, sizes)


# Differentiable with backward blocks of its own: upstream's VJP takes them from the forward's
# BlockSizes, so here the forward saves upstream's residuals (o, l, m) and the gradient calls the
# tunable `flash_attention_bwd` with no blocks: they are resolved when the gradient is traced.
# Not differentiated, the forward is upstream's call as before.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _flash(q, k, v, causal, sm_scale, sizes):
    return _fa.flash_attention(q, k, v, causal=causal, sm_scale=_scale(q, sm_scale),
                               block_sizes=sizes)


def _flash_fwd(q, k, v, causal, sm_scale, sizes):
    # Under jax.checkpoint this rule is traced later, outside the tunable call's interpret mode.
    with chips.interpret_mode() if chips.should_interpret() else contextlib.nullcontext():
        o, l, m = _fa._flash_attention(q, k, v, None, None, True, causal, _scale(q, sm_scale),
                                       sizes, False)
    return o, (q, k, v, o, l, m)


def _flash_bwd(causal, sm_scale, sizes, residuals, do):
    return flash_attention_bwd(*residuals, do, causal=causal, sm_scale=sm_scale)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _scale(q, sm_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale


def _fa_bwd_reference(q, k, v, o, l, m, do, *, causal=False, sm_scale=None):
    """(dq, dk, dv) by jax.vjp of the plain-JAX attention (o, l, m are not used)."""
    return flash_attention_bwd_reference(q, k, v, o, l, do, causal=causal, sm_scale=sm_scale)


def _fa_bwd_inputs(q, k, v, o, l, m, do, **kwargs):
    """Tuning inputs: q, k, v, do at random, o from the reference; upstream's backward uses
    p = exp(s - m) / l, so m = lse and l = 1 give the exact p."""
    (q, k, v, o, lse, do), opts = flash_attention_bwd_args((q, k, v), kwargs)
    return (q, k, v, o, jnp.ones_like(lse), lse, do), opts


@pt.tunable(block_q_major_dkv=_BLOCKS, block_q_dkv=_BLOCKS[:3], block_k_major_dkv=_BLOCKS,
            block_k_dkv=_BLOCKS[:3], block_q_dq=_BLOCKS, block_k_major_dq=_BLOCKS,
            block_k_dq=_BLOCKS[:3], default={name: 128 for name in _FA_BWD_BLOCKS},
            reference=_fa_bwd_reference, inputs=_fa_bwd_inputs,
            name="jax.ops.tpu.flash_attention_bwd",
            partition="b h S D, b h T D, b h T D, b h S D, b h S, b h S, b h S D"
                      " -> b h S D, b h T D, b h T D")
def flash_attention_bwd(q, k, v, o, l, m, do, *, causal: bool = False,
                        sm_scale: float | None = None, block_q_major_dkv: int,
                        block_q_dkv: int, block_k_major_dkv: int, block_k_dkv: int,
                        block_q_dq: int, block_k_major_dq: int, block_k_dq: int):
    """The backward of JAX's TPU flash attention (its dK/dV and dQ kernels, through its own VJP
    rule), with its backward BlockSizes as the tuned parameters: (dq, dk, dv) from the
    forward's inputs, its residuals o and l, m ((batch, heads, q_len) float32: the softmax
    denominator and row max) and the cotangent do.

    Accepts what the forward accepts, and q_len divisible by the (clamped) q blocks, kv_len by
    the KV blocks, each minor block dividing its major one.
    """
    _check_attention("JAX's flash_attention backward", q, k, v, gqa=False)
    s_q, s_k = q.shape[2], k.shape[2]
    blocks = dict(block_q_major_dkv=block_q_major_dkv, block_q_dkv=block_q_dkv,
                  block_k_major_dkv=block_k_major_dkv, block_k_dkv=block_k_dkv,
                  block_q_dq=block_q_dq, block_k_major_dq=block_k_major_dq,
                  block_k_dq=block_k_dq)
    for name, block in blocks.items():
        dim_name, dim, rule = (("q_len", s_q, _SUBLANES) if name.startswith("block_q")
                               else ("kv_len", s_k, _LANES))
        blocks[name] = block = min(block, dim)
        if dim % block:
            raise pt.InvalidConfig(
                f"{name}={block} must divide {dim_name}={dim} in JAX's flash_attention "
                "backward: choose blocks that divide it, or use "
                "pallas_tune.kernels.flash_attention (any length)")
        _check_tile(name, block, dim_name, dim, rule)
    for major, minor in (("block_q_major_dkv", "block_q_dkv"),
                         ("block_k_major_dkv", "block_k_dkv"),
                         ("block_k_major_dq", "block_k_dq")):
        if blocks[major] % blocks[minor]:
            raise pt.InvalidConfig(f"{minor}={blocks[minor]} must divide "
                                   f"{major}={blocks[major]}")
    sizes = _fa.BlockSizes(block_q=128, block_k_major=128, block_k=128, block_b=1, **blocks)
    dq, dk, dv, _, _ = _fa._flash_attention_bwd(False, causal, _scale(q, sm_scale), sizes, False,
                                                (q, k, v, None, None, o, l, m), do)
    return dq, dk, dv


@pt.tunable(block_q=_SPLASH_BLOCKS, block_kv=_SPLASH_BLOCKS, block_kv_compute=_BLOCKS,
            default={"block_q": 128, "block_kv": 128, "block_kv_compute": 128},
            reference=_mha_reference, name="jax.ops.tpu.splash_attention",
            standin=_standin.forward_standin, key_optional=["tables"],
            partition=lambda *a, causal=False, **_: _attention_rule(causal))
def splash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                     block_q: int, block_kv: int, block_kv_compute: int, tables: bool = True):
    """JAX's splash attention forward: q (batch, q_heads, q_len, head_dim), k and v (batch,
    kv_heads, kv_len, head_dim), q_heads a multiple of kv_heads. ``tables=False`` is the
    estimate's stand-in (``kernels._splash``): every block computed, unmasked, in grid order.

    Accepts q_len divisible by the (clamped) block_q; kv_len a multiple of 128 divisible by
    block_kv, itself divisible by block_kv_compute (a multiple of 128); any head_dim; float32 or
    bfloat16.
    """
    _check_attention("JAX's splash_attention", q, k, v, gqa=True)
    s_q, s_k = q.shape[2], k.shape[2]
    if s_k % _LANES:
        raise ValueError(
            f"JAX's splash_attention needs kv_len to be a multiple of {_LANES} (its "
            f"block_kv_compute must be); got kv_len={s_k}: use "
            "pallas_tune.kernels.flash_attention (any kv_len)")
    bq, bkv, bkvc = _splash_blocks(s_q, s_k, block_q, block_kv, block_kv_compute)
    sizes = _splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc)
    return _splash_fn(q, k, v, causal, sm_scale, sizes, tables)


def _splash_blocks(s_q, s_k, block_q, block_kv, block_kv_compute, suffix=""):
    """The clamped (block_q, block_kv, block_kv_compute); InvalidConfig where splash refuses."""
    bq, bkv, bkvc = min(block_q, s_q), min(block_kv, s_k), min(block_kv_compute, s_k)
    _check_tile(f"block_q{suffix}", bq, "q_len", s_q, _SUBLANES)
    for name, block, dim_name, dim in ((f"block_q{suffix}", bq, "q_len", s_q),
                                       (f"block_kv{suffix}", bkv, "kv_len", s_k)):
        if dim % block:
            raise pt.InvalidConfig(
                f"{name}={block} must divide {dim_name}={dim} in JAX's splash_attention: choose "
                "a block that divides it, or use pallas_tune.kernels.flash_attention (any "
                "length)")
    if bkv % bkvc or bkvc % _LANES:
        raise pt.InvalidConfig(f"block_kv{suffix}_compute={bkvc} must be a multiple of {_LANES} "
                               f"that divides block_kv{suffix}={bkv}")
    return bq, bkv, bkvc


def _splash_call(q, k, v, causal, sm_scale, sizes, tables=True):
    """Upstream's splash attention with these BlockSizes, vmapped over the batch (without its
    mask tables: the estimate's stand-in, ``kernels._splash``)."""
    s_q, s_k = q.shape[2], k.shape[2]
    head = _masks.CausalMask((s_q, s_k)) if causal else _masks.FullMask((s_q, s_k))
    mask = _masks.MultiHeadMask([head] * q.shape[1])
    kernel = _splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1)
    if not tables:
        kernel = _standin.strip_tables(kernel)
    return jax.vmap(kernel)(q * jnp.asarray(_scale(q, sm_scale), q.dtype), k, v)


# Differentiable with backward blocks of its own, resolved when the gradient is traced. Splash's
# residuals and mask infos are private to its VJP, so the gradient (`splash_attention_bwd`)
# recomputes upstream's forward with full BlockSizes and runs upstream's VJP: one forward more
# than upstream's own gradient. Not differentiated, the forward is upstream's call as before.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _splash_fn(q, k, v, causal, sm_scale, sizes, tables):
    return _splash_call(q, k, v, causal, sm_scale, sizes, tables)


def _splash_fwd(q, k, v, causal, sm_scale, sizes, tables):
    with chips.interpret_mode() if chips.should_interpret() else contextlib.nullcontext():
        return _splash_call(q, k, v, causal, sm_scale, sizes, tables), (q, k, v)


def _splash_bwd(causal, sm_scale, sizes, tables, residuals, do):
    return splash_attention_bwd(*residuals, do, causal=causal, sm_scale=sm_scale,
                                tables=tables)


_splash_fn.defvjp(_splash_fwd, _splash_bwd)


def _splash_bwd_reference(q, k, v, do, *, causal=False, sm_scale=None):
    """(dq, dk, dv) by jax.vjp of the plain-JAX attention."""
    return flash_attention_bwd_reference(q, k, v, None, None, do, causal=causal,
                                         sm_scale=sm_scale)


@pt.tunable(block_q_dkv=_SPLASH_BLOCKS, block_kv_dkv=_SPLASH_BLOCKS,
            block_kv_dkv_compute=_BLOCKS, block_q_dq=_SPLASH_BLOCKS, block_kv_dq=_SPLASH_BLOCKS,
            use_fused_bwd_kernel=[False, True],
            default={"block_q_dkv": 128, "block_kv_dkv": 128, "block_kv_dkv_compute": 128,
                     "block_q_dq": 128, "block_kv_dq": 128, "use_fused_bwd_kernel": False},
            reference=_splash_bwd_reference, name="jax.ops.tpu.splash_attention_bwd",
            standin=_standin.backward_standin, key_optional=["tables"],
            partition="b h S D, b h T D, b h T D, b h S D -> b h S D, b h T D, b h T D")
def splash_attention_bwd(q, k, v, do, *, causal: bool = False, sm_scale: float | None = None,
                         block_q_dkv: int, block_kv_dkv: int, block_kv_dkv_compute: int,
                         block_q_dq: int, block_kv_dq: int, use_fused_bwd_kernel: bool,
                         tables: bool = True):
    """The backward of JAX's splash attention with its backward BlockSizes as the tuned
    parameters: (dq, dk, dv) for the cotangent do. Upstream's forward is recomputed first (its
    blocks: the dK/dV ones), then upstream's VJP runs its dK/dV and dQ kernels (one fused
    kernel with ``use_fused_bwd_kernel``, where block_q_dq and block_kv_dq are unused).

    Accepts what ``splash_attention`` accepts, with these blocks.
    """
    _check_attention("JAX's splash_attention backward", q, k, v, gqa=True)
    s_q, s_k = q.shape[2], k.shape[2]
    if s_k % _LANES:
        raise ValueError(f"JAX's splash_attention needs kv_len to be a multiple of {_LANES}; "
                         f"got kv_len={s_k}: use pallas_tune.kernels.flash_attention")
    bq, bkv, bkvc = _splash_blocks(s_q, s_k, block_q_dkv, block_kv_dkv, block_kv_dkv_compute,
                                   "_dkv")
    dq_blocks = {}
    if not use_fused_bwd_kernel:
        bq_dq, bkv_dq, _ = _splash_blocks(s_q, s_k, block_q_dq, block_kv_dq, _LANES, "_dq")
        dq_blocks = dict(block_q_dq=bq_dq, block_kv_dq=bkv_dq)
    sizes = _splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, block_q_dkv=bq,
                               block_kv_dkv=bkv, block_kv_dkv_compute=bkvc,
                               use_fused_bwd_kernel=use_fused_bwd_kernel, **dq_blocks)
    _, vjp = jax.vjp(lambda a, b, c: _splash_call(a, b, c, causal, sm_scale, sizes, tables),
                     q, k, v)
    return vjp(do.astype(q.dtype))


@pt.tunable(tm=[128, 256, 512], tk=[128, 256, 512, 1024], tn=[128, 256, 512, 1024],
            default={"tm": 128, "tk": 128, "tn": 128}, reference=grouped_matmul_reference,
            inputs=_group_inputs, name="jax.ops.tpu.megablox.gmm",
            partition="M K, G K n, G -> M n")  # Experts' columns; rows follow the routing.
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
    return _gmm_fn(lhs, rhs, group_sizes, (tm, tk, tn))


# Differentiable with tilings of its own for the gradient (`megablox_gmm_bwd`), resolved when
# the gradient is traced; not differentiated, the forward is upstream's call as before.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gmm_fn(lhs, rhs, group_sizes, tiling):
    return _gmm.gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype, tiling=tiling)


def _gmm_fwd(lhs, rhs, group_sizes, tiling):
    with chips.interpret_mode() if chips.should_interpret() else contextlib.nullcontext():
        return _gmm_fn(lhs, rhs, group_sizes, tiling), (lhs, rhs, group_sizes)


def _gmm_bwd(tiling, residuals, grad):
    lhs, rhs, group_sizes = residuals
    dlhs, drhs = megablox_gmm_bwd(lhs, rhs, group_sizes, grad)
    return dlhs, drhs, None


_gmm_fn.defvjp(_gmm_fwd, _gmm_bwd)


def _gmm_bwd_reference(lhs, rhs, group_sizes, grad):
    _, vjp = jax.vjp(lambda a, b: grouped_matmul_reference(a, b, group_sizes), lhs, rhs)
    return vjp(grad.astype(lhs.dtype))


def _gmm_bwd_inputs(lhs, rhs, group_sizes, grad):
    (lhs, rhs, group_sizes), _ = _group_inputs(lhs, rhs, group_sizes)
    key = jax.random.key(1)
    return [lhs, rhs, group_sizes, jax.random.normal(key, grad.shape).astype(grad.dtype)], {}


@pt.tunable(tm=[128, 256, 512], tk=[128, 256, 512, 1024], tn=[128, 256, 512, 1024],
            tm_t=[128, 256, 512], tk_t=[128, 256, 512, 1024], tn_t=[128, 256, 512, 1024],
            default={"tm": 128, "tk": 128, "tn": 128, "tm_t": 128, "tk_t": 128, "tn_t": 128},
            reference=_gmm_bwd_reference, inputs=_gmm_bwd_inputs,
            name="jax.ops.tpu.megablox.gmm_bwd")
def megablox_gmm_bwd(lhs, rhs, group_sizes, grad, *, tm: int, tk: int, tn: int, tm_t: int,
                     tk_t: int, tn_t: int):
    """The gradient of megablox gmm for the cotangent grad (m, n): (dlhs, drhs), as upstream's
    own VJP computes them, dlhs by gmm against rhs transposed (tiling tm, tk, tn over its m, n
    and k) and drhs by tgmm (tiling tm_t, tk_t, tn_t over m, k and n).

    Accepts what ``megablox_gmm`` accepts, tm and tm_t dividing m.
    """
    m, k = lhs.shape
    n = rhs.shape[2]
    if grad.shape != (m, n):
        raise ValueError(f"megablox gmm's gradient needs grad of shape {(m, n)}; got "
                         f"{grad.shape}")
    tiles = {"tm": min(tm, m), "tk": min(tk, n), "tn": min(tn, k), "tm_t": min(tm_t, m),
             "tk_t": min(tk_t, k), "tn_t": min(tn_t, n)}
    for name, dim_name, dim, multiple in (("tm", "m", m, _SUBLANES), ("tk", "n", n, _LANES),
                                          ("tn", "k", k, _LANES), ("tm_t", "m", m, _SUBLANES),
                                          ("tk_t", "k", k, _LANES), ("tn_t", "n", n, _LANES)):
        if name.startswith("tm") and m % tiles[name]:
            raise pt.InvalidConfig(f"{name}={tiles[name]} must divide m={m} in megablox's "
                                   "gradient: choose one that divides m")
        _check_tile(name, tiles[name], dim_name, dim, multiple)
    dlhs = _gmm.gmm(grad.astype(lhs.dtype), rhs, group_sizes, lhs.dtype,
                    (tiles["tm"], tiles["tk"], tiles["tn"]), transpose_rhs=True)
    drhs = _gmm.tgmm(lhs.swapaxes(0, 1), grad.astype(lhs.dtype), group_sizes, rhs.dtype,
                     (tiles["tm_t"], tiles["tk_t"], tiles["tn_t"]))
    return dlhs, drhs


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
