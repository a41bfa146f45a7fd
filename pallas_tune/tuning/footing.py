"""Pallas vs XLA on one footing: which figures the XLA decision compares, and the margin it needs.

Under ``--timer tpu-estimate`` the tuner compares the best config's figure (libtpu's static
estimate of the Pallas kernel) with a figure for the kernel's reference, compiled by XLA. Two
XLA figures come out of the same deviceless compile, and they stand in different relations to
the chip (``benchmarks/results/xla_footing.md``: Tokamax's real TPU 7x times of XLA's attention
and of a Pallas flash attention at 10 keys, S = 512 to 8192; XLA's figures at the 6 up to
S = 2048, where its compile fit a worker):

- libtpu's static estimate summed over XLA's ops is the same kind of figure as the Pallas one,
  but where some ops report 0 cycles (``partial``) it is only a lower bound: on attention it
  came out at 0.18-0.28x the chip's time, and taken as it is it put XLA ahead on 2 of 6 keys
  where the chip has Pallas 1.7-2.8x faster. A partial sum never decides.
- XLA's own cost model of its fusions is complete, and came out near the chip's time
  (0.77-1.07x, median :data:`XLA_MODEL_BIAS`), while libtpu's estimate of a Pallas kernel came
  out at about half of it (0.35-0.80x, median :data:`PALLAS_BIAS` where both exist). Divided by
  their biases, the two are on one footing.

So: where libtpu's XLA sum is complete, it is compared with the Pallas estimate as it is (same
kind); where it is partial, XLA's cost model, scaled by ``PALLAS_BIAS / XLA_MODEL_BIAS`` to the
Pallas estimate's footing, is. Either way XLA runs only where its figure times :data:`MARGIN`
is below the best config's: the spread of the relative bias across the measured keys, so that
no key measured would have flipped the wrong way. The biases are measured on 7x attention only
(the public data that has both implementations' real times), a compute-bound kernel. One
physical check holds everywhere: no implementation moves the call's own data (its arrays read
once, its outputs written once) faster than libtpu's model of HBM does, nor does its dots
faster than the MXU's peak, so an XLA figure below that floor (:func:`data_floor_ms`) is not
credible and never decides. On memory-bound calls
(decode matmuls) that is what keeps a cost-model figure measured on attention from picking
XLA. Measured rows (a device timed both) compare as they are: no footing, no margin.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["MARGIN", "PALLAS_BIAS", "XLA_MODEL_BIAS", "data_floor_ms", "on_footing",
           "xla_decision", "xla_row"]

# Figure / the chip's time, medians over benchmarks/results/xla_footing.md's keys (tpu7x).
PALLAS_BIAS: Final = 0.48  # libtpu's static estimate of a Pallas kernel.
XLA_MODEL_BIAS: Final = 0.94  # XLA's cost model of the reference's fusions.
MARGIN: Final = 1.55  # XLA must win by this factor (the relative bias's spread over the keys).
# Why, in a user's words (the note of a Pallas kept within the margin says it).
WHY: Final = "the estimates' error against the chip varies that much between calls"


def on_footing(model: float) -> float:
    """XLA's cost-model figure (any unit) brought to the Pallas estimate's footing."""
    return model * PALLAS_BIAS / XLA_MODEL_BIAS


def data_floor_ms(kernel: Any, args: Any, kwargs: Any, chip: str) -> float:
    """The least time any implementation of the call can take, in an estimate's units (ms):
    the larger of reading its array arguments once and writing its outputs once at libtpu's
    model of the chip's HBM bandwidth (the spec's times the fitted ``bw_eff``), and the
    reference's dots at the MXU's peak (int8 x int8 dots at the int8 rate, any other at the
    bf16 rate: what libtpu's MXU asymptote is calibrated to). 0 where it cannot be said."""
    import jax
    import numpy as np

    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.fitted import V6E
    from pallas_tune.measure.loops import floor_flops

    spec = chip_spec(chip)
    if not spec.hbm_bw_bytes_per_s or not spec.bf16_flops:
        return 0.0

    def nbytes(tree: Any) -> int:
        return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
                   for a in jax.tree_util.tree_leaves(tree) if hasattr(a, "shape"))

    reference = getattr(kernel, "reference", None)
    if reference is None:
        return 0.0
    try:
        jaxpr, out = jax.make_jaxpr(lambda *a: reference(*a, **kwargs), return_shape=True)(*args)
        data = nbytes(list(args)) + nbytes(out)
        mxu = (floor_flops(jaxpr.jaxpr, int8=False) / spec.bf16_flops
               + floor_flops(jaxpr.jaxpr, int8=True) / (spec.int8_ops or 2 * spec.bf16_flops))
    except Exception:  # noqa: BLE001 - no floor is a weaker check, not a failed tuning.
        return 0.0
    return max(data / (spec.hbm_bw_bytes_per_s * V6E.bw_eff), mxu) * 1e3


def xla_row(result: Any, clock_hz: float) -> dict[str, Any]:
    """The reference's figures from its estimate (a ``measure.estimate.EstimateResult``), as
    :func:`xla_decision` reads them: ``median_ms`` (libtpu's sum), ``partial`` (ops it gave no
    estimate), ``model_ms`` (XLA's cost model, where the compile carried one); ``error`` when
    the compile gave no figure."""
    from pallas_tune.measure.estimate import cycles_to_ms

    row: dict[str, Any] = {"implementation": "xla", "timer": "tpu-estimate"}
    if result is None or not result.ok or result.cycles is None:
        row["error"] = ((result.message[:500] or result.kind) if result is not None
                        else "no reference")
        if result is not None and result.model_cycles:  # libtpu gave none: the model did.
            row["model_ms"] = cycles_to_ms(result.model_cycles, clock_hz)
            row["error"] = row["error"].split("\n")[0]  # Not the dying worker's log.
        return row
    ms = cycles_to_ms(result.cycles, clock_hz)
    row.update(median_ms=ms, spread_ms=0.0, times_ms=[ms], cycles=result.cycles,
               partial=result.ops_without_estimate)
    if result.model_cycles:
        row["model_ms"] = cycles_to_ms(result.model_cycles, clock_hz)
    return row


def xla_decision(xla_row: Mapping[str, Any] | None, best_ms: float) -> tuple[float, str, str]:
    """(XLA's figure, on the Pallas estimate's footing where estimated; what calls run; a note).

    Estimates (``timer: tpu-estimate``): XLA runs only where its figure times :data:`MARGIN` is
    below ``best_ms`` and not below the call's data floor (``floor_ms``); a partial libtpu sum
    is replaced by XLA's cost model on the footing, or, without one, never makes XLA win.
    Measured rows: XLA runs where it is faster."""
    if xla_row is None or ("median_ms" not in xla_row and "model_ms" not in xla_row):
        return math.nan, "pallas", (xla_row or {}).get("error", "")
    if "median_ms" not in xla_row:  # libtpu's compile of XLA's program gave no figure.
        model = float(xla_row["model_ms"])
        xla_ms = on_footing(model)
        how = (f"XLA's cost model ({model:.4g} ms, from a compile without libtpu's profiling "
               f"flag, as the profiled one failed) at the Pallas estimate's footing "
               f"(x{PALLAS_BIAS / XLA_MODEL_BIAS:.3g}: {xla_ms:.4g} ms)")
        if xla_ms >= best_ms:
            return xla_ms, "pallas", f"Pallas runs: {how} is slower"
        return _credible(xla_row, xla_ms, best_ms, how)
    xla_ms = float(xla_row["median_ms"])
    if xla_row.get("timer") != "tpu-estimate":  # Timed on a device beside the configs.
        return xla_ms, ("xla" if xla_ms < best_ms else "pallas"), ""
    partial = int(xla_row.get("partial") or 0)
    if xla_ms >= best_ms:  # Slower (or a lower bound that is slower): Pallas wins.
        return xla_ms, "pallas", ""
    how = "libtpu's estimate of both"
    if partial:
        model = xla_row.get("model_ms")
        if model is None or not math.isfinite(float(model)):
            return xla_ms, "pallas", (
                f"XLA's estimate ({xla_ms:.4g} ms) is partial: {partial} of its ops have no "
                "estimate, so it is a lower bound and cannot show that XLA wins, and XLA's "
                "cost model gave no figure; Pallas is kept. Time both on a TPU (--xla, "
                "--timer wallclock) to decide.")
        xla_ms = on_footing(float(model))
        how = (f"XLA's cost model ({float(model):.4g} ms) at the Pallas estimate's footing "
               f"(x{PALLAS_BIAS / XLA_MODEL_BIAS:.3g}: {xla_ms:.4g} ms), as libtpu's sum is "
               f"partial ({partial} ops without an estimate)")
    return _credible(xla_row, xla_ms, best_ms, how)


def _credible(xla_row: Mapping[str, Any], xla_ms: float, best_ms: float, how: str
              ) -> tuple[float, str, str]:
    """The floor and the margin, for an XLA figure on the estimate's footing."""
    floor = float(xla_row.get("floor_ms") or 0.0)
    if xla_ms < floor:
        return xla_ms, "pallas", (
            f"Pallas is kept: XLA's figure ({how}) is below the least time any implementation "
            f"of the call takes ({floor:.4g} ms: its data moved once at libtpu's HBM bandwidth, "
            "its dots at the MXU's peak), so it is not credible. Time both on a TPU (--xla, "
            "--timer wallclock) to decide.")
    ahead = best_ms / xla_ms if xla_ms > 0 else math.inf
    if xla_ms * MARGIN < best_ms:
        return xla_ms, "xla", (f"XLA runs: its figure is {ahead:.2f}x lower ({how}), past the "
                               f"{MARGIN:g}x it must win by")
    if xla_ms < best_ms:  # Within 10%, a percentage: "1.00x lower" had read as no gap.
        gap = f"{(ahead - 1) * 100:.2g}%" if ahead < 1.1 else f"{ahead:.2f}x"
        return xla_ms, "pallas", (f"XLA's figure is {gap} lower ({how}), but XLA must "
                                  f"win by {MARGIN:g}x here (the margin: {WHY}); Pallas kept")
    return xla_ms, "pallas", ""
