"""Tune an MoE grouped matmul for TPU v6e on a CPU host, on the compiler's static estimates, and
see what those estimates cannot follow.

libtpu's static profile takes scalar-prefetch values, here the grouped matmul's visit table, as
0. With one k step (tk = K) the kernel's block indices move only through that table, so the
profile would count one weight fetch where the data needs one per visit: pallas-tune gives such
a config no estimate (a failed trial, with the reason, and the search goes on), and the
winner's figure carries a caveat saying what else the profile could not follow. Every figure
printed is a compiler ESTIMATE, not a measurement.

Needs libtpu (pip install 'pallas-tune[tpu]'); without it the example says so and exits.

    python examples/estimate_moe.py [--rows 1024] [--k 512] [--n 512] [--experts 8] [--trials 5]
"""

from __future__ import annotations

import argparse
import importlib.util

import jax
import jax.numpy as jnp

from pallas_tune.kernels.grouped_matmul import grouped_matmul


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args()
    if importlib.util.find_spec("libtpu") is None:
        print("this example needs libtpu for the v6e compiler: pip install 'pallas-tune[tpu]'")
        return
    from pallas_tune.measure.estimate import Estimator

    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((a.rows, a.k), bf),
            jax.ShapeDtypeStruct((a.experts, a.k, a.n), bf),
            jax.ShapeDtypeStruct((a.experts,), jnp.int32))

    # The same tiles with one k step and with two: only the second can be estimated.
    tiles = [dict(tm=128, tk=a.k, tn=256), dict(tm=128, tk=a.k // 2, tn=256)]
    with Estimator(1) as est:
        for config, r in zip(tiles, est.map(grouped_matmul, args, {}, tiles, "v6e",
                                            standin=False), strict=True):
            said = f"{r.cycles / 1.75e6:.4f} ms ESTIMATE" if r.ok else f"{r.kind}: {r.message}"
            print(f"{config}: {said}\n")

    # A tune: refused configs are failed trials with their reason; the winner is estimable.
    result = grouped_matmul.tune(*args, timer="tpu-estimate", chip="v6e", trials=a.trials,
                                 workers=1, write=False, xla=False, seed=0)
    for rec in result.records:
        what = (f"{rec.median_ms:.4f} ms" if rec.outcome.timed
                else f"{rec.outcome.value} ({rec.detail}): {rec.error[:80]}...")
        print(f"  trial {rec.number}: {rec.config} -> {what}")
    best = result.best_record.config
    print(f"winner {best}: {result.best_ms:.4f} ms (ESTIMATE, v6e)")
    print(f"its caveat: {result.provenance.get('estimate_caveat', 'none')[:200]}...")
    assert min(best["tk"], a.k) < a.k, "a one-k-step config cannot win on estimates"


if __name__ == "__main__":
    main()
