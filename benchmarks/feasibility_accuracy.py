"""How well does the VMEM model agree with the real TPU compiler? (deviceless; needs libtpu)

For every candidate of the full search space of several kernels, on several chips, compile
deviceless with libtpu (the real Mosaic + XLA:TPU compiler, no TPU attached) and compare with
(a) the model alone (its point estimate against the limit) and (b) the two-stage filter the tuner
uses (model; borderline candidates compiled). Prints the confusion matrices and the targets:
≥ 99% agreement of the model, no compiler-OOM candidate passed by the two-stage filter, ≤ 1% of
compilable candidates rejected.

    python benchmarks/feasibility_accuracy.py [--chips v6e v5e] [--threads 2] [--csv out.csv]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tune.feasibility import compile as _compile  # noqa: E402
from pallas_tune.feasibility import inspect as _inspect  # noqa: E402
from pallas_tune.feasibility import model as feasibility  # noqa: E402
from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.kernels.flash_attention import flash_attention  # noqa: E402
from pallas_tune.kernels.matmul import matmul  # noqa: E402
from pallas_tune.kernels.rms_norm import rms_norm  # noqa: E402

import pallas_tune as pt  # noqa: E402

S = jax.ShapeDtypeStruct
SEM = [("parallel", "parallel", "arbitrary")]
# The shipped matmul space stops at 1024 tiles; this one reaches past every chip's limits.
matmul_wide = pt.tunable(bm=[256, 512, 1024, 2048], bn=[256, 512, 1024, 2048],
                         bk=[256, 512, 1024, 2048], buffering=[1, 2], semantics=SEM,
                         name="matmul_wide")(matmul.fn)
CASES = [
    ("matmul 4096^3 bf16, tiles to 2048", matmul_wide, (S((4096, 4096), jnp.bfloat16),) * 2, {}),
    ("matmul 2048^3 bf16", matmul, (S((2048, 2048), jnp.bfloat16),) * 2, {}),
    ("matmul 4096^3 f32", matmul, (S((4096, 4096), jnp.float32),) * 2, {}),
    ("flash_attention llama8b S=8192 causal", flash_attention,
     (S((1, 32, 8192, 128), jnp.bfloat16), S((1, 8, 8192, 128), jnp.bfloat16),
      S((1, 8, 8192, 128), jnp.bfloat16)), {"causal": True}),
    ("rms_norm 8192x4096 bf16", rms_norm,
     (S((8192, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16)), {}),
]


def run(chips: list[str], threads: int, csv: str | None) -> None:
    if not _compile.libtpu_available():
        print("libtpu is not installed: pip install 'pallas-tune[tpu]'. Nothing to compare.")
        return
    rows = []
    jobs = []
    for chip in chips:
        spec = chip_spec(chip)
        for label, kernel, args, static in CASES:
            for config in kernel.space:
                kw = {**static, **config}
                calls = _inspect.find_pallas_calls(kernel.fn, args, kw)
                verdict = feasibility.model_verdict(calls, spec)
                jobs.append((spec.name, label, kernel, args, kw, config, verdict))
    print(f"compiling {len(jobs)} candidates deviceless with {threads} threads ...", flush=True)
    t0 = time.perf_counter()

    def compile_one(job):
        chip, _, kernel, args, kw, _, _ = job
        return _compile.compile_deviceless(kernel.fn, args, kw, chip=chip)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(compile_one, jobs))
    wall = time.perf_counter() - t0
    for job, res in zip(jobs, results, strict=True):
        chip, label, _, _, _, config, v = job
        compiles = res.ok
        model_ok = v.ok  # Point estimate within the limit (borderline: estimate decides).
        two_stage_ok = v.status == "ok" or (v.status == "borderline" and compiles)
        rows.append(dict(chip=chip, case=label, config=config, status=v.status,
                         est=v.vmem_bytes, limit=v.limit_bytes, kind=res.kind,
                         used=res.scoped_vmem_bytes, compiles=compiles, model_ok=model_ok,
                         two_stage_ok=two_stage_ok, compile_s=res.compile_s))

    print(f"\ncompiled in {wall:.0f} s wall ({sum(r['compile_s'] for r in rows):.0f} s of "
          f"compiler time); jax {jax.__version__}\n")
    print(f"{'chip':8s} {'case':40s} {'n':>4s} | model vs compiler: {'TP':>4s} {'TN':>4s} "
          f"{'FP':>4s} {'FN':>4s} {'agree':>6s} | two-stage: {'FP':>3s} {'FN':>3s} "
          f"{'compiled':>8s}")
    total = dict(n=0, agree=0, fp2=0, fn2=0, compilable=0, compiled=0)
    for chip in dict.fromkeys(r["chip"] for r in rows):
        for label in dict.fromkeys(r["case"] for r in rows):
            rs = [r for r in rows if r["chip"] == chip and r["case"] == label]
            tp = sum(r["model_ok"] and r["compiles"] for r in rs)
            tn = sum(not r["model_ok"] and not r["compiles"] for r in rs)
            fp = sum(r["model_ok"] and not r["compiles"] for r in rs)
            fn = sum(not r["model_ok"] and r["compiles"] for r in rs)
            fp2 = sum(r["two_stage_ok"] and not r["compiles"] for r in rs)
            fn2 = sum(not r["two_stage_ok"] and r["compiles"] for r in rs)
            compiled = sum(r["status"] == "borderline" for r in rs)
            print(f"{chip:8s} {label:40s} {len(rs):4d} | {'':19s}{tp:4d} {tn:4d} {fp:4d} {fn:4d} "
                  f"{(tp + tn) / len(rs):6.1%} | {'':11s}{fp2:3d} {fn2:3d} {compiled:8d}")
            total["n"] += len(rs)
            total["agree"] += tp + tn
            total["fp2"] += fp2
            total["fn2"] += fn2
            total["compilable"] += sum(r["compiles"] for r in rs)
            total["compiled"] += compiled
    print(f"\nmodel alone: {total['agree']}/{total['n']} = {total['agree'] / total['n']:.2%} "
          f"agreement (target >= 99%)")
    print(f"two-stage filter: {total['fp2']} compiler-infeasible candidates passed (target 0), "
          f"{total['fn2']}/{total['compilable']} compilable candidates rejected "
          f"(target <= 1%), {total['compiled']}/{total['n']} candidates needed a compile")
    bad = [r for r in rows if r["model_ok"] != r["compiles"]]
    if bad:
        print("\nmodel disagreements (estimate vs what the compiler allocated):")
        for r in bad:
            used = f"{r['used'] / 2**20:.2f}" if r["used"] else "-"
            print(f"  {r['chip']:8s} {r['case'][:28]:28s} {str(r['config'])[:70]:70s} "
                  f"{r['status']:10s} est {r['est'] / 2**20:7.2f} MiB used {used:>7s} "
                  f"limit {r['limit'] / 2**20:5.1f} -> {r['kind']}")
    if csv:
        import pandas as pd

        pd.DataFrame(rows).to_csv(csv, index=False)
        print(f"\nwrote {csv}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--chips", nargs="+", default=["v6e", "v5e"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--csv")
    a = p.parse_args()
    run(a.chips, a.threads, a.csv)
