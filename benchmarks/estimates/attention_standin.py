"""Does flash attention's query-head stand-in hold? Checked where the full problem compiles.

At long context a single KV group is too much for libtpu's profile on a 24 GB host (Llama-3.1-8B
at 32768 tokens, 2048 tiles: 1024 grid steps, past 22 GB), so the stand-ins of
``flash_attention`` and ``flash_attention_bwd`` also drop query heads within a group, down to
128 grid steps (the fused backward only where its VMEM limit is not capped). This prints the stand-in's scaled estimate against the full compile at
shapes where the stand-in cuts the group and the full problem still fits (configs it does
not cut are left out), then the stand-in's
figures at 32768 tokens, where nothing else is readable. Every figure is a v6e compiler
ESTIMATE, not a measurement.

    python benchmarks/estimates/attention_standin.py [--memory-gb 14] [--long 32768]
        [--passes forward backward fused long]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 128-blocks at 1024 tokens (8 query heads to a KV head,
cut by the stand-in), forward and backward.
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tune.kernels import flash_attention as fa  # noqa: E402
from pallas_tune.kernels import flash_attention_bwd as fab  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402

CLOCK = 1.75e9
BF = jnp.bfloat16
FWD = [{"bq": 1024, "bkv": 1024}, {"bq": 2048, "bkv": 1024}, {"bq": 4096, "bkv": 2048}]
BWD = [dict(bq_dq=b, bkv_dq=b, bq_dkv=b, bkv_dkv=b, fused=False) for b in (1024, 2048)]
FUSED = [{**c, "fused": True} for c in BWD]
# (q heads, KV heads, tokens): the 70B/TP8 shard (a group of 8) and an 8B KV group.
CHECKED = [(8, 1, 8192), (4, 1, 8192), (8, 1, 16384)]
if bench.SMOKE:  # Small blocks, so that a short sequence still has the stand-in cut a group.
    FWD, CHECKED = [{"bq": 128, "bkv": 128}], [(8, 1, 1024)]
    BWD = [dict(bq_dq=128, bkv_dq=128, bq_dkv=128, bkv_dkv=128, fused=False)]
    FUSED = [{**c, "fused": True} for c in BWD]


def _specs(hq, hkv, t, backward):
    q = jax.ShapeDtypeStruct((1, hq, t, 128), BF)
    k = jax.ShapeDtypeStruct((1, hkv, t, 128), BF)
    if not backward:
        return fa.flash_attention, [q, k, k]
    lse = jax.ShapeDtypeStruct((1, hq, t), jnp.float32)
    return fab.flash_attention_bwd, [q, k, k, q, lse, q]


def _cut(kernel, args, cfg):
    (q, k, *_), _, scale = kernel.standin(list(args), {"causal": True}, cfg)
    return f"{q.shape[1]}/{k.shape[1]}", scale


def _pass(bwd, cfg):
    return ("backward, fused" if cfg.get("fused") else "backward") if bwd else "forward"


def _ms(r):
    return cycles_to_ms(r.cycles, CLOCK) if r.ok and r.cycles else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--memory-gb", type=float, default=14)
    p.add_argument("--long", type=int, default=32768)
    p.add_argument("--passes", nargs="*", choices=["forward", "backward", "fused", "long"],
                   default=bench.smoke(["forward", "backward", "long"], ["forward", "backward"]))
    p.add_argument("--out", default=bench.result("attention_standin.md"))
    p.add_argument("--append", action="store_true", help="add rows to --out's table")
    a = p.parse_args()
    lines = ["# Flash attention's query-head stand-in (v6e ESTIMATES)", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "", f"    {bench.command(__file__)}",
             "", f"{bench.today()}; {bench.versions('jax', 'libtpu')}; {bench.host()}", "",
             "| pass | q/KV heads | tokens | blocks | stand-in heads (q/KV) | scale | "
             "stand-in ms | full ms | stand-in / full |", "|---|---|---|---|---|---|---|---|---|"]
    tail: list[str] = []  # What follows the table (its notes): kept after the new rows.
    if a.append and os.path.exists(a.out):
        with open(a.out) as f:
            lines = f.read().rstrip("\n").split("\n")
        last = max(i for i, line in enumerate(lines) if line.startswith("|"))
        lines, tail = lines[:last + 1], lines[last + 1:]
    with Estimator(1, memory_limit_bytes=int(a.memory_gb * (1 << 30))) as est:
        shapes = [(s, False, c) for s in CHECKED for c in FWD] * ("forward" in a.passes)
        shapes += [(s, True, c) for s in CHECKED if s[2] <= 8192  # Two passes: at most 8192.
                   for c in BWD] * ("backward" in a.passes)
        shapes += [(s, True, c) for s in CHECKED if s[2] <= 8192
                   for c in FUSED] * ("fused" in a.passes)
        shapes += [((hq, hkv, a.long), bwd, c) for hq, hkv in ((32, 8), (8, 1))
                   for bwd, cs in ((False, FWD), (True, BWD + FUSED)) for c in cs
                   ] * ("long" in a.passes)
        for (hq, hkv, t), bwd, cfg in shapes:
            kernel, args = _specs(hq, hkv, t, bwd)
            cut, scale = _cut(kernel, args, cfg)
            if scale == 1:  # Nothing to check: the stand-in is the full problem.
                continue
            scaled = est.map(kernel, args, {"causal": True}, [cfg], "tpu_v6e", standin=True)[0]
            full = (est.map(kernel, args, {"causal": True}, [cfg], "tpu_v6e", standin=False)[0]
                    if t != a.long else None)
            s, f = _ms(scaled), full and _ms(full)
            blocks = cfg.get("bq", cfg.get("bq_dkv")), cfg.get("bkv", cfg.get("bkv_dkv"))
            lines.append(
                f"| {_pass(bwd, cfg)} | {hq}/{hkv} | {t} | {blocks[0]}/"
                f"{blocks[1]} | {cut} | {scale:g} | {f'{s:.4f}' if s else scaled.kind} | "
                f"{f'{f:.4f}' if f else (full.kind if full else 'not compiled')} | "
                f"{f'{s / f:.3f}' if s and f else '-'} |")
            print(lines[-1], flush=True)
            bench.write(a.out, "\n".join(lines + tail) + "\n", echo=False)  # Kept if cut short.
    bench.write(a.out, "\n".join(lines + tail) + "\n")


if __name__ == "__main__":
    main()
