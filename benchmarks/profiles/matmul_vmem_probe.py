"""Would a ``vmem_limit_bytes`` in kernels/matmul.py unlock faster 2048-row tiles? (v6e)

When this probe ran, the shipped matmul set no ``vmem_limit_bytes``, so its blocks lived in the
chip's default scoped VMEM (32 MiB on v6e) and most 2048-row tiles were infeasible
(model_sweeps.txt, 2026-11-25); it now tunes ``vmem_limit_bytes`` (0, 64 MiB, 100 MiB). This
compiles the same kernel body with a 100 MiB limit at the two Llama-3 2048-token shapes where
XLA's matmul beats the tuned one, and prints the static estimate of each tiling. Every figure is
a COMPILER ESTIMATE on a CPU host (deviceless libtpu), not a measurement.

    python benchmarks/profiles/matmul_vmem_probe.py

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 256^3, two tilings (default and a raised limit).
"""

from __future__ import annotations

import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

bench.static_profile_env("mm-vmem-probe-")  # Before JAX loads.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from pallas_tune.feasibility import compile as _compile  # noqa: E402
from pallas_tune.kernels.matmul import _kernel  # noqa: E402

CLOCK = 1.75e9
SHAPES = [(2048, 4096, 14336), (2048, 8192, 7168)]  # (M, K, N); XLA: 0.2753 / 0.2764 ms.
TILES = [(1024, 1024, 1024, None), (2048, 1024, 1024, 100 << 20), (2048, 2048, 512, 100 << 20),
         (2048, 2048, 1024, 100 << 20), (1024, 2048, 2048, 100 << 20),
         (2048, 1024, 2048, 100 << 20)]
if bench.SMOKE:
    SHAPES, TILES = [(256, 256, 256)], [(128, 128, 128, None), (256, 256, 256, 100 << 20)]


def _matmul(x, y, *, bm, bn, bk, limit):
    """kernels/matmul.py's pallas_call (double-buffered inputs), with ``vmem_limit_bytes``."""
    (m, k), n = x.shape, y.shape[1]
    return pl.pallas_call(
        functools.partial(_kernel, k_tail=k % bk),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[pl.BlockSpec((bm, bk), lambda i, j, kk: (i, kk)),
                  pl.BlockSpec((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=limit),
        name=f"mm_{bm}x{bn}x{bk}")(x, y)


def main() -> None:
    if not bench.have_libtpu():
        return
    print(f"# matmul tilings under a raised VMEM limit: v6e compiler ESTIMATES at 1.75 GHz "
          f"(jax {jax.__version__}), not measurements")
    for m, k, n in SHAPES:
        args = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                jax.ShapeDtypeStruct((k, n), jnp.bfloat16)]
        for bm, bn, bk, limit in TILES:
            f = functools.partial(_matmul, bm=bm, bn=bn, bk=bk, limit=limit)
            r = _compile.compile_deviceless(f, args, {}, chip="tpu_v6e")
            est = (f"{sum(r.estimated_cycles) / CLOCK * 1e3:.4f} ms"
                   if r.ok and r.estimated_cycles else f"failed: {r.kind} {r.message[:120]}")
            where = f"{limit >> 20} MiB" if limit else "default (32 MiB)"
            print(f"{m}x{k}x{n}  tiles {bm}x{bn}x{bk}  VMEM limit {where:16s} {est}", flush=True)


if __name__ == "__main__":
    main()
