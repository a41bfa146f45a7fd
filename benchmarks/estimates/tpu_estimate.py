"""Tuning for TPU v6e without a TPU: the compiler's static cycle estimate as the objective.

For a 2048^3 bf16 matmul and a Llama-3.1-8B flash attention (32 q heads, 8 KV heads, head_dim
128, S=2048, causal) on v6e, prints:
- the estimated time of the tuned config (default search, 24 trials), of the declared default, of the worst
  feasible config and of the exhaustive optimum;
- the Spearman rank correlation between our roofline model and the compiler estimate over the
  whole space;
- how close the stand-in (fewer parallel blocks, scaled) is to full compiles;
- the CPU time spent.
Every figure is a compiler ESTIMATE (deviceless libtpu compile, converted at the chip clock), not a
measurement. The full-space estimates are also written as Kernel Tuner-format landscapes to
benchmarks/landscapes/ for the search-efficiency benchmark.

    python benchmarks/estimates/tpu_estimate.py [--workers 2] [--trials 24]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): a 256^2 matmul, its first 4 configs (the default first)
as the "space", 2 trials, one worker; the landscape goes to the smoke folder.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import resource
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pandas as pd  # noqa: E402

from pallas_tune.feasibility import inspect as _inspect  # noqa: E402
from pallas_tune.feasibility import model as feasibility  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402
from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.kernels.flash_attention import flash_attention  # noqa: E402
from pallas_tune.kernels.matmul import matmul  # noqa: E402
from pallas_tune.feasibility.roofline import roofline_calls  # noqa: E402

S = jax.ShapeDtypeStruct
CASES = [
    ("matmul_2048_bf16", matmul, (S((2048, 2048), jnp.bfloat16),) * 2, {}),
    ("flash_attention_llama8b_s2048_causal", flash_attention,
     (S((1, 32, 2048, 128), jnp.bfloat16), S((1, 8, 2048, 128), jnp.bfloat16),
      S((1, 8, 2048, 128), jnp.bfloat16)), {"causal": True}),
]
SPACE_LIMIT = bench.smoke(None, 4)  # Smoke runs: the first configs of the space only.
if bench.SMOKE:
    CASES = [("matmul_256_bf16", matmul, (S((256, 256), jnp.bfloat16),) * 2, {})]


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _spearman(a: pd.Series, b: pd.Series) -> float:
    return float(a.rank().corr(b.rank()))


def _landscape(name, kernel, key, df, spec):
    # Kernel Tuner format: scalar parameter values (tuples joined with ","), an int problem size.
    names = list(kernel.space.names)

    def flat(v):
        return ",".join(map(str, v)) if isinstance(v, tuple | list) else v

    cache = {}
    for _, r in df.iterrows():
        values = [flat(r[n]) for n in names]
        k = ",".join(str(v) for v in values)
        rec = dict(zip(names, values))
        if r["ok"]:
            rec.update(time=r["est_ms"], times=[r["est_ms"]])
        else:
            rec["time"] = "CompilationFailedConfig"
        cache[k] = rec
    out = {
        "device_name": f"{spec.device_kind} (libtpu static cycle ESTIMATE, deviceless)",
        "kernel_name": name, "pallas_tune_key": key,
        "problem_size": [int(x) for x in re.findall(r"=(\d+)x", key)] or [1],
        "tune_params_keys": names,
        "tune_params": {p.name: [flat(c) for c in p.choices] for p in kernel.space.params},
        "objective": "time", "cache": cache,
    }
    path = bench.output(os.path.join(bench.LANDSCAPES, f"{name}_v6e_estimate.json"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=0)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workers", type=int, default=bench.smoke(2, 1))
    p.add_argument("--trials", type=int, default=bench.smoke(24, 2))
    p.add_argument("--standin-checks", type=int, default=bench.smoke(6, 1))
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    spec = chip_spec("v6e")
    print(f"chip {spec.name}, clock {spec.clock_hz / 1e9:g} GHz; all times are compiler "
          f"ESTIMATES (ms); jax {jax.__version__}\n")
    summary = []
    for name, kernel, args, static in CASES:
        cpu0, wall0 = _cpu_s(), time.perf_counter()
        configs, rows = [], []
        for cfg in itertools.islice(kernel.space.ordered_candidates(), SPACE_LIMIT):
            calls = _inspect.find_pallas_calls(kernel.fn, args, {**static, **cfg})
            v = feasibility.model_verdict(calls, spec)
            rl = roofline_calls(calls, spec)
            rows.append(dict(cfg, model=v.status, roofline_ms=rl.time_ms))
            configs.append(cfg)
        with Estimator(a.workers) as est:
            results = est.map(kernel, args, static, configs, spec.name)
            for row, r in zip(rows, results, strict=True):
                row.update(ok=r.ok, kind=r.kind, scale=r.scale,
                           est_ms=cycles_to_ms(r.cycles, spec.clock_hz) if r.ok else float("inf"))
            df = pd.DataFrame(rows)
            # Stand-in accuracy: full compiles of the configs whose stand-in was scaled most.
            scaled = df[df.ok & (df.scale > 1)].sort_values("scale", ascending=False)
            check = scaled.head(a.standin_checks)
            full = est.map(kernel, args, static, [configs[i] for i in check.index], spec.name,
                           standin=False)
        errs = [abs(row.est_ms - cycles_to_ms(f.cycles, spec.clock_hz))
                / cycles_to_ms(f.cycles, spec.clock_hz)
                for (_, row), f in zip(check.iterrows(), full, strict=True) if f.ok]
        space_cpu, space_wall = _cpu_s() - cpu0, time.perf_counter() - wall0

        cpu1, wall1 = _cpu_s(), time.perf_counter()
        tuned = kernel.tune(*args, trials=a.trials, seed=0, timer="tpu-estimate", chip="v6e",
                            workers=a.workers, write=False, **static)
        tune_cpu, tune_wall = _cpu_s() - cpu1, time.perf_counter() - wall1

        ok = df[df.ok]
        default = kernel.space.default
        d_row = df[(df[list(default)] == pd.Series(default)).all(axis=1)] if default else df.head(1)
        best, worst = ok.est_ms.min(), ok.est_ms.max()
        key = kernel.cache_key(*args, **static)
        path = _landscape(name, kernel, key, df, spec)
        print(f"== {name}: {key}")
        print(f"   space {len(df)} configs: {len(ok)} compile, "
              f"{(~df.ok).sum()} rejected by the compiler ({df[~df.ok].kind.value_counts().to_dict()})")
        print(f"   {'config':58s} {'est ms':>9s}")
        print(f"   {'tuned (' + str(a.trials) + ' trials): ' + str(tuned.best)[:44]:58s} "
              f"{tuned.best_ms:9.4f}")
        print(f"   {'declared default: ' + str(default)[:40]:58s} {float(d_row.est_ms.iloc[0]):9.4f}")
        print(f"   {'worst feasible':58s} {worst:9.4f}")
        print(f"   {'exhaustive optimum':58s} {best:9.4f}")
        print(f"   tuned / optimum = {tuned.best_ms / best:.3f}; default / tuned = "
              f"{float(d_row.est_ms.iloc[0]) / tuned.best_ms:.2f}x; worst / tuned = "
              f"{worst / tuned.best_ms:.1f}x")
        print(f"   Spearman(roofline model, compiler estimate) over {len(ok)} configs = "
              f"{_spearman(ok.roofline_ms, ok.est_ms):.3f}")
        if errs:
            print(f"   stand-in vs full compile on the {len(errs)} most-scaled configs: max "
                  f"|error| {max(errs):.2%}, mean {sum(errs) / len(errs):.2%}")
        print(f"   CPU time: whole space {space_cpu:.0f} s ({space_wall:.0f} s wall); tuning "
              f"{tune_cpu:.0f} s ({tune_wall:.0f} s wall)")
        print(f"   landscape: {os.path.relpath(path, os.getcwd())}\n")
        summary.append(name)


if __name__ == "__main__":
    main()
