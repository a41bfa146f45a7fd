"""Tune from the config you run today: it is evaluated right after the declared default (the
baseline of every speed-up), so the result is never slower than either.

``warm_configs=[...]`` (``pallas-tune sweep --warm-configs JSON``) puts your own configs ahead
of the tuner's other warm starts: a hand-written config, another library's defaults (the benchmarks
tune JAX's splash attention from MaxText's blocks this way). Runs on this CPU host in Pallas
interpret mode, whose times track grid steps, not TPU speed.

    python examples/tune_from_my_config.py [--trials 4]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp

import pallas_tune as pt
from pallas_tune.kernels.matmul import matmul

MINE = {"bm": 128, "bn": 128, "bk": 128, "buffering": 2,
        "semantics": ("parallel", "parallel", "arbitrary"), "vmem_limit_bytes": 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=4)
    a = p.parse_args()
    x = jnp.ones((256, 256), jnp.bfloat16)
    res = matmul.tune(x, x, trials=a.trials, seed=0, repeats=2, warm_configs=[MINE],
                      write=False)
    trials = res.trials.sort_values("number")
    tiles = ("bm", "bn", "bk", "buffering")
    first, second = ({k: int(trials.iloc[i][k]) for k in tiles} for i in (0, 1))
    mine = trials.iloc[1]  # Its figure: the final re-ranking's where it was re-timed, as best's.
    print(f"trial 0 (the declared default, the baseline): {first}")
    print(f"trial 1 (my config): {second} -> {float(mine['median_ms']):.4f} ms "
          f"({mine['figure']}; interpret mode, CPU)")
    print(f"best of {len(trials)} trials: {dict(res.best)} -> {res.best_ms:.4f} ms")
    assert first == {k: matmul.space.default[k] for k in tiles}, first
    assert second == {k: MINE[k] for k in tiles}, second
    try:  # A config outside the space is refused before any trial.
        matmul.tune(x, x, trials=2, warm_configs=[{**MINE, "bm": 100}], write=False)
    except pt.TuneOptionError as e:
        print(f"refused: {str(e)[:160]}...")


if __name__ == "__main__":
    main()
