"""Two terms libtpu's static estimate may leave out on a real chip, to add back: opt-in.

Checked against block sizes a real TPU v6e ran best (vLLM tpu-inference's int8 quantized
matmul table, ``benchmarks/estimates/estimate_fidelity.py``), libtpu's static estimate sometimes
prefers larger batch and in blocks, and fewer, bigger grid steps, than the chip did. Two costs it
could under-count would explain that, each a term here, per pallas_call, from the traced call
alone (:func:`pallas_tune.feasibility.fitted.call_features`)::

    corrected = estimate + exposed · (fill and drain bytes + serial bytes) / bw  +  S · step_s

- **Exposed DMA at the chip's bandwidth.** libtpu's static profile moves HBM bytes faster than
  the chip: 1.44x v6e's spec bandwidth in the model fitted to its estimates
  (:data:`pallas_tune.feasibility.fitted.V6E`, ``bw_eff``; its read-only probe gives 1.42x,
  ``notes/libtpu-static-cost.md``). Where nothing hides a DMA (the pipeline's first fetch of
  every window and last write-back, and the refetches of a single-buffered window) that would
  be time the chip spends and the estimate does not: ``1 - 1/1.44`` of those bytes at the spec
  bandwidth. Derived from ``bw_eff``, not fitted.
- **Per-step overhead.** libtpu counts about 313 cycles (0.18 us) per grid step
  (``fitted.V6E.step_s``); JAX's Pallas TPU guide puts the chip's at about 0.35 us.
  ``step_s`` = 0.15 us, fitted to the ten keys of a fitting sample
  (``benchmarks/results/data/estimate_fidelity_fit.json``;
  ``benchmarks/estimates/estimate_correction_fit.py``).

**Measured, it does not help**, so it is off unless asked for (``estimate_correction=True``,
``--estimate-correction``). On the fitting sample it puts the real winner first on 9 of 10 keys
(libtpu's figure: 7); on the ten reported keys, which it was not fitted on, on 7 (libtpu's: 8),
and no setting of the two terms beats libtpu's figure there on both first place and picks
within 2% (``benchmarks/results/estimate_correction_fit.txt``). The real winners are single
labels from noisy measurements, so ranks within a few percent cannot be resolved with them. It
is kept, tested and documented so that the next ground truth (measured times of every config,
on a chip) can test it again. Measured for v6e only; other chips' estimates are never corrected.
The trial keeps libtpu's own figure (``cycles``); a corrected figure is still an ESTIMATE.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Final

from pallas_tune.chips import ChipSpec
from pallas_tune.feasibility.fitted import V6E as _FITTED_V6E
from pallas_tune.feasibility.fitted import CallFeatures, call_features

__all__ = ["V6E_CORRECTION", "Correction", "correction_for", "correction_s", "describe"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Correction:
    """The terms added to libtpu's estimate (see the module docstring)."""

    name: str  # Written to the provenance: which correction a figure carries.
    exposed: float  # Fraction of exposed DMA time the estimate misses.
    step_s: float  # Seconds per grid step the estimate misses.


V6E_CORRECTION: Final = Correction(name="v6e-2026-11-28", exposed=1.0 - 1.0 / _FITTED_V6E.bw_eff,
                                   step_s=1.5e-7)
_BY_CHIP: Final = {"tpu_v6e": V6E_CORRECTION}


def correction_for(chip: str) -> Correction | None:
    """The correction measured for ``chip`` (a canonical name), None where none was."""
    return _BY_CHIP.get(chip)


def correction_s(features: Sequence[CallFeatures], spec: ChipSpec, c: Correction) -> float:
    """Seconds to add to libtpu's estimate of a program with these pallas_calls."""
    bw = spec.hbm_bw_bytes_per_s or 1e12
    return sum(c.exposed * (f.step_bytes + f.serial_bytes) / bw + f.steps * c.step_s
               for f in features)


def corrected_ms(estimate_ms: float, calls: Sequence[Any], spec: ChipSpec
                 ) -> tuple[float, str]:
    """(the corrected figure, what the trial says about it) for libtpu's ``estimate_ms`` of a
    program whose traced pallas_calls are ``calls``; the figure unchanged and "" where no
    correction applies (another chip, no pallas_call)."""
    c = correction_for(spec.name)
    if c is None or not calls:
        return estimate_ms, ""
    add = correction_s([call_features(k) for k in calls], spec, c) * 1e3
    return estimate_ms + add, f"corrected ({c.name}): libtpu {estimate_ms:.6g} ms + {add:.3g} ms"


def describe(chip: str) -> str:
    """One line for the provenance: the correction a chip's estimates carry, or none."""
    c = correction_for(chip)
    if c is None:
        return "none: no correction is measured for this chip; libtpu's figure as it is"
    return (f"{c.name}: + {c.exposed:.3f} x exposed DMA bytes / HBM bandwidth + "
            f"{c.step_s * 1e6:.2f} us per grid step (pallas_tune.measure.correction)")
