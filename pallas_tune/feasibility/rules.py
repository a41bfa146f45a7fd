"""The TPU block rules: which BlockSpecs Mosaic accepts, checked on traced ``pallas_call``\\ s.

The rules below are what JAX's Pallas TPU lowering enforces (``_check_block_mappings`` and the
pipeline-mode check in ``jax/_src/pallas/mosaic/lowering.py``, JAX 0.12) and what the deviceless
libtpu 0.0.50.1 compiler then accepts, checked on v5e, v6e and 7x by
``benchmarks/feasibility/feasibility_accuracy.py``:

1. A block need not divide its array dim. Edge blocks are padded on input (unspecified values)
   and clipped on output; a block may even be larger than its array dim.
2. Rank >= 2: the last block dim is a multiple of 128 (lanes) or the full array dim, and the
   second-to-last a multiple of 8 (sublanes) or the full array dim. A squeezed (``None``) dim
   counts as 1 here. The rule is the same for every dtype and generation: the compiler accepted
   8-row blocks of bf16 on 7x (native tile 16 rows) and of int8/fp8/int4 (32/32/64 rows) on
   v5e, v6e and 7x, even from operands pinned to the native tiling; XLA copies operands to a
   matching tiling where it must. No E2002 ("not divisible by tiling") was seen. The dtype's
   native tiling is therefore opt-in (``native_tiling=True``): blocks off it compile but may
   cost relayout copies.
3. Rank 1: the full array dim, a multiple of 8 * 128, or a power of two of at least
   128 * 32 / bitwidth (bool counts as 32-bit, its memref type).
4. A rank-0 block in VMEM is not supported; a block in memory space ANY/HBM must be the whole
   array at index 0.
5. ``pipeline_mode=pl.Buffered(n)`` on a ``pallas_call``: n is a single int, 1 or 2 (deeper
   pipelines need ``pltpu.emit_pipeline`` inside the kernel).
6. At least one element of every block is in bounds at every grid step (the Pallas docs'
   contract). No compiler checks it: a grid larger than ``cdiv(dim, block)`` compiles and then
   reads or writes out of bounds at run time. Checked on the index map at the grid's extremes
   (exact for affine index maps; skipped where the map takes scalar-prefetch refs).

Rules 2-5 fail at lowering (a ``ValueError``/``LoweringException`` from Pallas, before Mosaic
or XLA see the kernel; plain CPU jaxlib reproduces them), rule 6 only at run time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from pallas_tune.chips import ChipSpec, chip_spec

if TYPE_CHECKING:
    from pallas_tune.feasibility.inspect import BlockInfo, PallasCallInfo

__all__ = ["block_rule_violations", "itemsize_bits", "native_sublane_tiling"]

SUBLANES: Final = 8  # Every TPU generation in jax.tpu_info (v2 to 8t) has 8 sublanes.
LANES: Final = 128
_HBM_SPACES: Final = ("any", "hbm", "memoryspace.any")
_SUB_BYTE: Final = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}


def itemsize_bits(dtype: Any) -> int:
    """Bits per element (4 for int4, 8 for bool), as Mosaic counts them."""
    dt = np.dtype(dtype)
    if dt.name in _SUB_BYTE:
        return _SUB_BYTE[dt.name]
    return dt.itemsize * 8


def native_sublane_tiling(spec: ChipSpec, bits: int) -> int:
    """Rows of the chip's native (rows, 128) tile for a ``bits``-wide dtype (jax tpu_info:
    8 for 16/32-bit before 7x, 8 * 32 / bits otherwise: bf16 16 rows on 7x, int8 32, int4 64)."""
    if bits >= 8:
        return spec.sublane_tiling(bits // 8)
    return spec.sublane_tiling(1) * (8 // bits)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _kinds(b: BlockInfo) -> tuple[str, ...]:
    if b.dim_kinds:
        return b.dim_kinds
    return tuple("squeezed" if d is None else "blocked" for d in b.block_shape)


def _tiled_dim(where: str, axis: int, blk: int | None, kind: str, full: int, mult: int,
               unit: str) -> str | None:
    """The rule for one of the last two dims of a rank >= 2 block (None: fine)."""
    if kind == "squeezed":
        if full == 1:
            return None
        return (f"{where}: block dim {axis} is squeezed (None, size 1) but is one of the last two "
                f"dims, which must be a multiple of {mult} ({unit}) or the array dim {full}; "
                f"block it by {mult} or {full} instead, or squeeze a leading dim")
    if blk is None or blk == full or blk % mult == 0:
        return None
    return (f"{where}: block dim {axis} = {blk} must be a multiple of {mult} ({unit}) or equal "
            f"the array dim {full}; use {_round_up(blk, mult)} or {full}")


def _rank1(where: str, b: BlockInfo, sublanes: int, lanes: int) -> str | None:
    blk, full = b.block_shape[0], b.array_shape[0]
    if blk is None or blk == full:
        return None
    bits = 32 if b.dtype == np.bool_ else itemsize_bits(b.dtype)
    chunk, min_pow2 = sublanes * lanes, lanes * max(1, 32 // bits)
    if blk % chunk == 0 or (blk >= min_pow2 and blk & (blk - 1) == 0):
        return None
    return (f"{where}: rank-1 block dim 0 = {blk} must equal the array dim {full}, be a multiple "
            f"of {chunk}, or be a power of two >= {min_pow2} (for {b.dtype.name}); use "
            f"{max(min_pow2, 1 << max(0, blk - 1).bit_length())} or {_round_up(blk, chunk)}")


def _bounds(where: str, b: BlockInfo) -> list[str]:
    if b.max_start is None:
        return []
    out = []
    for axis, (start, blk, full) in enumerate(zip(b.max_start, b.block_shape, b.array_shape,
                                                  strict=True)):
        if start is None or start < full:
            continue
        size = blk if blk is not None else 1
        out.append(f"{where}: block dim {axis} (size {size}) starts at element {start} at the "
                   f"grid's far end, past the array dim {full}; at least one element of every "
                   f"block must be in bounds: make the grid cdiv({full}, {size}) = "
                   f"{-(-full // size)} along it")
    return out


def _one_block(where: str, b: BlockInfo, spec: ChipSpec | None, native_tiling: bool,
               sublanes: int, lanes: int) -> list[str]:
    space = b.memory_space
    if "semaphore" in space:
        return []
    if any(s == space for s in _HBM_SPACES):
        if b.trivial_window:
            return []
        return [f"{where}: a block in memory space {space!r} must be the whole array "
                f"{b.array_shape} with an all-zero index map; use block_shape=None there and "
                f"copy by hand (pltpu.async_copy / emit_pipeline)"]
    if "smem" in space and b.trivial_window:
        return []
    problems = []
    count = b.buffer_count
    if b.split_buffering or (count is not None and count not in (1, 2)):
        problems.append(f"{where}: pipeline_mode=pl.Buffered({count}) is not supported on a "
                        f"pallas_call (1 or 2 buffers, one count for both directions); use 1 or "
                        f"2, or pltpu.emit_pipeline inside the kernel for deeper pipelines")
    kinds = _kinds(b)
    for axis, (blk, kind) in enumerate(zip(b.block_shape, kinds, strict=True)):
        if blk is not None and blk <= 0:
            problems.append(f"{where}: block dim {axis} = {blk} must be positive")
    rank = len(b.block_shape)
    if rank == 0:
        problems.append(f"{where}: a rank-0 block in VMEM is not supported; give the operand a "
                        f"rank >= 1 or put it in SMEM")
    elif rank == 1:
        p = _rank1(where, b, sublanes, lanes)
        problems += [p] if p else []
    else:
        rows = sublanes
        if native_tiling and spec is not None and spec.platform == "tpu":
            rows = max(rows, native_sublane_tiling(spec, itemsize_bits(b.dtype)))
        for axis, mult, unit in ((rank - 2, rows, "sublanes" if rows == sublanes else
                                  f"the native {b.dtype.name} tiling"), (rank - 1, lanes, "lanes")):
            p = _tiled_dim(where, axis, b.block_shape[axis], kinds[axis], b.array_shape[axis],
                           mult, unit)
            problems += [p] if p else []
    return problems + _bounds(where, b)


def block_rule_violations(calls: Sequence[PallasCallInfo], *, spec: ChipSpec | str | None = None,
                          native_tiling: bool = False, sublanes: int | None = None,
                          lanes: int | None = None) -> list[str]:
    """The TPU block-rule violations of the given pallas_calls (empty: all fine).

    Args:
      calls: from :func:`pallas_tune.feasibility.inspect.find_pallas_calls`.
      spec: the target chip (a :class:`ChipSpec` or a name). Sets the sublane/lane counts (8 and
        128 on every TPU so far) and, with ``native_tiling``, the dtype's native tile. Without
        it the rules are the ones every TPU generation shares.
      native_tiling: also require the second-to-last block dim to be a multiple of the dtype's
        native tile on ``spec`` (bf16: 16 rows on 7x; int8/fp8: 32; int4: 64) or the full dim.
        The compiler does not require this (see the module doc); it prunes candidates that
        would make XLA relayout their operands.
      sublanes, lanes: override the chip's counts (for tests and unusual targets).

    Each message names the pallas_call and operand, the dim, its value and what it must be.
    """
    if isinstance(spec, str):
        spec = chip_spec(spec)
    if spec is not None and spec.platform != "tpu":
        return []  # GPU/CPU targets have no Mosaic block rules.
    sub = sublanes if sublanes is not None else (spec.sublanes if spec else SUBLANES)
    ln = lanes if lanes is not None else (spec.lanes if spec else LANES)
    problems = []
    for call in calls:
        if getattr(call, "backend", "mosaic_tpu") != "mosaic_tpu":
            continue  # GPU backends have rules of their own (Triton: power-of-two shapes).
        for b in call.blocks:
            where = f"{call.name or 'pallas_call'} {b.origin}"
            problems += _one_block(where, b, spec, native_tiling, sub, ln)
    return problems
