"""Splash attention's blocks, a small grid estimated on its stand-in (v6e compiler ESTIMATES).

pallas-tune's Bayesian tuner thrashed on splash at 8192 tokens on this 2-core, 24 GB host (its
workers, two at a time beside a step compile, were replaced again and again for half an hour
without recording a trial; memory the likely cause, not confirmed), so splash's blocks were searched here by hand: forwards at six configs
around MaxText's (every block 512), and the backward adapter (splash's forward at the dK/dV
blocks, then its VJP) at five. Splash's training cost at a pair = forward(forward config) +
adapter(backward config) - forward(its dK/dV blocks).

    python benchmarks/estimates/splash_grid.py TOKENS Q_HEADS KV_HEADS OUT.json [maxtext|best8b]

The compile worker's memory cap is 14 GiB (``SPLASH_GRID_MEMORY_GB`` sets another).
"""

import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from pallas_tune.measure.estimate import Estimator, cycles_to_ms
from pallas_tune.kernels import upstream as up

t = int(sys.argv[1])
hq, hk = int(sys.argv[2]), int(sys.argv[3])
out = sys.argv[4]
S = jax.ShapeDtypeStruct
bf = jnp.bfloat16
q = S((1, hq, t, 128), bf)
k = S((1, hk, t, 128), bf)
F = [
    (1024, 1024, 512),
    (2048, 1024, 512),
    (2048, 2048, 512),
    (1024, 1024, 1024),
    (4096, 2048, 512),
    (2048, 1024, 1024),
]
B = [
    (1024, 1024, 512, 1024, 1024, False),
    (2048, 1024, 512, 2048, 1024, False),
    (1024, 1024, 1024, 1024, 1024, False),
    (2048, 2048, 512, 2048, 2048, False),
    (1024, 1024, 512, 1024, 1024, True),
]
if sys.argv[5:] == ["maxtext"]:  # MaxText's blocks alone: every block 512, unfused backward.
    F, B = [(512, 512, 512)], [(512, 512, 512, 512, 512, False)]
elif sys.argv[5:] == ["best8b"]:  # The best of the grid at Llama-3.1-8B's 8192-token shape.
    F, B = [(1024, 1024, 512)], [(1024, 1024, 512, 1024, 1024, True)]
rows = []


def _row(est, kind, kernel, args, cfg):
    """One config's stand-in estimate, as a row (its error where it has none)."""
    t0 = time.time()
    r = est.map(kernel, args, {"causal": True}, [cfg], "tpu_v6e", standin=True)[0]
    return {"kind": kind, "config": cfg,
            "ms": cycles_to_ms(r.cycles, 1.75e9) if r.ok and r.cycles else None,
            "scale": r.scale, "error": None if r.ok else r.message[:200],
            "wall_s": round(time.time() - t0, 1)}


FWD_KEYS = ("block_q", "block_kv", "block_kv_compute")
BWD_KEYS = ("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute", "block_q_dq", "block_kv_dq",
            "use_fused_bwd_kernel")
runs = [("forward", up.splash_attention, [q, k, k], dict(zip(FWD_KEYS, f, strict=True)))
        for f in F]
runs += [("adapter (forward at dK/dV blocks + backward)", up.splash_attention_bwd, [q, k, k, q],
          dict(zip(BWD_KEYS, b, strict=True))) for b in B]
with Estimator(1, memory_limit_bytes=int(float(os.environ.get("SPLASH_GRID_MEMORY_GB", "14"))
                                         * (1 << 30))) as est:
    for kind, kernel, args, cfg in runs:
        rows.append(_row(est, kind, kernel, args, cfg))
        print(json.dumps(rows[-1]), flush=True)
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
