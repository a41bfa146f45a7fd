"""Does splash's estimate stand-in hold? The method checked where the truth is readable.

libtpu's static profile cannot read splash attention past one block (its mask tables are taken
as 0), so pallas-tune estimates splash on a stand-in (``kernels/_splash.py``): every block
computed with no tables, for one KV head, scaled by the heads and by the share of blocks a
causal mask leaves. This script applies the same method to pallas-tune's own flash attention,
whose causal program libtpu reads directly (block skipping by grid arithmetic, no tables): the
causal estimate against the full-mask estimate times the causal share, per block config. Then
it prints splash's stand-in figures at MaxText's blocks beside the flash ones. Every figure is a
v6e compiler ESTIMATE, not a measurement.

    python benchmarks/estimates/splash_standin.py [--tokens 4096 8192] [--memory-gb 16]
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

from pallas_tune.kernels import upstream  # noqa: E402
from pallas_tune.kernels._splash import causal_fraction  # noqa: E402
from pallas_tune.kernels.flash_attention import flash_attention  # noqa: E402
from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402

CLOCK = 1.75e9
FLASH = [{"bq": 512, "bkv": 512}, {"bq": 1024, "bkv": 1024}, {"bq": 2048, "bkv": 1024},
         {"bq": 4096, "bkv": 2048}]
MAXTEXT_FWD = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
MAXTEXT_BWD = {"block_q_dkv": 512, "block_kv_dkv": 512, "block_kv_dkv_compute": 512,
               "block_q_dq": 512, "block_kv_dq": 512, "use_fused_bwd_kernel": False}


if bench.SMOKE:  # One config at 512 tokens.
    FLASH = [{"bq": 256, "bkv": 256}]


def _ms(r) -> float | None:
    return cycles_to_ms(r.cycles, CLOCK) if r.ok and r.cycles else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="*", default=bench.smoke([4096, 8192], [512]))
    p.add_argument("--memory-gb", type=float, default=16)
    p.add_argument("--out", default=bench.result("splash_standin.md"))
    a = p.parse_args()
    bf = jnp.bfloat16
    RECEIPT = f"{bench.today()}; {bench.versions('jax', 'libtpu')}; {bench.host()}"  # noqa: N806
    lines = ["# Splash attention's estimate stand-in, checked on flash attention (v6e "
             "ESTIMATES)", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             f"    {bench.command(__file__)}", "", RECEIPT, "",
             "| tokens | flash blocks | causal, read directly (ms) | full x causal share (ms) | "
             "stand-in / direct |", "|---|---|---|---|---|"]
    splash_rows = []
    with Estimator(1, memory_limit_bytes=int(a.memory_gb * (1 << 30))) as est:
        for t in a.tokens:
            q = jax.ShapeDtypeStruct((1, 32, t, 128), bf)
            k = jax.ShapeDtypeStruct((1, 8, t, 128), bf)
            for cfg in FLASH:
                if cfg["bq"] > t or cfg["bkv"] > t:
                    continue
                direct, full = (est.map(flash_attention, [q, k, k], {"causal": c}, [cfg],
                                        "tpu_v6e", standin=True)[0] for c in (True, False))
                share = causal_fraction(t, t, cfg["bq"], cfg["bkv"])
                d, f = _ms(direct), _ms(full)
                ratio = f"{f * share / d:.3f}" if d and f else "-"
                lines.append(f"| {t} | {cfg['bq']}/{cfg['bkv']} | {d and f'{d:.4f}'} | "
                             f"{f and f'{f * share:.4f}'} | {ratio} |")
                print(lines[-1], flush=True)
                bench.write(a.out, "\n".join(lines) + "\n", echo=False)  # Kept if cut short.
            fwd = est.map(upstream.splash_attention, [q, k, k], {"causal": True},
                          [MAXTEXT_FWD], "tpu_v6e", standin=True)[0]
            train = est.map(upstream.splash_attention_bwd, [q, k, k, q], {"causal": True},
                            [MAXTEXT_BWD], "tpu_v6e", standin=True)[0]
            splash_rows.append((t, _ms(fwd), _ms(train), fwd.message or train.message))
            print(splash_rows[-1], flush=True)
    lines += ["", "Splash at MaxText's blocks (all 512, unfused backward), on the stand-in:", "",
              "| tokens | forward ms | forward + backward ms (its training cost) | note |",
              "|---|---|---|---|"]
    lines += [f"| {t} | {f and f'{f:.4f}'} | {b and f'{b:.4f}'} | {(m or '')[:120]} |"
              for t, f, b, m in splash_rows]
    bench.write(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
