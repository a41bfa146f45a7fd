"""Tunable adapters for the Pallas GPU ops that JAX ships (Triton backend): called, not copied.

Each adapter exposes the knobs the upstream op honours (block sizes, ``num_warps``,
``num_stages``, ``k_splits``) as tunable keywords and checks, before tracing, what the op itself
accepts: a config the op would refuse for these shapes raises :class:`pallas_tune.InvalidConfig`
(the tuner records it as infeasible), a shape no config of the space can serve raises
``ValueError`` naming the rule.

- :func:`mha`: ``jax.experimental.pallas.ops.gpu.attention.mha`` (forward; q, k, v as
  ``(batch, seq, heads, head_dim)``). Needs every sequence length to be a multiple of the blocks.
- :func:`decode_attention`: ``...ops.gpu.decode_attention.gqa`` (one query token per sequence,
  grouped-query heads; the KV sequence is split ``k_splits`` ways and reduced afterwards).
- :func:`paged_attention`: ``...ops.gpu.paged_attention.paged_attention`` (decode over a paged
  KV cache addressed by a block table).
- :func:`softmax`: ``...ops.gpu.softmax.softmax`` (last axis; one row per program).
- :func:`layer_norm`, :func:`rms_norm`: ``...ops.gpu.{layer_norm,rms_norm}`` forward. Upstream
  computes ``num_warps`` itself from the row length (the argument is overwritten), so only
  ``num_stages`` is tunable; the space says so rather than pretending.

Spaces, upstream defaults and model shape sets live in ``search_spaces/gpu_*.toml``.

Triton needs power-of-two block shapes, so head dims are powers of two here (``mha`` pads them
itself). On a CPU host the ops run in Pallas interpret mode (``interpret=True``), for tests; their
timings there say nothing about a GPU.
"""

from __future__ import annotations

import functools
import math
import warnings

import jax
import jax.numpy as jnp

import pallas_tune as pt
from pallas_tune import chips

__all__ = ["decode_attention", "layer_norm", "mha", "paged_attention", "rms_norm", "softmax"]

@functools.cache
def _ops():
    """The upstream modules, imported once (they warn that Triton ops are deprecated)."""
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        names = ("attention", "decode_attention", "paged_attention", "softmax", "layer_norm",
                 "rms_norm")
        return {n: importlib.import_module(f"jax.experimental.pallas.ops.gpu.{n}") for n in names}


def _interpret() -> bool:
    return chips.should_interpret()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check_head_dim(d: int, what: str) -> None:
    if not _pow2(d):
        raise ValueError(f"{what}: head_dim={d} must be a power of two (Triton block shapes are "
                         "powers of two); pad the head dimension.")


# ---- attention (prefill) ---------------------------------------------------------------------

def _mha_reference(q, k, v, *, causal: bool = False, sm_scale: float | None = None):
    """Plain-JAX attention over (batch, seq, heads, head_dim), f32 softmax."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        mask = jnp.tril(jnp.ones(s.shape[-2:], dtype=bool))
        s = jnp.where(mask, s, -0.7 * float(jnp.finfo(jnp.float32).max))
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


@pt.tunable(space="gpu_attention", reference=_mha_reference, name="jax.ops.gpu.attention.mha")
def mha(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
        block_q: int, block_k: int, num_warps: int, num_stages: int):
    """Fused attention forward (q, k, v: batch, seq, heads, head_dim; equal head counts).

    Raises:
      ValueError: shapes upstream cannot serve (sequence lengths not multiples of 16, unequal
        heads or head dims).
      InvalidConfig: a block that does not divide its sequence length.
    """
    b, sq, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[2:] != (h, d):
        raise ValueError(f"mha: q {q.shape}, k {k.shape}, v {v.shape} must share batch, heads "
                         "and head_dim (GQA is not supported by this upstream op).")
    sk = k.shape[1]
    for name, n in (("q_len", sq), ("kv_len", sk)):
        if n % 16:
            raise ValueError(f"mha: {name}={n} must be a multiple of 16 (upstream needs the "
                             "sequence to be a multiple of its power-of-two blocks); pad it.")
    bq, bk = min(block_q, sq), min(block_k, sk)
    if sq % bq or sk % bk:
        raise pt.InvalidConfig(f"block_q={bq} must divide q_len={sq} and block_k={bk} must "
                               f"divide kv_len={sk}")
    if causal and sq != sk:
        raise ValueError(f"mha: causal needs q_len == kv_len (got {sq} and {sk}).")
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    attention = _ops()["attention"]
    sizes = attention.BlockSizes(block_q=bq, block_k=bk)
    return attention.mha(q, k, v, None, sm_scale=scale, causal=causal, block_sizes=sizes,
                         num_warps=num_warps, num_stages=num_stages, interpret=_interpret())


# ---- decode attention ------------------------------------------------------------------------

def _decode_reference(q, k, v):
    """q (batch, q_heads, d); k, v (batch, kv_len, kv_heads, d): one query token each."""
    group = q.shape[1] // k.shape[2]
    kk = jnp.repeat(k, group, axis=2)
    vv = jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bhd,bkhd->bhk", q, kk, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(s / math.sqrt(q.shape[-1]), axis=-1)
    return jnp.einsum("bhk,bkhd->bhd", p.astype(v.dtype), vv,
                      preferred_element_type=jnp.float32).astype(q.dtype)


@pt.tunable(space="gpu_decode_attention", reference=_decode_reference,
            name="jax.ops.gpu.decode_attention.gqa")
def decode_attention(q, k, v, *, block_k: int, k_splits: int, num_warps: int, num_stages: int):
    """Decode attention, one query token per sequence (grouped-query heads).

    q: (batch, q_heads, head_dim); k, v: (batch, kv_len, kv_heads, head_dim).

    Raises:
      ValueError: kv_len not a multiple of 16, q_heads not a multiple of kv_heads, head_dim not a
        power of two.
      InvalidConfig: ``kv_len / k_splits`` below 16 or not divisible by ``block_k``.
    """
    b, hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or hq % k.shape[2]:
        raise ValueError(f"decode_attention: q {q.shape}, k {k.shape}, v {v.shape}: k and v "
                         "must match, share batch and head_dim, and q_heads must be a multiple "
                         "of kv_heads.")
    _check_head_dim(d, "decode_attention")
    sk = k.shape[1]
    if sk % 16:
        raise ValueError(f"decode_attention: kv_len={sk} must be a multiple of 16; pad the cache.")
    split = sk // k_splits
    if sk % k_splits or split < 16:
        raise pt.InvalidConfig(f"k_splits={k_splits} must divide kv_len={sk} into pieces of at "
                               "least 16")
    if split % min(block_k, split) or not _pow2(min(block_k, split)):
        raise pt.InvalidConfig(f"block_k={block_k} must divide kv_len/k_splits={split} and be a "
                               "power of two")
    out = _ops()["decode_attention"].gqa(
        q, k, v, block_h=16, block_k=block_k, k_splits=k_splits, num_warps=num_warps,
        num_stages=num_stages, interpret=_interpret())
    return out.astype(q.dtype)  # Upstream's final division promotes bf16 to f32.


# ---- paged attention -------------------------------------------------------------------------

def _paged_reference(q, k_pages, v_pages, block_tables, lengths):
    """Gathers each sequence's pages and attends over its first ``lengths`` positions."""
    hkv, _, page, d = k_pages.shape
    b, pages_per_seq = block_tables.shape
    k = k_pages[:, block_tables].reshape(hkv, b, pages_per_seq * page, d).transpose(1, 2, 0, 3)
    v = v_pages[:, block_tables].reshape(hkv, b, pages_per_seq * page, d).transpose(1, 2, 0, 3)
    group = q.shape[1] // hkv
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bhd,bkhd->bhk", q, k, preferred_element_type=jnp.float32)
    pos = jnp.arange(k.shape[1])[None, None, :]
    s = jnp.where(pos < lengths[:, None, None], s, -0.7 * float(jnp.finfo(jnp.float32).max))
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhk,bkhd->bhd", p.astype(v.dtype), v,
                      preferred_element_type=jnp.float32).astype(q.dtype)


def _paged_inputs(q, k_pages, v_pages, block_tables, lengths):
    """Tuning inputs: random q and pages, each sequence a random set of distinct pages, full
    lengths (the default random inputs would give zero lengths and empty attention)."""
    key = jax.random.key(0)
    kq, kk, kv, kt = jax.random.split(key, 4)
    b, pages_per_seq = block_tables.shape
    total = k_pages.shape[1]
    tables = jnp.stack([jax.random.permutation(jax.random.fold_in(kt, i), total)[:pages_per_seq]
                        for i in range(b)]).astype(jnp.int32)
    full = jnp.full((b,), pages_per_seq * k_pages.shape[2], jnp.int32)
    return ([jax.random.normal(kq, q.shape, jnp.float32).astype(q.dtype),
             jax.random.normal(kk, k_pages.shape, jnp.float32).astype(k_pages.dtype),
             jax.random.normal(kv, v_pages.shape, jnp.float32).astype(v_pages.dtype),
             tables, full], {})


@pt.tunable(space="gpu_paged_attention", reference=_paged_reference, inputs=_paged_inputs,
            name="jax.ops.gpu.paged_attention")
def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, pages_per_compute_block: int,
                    k_splits: int, num_warps: int, num_stages: int):
    """Paged grouped-query decode attention.

    q: (batch, q_heads, head_dim); k_pages, v_pages: (kv_heads, total_pages, page_size,
    head_dim); block_tables: int32 (batch, pages_per_sequence); lengths: int32 (batch,).

    Raises:
      ValueError: mismatched shapes or dtypes, page_size or head_dim not a power of two, or
        page_size below 16.
      InvalidConfig: ``k_splits`` not dividing pages_per_sequence, or the compute block not
        dividing the pages of a split.
    """
    b, hq, d = q.shape
    hkv, _, page, dk = k_pages.shape
    if (k_pages.shape != v_pages.shape or dk != d or hq % hkv or block_tables.shape[0] != b
            or lengths.shape != (b,)):
        raise ValueError(f"paged_attention: q {q.shape}, k_pages {k_pages.shape}, v_pages "
                         f"{v_pages.shape}, block_tables {block_tables.shape}, lengths "
                         f"{lengths.shape} do not fit together.")
    if block_tables.dtype != jnp.int32 or lengths.dtype != jnp.int32:
        raise ValueError("paged_attention: block_tables and lengths must be int32.")
    _check_head_dim(d, "paged_attention")
    if not _pow2(page) or page < 16:
        raise ValueError(f"paged_attention: page_size={page} must be a power of two >= 16.")
    pages = block_tables.shape[1]
    if pages % k_splits:
        raise pt.InvalidConfig(f"k_splits={k_splits} must divide pages_per_sequence={pages}")
    per_split = pages // k_splits
    if per_split % min(pages_per_compute_block, per_split):
        raise pt.InvalidConfig(f"pages_per_compute_block={pages_per_compute_block} must divide "
                               f"the {per_split} pages of a split")
    out = _ops()["paged_attention"].paged_attention(
        q, k_pages, v_pages, block_tables, lengths, block_h=16,
        pages_per_compute_block=pages_per_compute_block, k_splits=k_splits,
        num_warps=num_warps, num_stages=num_stages, interpret=_interpret())
    return out.astype(q.dtype)


# ---- row-wise ops ----------------------------------------------------------------------------

def _softmax_reference(x):
    return jax.nn.softmax(x.astype(jnp.float32), axis=-1).astype(x.dtype)


@pt.tunable(space="gpu_softmax", reference=_softmax_reference, name="jax.ops.gpu.softmax")
def softmax(x, *, num_warps: int):
    """Softmax over the last axis of ``x`` (any rank ≥ 1; any row length)."""
    if x.ndim < 1:
        raise ValueError("softmax: x must have at least one axis.")
    return _ops()["softmax"].softmax(x, axis=-1, num_warps=num_warps, interpret=_interpret())


def _norm_check(x, weight, bias, what: str) -> None:
    n = x.shape[-1]
    if x.ndim != 3 or weight.shape != (n,) or bias.shape != (n,):
        raise ValueError(f"{what}: x must be (batch, seq, features) with weight and bias of "
                         f"shape (features,); got x {x.shape}, weight {weight.shape}, bias "
                         f"{bias.shape}.")


def _layer_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    xf = x.astype(jnp.float32)
    mean = xf.mean(-1, keepdims=True)
    var = ((xf - mean) ** 2).mean(-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * weight + bias
    return y.astype(x.dtype)


def _rms_norm_reference(x, weight, bias, *, eps: float = 1e-5):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt((xf * xf).mean(-1, keepdims=True) + eps) * weight + bias
    return y.astype(x.dtype)


@pt.tunable(space="gpu_layer_norm", reference=_layer_norm_reference,
            name="jax.ops.gpu.layer_norm")
def layer_norm(x, weight, bias, *, eps: float = 1e-5, num_stages: int):
    """Layer norm over the last axis of x (batch, seq, features)."""
    _norm_check(x, weight, bias, "layer_norm")
    return _ops()["layer_norm"].layer_norm(x, weight, bias, num_stages=num_stages, eps=eps,
                                           interpret=_interpret())


@pt.tunable(space="gpu_rms_norm", reference=_rms_norm_reference, name="jax.ops.gpu.rms_norm")
def rms_norm(x, weight, bias, *, eps: float = 1e-5, num_stages: int):
    """RMS norm (with bias, as upstream) over the last axis of x (batch, seq, features)."""
    _norm_check(x, weight, bias, "rms_norm")
    return _ops()["rms_norm"].rms_norm(x, weight, bias, num_stages=num_stages, eps=eps,
                                       interpret=_interpret())
