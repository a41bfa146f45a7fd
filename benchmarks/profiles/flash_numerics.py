"""Flash attention's numerical error on bf16 inputs against an f32 reference, before and after.

Runs ``kernels/flash_attention.py`` (the working tree, and with ``--rev`` the same file at a git
revision) in Pallas interpret mode on the CPU: q (1, 4, 512, 128), k and v (1, 1, 512, 128)
drawn N(0, 1) times a scale, cast to bf16, against ``flash_attention_reference`` on the f32
inputs. Prints the max and mean absolute error and the NaN count per config. Correctness only:
no timing.

    python benchmarks/profiles/flash_numerics.py [--rev 18bb77e]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): S=256, scale 1, causal, 128x128 blocks.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llo_profile  # noqa: E402
import _common as bench  # noqa: E402 - on the path llo_profile set.

from pallas_tune.kernels.flash_attention import (  # noqa: E402
    flash_attention, flash_attention_reference)


SEQ = bench.smoke(512, 256)
SCALES = bench.smoke((1.0, 4.0), (1.0,))
CAUSAL = bench.smoke((True, False), (True,))
BLOCKS = bench.smoke(((512, 512), (512, 256), (256, 128)), ((128, 128),))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", help="also run kernels/flash_attention.py at this git revision")
    a = p.parse_args()
    versions = llo_profile.versions("flash_attention", flash_attention.fn, a.rev)
    print("# flash attention, bf16 inputs vs an f32 reference, Pallas interpret mode (CPU)")
    print(f"{'version':>14s} {'scale':>5s} {'causal':>6s} {'bq x bkv':>9s} {'max err':>8s} "
          f"{'mean err':>9s} {'NaN':>4s}")
    with pltpu.force_tpu_interpret_mode():
        for scale in SCALES:
            for causal in CAUSAL:
                keys = jax.random.split(jax.random.PRNGKey(0), 3)
                q, k, v = (jax.random.normal(key, (1, 4, SEQ, 128), jnp.float32) * scale
                           for key in keys)
                k, v = k[:, :1], v[:, :1]
                ref = np.asarray(flash_attention_reference(q, k, v, causal=causal))
                bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
                for label, fn in versions:
                    for bq, bkv in BLOCKS:
                        out = np.asarray(fn(*bf, causal=causal, bq=bq, bkv=bkv), np.float32)
                        err = np.abs(out - ref)
                        print(f"{label:>14s} {scale:5.1f} {causal!s:>6s} {bq:4d}x{bkv:<4d} "
                              f"{np.nanmax(err):8.4f} {np.nanmean(err):9.5f} "
                              f"{int(np.isnan(out).sum()):4d}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
