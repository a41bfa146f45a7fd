"""Tunable adapters for the Pallas TPU decode kernels that JAX ships: called, not copied.

- :func:`paged_attention`: ``jax.experimental.pallas.ops.tpu.paged_attention`` (one query per
  sequence over a paged KV cache): ``pages_per_compute_block`` (KV pages per grid step or loop
  iteration), ``inline_seq_dim`` (a loop over the pages inside the kernel instead of a grid axis)
  and ``megacore_mode`` (split over the two cores of a v4/v5p chip).
- :func:`ragged_paged_attention`: ``...ops.tpu.ragged_paged_attention`` (mixed prefill and
  decode, vLLM's TPU attention): ``num_kv_pages_per_block``, ``num_queries_per_block`` and
  ``vmem_limit_bytes``.

Both kernels read sequence lengths and page tables at run time. The TPU compiler's static cycle
estimate (the ``tpu-estimate`` timer) evaluates conditions on grid indices but cannot know
values in memory: a ``pl.when`` on a length is counted as taken, and a loop whose trip count
comes from a length is counted as a fixed guess, whatever the lengths (measured on libtpu
0.0.50.1: ``inline_seq_dim=True`` gives the same estimate for 8 and 16 pages per block, and a
1024-token ragged batch over 256 sequences of 2048 tokens is "estimated" at 14 µs where reading
its KV cache alone takes 1.3 ms). So:

- ``paged_attention`` with ``inline_seq_dim=False`` is estimated as decode with every sequence
  at its full page-table length (every page read); the shipped space tunes that form.
  ``inline_seq_dim=True`` (upstream's default) can only be timed on a TPU.
- ``ragged_paged_attention`` as it is has no static estimate (``pallas_tune.measure.estimate``
  reports "no estimate" for kernels with such loops); its stand-in composes one from the call's
  concrete metadata (``kernels/_rpa_estimate.py``): libtpu's estimates of upstream's kernel with
  static trip counts give the cycles of a grid step and of a KV-block iteration (each iteration
  DMAs whole blocks and computes every query row of its block, whatever the lengths), and
  upstream's loops replayed over the concrete ``kv_lens``, ``cu_q_lens`` and ``num_seqs`` give
  how many of each the call runs. Metadata given as ``jax.ShapeDtypeStruct`` (a shape set,
  ``autotune``) gets this adapter's serving mix (``inputs=``); concrete metadata that breaks
  upstream's preconditions stops the tune, naming the value. The trial detail says which.
  Against JAX's published v6e block sizes: ``benchmarks/results/rpa_fidelity.md``.

Nor does ``ragged_paged_attention`` run in JAX's Pallas interpreters (a CPU host's interpret mode)
on the JAX versions checked, 0.10.2 and 0.12.0.1, with float32 or bfloat16 inputs and any config:
the HLO interpreter fails on upstream's masked stores (``'TypedInt' object has no attribute
'shape'``), the TPU interpreter on its reshaped refs. The adapter says so (``NotImplementedError``
naming the JAX version) instead of JAX's AttributeError; on newer JAX it tries
(``tests/test_upstream_decode.py`` shows which versions run it). It lowers and compiles for a TPU
on any host; on a CPU, :func:`ragged_paged_attention_reference` is the same attention.

Inputs must satisfy upstream's run-time preconditions, which no shape check can see: lengths in
[1, pages_per_sequence * page_size] (a zero-length sequence leaves its output row unwritten
upstream), page indices in range.
"""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tune as pt
from pallas_tune import chips
from pallas_tune.kernels import _rpa_estimate

__all__ = ["paged_attention", "paged_attention_reference", "ragged_paged_attention",
           "ragged_paged_attention_reference", "rpa_default_blocks", "rpa_runs_interpreted"]

# The packages re-export their functions under the modules' own names; take the modules.
_pa = importlib.import_module(
    "jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel")
_rpa = importlib.import_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")
_rpa_tuned = importlib.import_module(
    "jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes")

_MASK = -0.7 * float(np.finfo(np.float32).max)


# ---- paged attention (decode) ---------------------------------------------------------------

def paged_attention_reference(q, k_pages, v_pages, lengths, page_indices, *,
                              attn_logits_soft_cap: float | None = None):
    """Plain-JAX paged decode attention (f32), upstream's semantics: no softmax scale (q is
    pre-scaled), keys at positions >= lengths[b] masked, and K and V rounded to bfloat16 (the
    kernel loads every page as bfloat16, whatever the cache dtype)."""
    b, hq, d = q.shape
    hkv, _, page, _ = k_pages.shape
    group = hq // hkv
    as_kernel = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    k = as_kernel(k_pages[:, page_indices].reshape(hkv, b, -1, d))
    v = as_kernel(v_pages[:, page_indices].reshape(hkv, b, -1, d))
    qg = q.reshape(b, hkv, group, d).astype(jnp.float32)
    s = jnp.einsum("bhgd,hbtd->bhgt", qg, k)
    if attn_logits_soft_cap is not None:
        s = jnp.tanh(s / attn_logits_soft_cap) * attn_logits_soft_cap
    valid = jnp.arange(k.shape[2])[None, :] < lengths[:, None]
    s = jnp.where(valid[:, None, None, :], s, _MASK)
    out = jnp.einsum("bhgt,hbtd->bhgd", jax.nn.softmax(s, axis=-1), v)
    return out.reshape(b, hq, d).astype(q.dtype)


def _paged_shapes(q, k_pages, v_pages, lengths, page_indices):
    b, hq, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[3] != d:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must be equal, "
                         f"(kv_heads, total_pages, page_size, head_dim={d})")
    if hq % k_pages.shape[0]:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({k_pages.shape[0]})")
    if lengths.shape != (b,) or page_indices.ndim != 2 or page_indices.shape[0] != b:
        raise ValueError(f"lengths {lengths.shape} must be ({b},) and page_indices "
                         f"{page_indices.shape} ({b}, pages_per_sequence)")
    if lengths.dtype != jnp.int32 or page_indices.dtype != jnp.int32:
        raise ValueError(f"lengths ({lengths.dtype}) and page_indices ({page_indices.dtype}) "
                         "must be int32")
    return page_indices.shape[1]


def largest_divisor_at_most(n: int, k: int) -> int:
    """The largest divisor of n that is <= k (at least 1)."""
    return max(c for c in range(1, min(n, max(k, 1)) + 1) if n % c == 0)


def _paged_inputs(q, k_pages, v_pages, lengths, page_indices, **kwargs):
    """Tuning inputs: every sequence at its full page-table length (what the static estimate
    assumes), each sequence's pages distinct and scattered over the cache."""
    b, pps = page_indices.shape
    total = k_pages.shape[1]
    rng = np.random.default_rng(0)
    pages = rng.permutation(total)[: b * pps] if total >= b * pps else rng.integers(
        0, total, b * pps)
    ks = jax.random.split(jax.random.key(0), 3)
    normal = lambda k, a: jax.random.normal(k, a.shape, jnp.float32).astype(a.dtype)  # noqa
    scale = 1.0 / math.sqrt(q.shape[-1])  # Upstream takes q pre-scaled.
    return ([(normal(ks[0], q) * scale).astype(q.dtype), normal(ks[1], k_pages),
             normal(ks[2], v_pages),
             jnp.full((b,), pps * k_pages.shape[2], jnp.int32),
             jnp.asarray(pages.reshape(b, pps), jnp.int32)], kwargs)


def _paged_standin(args, kwargs, config):
    """Fewer sequences (identical work each at full length), same blocks (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k_pages, v_pages, lengths, page_indices = args
    b, pps = page_indices.shape
    ppcb = largest_divisor_at_most(pps, config["pages_per_compute_block"])
    (nb,), scale = shrink_parallel([b], k_pages.shape[0] * (pps // ppcb))
    sub = lambda a: jax.ShapeDtypeStruct((nb,) + a.shape[1:], a.dtype)  # noqa: E731
    return [sub(q), k_pages, v_pages, sub(lengths), sub(page_indices)], kwargs, scale


@pt.tunable(space="paged_attention", reference=paged_attention_reference, inputs=_paged_inputs,
            standin=_paged_standin, name="jax.ops.tpu.paged_attention",
            # TOML has no None, so this parameter and the default live here (see the toml).
            megacore_mode=[None],
            # vLLM's TPU backend (v0, attention/backends/pallas.py): "pages_per_compute_block =
            # 16  # TODO(woosuk): Tune this value.", in the grid form.
            default={"pages_per_compute_block": 16, "inline_seq_dim": False,
                     "megacore_mode": None})
def paged_attention(q, k_pages, v_pages, lengths, page_indices, *,
                    attn_logits_soft_cap: float | None = None, pages_per_compute_block: int,
                    inline_seq_dim: bool, megacore_mode: str | None):
    """JAX's paged decode attention. q: (batch, q_heads, head_dim), pre-scaled; k_pages,
    v_pages: (kv_heads, total_pages, page_size, head_dim); lengths: int32 (batch,);
    page_indices: int32 (batch, pages_per_sequence).

    ``pages_per_compute_block`` is lowered to the largest divisor of pages_per_sequence not above
    it (upstream requires a divisor).
    """
    pps = _paged_shapes(q, k_pages, v_pages, lengths, page_indices)
    ppcb = largest_divisor_at_most(pps, pages_per_compute_block)
    if megacore_mode == "kv_head" and k_pages.shape[0] % 2:
        raise pt.InvalidConfig(f"megacore_mode='kv_head' needs an even kv head count, got "
                               f"{k_pages.shape[0]}")
    if megacore_mode == "batch" and q.shape[0] % 2:
        raise pt.InvalidConfig(f"megacore_mode='batch' needs an even batch, got {q.shape[0]}")
    return _pa.paged_attention(q, k_pages, v_pages, lengths, page_indices,
                               attn_logits_soft_cap=attn_logits_soft_cap,
                               pages_per_compute_block=ppcb, megacore_mode=megacore_mode,
                               inline_seq_dim=bool(inline_seq_dim))


# ---- ragged paged attention (mixed prefill and decode) --------------------------------------

def ragged_paged_attention_reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                                     *, sm_scale: float = 1.0, sliding_window: int | None = None,
                                     soft_cap: float | None = None):
    """Plain-JAX ragged paged attention (f32), traceable: each query token gathers its own
    sequence's pages (the straightforward XLA formulation; T x context x heads of reads).

    Token t belongs to sequence i where cu_q_lens[i] <= t < cu_q_lens[i + 1], i < num_seqs; it
    sits at position kv_lens[i] - q_len_i + (t - cu_q_lens[i]) and attends causally. Rows of
    tokens past cu_q_lens[num_seqs] are zero.
    """
    tokens, hq, d = q.shape
    _, page, hkv2, _ = kv_pages.shape
    hkv = hkv2 // 2
    group = hq // hkv
    n = num_seqs[0]
    t = jnp.arange(tokens)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], t, side="right"), 0, kv_lens.shape[0] - 1)
    live = (t < cu_q_lens[n]) & (seq < n)
    q_len = cu_q_lens[seq + 1] - cu_q_lens[seq]
    pos = kv_lens[seq] - q_len + (t - cu_q_lens[seq])  # (T,)
    kv = kv_pages[page_indices[seq]].reshape(tokens, -1, hkv2, d)  # (T, ctx, 2*hkv, d)
    k = kv[:, :, 0::2].astype(jnp.float32)
    v = kv[:, :, 1::2].astype(jnp.float32)
    qg = q.reshape(tokens, hkv, group, d).astype(jnp.float32)
    s = jnp.einsum("thgd,tchd->thgc", qg, k) * sm_scale
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    col = jnp.arange(k.shape[1])[None, :]
    ok = (col <= pos[:, None]) & (col < kv_lens[seq][:, None])
    if sliding_window is not None:
        ok &= pos[:, None] - sliding_window < col
    s = jnp.where(ok[:, None, None, :], s, _MASK)
    out = jnp.einsum("thgc,tchd->thgd", jax.nn.softmax(s, axis=-1), v).reshape(tokens, hq, d)
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)


def rpa_default_blocks(q, kv_pages, page_indices) -> tuple[int, int]:
    """Upstream's own (num_kv_pages_per_block, num_queries_per_block) for these shapes on a v6e:
    its tuned table (``get_tuned_block_sizes``), else its default (128, 32), clamped."""
    hq_blk, hkv2_blk = _rpa.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype,
                                                   kv_pages.dtype)
    key = _rpa_tuned.simplify_key((q.dtype, kv_pages.dtype, hq_blk, hkv2_blk // 2, q.shape[2],
                                   kv_pages.shape[1], q.shape[0], page_indices.shape[1]))
    bkv, bq = _rpa_tuned.TUNED_BLOCK_SIZES.get("TPU v6", {}).get(key, (128, 32))
    return min(page_indices.shape[1], bkv), min(q.shape[0], bq)


def _rpa_inputs(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kwargs):
    """Tuning inputs as vLLM's TPU tuner builds them: sequences decode one token each, all at
    their full page-table length; the rest of the token budget is prefill, given to the last
    sequences (at most a full context each), so every token is live when the cache can hold it
    (``_rpa_estimate.serving_metadata``, which the composed estimate uses for the same specs).
    """
    seqs, pps = page_indices.shape
    lens, cu, n = _rpa_estimate.serving_metadata(q.shape[0], seqs, pps, kv_pages.shape[1])
    rng = np.random.default_rng(0)
    total = kv_pages.shape[0]
    pages = rng.permutation(total)[: seqs * pps] if total >= seqs * pps else rng.integers(
        0, total, seqs * pps)
    ks = jax.random.split(jax.random.key(0), 2)
    return ([jax.random.normal(ks[0], q.shape, jnp.float32).astype(q.dtype),
             jax.random.normal(ks[1], kv_pages.shape, jnp.float32).astype(kv_pages.dtype),
             jnp.asarray(lens, jnp.int32), jnp.asarray(pages.reshape(seqs, pps), jnp.int32),
             jnp.asarray(cu, jnp.int32), jnp.asarray([n], jnp.int32)], kwargs)


# JAX versions whose Pallas interpreters cannot run upstream's ragged paged attention: every
# supported version up to this one (checked: 0.10.2 and 0.12.0.1, float32 and bfloat16).
RPA_INTERPRETED_FAILS_THROUGH = (0, 12)


def rpa_runs_interpreted(version: str = jax.__version__) -> bool:
    """Whether JAX ``version``'s Pallas interpreters may run upstream's ragged paged attention
    (False for the versions known to fail; newer ones are tried)."""
    parts = [int(p) if p.isdigit() else 0 for p in version.split(".")[:2]]
    return tuple(parts) > RPA_INTERPRETED_FAILS_THROUGH


def _interpreting() -> bool:
    """Whether a pallas_call traced now runs in a Pallas interpreter (the switch a tunable call
    sets around its kernel on a CPU host; resolving a config traces without it)."""
    return bool(chips._interpret_state().value)


@pt.tunable(space="ragged_paged_attention", reference=ragged_paged_attention_reference,
            inputs=_rpa_inputs, name="jax.ops.tpu.ragged_paged_attention",
            standin=_rpa_estimate.standin, key_optional=["static_kv_blocks"])
def ragged_paged_attention(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *,
                           sm_scale: float = 1.0, sliding_window: int | None = None,
                           soft_cap: float | None = None, num_kv_pages_per_block: int,
                           num_queries_per_block: int, vmem_limit_bytes: int,
                           static_kv_blocks: int = 0):
    """JAX's ragged paged attention. q: (tokens, q_heads, head_dim); kv_pages: (total_pages,
    page_size, 2 * kv_heads, head_dim), K and V interleaved on the head axis; kv_lens: int32
    (max_seqs,); page_indices: int32 (max_seqs, pages_per_seq); cu_q_lens: int32 (max_seqs+1,);
    num_seqs: int32 (1,).

    Block sizes are clamped to pages_per_seq and to the token count. ``static_kv_blocks > 0``
    is the ``tpu-estimate`` stand-in's (``kernels._rpa_estimate``): upstream's kernel with each
    sequence loop run once and each KV-block loop that many times, whatever the lengths; it
    computes nothing meaningful.

    Raises:
      ValueError: kv_pages not shaped (total_pages, page_size, 2 * kv_heads, head_dim).
      NotImplementedError: run in a Pallas interpreter (a CPU host) on a JAX version whose
        interpreters cannot run upstream's kernel (see the module docstring).
    """
    tokens = q.shape[0]
    pps = page_indices.shape[1]
    if kv_pages.ndim != 4 or kv_pages.shape[2] % 2 or kv_pages.shape[3] != q.shape[2]:
        raise ValueError(f"kv_pages {kv_pages.shape} must be (total_pages, page_size, "
                         f"2*kv_heads, head_dim={q.shape[2]})")
    if _interpreting() and not rpa_runs_interpreted():
        raise NotImplementedError(
            f"JAX {jax.__version__}'s Pallas interpreters cannot run upstream's ragged paged "
            "attention, with any input dtype or config (checked on JAX 0.10.2 and 0.12.0.1, "
            "float32 and bfloat16: the HLO interpreter fails on its masked stores, \"'TypedInt' "
            "object has no attribute 'shape'\", the TPU interpreter on its reshaped refs). Run "
            "it on a TPU (it lowers for one on any host: with pallas_tune.target(\"v6e\")), or "
            "on this host call ragged_paged_attention_reference, the same attention in plain "
            "JAX.")
    fn = (_rpa_estimate.static_kernel(static_kv_blocks) if static_kv_blocks > 0
          else _rpa.ragged_paged_attention)
    return fn(
        q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=sm_scale,
        sliding_window=sliding_window, soft_cap=soft_cap,
        num_kv_pages_per_block=min(num_kv_pages_per_block, pps),
        num_queries_per_block=min(num_queries_per_block, tokens),
        vmem_limit_bytes=vmem_limit_bytes)
