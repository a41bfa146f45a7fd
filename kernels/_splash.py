"""Estimating JAX's splash attention, whose static profile libtpu cannot read.

Splash finds each block's KV index, and whether to compute and mask it, in scalar-prefetched
mask tables. libtpu's static profile takes such tables as 0: past one block it would count
neither the fetches nor the blocks splash computes, and pallas-tune's census refuses it
(``pallas_tune.measure.loops``). Its stand-in (:func:`forward_standin`,
:func:`backward_standin`) is the same kernel with the tables taken out, so that it fetches and
computes every block in grid order (what a full mask does, without the tables' lookups), for one
KV head and as few of its query heads as keep 128 grid steps, scaled by the heads and by the
share of blocks a causal mask leaves to compute. The masking of the diagonal blocks is not
counted: the figure leans in splash's favour. The method is checked on pallas-tune's own flash
attention, whose causal program libtpu can read (``benchmarks/estimates/splash_standin.py``).

Where one head is still more work than a compile worker's profile holds (past 8192 x 8192
scores: at 32768 tokens every backward config died at 18 GB), the query sequence is cut too, to
whole query blocks, and scaled by the cut: with no mask each query's work is the same and
independent of the others'. The cut scales fixed costs with the rows, so it leans against
splash: 1.02x to 1.08x of the uncut figure at 8192 tokens cut to a quarter
(``benchmarks/estimates/splash_query_cut.py``).
"""

from __future__ import annotations

import math


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


# The most scores (query rows x keys) of one head the stand-in keeps: 8192 x 8192, where every
# config splash_grid.py estimated at 8192 tokens compiled in 18 GB and none of 100 backward
# candidates did at 32768 (one head, 16x the scores). Shorter sequences are not cut.
MAX_SCORES = 8192 * 8192


def _cut(args, blocks, q_args, max_scores=MAX_SCORES, target: int = 128):
    """The arguments cut to one KV head (batch 1), to as few of its query heads as keep
    ``target`` grid steps, and where one head has more than ``max_scores`` scores to whole
    multiples of every kernel's query block (the args at ``q_args`` along their sequence axis),
    with the scale back. ``blocks``: each kernel's (block_q, block_kv), the first one's steps
    deciding the heads.

    Heads and batch rows are identical independent work (the dK/dV kernel's run over the group
    is only shorter), and so, with every block computed unmasked, are query rows; a profile of
    every block of every head of a long sequence does not fit a compile worker (8192 tokens, 32
    heads: SIGABRT; 32768 tokens, one group of 4: past 22 GB). Fixed costs per KV block (the
    dK/dV kernel's stores) are scaled with the rows, so a cut leans against splash."""
    import jax

    q, k = args[0], args[1]
    s_q, s_k = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    keep = s_q
    # Not where a block fails to divide q_len: the kernel must refuse the config on the real
    # length, not give a figure for a cut one it divides.
    if s_q * s_k > max_scores and all(s_q % bq == 0 for bq, _ in blocks):
        unit = math.lcm(*(bq for bq, _ in blocks))
        keep = min(s_q, max(unit, max_scores // s_k // unit * unit))
    steps = _steps(keep, s_k, *blocks[0])  # The first kernel's, as before the cut existed.
    heads = max(1, min(group, -(-target // max(1, steps))))
    if keep < s_q:  # Cut: no more heads than keep the scores within the bound.
        heads = max(1, min(heads, max_scores // (keep * s_k)))

    def shape(i, a):
        rows = keep if i in q_args else a.shape[2]
        return (1, heads if a.shape[1] == q.shape[1] else 1, rows, *a.shape[3:])

    out = [jax.ShapeDtypeStruct(shape(i, a), a.dtype) for i, a in enumerate(args)]
    return out, float(q.shape[0] * q.shape[1]) / heads * (s_q / keep)


def _steps(s_q, s_k, bq, bkv):
    return -(-s_q // bq) * -(-s_k // bkv)


def forward_standin(args, kwargs, config, *, max_scores: int = MAX_SCORES):
    """The forward's stand-in: no tables, full attention, scaled by the causal share (of the
    full lengths, whatever the cut)."""
    s_q, s_k = _lengths(args)
    bq, bkv = min(config["block_q"], s_q), min(config["block_kv"], s_k)
    scale = causal_fraction(s_q, s_k, bq, bkv) if kwargs.get("causal") else 1.0
    cut, rows = _cut(args, [(bq, bkv)], {0}, max_scores)
    return cut, {**kwargs, "causal": False, "tables": False}, scale * rows


# Dots per block: the forward recomputed by the backward adapter 2 (QK^T, PV), the dK/dV kernel
# 4 (QK^T, dV, dP, dK), the dQ kernel 3 (QK^T, dP, dQ): weights of each kernel's causal share.
_FWD_DOTS, _DKV_DOTS, _DQ_DOTS = 2, 4, 3


def backward_standin(args, kwargs, config, *, max_scores: int = MAX_SCORES):
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
    # The programs' kernels: the forward and dK/dV at the dK/dV blocks, the dQ one at its own.
    kernels = [blocks, blocks]
    if not config["use_fused_bwd_kernel"]:
        kernels.append((min(config["block_q_dq"], s_q), min(config["block_kv_dq"], s_k)))
    cut, rows = _cut(args, kernels, {0, 3}, max_scores)  # q and do carry the query rows.
    return cut, {**kwargs, "causal": False, "tables": False}, scale * rows


__all__ = ["MAX_SCORES", "backward_standin", "causal_fraction", "forward_standin", "strip_tables"]
