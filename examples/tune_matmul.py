"""Tune → cache → dispatch, on a laptop: the shipped tiled matmul, tuned on whatever this host is.

On a CPU host the kernel runs in Pallas interpret mode, so the times below are interpreter wall
clock (they track grid steps, not TPU speed) and the cache entry says so. On a TPU or GPU host the
same script measures the real kernel.

    python examples/tune_matmul.py [--size 512] [--trials 12]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tune as pt
from pallas_tune.kernels.matmul import matmul, matmul_reference


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()

    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (args.size, args.size), jnp.float32).astype(args.dtype)
    y = jax.random.normal(ky, (args.size, args.size), jnp.float32).astype(args.dtype)

    print(f"chip: {pt.current_chip()}   key: {matmul.cache_key(x, y)}")
    print(f"before tuning, a call would use: {matmul.config_for(x, y)}\n")

    result = matmul.tune(x, y, trials=args.trials, seed=0)
    # The final ranking (the best configs and the default, re-timed interleaved), the winner,
    # its speed-up over the default, or a NOISE line where these timings cannot rank them.
    print(result)
    print(f"({result.provenance['timing_note']})\n")

    # Dispatch: the decorated kernel now resolves the tuned config at trace time.
    cfg = matmul.config_for(x, y)
    out = jax.jit(matmul)(x, y)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - matmul_reference(x, y).astype(jnp.float32))))
    print(f"after tuning, a call uses: {cfg}; max |out - reference| = {err:.3g}")

    # A fresh process finds it in the cache without tuning (and without importing Optuna).
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from pallas_tune.kernels.matmul import matmul\n"
        f"x = jax.ShapeDtypeStruct(({args.size}, {args.size}), jnp.dtype('{args.dtype}'))\n"
        "c = matmul.config_for(x, x)\n"
        "print(f'second process: source={c.source} config={dict(c)} '\n"
        "      f'optuna imported: {\"optuna\" in sys.modules}')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(matmul_reference(x, y), np.float32), rtol=2e-2, atol=1e-1)


if __name__ == "__main__":
    main()
