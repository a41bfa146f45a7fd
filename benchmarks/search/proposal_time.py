"""How long the default search takes to propose, with BLAS threads as the process found them
and held to one (``pallas_tune.search.model.one_blas_thread``, what a proposal does), on an
idle host and beside busy processes (a tune's compile and timing workers).

The search's linear algebra is small: a GP on tens of measured configs, scored on up to 4096
candidates. With a BLAS pool of several threads, starting them costs more than they save, and
where other processes hold the cores (a tune's own workers) a pool's threads wait for them.
Each row replays one 50-proposal search (seed 0, each evaluation one recorded repeat, as
``search_efficiency.py``'s time per proposal) on the largest landscape, and gives the wall time
per proposal; "same proposals" counts those equal to the first row's (one thread and several
sum in another order, so an expected improvement that ties to the last bits may break the
other way).

    python benchmarks/search/proposal_time.py [--landscapes DIR] [--proposals 50] [--busy 0,2]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the v6e matmul estimate landscape in
benchmarks/landscapes, 8 proposals, idle and one busy process.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import math
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import search_harness as h  # noqa: E402

from pallas_tune.search import gp, replay  # noqa: E402


def _spin() -> None:
    while True:
        pass


@contextlib.contextmanager
def busy(n: int) -> Iterator[None]:
    """``n`` processes spinning on the CPU for the duration."""
    procs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.2 if n else 0.0)
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.join()


def search(land: replay.Landscape, proposals: int, one_thread: bool
           ) -> tuple[list[float], list[Any]]:
    """Wall ms of each proposal of one search, and the configs proposed."""
    limit = gp.one_blas_thread
    if not one_thread:  # The BLAS pools as the process found them.
        gp.one_blas_thread = contextlib.nullcontext
    try:
        bo = gp.CandidateBO(land.configs, land.choices, seed=0, budget=proposals)
        rng = np.random.default_rng(0)
        measured: dict = {}
        wall, configs = [], []
        for _ in range(min(proposals, len(land.configs))):
            t0 = time.perf_counter()
            c = bo.propose(measured)
            wall.append(1000 * (time.perf_counter() - t0))
            configs.append(c)
            reps = land.times[c]
            measured[c] = float(rng.choice(reps)) if reps else math.inf
        return wall, configs
    finally:
        gp.one_blas_thread = limit


def blas_threads() -> str:
    """The BLAS pools this process has, and their threads."""
    from threadpoolctl import threadpool_info

    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return ", ".join(f"{p.get('internal_api')} {p.get('num_threads')}" for p in pools) or "none"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--landscapes", default=None,
                   help=f"folder of Kernel Tuner files (default: ${replay.LANDSCAPES_ENV} or "
                        "../shared/landscapes); the largest is replayed")
    p.add_argument("--proposals", type=int, default=bench.smoke(50, 8))
    p.add_argument("--busy", default=bench.smoke(f"0,{os.cpu_count() or 1}", "0,1"),
                   help="comma-separated counts of busy processes beside the search")
    p.add_argument("--out", default=bench.output(bench.result("proposal_time.md")))
    a = p.parse_args(argv)
    paths = [] if bench.SMOKE and a.landscapes is None else replay.find_landscapes(a.landscapes)
    paths = paths or sorted(glob.glob(os.path.join(bench.LANDSCAPES, "matmul*.json")))
    path = max(paths, key=lambda q: len(h.load(q).configs))
    land = h.load(path)
    search(land, 2, True)  # Imports (scipy.optimize) and the BLAS scan, outside the rows.
    rows, first = [], None
    for n in (int(x) for x in a.busy.split(",")):
        for one in (False, True):
            with busy(n):
                wall, configs = search(land, a.proposals, one)
            first = first or configs
            same = sum(x == y for x, y in zip(configs, first, strict=False))
            rows.append(("one" if one else "as found", n, f"{statistics.mean(wall):.1f}",
                         f"{statistics.median(wall):.1f}", f"{np.percentile(wall, 90):.1f}",
                         f"{max(wall):.1f}", f"{same}/{len(configs)}"))
            print(rows[-1], flush=True)
    text = "\n".join([
        "# The default search's time per proposal: BLAS threads as found, and one", "",
        __doc__.split("\n\n")[0].replace("\n", " "), "",
        f"`{bench.command(__file__, argv)}` ({bench.today()}, {bench.host()}; "
        f"{bench.versions('numpy', 'scipy', 'threadpoolctl')}; BLAS as found: "
        f"{blas_threads()}). {h.landscape_id(path)}: {len(land.configs)} configs, "
        f"{a.proposals} proposals, seed 0; wall ms per proposal.", "",
        *bench.table(("BLAS threads", "busy processes", "mean", "median", "p90", "max",
                      "same proposals"), rows), ""])
    bench.write(a.out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
