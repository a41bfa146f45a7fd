"""Which interpret mode pallas-tune uses on the CPU, and why: HLO interpreter vs TPU simulator.

``pallas_tune.interpret_mode()`` (what decorated kernels get automatically on a CPU host) selects
JAX's HLO interpreter (``interpret=True``); ``pltpu.force_tpu_interpret_mode()`` selects the TPU
simulator (``InterpretParams``), which models DMAs and semaphores. Both give correct results; this
prints their steady-state wall time per call on the shipped matmul. These are CPU interpreter
timings, not kernel performance.

    python benchmarks/runtime/interpret_modes.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels.matmul import matmul, matmul_reference

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402


def _time(fn, *args, n=5):
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    print(f"{'problem':28s} {'tiles':14s} {'HLO interp ms':>14s} {'TPU simulator ms':>17s} "
          f"{'ratio':>6s}")
    for size, tile in bench.smoke(((512, 128), (512, 256), (1024, 256)), ((256, 128),)):
        x = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
        cfg = dict(bm=tile, bn=tile, bk=tile, buffering=2,
                   semantics=("parallel", "parallel", "arbitrary"))
        f = jax.jit(lambda a, b: matmul.__wrapped__(a, b, **cfg))
        g = jax.jit(lambda a, b: matmul.__wrapped__(a, b, **cfg))
        with pt.interpret_mode():
            fast = _time(f, x, x, n=bench.smoke(5, 1))
            ref_err = float(jnp.max(jnp.abs(f(x, x) - matmul_reference(x, x))))
        with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
            slow = _time(g, x, x, n=bench.smoke(3, 1))
        print(f"matmul {size}^3 f32{'':14s} {tile}^3{'':9s} {fast:14.1f} {slow:17.1f} "
              f"{slow / fast:6.1f}   (max err {ref_err:.1e})")


if __name__ == "__main__":
    main()
