"""Tune for TPU v6e on a CPU host where libtpu's profiler aborts on some configs, and see what
each candidate was ranked by.

The kernel scales a bf16 array, either in bf16 (``f32=False``) or through f32. libtpu's static
profiler aborts on the bf16 form (a bf16 vector times a packed constant), so those configs get
no libtpu estimate. With ``estimate_fallback="model"`` they are ranked by pallas-tune's fitted
model instead, calibrated onto libtpu's figures on the configs that have both (never ranked raw
against them), and every config is ranked by the larger of libtpu's figure and the calibrated
model's. Each trial says which figure it has; the entry's timer names the mix. Every figure
printed is a compiler ESTIMATE or a model's, not a measurement.

Needs libtpu (pip install 'pallas-tune[tpu]'); without it the example says so and exits.

    python examples/estimate_fallback.py [--rows 256] [--cols 512] [--trials 12]
"""

from __future__ import annotations

import argparse
import importlib.util
import os

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

import pallas_tune as pt


@pt.tunable(br=[8, 16, 32], bc=[128, 256], f32=[False, True], name="example_fallback_scale")
def scale(x, *, factor=1.4427, br, bc, f32):
    """x * factor, tiled (br, bc); in f32 or in x's dtype."""

    def body(x_ref, o_ref):
        v = x_ref[...]
        o_ref[...] = (v.astype(jnp.float32) * factor).astype(v.dtype) if f32 else v * factor

    r, c = x.shape
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(r // br, c // bc),
                          in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                          name="example_fallback_scale")(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--cols", type=int, default=512)
    p.add_argument("--trials", type=int, default=12)
    a = p.parse_args()
    if importlib.util.find_spec("libtpu") is None:
        print("this example needs libtpu for the v6e compiler: pip install 'pallas-tune[tpu]'")
        return
    os.environ.setdefault("PALLAS_TUNE_TPU_LOGS", "off")  # The aborts' logs: not needed here.
    x = jnp.ones((a.rows, a.cols), jnp.bfloat16)
    res = scale.tune(x, timer="tpu-estimate", chip="v6e", trials=a.trials, write=False,
                     transfer=False, warm_start=0, estimate_fallback="model")
    print(f"{'config':34s} {'ms (ESTIMATE)':>14s}  ranked by")
    for r in sorted(res.records, key=lambda r: (not r.outcome.timed,
                                                r.median_ms if r.outcome.timed else 0)):
        cfg = ", ".join(f"{k}={v}" for k, v in r.config.items())
        if r.outcome.timed:
            print(f"{cfg:34s} {r.median_ms:14.5f}  {r.measurement.timer}"
                  + (f": {r.detail[:70]}" if r.detail else ""))
        else:
            print(f"{cfg:34s} {'-':>14s}  not ranked: {(r.error or r.detail)[:70]}")
    print(f"\npick: {res.best}  ({res.best_ms:.5f} ms, ESTIMATE)")
    print(f"the entry's timer: {res.provenance['timer']}")
    print(f"what the figures are: {res.provenance['timing_note'][-300:]}")


if __name__ == "__main__":
    main()
