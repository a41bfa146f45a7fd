"""Where flash attention's v6e estimate goes: cycles and the static op mix of the kernel body.

Compiles ``kernels/flash_attention.py`` (and, with ``--rev``, the same file at a git revision,
for a before/after in one run) deviceless for TPU v6e with libtpu's static profile and its final
VLIW bundles dumped, and prints per config: the compiler's estimated cycles (whole kernel, every
grid step), the time at 1.75 GHz, the fraction of the roofline of the causal problem (useful
FLOPs only: the lower triangle), the bundles of the kernel program, and how many instructions
of each kind the program holds (static counts: loop bodies once, not per iteration).

Every figure is a COMPILER ESTIMATE on a CPU host, not a measurement.

    python benchmarks/profiles/flash_profile.py [--rev 84e6923] [--seq 2048]
        [--heads 32 --kv-heads 8]
        [--no-causal] [--configs 2048x2048 ...]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): S=256, 2 q heads, one KV head, 128x128 blocks.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llo_profile  # noqa: E402 - before JAX: it sets what libtpu reads when it loads.

import _common as bench  # noqa: E402 - on the path llo_profile set.
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

PEAK_FLOPS, CLOCK = 918e12, 1.75e9
KINDS = ("vmatmul", "vpop.f32.mrf", "vld", "vst", "vadd.f32", "vmax.f32", "vmul.f32", "vsub.f32",
         "vexp2", "vpack", "vunpack", "vsel", "vpop.eup")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", help="also profile kernels/flash_attention.py at this git revision")
    p.add_argument("--seq", type=int, default=bench.smoke(2048, 256))
    p.add_argument("--heads", type=int, default=bench.smoke(32, 2),
                   help="query heads (Llama-3.1-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=bench.smoke(8, 1),
                   help="KV heads (Llama-3.1-8B: 8)")
    p.add_argument("--no-causal", action="store_true", help="full attention, not causal")
    p.add_argument("--configs", nargs="+", default=bench.smoke(
        ["2048x2048", "1024x2048", "1024x1024", "512x512"], ["128x128"]))
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    from pallas_tune.kernels.flash_attention import flash_attention

    versions = llo_profile.versions("flash_attention", flash_attention.fn, a.rev)
    s, h, causal = a.seq, a.heads, not a.no_causal  # Llama-3.1-8B: head_dim 128, batch 1.
    q = jax.ShapeDtypeStruct((1, h, s, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, a.kv_heads, s, 128), jnp.bfloat16)
    pairs = s * (s + 1) / 2 if causal else s * s  # Useful FLOPs only: the lower triangle.
    floor_us = 4.0 * h * pairs * 128 / PEAK_FLOPS * 1e6
    print(f"# flash attention, Llama-3.1-8B, S={s}, {h} q heads, {a.kv_heads} KV heads, "
          f"{'causal' if causal else 'not causal'}, bf16; v6e compiler ESTIMATES; "
          f"roofline {floor_us:.1f} us")
    print(f"{'version':>14s} {'bq x bkv':>10s} {llo_profile.columns(KINDS)}")
    for label, fn in versions:
        for cfg in a.configs:
            bq, bkv = map(int, cfg.split("x"))
            row = llo_profile.profile_row(
                fn, [q, kv, kv], dict(causal=causal, bq=bq, bkv=bkv), kinds=KINDS,
                floor_us=floor_us, program=f"flash_attention_{bq}x{bkv}", clock=CLOCK,
                env="FLASH_PROFILE")
            print(f"{label:>14s} {cfg:>10s} {row}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
