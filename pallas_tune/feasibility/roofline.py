"""A roofline cost model for Pallas TPU kernels, from the traced pallas_call alone.

Per kernel: FLOPs = the dot FLOPs of one grid step × the number of steps; HBM bytes = for every
window, its block bytes × how often it is fetched (a block is refetched whenever an axis at or
outside the innermost grid axis its index depends on advances); time = max(FLOPs / peak,
bytes / bandwidth) + steps × a fixed per-step cost. It ignores masking (causal blocks skipped)
and overlap details: use it to rank and to seed searches, not as a measurement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.chips import ChipSpec, chip_spec

__all__ = ["RooflineEstimate", "fetches", "roofline", "roofline_calls"]

# Fixed cost of one grid step (pipeline bookkeeping, DMA issue), ~0.27 µs on v6e by the compiler
# estimate of 128^3 matmul tiles (notes/libtpu-static-cost.md).
STEP_OVERHEAD_S: Final = 0.3e-6


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RooflineEstimate:
    flops: float
    hbm_bytes: float
    steps: int
    time_s: float

    @property
    def time_ms(self) -> float:
        return self.time_s * 1e3


def fetches(blk: Any, grid: Sequence[int], steps: int) -> int:
    """How often a window is fetched over the grid: at every step where its index may follow
    anything (unknown axes), else whenever an axis at or outside the innermost one its index
    depends on advances; an axis of extent 1 never advances, so a window whose index depends
    on none but those (a weight block spanning the whole weight, under a grid over the batch)
    is fetched once: Pallas's pipeline skips the copy while the block index is unchanged."""
    axes = blk.grid_axes
    if axes is None:
        return steps
    moving = [a for a in axes if a < len(grid) and grid[a] > 1]
    if not moving:
        return 1
    return math.prod(grid[: max(moving) + 1])


def roofline_calls(calls: Sequence[_inspect.PallasCallInfo], spec: ChipSpec) -> RooflineEstimate:
    flops = nbytes = 0.0
    steps_total = 0
    time_s = 0.0
    for call in calls:
        grid = [g if g > 0 else 1 for g in call.grid]
        steps = math.prod(grid) if grid else 1
        f = 0.0
        for shape, _dtype, k, _lhs, _ops in call.dots:
            f += 2.0 * math.prod(shape) * k
        f *= steps
        b = 0.0
        for blk in call.blocks:
            if blk.memory_space in ("any", "hbm", "semaphore"):
                continue
            b += blk.block_bytes * fetches(blk, grid, steps)
        flops += f
        nbytes += b
        steps_total += steps
        peak = spec.bf16_flops or 1e14
        bw = spec.hbm_bw_bytes_per_s or 1e12
        time_s += max(f / peak, b / bw) + steps * STEP_OVERHEAD_S
    return RooflineEstimate(flops=flops, hbm_bytes=nbytes, steps=steps_total, time_s=time_s)


def roofline(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], *,
             chip: str = "v6e") -> RooflineEstimate:
    """Roofline time of ``fn(*args, **kwargs)``'s pallas_calls on ``chip`` (a model)."""
    return roofline_calls(_inspect.find_pallas_calls(getattr(fn, "fn", fn), args, kwargs),
                          chip_spec(chip))
