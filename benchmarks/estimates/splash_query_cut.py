"""Splash's stand-in with its query rows cut, against the stand-in without the cut (v6e ESTIMATES).

Past 8192 x 8192 scores a head (``kernels._splash.MAX_SCORES``) splash's stand-in also cuts the
query sequence, to whole query blocks, and scales by the cut: every block is computed unmasked
there, so each query's work is the same and independent of the others'. This script checks that
where the uncut stand-in still compiles (8192 tokens): the same configs' figures with the bound
lowered so that the cut keeps ``--keep`` query rows, against the figures without a cut. Each
figure is the stand-in's (full attention; the causal share is applied to both alike and left
out here). Every figure is a v6e compiler ESTIMATE, not a measurement.

    python benchmarks/estimates/splash_query_cut.py [--tokens 8192] [--keep 2048] [--memory-gb 16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tune.kernels import _splash, upstream  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402

CLOCK = 1.75e9
# The forward configs and backward adapters splash_grid.py searched at 8192 tokens, with
# MaxText's: (block_q, block_kv, block_kv_compute) and (dK/dV q, kv, kv compute, dQ q, kv, fused).
FORWARD = [(512, 512, 512), (1024, 1024, 512), (2048, 1024, 512), (1024, 4096, 1024)]
BACKWARD = [(512, 512, 512, 512, 512, False), (1024, 1024, 512, 1024, 1024, True),
            (2048, 1024, 512, 2048, 1024, False), (2048, 2048, 512, 2048, 2048, False)]


if bench.SMOKE:  # MaxText's forward at 1024 tokens (the backward's path is the same loop).
    FORWARD, BACKWARD = FORWARD[:1], []


def _configs():
    for f in FORWARD:
        yield "forward", dict(zip(("block_q", "block_kv", "block_kv_compute"), f, strict=True))
    for b in BACKWARD:
        yield "backward", dict(zip(("block_q_dkv", "block_kv_dkv", "block_kv_dkv_compute",
                                    "block_q_dq", "block_kv_dq", "use_fused_bwd_kernel"), b,
                                   strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=bench.smoke(8192, 1024))
    p.add_argument("--heads", type=int, nargs=2, default=bench.smoke([32, 8], [4, 1]),
                   metavar=("Q", "KV"))
    p.add_argument("--keep", type=int, default=bench.smoke(2048, 512),
                   help="query rows the cut keeps")
    p.add_argument("--memory-gb", type=float, default=16)
    p.add_argument("--out", default=bench.result("splash_query_cut.md"))
    a = p.parse_args()
    t, (hq, hkv) = a.tokens, a.heads
    q = jax.ShapeDtypeStruct((1, hq, t, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, hkv, t, 128), jnp.bfloat16)
    lines = ["# Splash's stand-in with its query rows cut (v6e ESTIMATES)", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "", f"    {bench.command(__file__)}",
             "", f"{bench.today()}; {bench.versions('jax', 'libtpu')}; {bench.host()}", "",
             f"{hq} query / {hkv} KV heads, {t} tokens, head_dim 128, bf16.", "",
             "| kernel | config | uncut: rows x heads, ms | cut: rows x heads, ms | "
             "cut / uncut |", "|---|---|---|---|---|"]
    with Estimator(1, memory_limit_bytes=int(a.memory_gb * (1 << 30))) as est:
        for kind, cfg in _configs():
            kernel, make, args = ((upstream.splash_attention, _splash.forward_standin, [q, k, k])
                                  if kind == "forward" else
                                  (upstream.splash_attention_bwd, _splash.backward_standin,
                                   [q, k, k, q]))
            cells, figures = [], []
            for bound in (t * t, a.keep * t):
                t0 = time.perf_counter()
                cut, kw, scale = make(args, {"causal": False}, cfg, max_scores=bound)
                r = est.map(kernel, cut, kw, [cfg], "tpu_v6e", standin=False)[0]
                ms = cycles_to_ms(r.cycles, CLOCK) * scale if r.ok and r.cycles else None
                figures.append(ms)
                cells.append(f"{cut[0].shape[2]} x {cut[0].shape[1]}, "
                             f"{f'{ms:.4f}' if ms else r.kind} ({time.perf_counter() - t0:.0f} s)")
            ratio = f"{figures[1] / figures[0]:.3f}" if all(figures) else "-"
            lines.append(f"| {kind} | {tuple(cfg.values())} | {cells[0]} | {cells[1]} | "
                         f"{ratio} |")
            print(lines[-1], flush=True)
            bench.write(a.out, "\n".join(lines) + "\n", echo=False)  # Kept if cut short.
    bench.write(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
