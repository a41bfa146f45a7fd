"""How few evaluations does each search strategy need? Replayed on measured landscapes.

Landscapes: every Kernel Tuner cache file under ../shared/landscapes (real GPU measurements; the
folder is optional: skipped with a note where absent) and benchmarks/landscapes (full-space v6e
compiler ESTIMATES from benchmarks/tpu_estimate.py). Each evaluation draws one recorded repeat
(noisy), failures cost an evaluation, a repeated proposal costs nothing.

Strategies: pallas-tune's `default` (GP over the enumerated candidates, pallas_tune.search),
`tpe` (Optuna TPE as it comes), `tpe-mv` (the previous default: multivariate TPE), `random`,
`grid`, and Kernel Tuner 1.5 strategies in its simulation mode (`KT:*`, which replays the mean
time of a config, not a noisy repeat; marked [mean]) where `kernel-tuner` is installed (`pip
install 'pallas-tune[bench]'`). On pallas-tune's own landscapes, `default+warm` is what the tuner
does: it measures its warm starts first (the declared default, the nearest tuned shapes'
winners, the roofline model's picks: pallas_tune.tuner.warm_start_configs), then searches.

Columns: mean of min(1, optimum / best so far) after 10, 20, 50 and 100 evaluations (± standard
error at 50), and the median number of evaluations to come within 5% and 2% of the optimum
(inf when fewer than half the seeds got there; the share that did in brackets). `random` runs
over the whole space, so its medians are always measured; where random needs more than the
budget, `default` runs on to --long-budget evaluations so that its median is measured too.
The closing table checks the target: default's median to 5% at most a quarter of random's (or
at most 3 where random needs fewer than 12).

    python benchmarks/search_efficiency.py [--seeds 20] [--budget 100] [--long-budget 600]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import math
import os
import statistics
import tempfile
import time
import warnings

from pallas_tune.search import replay

HERE = os.path.dirname(os.path.abspath(__file__))
SHARED = os.path.join(HERE, "..", "..", "shared", "landscapes")
KT_STRATEGIES = ["random_sample", "genetic_algorithm", "bayes_opt", "dual_annealing",
                 "pso", "adaptive_tabu_greywolf"]


def _kt_run(path_json: str, strategy: str, budget: int, seed: int) -> list[float]:
    import kernel_tuner

    res, _ = kernel_tuner.tune_cache(path_json, strategy=strategy, quiet=True, seed=seed,
                                     strategy_options={"max_fevals": budget})
    out = []
    for r in res[:budget]:
        t = r.get("time")
        out.append(float(t) if isinstance(t, int | float) and math.isfinite(t) else math.inf)
    return out


def _stats(seqs: list[list[float]], opt: float, budget: int) -> dict[str, object]:
    def at(seq: list[float], n: int) -> float:
        best = min(seq[:n], default=math.inf)
        return min(1.0, opt / best) if math.isfinite(best) and best > 0 else 0.0

    def reach(seq: list[float], tol: float) -> float:
        for i, t in enumerate(seq):
            if t <= opt * (1 + tol):
                return i + 1
        return math.inf

    out: dict[str, object] = {}
    for n in (10, 20, 50, 100):
        if n <= budget:
            out[f"@{n}"] = statistics.mean(at(s, n) for s in seqs)
    vals50 = [at(s, min(50, budget)) for s in seqs]
    out["se50"] = statistics.stdev(vals50) / math.sqrt(len(vals50)) if len(vals50) > 1 else 0.0
    for tol in (0.05, 0.02):
        r = [reach(s, tol) for s in seqs]
        share = sum(math.isfinite(x) for x in r) / len(r)
        out[f"reach{tol}"] = (statistics.median(r), share)
    return out


def _warm_starts(path: str) -> list[dict] | None:
    """The tuner's warm starts for a pallas-tune landscape (None for other files)."""
    import json

    with open(path) as f:
        meta = json.load(f)
    if "pallas_tune_key" not in meta:
        return None
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import sys

    sys.path.insert(0, HERE)
    from tpu_estimate import CASES

    from pallas_tune.tuning.loop import warm_start_configs

    for name, kernel, args, static in CASES:
        if name == meta["kernel_name"]:
            return warm_start_configs(kernel, args, static, "v6e", meta["pallas_tune_key"])
    return None


def _runs(land, method: str, budget: int, seeds: range, jobs: int, warm=()) -> list[list[float]]:
    if jobs > 1 and len(seeds) > 1:
        from joblib import Parallel, delayed

        return Parallel(n_jobs=jobs)(delayed(replay.run)(land, method, budget=budget, seed=s,
                                                         warm_start=warm) for s in seeds)
    return [replay.run(land, method, budget=budget, seed=s, warm_start=warm) for s in seeds]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--budget", type=int, default=100)
    p.add_argument("--long-budget", type=int, default=600,
                   help="default's budget where random needs more than --budget evaluations")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="processes for the seeds of pallas-tune's strategies")
    p.add_argument("--no-kt", action="store_true", help="skip Kernel Tuner's strategies")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    paths = sorted(glob.glob(os.path.join(SHARED, "**", "*.json.gz"), recursive=True))
    if not paths:
        print(f"note: {os.path.normpath(SHARED)} is absent: shared GPU landscapes skipped")
    paths += sorted(glob.glob(os.path.join(HERE, "landscapes", "*.json")))
    try:
        import kernel_tuner  # noqa: F401

        have_kt = not a.no_kt
    except ImportError:
        have_kt = False
        print("note: kernel-tuner is not installed (pip install 'pallas-tune[bench]'): "
              "Kernel Tuner peers skipped")
    tmp = tempfile.mkdtemp(prefix="pt-landscapes-")
    targets = []
    for path in paths:
        land = replay.load(path)
        opt = land.optimum
        name = os.path.relpath(path, os.path.join(HERE, "..", "..")) if "shared" in path else \
            os.path.relpath(path, HERE)
        print(f"\n#### {name}: {len(land.configs)} configs, optimum {opt:.5g} ms, "
              f"{args_str(a)}")
        print("| method | @10 | @20 | @50 | @100 | evals to 5% (reached) | evals to 2% (reached) "
              "| s |")
        print("|---|---|---|---|---|---|---|---|")
        seeds = range(a.seeds)
        t0 = time.perf_counter()
        rand = _runs(land, "random", len(land.configs), seeds, 1)
        rand_t = time.perf_counter() - t0
        rand_reach = _stats(rand, opt, a.budget)["reach0.05"][0]
        long = math.isinf(rand_reach) or rand_reach > a.budget
        precomputed = {"random": (rand, rand_t)}
        warm = _warm_starts(path) if path.endswith(".json") else None
        methods = [("default", None)]
        if warm:
            methods.append(("default+warm", None))
        methods += [(s, None) for s in ("tpe", "tpe-mv", "random", "grid")]
        if have_kt:
            plain = os.path.join(tmp, os.path.basename(path).replace(".gz", ""))
            if path.endswith(".gz"):
                with gzip.open(path, "rt") as f, open(plain, "w") as g:
                    g.write(f.read())
            else:
                plain = path
            methods += [(f"KT:{s}", plain) for s in KT_STRATEGIES]
        for method, plain in methods:
            t0 = time.perf_counter()
            seqs = []
            if method in precomputed:
                seqs, elapsed = precomputed[method]
            elif plain is None:
                budget = a.long_budget if long and method.startswith("default") else a.budget
                seqs = _runs(land, method.split("+")[0], budget,
                             seeds if method != "grid" else range(1), a.jobs,
                             warm if method == "default+warm" else ())
            else:
                try:
                    seqs = [_kt_run(plain, method[3:], a.budget, seed) for seed in seeds]
                except Exception as e:  # noqa: BLE001 - a peer that crashes is reported.
                    seqs = []
                    print(f"| {method} [mean] | failed: {type(e).__name__}: {str(e)[:60]} "
                          "| | | | | | |")
            if not seqs:
                continue
            st = _stats(seqs, opt, a.budget)
            if method.startswith("default"):
                targets.append((name, method, st["reach0.05"], rand_reach))
            label = method + (" [mean]" if plain is not None else "")
            if len(seqs[0]) > a.budget:
                label += f" (run to {len(seqs[0])})"
            cells = [f"{st.get(f'@{n}', float('nan')):.3f}" for n in (10, 20)]
            cells.append(f"{st['@50']:.3f} ± {st['se50']:.3f}")
            cells.append(f"{st.get('@100', float('nan')):.3f}")
            for tol in (0.05, 0.02):
                med, share = st[f"reach{tol}"]
                cells.append(f"{med:g} ({share:.0%})")
            elapsed = precomputed[method][1] if method in precomputed else \
                time.perf_counter() - t0
            print(f"| {label} | " + " | ".join(cells) + f" | {elapsed:.0f} |", flush=True)
    print("\n#### Target: default's median evaluations to 5% of the optimum at most a quarter of "
          "random's (at most 3 where random needs fewer than 12)")
    print("| landscape | strategy | default (reached) | random | target | met |")
    print("|---|---|---|---|---|---|")
    for name, method, (med, share), rnd in targets:
        target = 3 if rnd < 12 else rnd / 4
        print(f"| {name} | {method} | {med:g} ({share:.0%}) | {rnd:g} | ≤ {target:g} | "
              f"{'yes' if med <= target else 'no'} |")


def args_str(a: argparse.Namespace) -> str:
    return f"{a.seeds} seeds, budget {a.budget}"


if __name__ == "__main__":
    main()
