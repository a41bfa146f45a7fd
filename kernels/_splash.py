"""Estimating JAX's splash attention, whose static profile libtpu cannot read.

Splash finds each block's KV index, and whether to compute and mask it, in scalar-prefetched
mask tables. libtpu's static profile takes such tables as 0: past one block it would count
neither the fetches nor the blocks splash computes, and pallas-tune's census refuses it
(``pallas_tune.measure.loops``). Its stand-in (:func:`forward_standin`,
:func:`backward_standin`) is the same kernel with the tables taken out, so that it fetches and
computes every block in grid order (what a full mask does, without the tables' lookups), for one
KV head and as few of its query heads as keep 128 grid steps, scaled by the heads and by the
share of blocks a causal mask leaves to compute. The masking of the diagonal blocks is
not counted: the figure leans in splash's favour. The method is checked on pallas-tune's own
flash attention, whose causal program libtpu can read (``benchmarks/estimates/splash_standin.py``).
"""

from __future__ import annotations


def strip_tables(kernel):
    """``kernel`` (a ``SplashAttentionKernel``) with its mask tables removed, in place: every
    block fetched in grid order, computed and not masked. Raises ``NotImplementedError`` where
    this JAX's splash keeps its mask info elsewhere."""
    names = ("fwd_mask_info", "dq_mask_info", "dkv_mask_info")
    if not all(hasattr(kernel, n) for n in names):
        raise NotImplementedError("this JAX's splash attention keeps its mask info where the "
                                  "stand-in cannot reach it; estimate splash on a TPU")
    for n in names:
        info = getattr(kernel, n)
        if info is not None:
            tables = [f for f in ("data_next", "mask_next", "block_mask", "partial_mask_blocks")
                      if f in info._fields]
            setattr(kernel, n, info._replace(**dict.fromkeys(tables)))
    return kernel


def causal_fraction(s_q: int, s_k: int, bq: int, bkv: int) -> float:
    """The share of (bq, bkv) blocks a causal mask (query i sees keys j <= i) does not mask
    out entirely: the blocks splash computes."""
    n_q, n_k = -(-s_q // bq), -(-s_k // bkv)
    active = sum(min(n_k, (min(s_q, (i + 1) * bq) - 1) // bkv + 1) for i in range(n_q))
    return active / (n_q * n_k)


def _lengths(args):
    q, k = args[0], args[1]
    return q.shape[2], k.shape[2]


def _one_kv_head(args, steps: int, target: int = 128):
    """The arguments cut to one KV head (batch 1) and as few of its query heads as keep
    ``target`` grid steps, given ``steps`` per query head, and the scale back: heads and batch
    rows are identical independent work (the dK/dV kernel's run over the group is only
    shorter), and a profile of every block of every head of a long sequence does not fit a
    compile worker (8192 tokens, 32 heads: SIGABRT; 32768 tokens, one group of 4: past 22 GB)."""
    import jax

    q, k = args[0], args[1]
    group = q.shape[1] // k.shape[1]
    heads = max(1, min(group, -(-target // max(1, steps))))
    out = [jax.ShapeDtypeStruct((1, heads if a.shape[1] == q.shape[1] else 1, *a.shape[2:]),
                                a.dtype) for a in args]
    return out, float(q.shape[0] * q.shape[1]) / heads


def _steps(s_q, s_k, bq, bkv):
    return -(-s_q // bq) * -(-s_k // bkv)


def forward_standin(args, kwargs, config):
    """The forward's stand-in: no tables, full attention, scaled by the causal share."""
    s_q, s_k = _lengths(args)
    bq, bkv = min(config["block_q"], s_q), min(config["block_kv"], s_k)
    scale = causal_fraction(s_q, s_k, bq, bkv) if kwargs.get("causal") else 1.0
    cut, rows = _one_kv_head(args, _steps(s_q, s_k, bq, bkv))
    return cut, {**kwargs, "causal": False, "tables": False}, scale * rows


# Dots per block: the forward recomputed by the backward adapter 2 (QK^T, PV), the dK/dV kernel
# 4 (QK^T, dV, dP, dK), the dQ kernel 3 (QK^T, dP, dQ): weights of each kernel's causal share.
_FWD_DOTS, _DKV_DOTS, _DQ_DOTS = 2, 4, 3


def backward_standin(args, kwargs, config):
    """The backward adapter's stand-in: no tables, full attention, scaled by each kernel's
    causal share weighted by its dots (the forward and dK/dV kernels at the dK/dV blocks, the dQ
    kernel at its own, or at the dK/dV ones when fused)."""
    s_q, s_k = _lengths(args)
    scale = 1.0
    blocks = min(config["block_q_dkv"], s_q), min(config["block_kv_dkv"], s_k)
    if kwargs.get("causal"):
        dkv = causal_fraction(s_q, s_k, *blocks)
        dq = dkv if config["use_fused_bwd_kernel"] else causal_fraction(
            s_q, s_k, min(config["block_q_dq"], s_q), min(config["block_kv_dq"], s_k))
        scale = (((_FWD_DOTS + _DKV_DOTS) * dkv + _DQ_DOTS * dq)
                 / (_FWD_DOTS + _DKV_DOTS + _DQ_DOTS))
    cut, rows = _one_kv_head(args, _steps(s_q, s_k, *blocks))
    return cut, {**kwargs, "causal": False, "tables": False}, scale * rows


__all__ = ["backward_standin", "causal_fraction", "forward_standin", "strip_tables"]
