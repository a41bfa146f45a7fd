"""Flash attention's backward, fused (one pass: dK, dV and dQ) against the two passes (dK/dV,
then dQ): v6e compiler estimates of each config at a Llama attention shape.

Estimates ``flash_attention_bwd`` as the tuner does (``pallas_tune.measure.estimate.Estimator``:
deviceless v6e compiles with libtpu's static profile, in worker processes, on the kernel's
stand-in: fewer KV heads, the same tiles, scaled back) and prints per config: the estimated
cycles of the backward (the two pallas_calls, or the fused one, and XLA's delta = rowsum(dO *
O)), the time at 1.75 GHz and the fraction of the causal problem's roofline (useful FLOPs only:
the lower triangle, 2.5 times the forward's, as FlashAttention counts a backward).

Every figure is a COMPILER ESTIMATE on a CPU host, not a measurement.

    python benchmarks/profiles/flash_bwd_profile.py [--seq 8192] [--heads 32 --kv-heads 8]
        [--configs 2048x2048:fused 1024x2048:fused 2048x2048x2048x2048 ...] [--memory-gb 12]

A config is ``BQxBKV:fused`` (the dK/dV blocks, the pass fused) or ``BQDQxBKVDQxBQxBKV``
(the dQ pass's blocks, then the dK/dV pass's).

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): S=512, 2 q heads, one KV head, one fused config.
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

PEAK_FLOPS, CLOCK = 918e12, 1.75e9


def config(text: str) -> dict:
    """``BQxBKV:fused`` or ``BQDQxBKVDQxBQxBKV`` as the kernel's keywords."""
    if text.endswith(":fused"):
        bq, bkv = map(int, text[:-6].split("x"))
        return dict(bq_dq=128, bkv_dq=128, bq_dkv=bq, bkv_dkv=bkv, fused=True)
    bq_dq, bkv_dq, bq, bkv = map(int, text.split("x"))
    return dict(bq_dq=bq_dq, bkv_dq=bkv_dq, bq_dkv=bq, bkv_dkv=bkv, fused=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seq", type=int, default=bench.smoke(8192, 512))
    p.add_argument("--heads", type=int, default=bench.smoke(32, 2),
                   help="query heads (Llama-3.1-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=bench.smoke(8, 1),
                   help="KV heads (Llama-3.1-8B: 8)")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--memory-gb", type=float, default=12.0, help="each worker's memory cap")
    p.add_argument("--configs", nargs="+",
                   default=bench.smoke(["2048x2048:fused", "1024x2048:fused",
                                        "1024x1024:fused", "2048x2048x2048x2048"],
                                       ["256x256:fused"]))
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd
    from pallas_tune.measure.estimate import Estimator

    s, h, causal = a.seq, a.heads, not a.no_causal
    q = jax.ShapeDtypeStruct((1, h, s, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, a.kv_heads, s, 128), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, h, s), jnp.float32)
    pairs = s * (s + 1) / 2 if causal else s * s
    floor_ms = 2.5 * 4.0 * h * pairs * 128 / PEAK_FLOPS * 1e3
    print(f"# flash attention backward, S={s}, {h} q heads, {a.kv_heads} KV heads, "
          f"{'causal' if causal else 'full'}, bf16; v6e compiler ESTIMATES (stand-ins, "
          f"scaled); roofline {floor_ms:.4f} ms")
    print(f"{'config':>24s} {'cycles':>11s} {'ms':>8s} {'roofline':>8s} {'scale':>6s}")
    with Estimator(workers=1, memory_limit_bytes=int(a.memory_gb * (1 << 30))) as est:
        for text in a.configs:
            r, = est.map(flash_attention_bwd, [q, kv, kv, q, lse, q], dict(causal=causal),
                         [config(text)], "v6e")
            if not r.ok or not r.cycles:
                print(f"{text:>24s} no estimate ({r.kind}: {r.message[:160]})", flush=True)
                continue
            ms = r.cycles / CLOCK * 1e3
            print(f"{text:>24s} {r.cycles:11d} {ms:8.4f} {floor_ms / ms:8.1%} {r.scale:6g}",
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
