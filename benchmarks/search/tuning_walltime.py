"""Tuning wall time and result quality: pallas-tune against tune-jax's `tune`, same kernel and space.

Kernel: the shipped tiled matmul, 512^3 f32, over a space of 108 candidates (bm, bn, bk in
{128, 256, 512}, buffering {1, 2}, two dimension_semantics). Compared:
- tune-jax 0.8 `tune` (exhaustive, parallel compile, profiler timing);
- pallas-tune's default search (GP sampler) and its TPE sampler, 24 trials each (interleaved
  re-timing of the top 3 included);
- pallas-tune over the whole space (exhaustive).
Quality: every winner, plus the best of all, is re-timed in one interleaved session with the
same harness; the table shows each winner's time relative to the best.

Without an accelerator these are CPU wall-clock timings of Pallas interpret mode: they measure
the tuners' overheads and search, not TPU kernel speed.

    python benchmarks/search/tuning_walltime.py
    PALLAS_TUNE_BENCH_SMOKE=1 python benchmarks/search/tuning_walltime.py  # 256^3, 8 configs
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

if not os.environ.get("PALLAS_TUNE_CACHE_DIR"):  # A cache of this run's own.
    os.environ["PALLAS_TUNE_CACHE_DIR"] = bench.scratch("pt-walltime-")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_tune as pt  # noqa: E402
from pallas_tune.kernels.matmul import matmul  # noqa: E402
from pallas_tune.measure.timing import retime_interleaved  # noqa: E402


SIZE = bench.smoke(512, 256)
TRIALS = bench.smoke(24, 3)
TILES = bench.smoke([128, 256, 512], [128, 256])
SPACE = dict(bm=TILES, bn=TILES, bk=TILES, buffering=bench.smoke([1, 2], [2]),
             semantics=[("parallel", "parallel", "arbitrary"),
                        ("arbitrary", "arbitrary", "arbitrary")][:bench.smoke(2, 1)])
mm = pt.tunable(name="walltime_matmul", **SPACE)(matmul.fn)


def main() -> None:
    import tune_jax
    from jax._src import config as jax_config

    x = jax.random.normal(jax.random.key(0), (SIZE, SIZE), jnp.float32)
    y = jax.random.normal(jax.random.key(1), (SIZE, SIZE), jnp.float32)
    n = mm.space.size
    rows = []

    for sampler in ("gp", "tpe"):
        t = time.perf_counter()
        res = mm.tune(x, y, trials=TRIALS, seed=0, write=False, sampler=sampler)
        rows.append((f"pallas-tune {sampler}, {TRIALS} trials", time.perf_counter() - t, TRIALS,
                     res.best))

    t = time.perf_counter()
    full = mm.tune(x, y, trials=n, seed=0, write=False)
    rows.append((f"pallas-tune exhaustive ({n})", time.perf_counter() - t, n, full.best))

    # tune-jax compiles in its own threads: interpret mode must be set globally for it.
    prev = jax_config.pallas_tpu_interpret_mode_context_manager.value
    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(True)
    try:
        def f(a, b, bm=128, bn=128, bk=128, buffering=2, semantics=SPACE["semantics"][0]):
            return matmul.fn(a, b, bm=bm, bn=bn, bk=bk, buffering=buffering, semantics=semantics)

        t = time.perf_counter()
        g = tune_jax.tune(f, hyperparams=SPACE)
        jax.block_until_ready(g(x, y))
        rows.append((f"tune-jax 0.8 tune ({n}, exhaustive)", time.perf_counter() - t, n,
                     dict(g.optimal_hyperparams)))
    finally:
        jax_config.pallas_tpu_interpret_mode_context_manager.set_global(prev)

    # Each distinct winner re-timed once, interleaved: equal winners get equal times.
    distinct = []
    for r in rows:
        if r[3] not in distinct:
            distinct.append(r[3])
    times = retime_interleaved(matmul.fn, (x, y), {}, distinct, interpret=True,
                               rounds=bench.smoke(15, 2))
    med = [statistics.median(times[distinct.index(r[3])]) for r in rows]
    best = min(med)
    print(f"matmul {SIZE}^3 f32, space of {n}; CPU interpret-mode wall clock (no accelerator); "
          f"jax {jax.__version__}, tune-jax {tune_jax.__version__ if hasattr(tune_jax, '__version__') else '0.8'}")
    print(f"{'tuner':38s} {'wall s':>7s} {'evals':>6s} {'winner ms':>10s} {'vs best':>8s}  winner")
    for (name, wall, evals, cfg), m in zip(rows, med, strict=True):
        short = {k: v for k, v in cfg.items() if k != "semantics"}
        print(f"{name:38s} {wall:7.1f} {evals:6d} {m:10.3f} {m / best:8.3f}  {short}")


if __name__ == "__main__":
    main()
