"""Where HSTU attention's v6e estimate goes: cycles and the static op mix of the kernel body.

Compiles ``kernels/hstu_attention.py`` (and, with ``--rev``, the same file at a git revision,
for a before/after in one run) deviceless for TPU v6e with libtpu's static profile and its final
VLIW bundles dumped, and prints per shape and config: the compiler's estimated cycles (whole
kernel, every grid step), the time at 1.75 GHz, the fraction of the roofline of the causal
problem as benchmarks/kernels/model_shapes.py defines it (the larger of useful FLOPs, the lower
triangle 4·b·h·S(S+1)/2·d at 918 TFLOP/s, and q, k, v, bias and output bytes at 1.64 TB/s), the
bundles
of the kernel program, and how many instructions of each kind the program holds (static counts:
loop bodies once, not per iteration).

Shapes are DLRM-HSTU's (search_spaces/hstu_attention.toml: 4 heads, attention and hidden dim
128, bf16, a bias bucket per distance). Every figure is a COMPILER ESTIMATE on a CPU host, not a
measurement.

    python benchmarks/profiles/hstu_profile.py [--rev 45f79a9] [--seqs 2048 4096]
        [--configs 2048x2048 ...]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): S=256, 128x128 blocks.
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

PEAK_FLOPS, PEAK_BYTES, CLOCK = 918e12, 1.64e12, 1.75e9
BATCH = {2048: 4, 4096: 2, 8192: 1}  # search_spaces/hstu_attention.toml: ~8k tokens a batch.
KINDS = ("vmatmul", "vpop.f32.mrf", "vld", "vst", "vadd", "vmul", "vsel", "vpack", "vrot",
         "vtanh", "vpow2", "vrcp", "vpop.eup")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", help="also profile kernels/hstu_attention.py at this git revision")
    p.add_argument("--seqs", type=int, nargs="+", default=bench.smoke([2048], [256]))
    p.add_argument("--configs", nargs="+",
                   default=bench.smoke(["2048x2048", "1024x1024", "512x512"], ["128x128"]))
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    from pallas_tune.kernels.hstu_attention import hstu_attention

    versions = llo_profile.versions("hstu_attention", hstu_attention.fn, a.rev)
    print(f"{'version':>14s} {'S':>5s} {'bq x bkv':>10s} {llo_profile.columns(KINDS)}")
    for s in a.seqs:
        b = BATCH.get(s, 1)
        x = jax.ShapeDtypeStruct((b, 4, s, 128), jnp.bfloat16)
        bias = jax.ShapeDtypeStruct((s,), jnp.float32)
        flop_us = 4.0 * b * 4 * s * (s + 1) / 2 * 128 / PEAK_FLOPS * 1e6
        byte_us = (4 * b * 4 * s * 128 * 2 + 4 * s) / PEAK_BYTES * 1e6
        floor_us = max(flop_us, byte_us)
        print(f"# HSTU attention, DLRM-HSTU {b}x4x{s}x128, causal, bf16; v6e compiler "
              f"ESTIMATES; roofline {floor_us:.1f} us (FLOPs {flop_us:.1f}, HBM {byte_us:.1f})",
              flush=True)
        for label, fn in versions:
            for cfg in a.configs:
                bq, bkv = map(int, cfg.split("x"))
                row = llo_profile.profile_row(
                    fn, [x, x, x, bias], dict(bq=bq, bkv=bkv), kinds=KINDS, floor_us=floor_us,
                    program=f"hstu_attention_{min(bq, s)}x{min(bkv, s)}", clock=CLOCK,
                    env="HSTU_PROFILE")
                print(f"{label:>14s} {s:5d} {cfg:>10s} {row}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
