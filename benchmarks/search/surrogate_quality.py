"""How well the default search's surrogate can find a landscape's optimum, apart from the search.

For each exhaustively measured landscape: draw ``n`` configs at random (5 draws a size), fit the
default's GP to them exactly as a search step does (log times, capped at the median from 20
points, standardized; `pallas_tune.search.gp.CandidateBO`'s features), predict every config,
and score the best of the five it predicts fastest (by their recorded mean times) against the
optimum. Where that stays low however many random points the GP sees, a search that trusts the
GP cannot do much better within 50 evaluations: the landscape, not the acquisition, is the
limit. Beside it, what makes the landscape hard: how many configs are within 5% of the optimum,
the fastest config that differs from the optimum in 3 or more parameters (another basin), and
how far the recorded times span.

Also the same fit on other output transforms, for comparison: ranks mapped to normal scores
(``rank``; a Gaussian copula), and raw log times (``log``, no cap).

    python benchmarks/search/surrogate_quality.py [--landscapes DIR] [--sizes 50,150]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the two v6e estimate landscapes in benchmarks/landscapes,
one draw of 20.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import search_harness as h  # noqa: E402

from pallas_tune.search import replay  # noqa: E402
from pallas_tune.search.gp import CandidateBO  # noqa: E402
from pallas_tune.search.model import GP  # noqa: E402

TRANSFORMS = ("default", "rank", "log")
TOP = 5


def targets(bo: CandidateBO, times: np.ndarray, transform: str) -> np.ndarray:
    """Standardized model targets from run times: the search's own (``default``: ``bo``'s, the
    same code a search step runs) or another transform of the log times."""
    if transform == "default":
        return bo._targets(list(enumerate(times)), list(times))
    y = np.log(times)
    if transform == "rank":
        from scipy.stats import norm, rankdata

        y = norm.ppf((rankdata(y) - 0.5) / len(y))
    return (y - y.mean()) / (y.std() or 1.0)


def found(land: replay.Landscape, n: int, draws: int) -> dict[str, float]:
    """Per transform, the mean over draws of optimum / best recorded time of the GP's top 5."""
    t = np.array([land.means[c] for c in land.configs])
    ok = np.flatnonzero(np.isfinite(t))
    bo = CandidateBO(land.configs, land.choices, seed=0)
    x = bo.x
    out = {}
    for transform in TRANSFORMS:
        scores = []
        for seed in range(draws):
            rng = np.random.default_rng(seed)
            idx = rng.choice(ok, min(n, len(ok)), replace=False)
            gp = GP(x.shape[1], rng)
            gp.fit(x[idx], targets(bo, t[idx], transform), optimize=True)
            mu, _ = gp.predict(x[ok])
            scores.append(land.optimum / t[ok[np.argsort(mu)[:TOP]]].min())
        out[transform] = float(np.mean(scores))
    return out


def hardness(land: replay.Landscape) -> tuple[int, float, float]:
    """Configs within 5% of the optimum; optimum / the fastest config differing from the
    optimum's in 3 or more parameters; slowest / fastest recorded (finite) time."""
    means = land.means
    best = min(means, key=means.get)
    finite = [v for v in means.values() if math.isfinite(v)]
    near = sum(v <= 1.05 * land.optimum for v in finite)
    far = min((v for c, v in means.items()
               if sum(a != b for a, b in zip(c, best, strict=True)) >= 3), default=math.inf)
    return near, land.optimum / far, max(finite) / min(finite)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--landscapes", default=None,
                   help=f"folder of Kernel Tuner files (default: ${replay.LANDSCAPES_ENV} or "
                        "../shared/landscapes)")
    p.add_argument("--sizes", default=bench.smoke("50,150", "20"))
    p.add_argument("--draws", type=int, default=bench.smoke(5, 1))
    p.add_argument("--out", default=bench.output(bench.result("surrogate_quality.md")))
    a = p.parse_args(argv)
    smoke_only = bench.SMOKE and a.landscapes is None  # A plain clone has no ../shared.
    paths = [] if smoke_only else replay.find_landscapes(a.landscapes)
    paths += sorted(glob.glob(os.path.join(bench.LANDSCAPES, "*.json")))
    sizes = [int(s) for s in a.sizes.split(",")]
    t0 = time.time()
    head = ["| landscape | configs | within 5% | other basin | time span | "
            + " | ".join(f"n={n}: {tr}" for n in sizes for tr in TRANSFORMS) + " |",
            "|---|---|---|---|---|" + "---|" * (len(sizes) * len(TRANSFORMS))]
    rows = []
    for path in paths:
        land = h.load(path)
        near, basin, span = hardness(land)
        cells = [f"{v:.3f}" for n in sizes for v in found(land, n, a.draws).values()]
        basin_cell = f"{basin:.3f}" if basin > 0 else "-"
        rows.append(f"| {h.landscape_id(path)} | {len(land.configs)} | {near} | {basin_cell} | "
                    f"{span:.0f}x | " + " | ".join(cells) + " |")
        print(rows[-1], flush=True)
    text = "\n".join([
        "# How well the default's surrogate finds the optimum from random points", "",
        __doc__.split("\n\n")[0].replace("\n", " "), "",
        f"`{bench.command(__file__, argv)}` ({bench.today()}, {bench.host()}, "
        f"{time.time() - t0:.0f} s). Cells: optimum / the best recorded time among the "
        f"{TOP} configs the GP fitted on n random configs predicts fastest, mean of "
        f"{a.draws} draws (1.000: it found the optimum). `other basin`: optimum / the fastest "
        "config that differs from the optimum's in 3 or more parameters. `time span`: slowest "
        "/ fastest recorded time.", "", *head, *rows, ""])
    bench.write(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
