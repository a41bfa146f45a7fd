"""How few evaluations does each search strategy need? Replayed on measured landscapes.

Landscapes: every Kernel Tuner cache file under ../shared/landscapes (real GPU measurements; the
folder is optional: skipped with a note where absent) and benchmarks/landscapes (full-space v6e
compiler ESTIMATES from benchmarks/tpu_estimate.py). Each evaluation draws one recorded repeat
(noisy), failures cost an evaluation, a repeated proposal costs nothing.

Strategies: pallas-tune's `default`, `tpe` (Optuna TPE as it comes), `random`, `grid`, and Kernel
Tuner 1.5 strategies in its simulation mode (`KT:*`, which replays the mean time of a config, not
a noisy repeat; marked [mean]) where `kernel-tuner` is installed (`pip install
'pallas-tune[bench]'`).

Columns: mean of min(1, optimum / best so far) after 10, 20, 50 and 100 evaluations (± standard
error at 50), and the median number of evaluations to come within 5% and 2% of the optimum
(inf when fewer than half the seeds got there; the share that did in brackets).

    python benchmarks/search_efficiency.py [--seeds 20] [--budget 100]
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

from pallas_tune import replay

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("--budget", type=int, default=100)
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
        methods = [(s, None) for s in ("default", "tpe", "random", "grid")]
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
            seeds = range(a.seeds) if method != "grid" else range(1)
            for seed in seeds:
                if plain is None:
                    seqs.append(replay.run(land, method, budget=a.budget, seed=seed))
                else:
                    try:
                        seqs.append(_kt_run(plain, method[3:], a.budget, seed))
                    except Exception as e:  # noqa: BLE001 - a peer that crashes is reported.
                        seqs = []
                        print(f"| {method} [mean] | failed: {type(e).__name__}: {str(e)[:60]} "
                              "| | | | | | |")
                        break
            if not seqs:
                continue
            st = _stats(seqs, opt, a.budget)
            label = method + (" [mean]" if plain is not None else "")
            cells = [f"{st.get(f'@{n}', float('nan')):.3f}" for n in (10, 20)]
            cells.append(f"{st['@50']:.3f} ± {st['se50']:.3f}")
            cells.append(f"{st.get('@100', float('nan')):.3f}")
            for tol in (0.05, 0.02):
                med, share = st[f"reach{tol}"]
                cells.append(f"{med:g} ({share:.0%})")
            print(f"| {label} | " + " | ".join(cells) +
                  f" | {time.perf_counter() - t0:.0f} |", flush=True)


def args_str(a: argparse.Namespace) -> str:
    return f"{a.seeds} seeds, budget {a.budget}"


if __name__ == "__main__":
    main()
