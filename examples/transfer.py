"""Transfer: a new shape's search learns from the trials the kernel measured at other shapes.

1. Tunes the shipped matmul at one shape, then at a neighbouring one: the second search's prior
   is the first one's trials (read from the trial ledger beside the cache), and its provenance
   says so. (On a CPU host the kernel runs in interpret mode: the times are the interpreter's.)
2. In a checkout, replays the default search on the shipped v6e estimate landscape of the 2048^3
   matmul, with and without the shipped ledger's trials at the other shapes as its prior, and
   prints how many evaluations each needed to reach the optimum (compiler ESTIMATES).

    python examples/transfer.py
"""

from __future__ import annotations

import math
import os
import statistics

import jax
import jax.numpy as jnp

from pallas_tune.kernels.matmul import matmul

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tune_two_shapes() -> None:
    key = jax.random.key(0)
    first = [jax.random.normal(key, (256, 256), jnp.float32),
             jax.random.normal(key, (256, 256), jnp.float32)]
    second = [jax.random.normal(key, (256, 256), jnp.float32),
              jax.random.normal(key, (256, 512), jnp.float32)]
    # Every trial runs to the end (no early stop of slow ones): on a loaded host a cut-short
    # trial is not an "ok" one, and the prior below needs three.
    r1 = matmul.tune(*first, trials=4, seed=0, retime_top=0, slow_factor=None)
    r2 = matmul.tune(*second, trials=4, seed=0, retime_top=0)
    print(f"first shape: {r1.best} ({r1.provenance.get('prior') or 'no prior'})")
    prior = r2.provenance.get("prior")
    print(f"second shape: {r2.best}; its search learned from {prior}")
    assert prior and prior["trials"] >= 3, prior


def replay_with_prior() -> None:
    from pallas_tune.cache import ledger
    from pallas_tune.search import replay

    land_path = os.path.join(REPO, "benchmarks", "landscapes",
                             "matmul_2048_bf16_v6e_estimate.json")
    ledger_path = os.path.join(REPO, "caches", "tpu_v6e",
                               "pallas_tune.kernels.matmul.matmul.estimate.trials.jsonl")
    if not (os.path.exists(land_path) and os.path.exists(ledger_path)):
        print("replay skipped: run from a checkout (benchmarks/landscapes, caches/)")
        return
    land = replay.load(land_path)
    records, _ = ledger.read(ledger_path)
    own = "x=2048x2048:bfloat16,y=2048x2048:bfloat16"
    latest = {r["key"]: r["trials"] for r in records if r["key"] != own}
    prior = replay.make_prior(land, [[(t["config"], t["median_ms"]) for t in trials
                                      if t["outcome"] == "ok"] for trials in latest.values()])

    def evaluations(**kw) -> list[float]:
        out = []
        for seed in range(5):
            tr = replay.trace(land, "default", budget=60, seed=seed, **kw)
            out.append(next((i + 1 for i, c in enumerate(tr.configs)
                             if land.means[c] <= land.optimum * 1.0001), math.inf))
        return out

    print(f"prior: {len(prior.names)} other shapes, {prior.trials} trials (v6e ESTIMATES)")
    for label, kw in (("without prior", {}), ("with prior", {"prior": prior})):
        ev = evaluations(**kw)
        print(f"  {label}: evaluations to the optimum per seed {ev}, "
              f"mean {statistics.mean(ev):.1f}")


if __name__ == "__main__":
    tune_two_shapes()
    replay_with_prior()
