"""How much of the default search's shortfall on each landscape is the measurements' noise.

A replayed evaluation draws one of the config's recorded repeats (``pallas_tune.search.replay``),
and a landscape's repeats can be heavy-tailed: a few of a config's 32 runs at 2 to 4 times its
median. A search can be misled by such a draw in two ways: it turns away from a good config that
drew a slow repeat (and never measures it again), and it ends on the config whose draw was
luckiest, not the fastest it measured. Per landscape, this replays the default search twice
on the same seeds, as ``search_efficiency.py`` does (each config's recorded repeats drawn) and
noise-free (each config's median repeat, every time), and scores both as the harness does
(optimum / the mean time of the config that measured best, at the budget). Beside them: the
best config the drawn search *measured* (optimum / the lowest mean among the configs it
measured: what it would get if it could tell), and how noisy the fast configs are (the
configs within 5% of the optimum: the median of their repeats' coefficient of variation, and
the share of their repeats 1.5x their median or more).

Where noise-free scores little above drawn, noise is not what holds the search back: the
landscape is (``surrogate_quality.py``). Where best-measured is above drawn, the pick by a
single draw costs the difference.

    python benchmarks/search/search_noise.py [--landscapes DIR] [--seeds 20] [--budget 50]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the two v6e estimate landscapes in benchmarks/landscapes,
2 seeds of 10 evaluations.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import search_harness as h  # noqa: E402

from pallas_tune.search import replay  # noqa: E402

OUTLIER = 1.5  # A repeat this many times its config's median or more counts as an outlier.


def noise_free(land: replay.Landscape) -> replay.Landscape:
    """The landscape with each config's median repeat as its only one."""
    times = {c: [float(np.median(t))] if t else None for c, t in land.times.items()}
    return replay.Landscape(land.keys, land.params, times, land.name)


def spread(land: replay.Landscape) -> tuple[float, float, int]:
    """Over the configs within 5% of the optimum: the median coefficient of variation of their
    repeats, the share of their repeats at OUTLIER x their median or more; and the median
    number of repeats a config has."""
    top = [t for c, t in land.times.items()
           if t and land.means[c] <= 1.05 * land.optimum]
    cv = [float(np.std(t) / np.mean(t)) for t in top if len(t) > 1]
    reps = [t for t in top if len(t) > 1]
    out = [float(np.mean(np.asarray(t) >= OUTLIER * np.median(t))) for t in reps]
    n = statistics.median(len(t) for t in land.times.values() if t)
    return (statistics.median(cv) if cv else 0.0, statistics.mean(out) if out else 0.0,
            int(n))


def replay_pair(path: str, seed: int, budget: int) -> tuple[float, float, float]:
    """(drawn @budget, best measured by the drawn search, noise-free @budget) for one seed."""
    land = h.load(path)
    drawn = replay.trace(land, "default", budget=budget, seed=seed)
    clean = replay.trace(noise_free(land), "default", budget=budget, seed=seed)
    scores = []
    for tr in (drawn, clean):
        ok = [(v, c) for c, v in zip(tr.configs, tr.values, strict=True) if math.isfinite(v)]
        scores.append(min(1.0, land.optimum / land.means[min(ok)[1]]) if ok else 0.0)
    seen = min((land.means[c] for c in drawn.configs), default=math.inf)
    return scores[0], min(1.0, land.optimum / seen), scores[1]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--landscapes", default=None,
                   help=f"folder of Kernel Tuner files (default: ${replay.LANDSCAPES_ENV} or "
                        "../shared/landscapes)")
    p.add_argument("--seeds", type=int, default=bench.smoke(20, 2))
    p.add_argument("--budget", type=int, default=bench.smoke(50, 10))
    p.add_argument("--jobs", type=int, default=bench.smoke(2, 1),
                   help="processes (more than 1 needs joblib: the `bench` extra)")
    p.add_argument("--out", default=bench.output(bench.result("search_noise.md")))
    a = p.parse_args(argv)
    smoke_only = bench.SMOKE and a.landscapes is None  # A plain clone has no ../shared.
    paths = [] if smoke_only else replay.find_landscapes(a.landscapes)
    paths += sorted(glob.glob(os.path.join(bench.LANDSCAPES, "*.json")))
    t0 = time.time()
    units = [(path, seed) for path in paths for seed in range(a.seeds)]
    if a.jobs > 1:
        from joblib import Parallel, delayed

        got = Parallel(n_jobs=a.jobs, batch_size=1)(
            delayed(replay_pair)(path, seed, a.budget) for path, seed in units)
    else:
        got = [replay_pair(path, seed, a.budget) for path, seed in units]
    rows = ["| landscape | repeats | top 5%: repeat CV | top 5%: repeats ≥ 1.5x median | "
            f"drawn @{a.budget} | best measured | noise-free @{a.budget} |",
            "|---|---|---|---|---|---|---|"]
    for path in paths:
        res = [g for (q, _), g in zip(units, got, strict=True) if q == path]
        cv, out, n = spread(h.load(path))
        drawn, seen, clean = (statistics.mean(r[i] for r in res) for i in range(3))
        rows.append(f"| {h.landscape_id(path)} | {n} | {cv:.3f} | {out:.1%} | {drawn:.3f} | "
                    f"{seen:.3f} | {clean:.3f} |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# The default search with and without the measurements' noise", "",
        __doc__.split("\n\n")[0].replace("\n", " "), "",
        f"`{bench.command(__file__, argv)}` ({bench.today()}, {bench.host()}, "
        f"{time.time() - t0:.0f} s; {a.seeds} seeds, the same for both replays). `drawn`: "
        "the default as `search_efficiency.py` replays it, each evaluation one recorded repeat "
        "drawn at random; `best measured`: optimum / the lowest mean time among the configs "
        "that search measured; `noise-free`: the same search where every evaluation returns "
        "the config's median repeat. All three are optimum / a config's mean time over its "
        "recorded repeats, mean over seeds. `top 5%`: the configs within 5% of the optimum.",
        "", *rows, ""])
    bench.write(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
