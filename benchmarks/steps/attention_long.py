"""Causal GQA attention alone at a long context, forward + backward: the three a layer would
run, v6e compiler ESTIMATES where there are figures.

Where a whole layer's composed figure cannot be made on this host (``step_tuning.py`` compiles
the layer's glue whole: at 32768 tokens that needs more than 24 GB), attention, the part whose
S² work grows, is set out alone:

- pallas-tune: ``flash_attention`` and ``flash_attention_bwd`` at their tuned cache entries (the
  tuner's own re-timed estimates, recorded with their libtpu version; ``pallas-tune sweep``);
- splash: a ``splash_grid.py`` record (its stand-in's estimates), MaxText's blocks or a grid;
- XLA: the kernel's reference (what the all-XLA setting runs), forward and ``jax.vjp``, compiled
  deviceless for v6e without a profile, to say whether it fits the chip's HBM at all;
- the roofline: the causal problem's useful FLOPs (the lower triangle; 2.5x for the backward) at
  the MXU peak.

    python benchmarks/steps/attention_long.py --tokens 32768 --heads 32 --kv-heads 8
        [--splash SPLASH_GRID.json] [--rows-out attention_32k.json]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 512 tokens, 2 query heads to one KV head.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
from steps import upstream  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.feasibility.compile import compile_deviceless  # noqa: E402
from pallas_tune.kernels._attention import flash_attention_reference  # noqa: E402
from pallas_tune.kernels.flash_attention import flash_attention  # noqa: E402
from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd  # noqa: E402


def shapes(t: int, hq: int, hkv: int) -> tuple[list, list]:
    bf, s = jnp.bfloat16, jax.ShapeDtypeStruct
    q, kv = s((1, hq, t, 128), bf), s((1, hkv, t, 128), bf)
    return [q, kv, kv], [q, kv, kv, q, s((1, hq, t), jnp.float32), q]


def entry(kernel, args) -> dict:
    """The tuned entry's config and re-timed estimate (the cache's record of the sweep)."""
    key = kernel.cache_key(*args, causal=True)
    hit = kernel.cache.lookup("tpu_v6e", kernel.name, key)
    if not hit:
        module, name = kernel.name.rsplit(".", 1)
        return {"key": key, "error": f"no v6e estimate entry: pallas-tune sweep "
                f"{module}:{name} --shapes '{key}'"}
    found, path = hit
    return {"key": key, "config": found["config"], "ms": found.get("median_ms"), "file": path,
            "libtpu": ((found.get("provenance") or {}).get("versions") or {}).get("libtpu")}


def xla_fits(fwd_args) -> dict:
    """The reference's forward and VJP compiled deviceless for v6e: fits, or the reason not."""
    def step(q, k, v):
        out, vjp = jax.vjp(lambda a, b, c: flash_attention_reference(a, b, c, causal=True),
                           q, k, v)
        return vjp(out)  # Any cotangent of the output's shape: the backward's program.

    r = compile_deviceless(step, fwd_args, {}, chip="v6e")
    return {"compiles": r.ok, "kind": r.kind, "message": " ".join(r.message.split())[:400]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=bench.smoke(32768, 512))
    p.add_argument("--heads", type=int, default=bench.smoke(32, 2))
    p.add_argument("--kv-heads", type=int, default=bench.smoke(8, 1))
    p.add_argument("--splash", help="a splash_grid.py record at this shape")
    p.add_argument("--skip-xla", action="store_true")
    p.add_argument("--rows-out")
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    t, hq = a.tokens, a.heads
    fwd_args, bwd_args = shapes(t, hq, a.kv_heads)
    peak = chip_spec("v6e").bf16_flops
    floor = 4.0 * hq * t * (t + 1) / 2 * 128 / peak * 1e3
    row = {"tokens": t, "heads": hq, "kv_heads": a.kv_heads, "roofline_ms": {
        "forward": floor, "backward": 2.5 * floor},
        "ours": {"forward": entry(flash_attention, fwd_args),
                 "backward": entry(flash_attention_bwd, bwd_args)}}
    if a.splash:
        row["splash"] = upstream.recorded_cost(a.splash, grad=True)
    if not a.skip_xla:
        row["xla"] = xla_fits(fwd_args)
    ours = row["ours"]
    print(f"# causal attention, {t} tokens, {hq} q / {a.kv_heads} KV heads of 128, bf16; "
          "v6e compiler ESTIMATES")
    for part in ("forward", "backward"):
        e, r = ours[part], row["roofline_ms"][part]
        share = f"{r / e['ms']:.1%} of the roofline" if e.get("ms") else e.get("error")
        print(f"pallas-tune {part}: {e.get('ms')} ms {e.get('config')} ({share})")
    if "splash" in row:
        s = row["splash"]
        print(f"splash: forward {s['forward_ms']:.4f} backward {s['backward_ms']:.4f} "
              f"(blocks {s['forward_blocks']} / {s['backward_blocks']})")
    if "xla" in row:
        print(f"XLA reference, forward + VJP: {row['xla']}")
    if a.rows_out:
        with open(bench.output(a.rows_out), "w", encoding="utf-8") as f:
            json.dump({"command": bench.command(__file__), "row": row}, f, indent=1,
                      default=str)


if __name__ == "__main__":
    main()
