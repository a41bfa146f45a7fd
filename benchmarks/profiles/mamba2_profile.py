"""Where the Mamba-2 SSD kernel's v6e estimate goes: cycles and the static op mix of its body.

Compiles ``kernels/mamba2_ssd.py`` (and, with ``--rev``, the same file at a git revision, for a
before/after in one run) deviceless for TPU v6e with libtpu's static profile and its final VLIW
bundles dumped, and prints per shape and config: the compiler's estimated cycles (whole kernel,
every grid step), the time at 1.75 GHz, the fraction of the roofline as
benchmarks/kernels/model_shapes.py defines it (the larger of the recurrence's FLOPs,
6·b·t·heads·d_state·head_dim at 918 TFLOP/s, and the bytes of every input plus the output at 1.64
TB/s), the bundles of the kernel program and how many instructions of each kind it holds (static
counts: loop bodies once, not per iteration).

Shapes are Mamba-2 2.7B's (search_spaces/mamba2_ssd.toml: 80 heads of 64, d_state 128, one
group, bf16 x/B/C, f32 dt). Every figure is a COMPILER ESTIMATE on a CPU host, not a
measurement.

    python benchmarks/profiles/mamba2_profile.py [--rev 04131b1] [--shapes 4x2048 2x4096]
        [--configs 256x4 ...]
    python benchmarks/profiles/mamba2_profile.py --rev 04131b1 --errors  # numerics, interpret

``--errors`` instead runs each version in interpret mode on the CPU at a small shape (1 x 1000,
8 heads of 64, d_state 128; ragged for every chunk) and prints the largest absolute error
against the f32 step-by-step recurrence (``mamba2_ssd_scan``), for f32 and bf16 inputs.

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 1 x 256 tokens, chunk 128, 4 heads a block.
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

import pallas_tune as pt  # noqa: E402

PEAK_FLOPS, PEAK_BYTES, CLOCK = 918e12, 1.64e12, 1.75e9
HEADS, HEAD_DIM, D_STATE = 80, 64, 128  # Mamba-2 2.7B.
KINDS = ("vmatmul", "vpop.f32.mrf", "vld", "vst", "vadd", "vsub", "vmul", "vsel", "vmin",
         "vpack", "vrot", "vpow2", "vpop.eup", "vxpose")


def _args(b, t):
    S = jax.ShapeDtypeStruct
    bf, f32 = jnp.bfloat16, jnp.float32
    return [S((b, t, HEADS * HEAD_DIM), bf), S((b, t, HEADS), f32), S((HEADS,), f32),
            S((b, t, D_STATE), bf), S((b, t, D_STATE), bf), S((HEADS,), f32)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rev", help="also profile kernels/mamba2_ssd.py at this git revision")
    p.add_argument("--shapes", nargs="+", default=bench.smoke(["4x2048"], ["1x256"]),
                   help="batch x seq")
    p.add_argument("--configs", nargs="+",
                   default=bench.smoke(["256x4", "128x4", "256x2"], ["128x4"]),
                   help="chunk x heads_per_block")
    p.add_argument("--errors", action="store_true", help="numerics instead of estimates")
    a = p.parse_args()
    if a.errors:
        return _errors(a)
    if not bench.have_libtpu():
        return
    from pallas_tune.kernels.mamba2_ssd import mamba2_ssd

    versions = llo_profile.versions("mamba2_ssd", mamba2_ssd.fn, a.rev)
    print(f"{'version':>14s} {'b x t':>7s} {'L x hb':>7s} {llo_profile.columns(KINDS)}")
    for shape in a.shapes:
        b, t = map(int, shape.split("x"))
        args = _args(b, t)
        flop_us = 6.0 * b * t * HEADS * D_STATE * HEAD_DIM / PEAK_FLOPS * 1e6
        nbytes = sum(x.size * x.dtype.itemsize for x in args) + args[0].size * 2
        byte_us = nbytes / PEAK_BYTES * 1e6
        floor_us = max(flop_us, byte_us)
        print(f"# Mamba-2 SSD, Mamba-2 2.7B {b}x{t}, 80 heads x 64, d_state 128, bf16; v6e "
              f"compiler ESTIMATES; roofline {floor_us:.1f} us (FLOPs {flop_us:.1f}, HBM "
              f"{byte_us:.1f})", flush=True)
        for label, fn in versions:
            for cfg in a.configs:
                chunk, hb = map(int, cfg.split("x"))
                row = llo_profile.profile_row(
                    fn, args, dict(chunk=chunk, heads_per_block=hb), kinds=KINDS,
                    floor_us=floor_us, program=f"mamba2_ssd_{min(chunk, t)}x{hb}", clock=CLOCK,
                    env="MAMBA2_PROFILE")
                print(f"{label:>14s} {shape:>7s} {cfg:>7s} {row}", flush=True)


def _errors(a) -> None:
    import numpy as np

    from pallas_tune.kernels.mamba2_ssd import mamba2_ssd, mamba2_ssd_scan

    versions = llo_profile.versions("mamba2_ssd", mamba2_ssd.fn, a.rev)
    rng = np.random.default_rng(0)
    b, t, h, hd, n = 1, 1000, 8, 64, 128
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    x, B, C = f(b, t, h * hd), f(b, t, n) / np.sqrt(n), f(b, t, n) / np.sqrt(n)
    dt = np.log1p(np.exp(f(b, t, h) - 1.0))  # softplus, as Mamba-2's dt
    A, D = -np.exp(rng.uniform(0.0, 2.5, h)).astype(np.float32), f(h)
    print(f"# max |y - recurrence| in interpret mode (CPU), {b}x{t}, {h} heads x {hd}, "
          f"d_state {n}; inputs rounded to the dtype first, the oracle in f32")
    for dtype in (jnp.float32, jnp.bfloat16):
        xs, Bs, Cs = (jnp.asarray(v).astype(dtype) for v in (x, B, C))
        ref = np.asarray(mamba2_ssd_scan(xs.astype(jnp.float32), jnp.asarray(dt), jnp.asarray(A),
                                         Bs.astype(jnp.float32), Cs.astype(jnp.float32),
                                         jnp.asarray(D)))
        for label, fn in versions:
            for cfg in a.configs:
                chunk, hb = map(int, cfg.split("x"))
                with pt.interpret_mode():
                    y = fn(xs, jnp.asarray(dt), jnp.asarray(A), Bs, Cs, jnp.asarray(D),
                           chunk=chunk, heads_per_block=hb)
                y = np.asarray(y.astype(jnp.float32))
                print(f"{label:>14s} {jnp.dtype(dtype).name:>8s} {cfg:>7s} finite "
                      f"{bool(np.isfinite(y).all())} max abs err {np.abs(y - ref).max():.3e} "
                      f"(|ref| max {np.abs(ref).max():.2f})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
