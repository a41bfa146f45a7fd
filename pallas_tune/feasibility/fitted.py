"""A cost model of Pallas TPU kernels, from the traced pallas_call alone: the fallback where
libtpu's static profile aborts on a kernel or gives no estimate (``measure.loops``), in place of
the plain roofline (:mod:`.roofline`). Its constants were first fitted to libtpu's static
estimates (:data:`V6E`); on v6e and 7x the fallback ranks with constants fitted to real-TPU
winners instead (:data:`PUBLIC`, :func:`constants_for`).

Per pallas_call, with ``S`` grid steps (:func:`call_features` reads the rest off the trace)::

    t_mxu = S · Σ_dots 2·B·M·pad(N)·pad(K) / (peak · mxu_eff)
    t_vec = S · V · vec_s
    time  = max(t_mxu + t_vec, pipelined bytes / bw')
            + (serial bytes + one step's bytes) / bw' + S · step_s,     bw' = bw · bw_eff

- a dot (B, M, K) × (K, N) holds K × N in the MXU: ``pad`` rounds N and K up to the MXU's side
  (256 on v6e), so a 128-wide tile pays for a full one. Peak: the chip's bf16 peak, or
  ``int8_ops`` where both operands are 8-bit integers. f32 operands get the bf16 rate (an f32
  pass count, fitted in a trial form of this model, went to 1: libtpu's estimates of the f32
  dots of linear and paged attention are no slower);
- bytes as in :mod:`.roofline` (each VMEM window's block bytes × how often it is fetched), split
  three ways: a window's first fetch (or its last write-back) is the pipeline's fill or drain,
  exposed; later fetches of a window with one buffer (``pl.Buffered(1)``) wait for compute,
  *serial*; the rest overlap compute, *pipelined*. ``any``/HBM operands (manual DMA) are not
  counted: the trace does not say what they copy;
- ``V``: the elements of a step's largest intermediate value (a softmax's score tile, an f32
  upcast of a row block, a matmul's f32 partial product), a proxy for the step's vector
  (VPU/EUP) work. The largest, not the sum of all values, because a kernel's ``pl.when``
  branches are all in its trace though a step runs one of them. Dots are summed over branches
  (``inspect`` does not say which branch holds a dot), so a causal kernel's diagonal branches
  and a ragged last K step's masked dot are over-counted; the fit would make the MXU faster
  than its peak to make up for it, and ``mxu_eff`` sits at its bound, 1.

The constants (:data:`V6E`) were fitted to libtpu 0.0.50.1's static cycle estimates for v6e
(converted at 1.75 GHz) in the shipped ledgers ``caches/tpu_v6e/*.estimate.trials.jsonl``, every
shipped kernel and adapter, by ``python benchmarks/estimates/model_fidelity.py`` (least squares
on log time: the error within each tuning key, which decides the ranking, and the absolute error,
which sets the level, weighed alike). Fitted without the kernel it scores, it ranks a key's configs
with a median Spearman rho of 0.96 against libtpu's (the roofline: 0.89) and a mean regret of
3.3% (8.0%), but no better than the roofline on the attention kernels:
``benchmarks/results/model_fidelity.md``. It models libtpu's *estimate*, not a measured time. On
other TPU chips the MXU and HBM terms scale by the chip's peak, bandwidth and MXU side, as
:mod:`.roofline`'s do; the per-step and per-element constants by v6e's clock over the chip's
(``ChipSpec.clock_hz``; unscaled where that is 0). Nothing is fitted there. Use it to rank
configs of one kernel.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from pallas_tune.chips import ChipSpec
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.feasibility.roofline import fetches

__all__ = ["PUBLIC", "V6E", "CallFeatures", "Constants", "call_features", "constants_for",
           "fitted_calls", "time_of"]

_V6E_CLOCK_HZ: Final = 1.75e9  # The clock the fitted v6e estimates were converted at.
_UNCOUNTED_SPACES: Final = ("any", "hbm", "semaphore")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Constants:
    """The model's fitted constants (see the module docstring for each term)."""

    mxu_eff: float  # MXU rate over the chip's peak (> 1 where it absorbs over-counted dots).
    bw_eff: float  # libtpu's HBM bandwidth over the chip's spec.
    step_s: float  # Cost of one grid step (s, at v6e's clock).
    vec_s: float  # Cost of one element of a step's largest intermediate (s, at v6e's clock).


# Fitted to v6e estimates of every shipped kernel: `python benchmarks/estimates/model_fidelity.py`
# (2026-11-27, benchmarks/results/model_fidelity.md). mxu_eff sits at its bound, 1 (the fit would
# take more: over-counted dots); bw_eff 1.44 is near libtpu's read-only probe, 1332 B/cycle at
# 1.75 GHz = 1.42 x spec (notes/libtpu-static-cost.md); step_s is 313 cycles; vec_s 0.39 cycles.
V6E: Final = Constants(mxu_eff=1.0, bw_eff=1.44, step_s=1.79e-7, vec_s=2.24e-13)

# Fitted per chip to real-TPU winners: the block sizes vLLM tpu-inference 0.32.0 publishes as
# measured best for its quantized matmul (v6e int8, v7 float8), 80 keys a chip drawn at random,
# never a key that benchmarks/results/estimate_fidelity.md scores (a softmax loss on each key's
# winner over its configs; `python benchmarks/estimates/fallback_public_fit.py`,
# benchmarks/results/fallback_public_fit.md). The fallback a tune ranks by on these chips. They
# rank, they do not time (the MXU held at its peak: a ranking fixes the rest only relative to
# it): on v6e the winners say a grid step costs 3.9x what libtpu's estimates charge (step_s 699
# ns against 179) and a vector element 2.9x, and HBM moves 0.83x the spec's bandwidth where
# libtpu's estimates take 1.44x; on 7x the fit takes the HBM to a ninth of the spec's and a
# step to 4.4 us: the chip's winners use larger blocks than bandwidth and steps explain. Refitted
# 2026-12-06 after the models stopped counting a fetch per step for windows whose index stays put
# (``roofline.fetches``; loss 1.014 to 0.895 on v6e, 1.017 to 0.758 on 7x), and again for 7x
# once its configs were traced with the VMEM limit the kernel sets on a real v7 (48 MiB, not
# the 96 MiB it takes on a CPU host: configs the chip cannot run had been in the ranking; loss
# 0.758 to 0.536). A chip with no fit of its own gets V6E, scaled as the module docstring says.
PUBLIC: Final[dict[str, Constants]] = {
    "tpu_v6e": Constants(mxu_eff=1.0, bw_eff=0.8291, step_s=6.985e-7, vec_s=6.558e-13),
    "tpu_7x": Constants(mxu_eff=1.0, bw_eff=0.1125, step_s=4.428e-6, vec_s=7.717e-13),
}


def constants_for(spec: ChipSpec) -> Constants:
    """The constants the fallback ranks ``spec``'s configs with: the chip's fit to real-TPU
    winners (:data:`PUBLIC`) where there is one, else :data:`V6E` (libtpu's v6e estimates)."""
    return PUBLIC.get(spec.name, V6E)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CallFeatures:
    """What the model reads off one traced pallas_call (plain data: JSON-able via asdict)."""

    steps: int
    # Per dot of one step: (batch, M, N, K, kind), kind "int8" or "bf16" (any other dtype).
    dots: tuple[tuple[int, int, int, int, str], ...]
    pipelined_bytes: float  # Refetches that overlap compute (windows with two or more buffers).
    serial_bytes: float  # Refetches of single-buffered windows.
    step_bytes: float  # One step's bytes of every window (pipeline fill and drain).
    vec_elems: float  # Elements of the step's largest intermediate value.


def _dot_dims(dot: tuple[Any, ...]) -> tuple[int, int, int, int, str]:
    """(batch, M, N, K, kind) of one entry of ``PallasCallInfo.dots``."""
    shape, _dtype, k, _lhs, operands = dot
    shape = tuple(int(s) for s in shape)
    n = shape[-1] if shape else 1
    m = shape[-2] if len(shape) >= 2 else 1
    batch = math.prod(shape[:-2]) if len(shape) > 2 else 1
    dtypes = [np.dtype(d) for _, d in operands]
    int8 = bool(dtypes) and all(d.kind in "iu" and d.itemsize == 1 for d in dtypes)
    return batch, m, n, int(k), "int8" if int8 else "bf16"


def call_features(call: _inspect.PallasCallInfo) -> CallFeatures:
    """The features of one pallas_call: grid steps, dots, window traffic, vector work."""
    grid = [g if g > 0 else 1 for g in call.grid]
    steps = math.prod(grid) if grid else 1
    pipelined = serial = step_bytes = 0.0
    for blk in call.blocks:
        if blk.memory_space in _UNCOUNTED_SPACES:
            continue
        step_bytes += blk.block_bytes
        refetched = blk.block_bytes * max(fetches(blk, grid, steps) - 1, 0)
        if blk.buffer_count == 1 and not blk.trivial_window:
            serial += refetched
        else:
            pipelined += refetched
    vec = float(math.prod(call.largest_value[0])) if call.largest_value else 0.0
    return CallFeatures(steps=steps, dots=tuple(_dot_dims(d) for d in call.dots),
                        pipelined_bytes=pipelined, serial_bytes=serial, step_bytes=step_bytes,
                        vec_elems=vec)


def time_of(features: Sequence[CallFeatures], spec: ChipSpec, c: Constants) -> float:
    """The model's time (s) of a program's pallas_calls, from their features."""
    side = spec.mxu_dim or 128
    bf16 = spec.bf16_flops or 1e14
    peaks = {"bf16": bf16 * c.mxu_eff, "int8": (spec.int8_ops or bf16) * c.mxu_eff}
    bw = (spec.hbm_bw_bytes_per_s or 1e12) * c.bw_eff
    clock = _V6E_CLOCK_HZ / spec.clock_hz if spec.clock_hz else 1.0
    total = 0.0
    for f in features:
        t_mxu = sum(2.0 * batch * m * math.ceil(n / side) * side * math.ceil(k / side) * side
                    / peaks[kind] for batch, m, n, k, kind in f.dots)
        t_compute = f.steps * (t_mxu + f.vec_elems * c.vec_s * clock)
        total += (max(t_compute, f.pipelined_bytes / bw)
                  + (f.serial_bytes + f.step_bytes) / bw + f.steps * c.step_s * clock)
    return total


def fitted_calls(calls: Sequence[_inspect.PallasCallInfo], spec: ChipSpec,
                 constants: Constants | None = None) -> float:
    """The fitted model's time (s) of these pallas_calls on ``spec``'s chip, with ``constants``
    (default :func:`constants_for` the chip), to rank configs of one kernel; not a
    measurement."""
    return time_of([call_features(c) for c in calls], spec, constants or constants_for(spec))
