"""The ``tpu-estimate`` of JAX's ragged paged attention, from the call's concrete lengths.

Upstream's kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel``) runs a grid
of (heads blocks, query blocks); in each query block a ``while_loop`` over the sequences whose
tokens it holds, and in each of those a ``while_loop`` over the sequence's KV blocks
(``ceil(kv_len / (num_kv_pages_per_block * page_size))`` of them). libtpu's static profile
cannot know these trip counts (it counts a fixed guess: 14 us for a batch that reads 2.1 GB of
KV cache). But each KV-block iteration does the same work whatever the data: it DMAs
``num_kv_pages_per_block`` whole pages (past a sequence's end, page 0 again), computes all
``num_queries_per_block`` query rows against them (rows of other sequences masked, not
skipped) and starts the next block's DMA. So the call's cycles are

    fixed + steps * per_step + iterations * per_iteration

with ``steps`` the grid steps and ``iterations`` the KV-block iterations the call's concrete
``kv_lens``, ``cu_q_lens`` and ``num_seqs`` give (:func:`work` replays upstream's control flow).
The three costs are libtpu's: the same kernel with static trip counts (:func:`static_kernel`: each
sequence loop once, the KV-block loop ``fori_loop``-ed 2 or 4 times), one heads block, estimated
at 1 and 2 query blocks (:func:`standin`, three compiles a config). A sequence's own scalar work
(a few SMEM reads between its KV loops) is not counted: it was below 1% of one KV block's
estimate (v6e, libtpu 0.0.50.1).

Inputs given as ``jax.ShapeDtypeStruct`` (a shape set, ``autotune``) get upstream-independent
serving metadata (:func:`serving_metadata`: every sequence decoding at its full page-table
length, the rest of the token budget prefill), as the adapter's ``inputs=`` builds them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import types
from typing import Any

import numpy as np

__all__ = ["Work", "check_metadata", "costs", "piece_problems", "serving_metadata", "standin",
           "static_kernel", "work"]

_rpa = importlib.import_module("jax.experimental.pallas.ops.tpu.ragged_paged_attention.kernel")

# The pieces: (query blocks, KV-block iterations per sequence) of each static-trip compile.
PIECES = ((1, 2), (1, 4), (2, 2))


class _StaticLax:
    """``jax.lax`` with ``while_loop`` replaced for upstream's kernel: the outer loop (the
    sequences of a query block) runs its body once, the inner one (a sequence's KV blocks)
    ``kv_blocks`` times, a loop of static trip count (``fori_loop``, as a while loop is on the
    chip: not unrolled). The condition is not evaluated."""

    def __init__(self, kv_blocks: int):
        self._trips, self._depth, self.loops = (1, kv_blocks), 0, 0

    def __getattr__(self, name: str) -> Any:
        from jax import lax

        return getattr(lax, name)

    def while_loop(self, cond_fun: Any, body_fun: Any, init_val: Any) -> Any:
        from jax import lax

        del cond_fun  # Static trips: the condition is the data's, not counted.
        if self._depth >= len(self._trips):
            raise NotImplementedError("upstream's ragged paged attention nests more than two "
                                      "while loops: this JAX's kernel is not the one the "
                                      "composed estimate models")
        trips = self._trips[self._depth]
        self._depth, self.loops = self._depth + 1, self.loops + 1
        try:
            if trips == 1:
                return body_fun(init_val)
            return lax.fori_loop(0, trips, lambda _, s: body_fun(s), init_val)
        finally:
            self._depth -= 1


def _clone(fn: Any, **globals_: Any) -> Any:
    """``fn`` with some of its module's globals replaced (its nested functions see them too)."""
    new = types.FunctionType(fn.__code__, {**fn.__globals__, **globals_}, fn.__name__,
                             fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    return new


@functools.cache
def static_kernel(kv_blocks: int) -> Any:
    """Upstream's ``ragged_paged_attention`` (unjitted) whose kernel runs each sequence loop once
    and each KV-block loop ``kv_blocks`` times. Raises NotImplementedError where this JAX's
    module is not laid out as the one modelled (JAX 0.10.2 and 0.12.0.1 ship the same)."""
    body = getattr(_rpa, "ragged_paged_attention_kernel", None)
    outer = getattr(_rpa.ragged_paged_attention, "__wrapped__", None)
    if body is None or outer is None or "lax" not in body.__code__.co_names:
        raise NotImplementedError("this JAX's ragged paged attention is not laid out as the "
                                  "composed estimate expects; time it on a TPU")
    kernel = _clone(body, lax=_StaticLax(kv_blocks))
    return _clone(outer, ragged_paged_attention_kernel=kernel)


@dataclasses.dataclass(frozen=True)
class Work:
    """What a call runs (one heads block's counts times ``heads_blocks``): grid ``steps``,
    sequence visits, KV-block ``iterations``, and the KV bytes they DMA."""

    steps: int
    visits: int
    iterations: int
    kv_bytes: int


def check_metadata(kv_lens: np.ndarray, page_indices: np.ndarray, cu_q_lens: np.ndarray,
                   num_seqs: np.ndarray, *, tokens: int, page_size: int, total_pages: int
                   ) -> int:
    """Upstream's run-time preconditions on concrete metadata (what no shape check sees); the
    number of live sequences. Raises ValueError naming the first broken one and the fix."""
    seqs, pps = page_indices.shape
    n = int(np.asarray(num_seqs).reshape(-1)[0])
    fix = ("; ragged paged attention reads these at run time, so an estimate from them would "
           "count work the kernel does not do: pass the metadata vLLM would (or "
           "jax.ShapeDtypeStruct metadata for a serving mix)")
    if not 0 <= n <= seqs:
        raise ValueError(f"num_seqs={n} is outside [0, {seqs}] (page_indices has {seqs} rows)"
                         + fix)
    cu = np.asarray(cu_q_lens, np.int64)[: n + 1]
    if cu[0] != 0 or (np.diff(cu) < 0).any() or cu[n] > tokens:
        raise ValueError(f"cu_q_lens[:num_seqs + 1] must rise from 0 to at most the {tokens} "
                         f"query tokens; got {cu.tolist()[:8]}{'...' if n > 7 else ''} "
                         f"ending at {int(cu[n])}" + fix)
    lens = np.asarray(kv_lens, np.int64)[:n]
    bad = np.flatnonzero((lens < 1) | (lens > pps * page_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"kv_lens[{i}]={int(lens[i])} is outside [1, {pps * page_size}] "
                         f"(pages_per_seq {pps} x page_size {page_size})" + fix)
    short = np.flatnonzero(np.diff(cu) > lens)
    if short.size:
        i = int(short[0])
        raise ValueError(f"sequence {i} has {int(cu[i + 1] - cu[i])} query tokens but "
                         f"kv_lens[{i}]={int(lens[i])}: its queries must be among its KV "
                         "positions" + fix)
    pages = np.asarray(page_indices)[:n]
    used = np.arange(pps)[None, :] < -(-lens[:, None] // page_size)
    if used.any() and not ((pages[used] >= 0) & (pages[used] < total_pages)).all():
        raise ValueError(f"page_indices of the live sequences must be in [0, {total_pages}) "
                         "(kv_pages' page count)" + fix)
    return n


def work(kv_lens: np.ndarray, cu_q_lens: np.ndarray, n: int, *, tokens: int, page_size: int,
         bq: int, bkv: int, heads_blocks: int, page_bytes: int) -> Work:
    """The grid steps and KV-block iterations upstream's kernel runs for this metadata and
    these (clamped) blocks: its loops replayed (``compute_with_cur_q_blk``'s sequence walk)."""
    per_block = bkv * page_size
    cu = [int(x) for x in np.asarray(cu_q_lens)[: n + 1]]
    blocks = [-(-int(x) // per_block) for x in np.asarray(kv_lens)[:n]]
    q_blocks = -(-tokens // bq)
    seq = visits = iterations = 0
    for b in range(q_blocks):
        start, end = b * bq, (b + 1) * bq
        done = False
        while not done and n and start < cu[n] and seq < n:
            visits, iterations = visits + 1, iterations + blocks[seq]
            q_end = cu[seq + 1]
            done, seq = q_end >= end, seq + 1 if q_end <= end else seq
        seq = seq if seq < n else 0
    return Work(heads_blocks * q_blocks, heads_blocks * visits, heads_blocks * iterations,
                heads_blocks * iterations * bkv * page_bytes)


def serving_metadata(tokens: int, seqs: int, pps: int, page_size: int
                     ) -> tuple[np.ndarray, np.ndarray, int]:
    """(kv_lens, cu_q_lens, num_seqs) as vLLM's TPU tuner builds them: sequences decode one
    token each, all at their full page-table length; the rest of the token budget is prefill,
    given to the last sequences (at most a full context each)."""
    ctx = pps * page_size
    n = min(seqs, tokens)
    q_lens = np.ones(n, np.int64)
    extra = tokens - n
    for i in range(n - 1, -1, -1):
        add = min(extra, ctx - 1)
        q_lens[i] += add
        extra -= add
    cu = np.zeros(seqs + 1, np.int64)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    lens = np.zeros(seqs, np.int64)
    lens[:n] = ctx
    return lens, cu, n


def _concrete(a: Any) -> np.ndarray | None:
    import jax

    return None if isinstance(a, jax.ShapeDtypeStruct) else np.asarray(a)


def piece_problems(args, kwargs, bq):
    """The static-trip problems of :data:`PIECES` for this call at query block ``bq``: one heads
    block, ``g * bq`` tokens; the metadata's shapes kept (its SMEM)."""
    import jax

    q, kv_pages = args[0], args[1]
    hq_blk, hkv2_blk = _rpa.get_min_heads_per_blk(q.shape[1], kv_pages.shape[2], q.dtype,
                                                   kv_pages.dtype)
    kv_sub = jax.ShapeDtypeStruct(kv_pages.shape[:2] + (hkv2_blk, q.shape[2]), kv_pages.dtype)
    spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)  # noqa: E731
    return [([jax.ShapeDtypeStruct((g * bq, hq_blk, q.shape[2]), q.dtype), kv_sub,
              *(spec(a) for a in args[2:])], {**kwargs, "static_kv_blocks": k})
            for g, k in PIECES]


def costs(cycles):
    """(fixed, per grid step, per KV-block iteration) cycles from the estimates of the
    :data:`PIECES`; ValueError where libtpu's figures do not give positive costs."""
    p1, p2, p3 = cycles
    per_iter, per_step = (p2 - p1) / 2, p3 - p2
    fixed = p1 - per_step - 2 * per_iter
    if per_iter <= 0 or per_step < 0:
        raise ValueError(
            f"libtpu's estimates of the static-trip pieces ({p1}, {p2}, {p3} cycles) give "
            f"{per_iter:.0f} cycles per KV block and {per_step:.0f} per grid step, not "
            "positive: no composed estimate for this config (time it on a TPU)")
    return max(fixed, 0.0), float(per_step), per_iter


def standin(args, kwargs, config):
    """The composed stand-in (:class:`pallas_tune.measure.pieces.Pieces`): the static-trip
    kernel on one heads block at :data:`PIECES`, combined with the call's :func:`work`."""
    from pallas_tune.measure.pieces import Pieces

    q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs = args
    tokens, hq, d = q.shape
    total_pages, page_size, hkv2, _ = kv_pages.shape
    seqs, pps = page_indices.shape
    bkv = min(config["num_kv_pages_per_block"], pps)
    bq = min(config["num_queries_per_block"], tokens)
    hq_blk, hkv2_blk = _rpa.get_min_heads_per_blk(hq, hkv2, q.dtype, kv_pages.dtype)
    meta = [_concrete(a) for a in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    if any(m is None for m in meta):  # Abstract: the serving mix (the adapter's inputs=).
        lens, cu, n = serving_metadata(tokens, seqs, pps, page_size)
        said = (f"serving mix built for abstract metadata: {n} sequences at their full "
                f"{pps * page_size} tokens, {int(cu[n]) - n} prefill tokens")
    else:
        try:
            n = check_metadata(*meta, tokens=tokens, page_size=page_size,
                               total_pages=total_pages)
        except ValueError as e:  # Every candidate fails with it: the tuner stops, naming it.
            return Pieces((), costs, error=f"ragged paged attention's metadata: {e}"), kwargs, 2.0
        lens, cu = meta[0], meta[2]
        said = f"the call's metadata: {n} sequences, {int(np.asarray(cu)[n])} live tokens"
    page_bytes = page_size * hkv2_blk * d * np.dtype(kv_pages.dtype).itemsize
    w = work(lens, cu, n, tokens=tokens, page_size=page_size, bq=bq, bkv=bkv,
             heads_blocks=hq // hq_blk, page_bytes=page_bytes)
    problems = piece_problems(args, kwargs, bq)

    def combine(cycles):
        fixed, per_step, per_iter = costs(cycles)
        return (fixed + w.steps * per_step + w.iterations * per_iter,
                f"libtpu estimate composed over the concrete lengths ({said}): {w.steps} grid "
                f"steps x {per_step:.0f} + {w.iterations} KV blocks of {bkv} pages x "
                f"{per_iter:.0f} + {fixed:.0f} cycles, from the kernel with static trip counts "
                "(kernels/_rpa_estimate.py)")

    # Not a factor (the pieces are combined, not scaled): the stand-in check's order, smallest
    # first, i.e. the config with the most steps and iterations, the smallest blocks: the
    # cheapest compiles, never out of VMEM.
    return Pieces(problems, combine), kwargs, 1 + 1 / (w.steps + w.iterations + 1)
