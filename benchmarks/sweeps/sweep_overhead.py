"""The tuner's own cost per trial over a long run: does it stay flat from trial 1 to 300?

One process runs ``pallas_tune.tuning.run`` for 300 trials of a synthetic kernel (three
parameters of 12 values: 1728 configs, so the default GP sampler proposes every trial) with a
stub evaluator: each candidate's "program" is claimed as a real one is (``Evaluator._answer``,
through the storage when there is one) and its time is a formula, so no kernel is traced,
compiled or run. What is left is the tuner: Optuna's ask and tell, the storage, the claims, the
trial log, the sampler. Per trial (between two consecutive trial records):

- ``sampler``: the sampler's proposal (``CandidateSampler.sample_relative``; the GP, whose fit
  legitimately grows with the number of points);
- ``bookkeeping``: everything else but the (stub) evaluation: the storage and the loop;
- ``reads``: trials the loop's reads of the study went through per trial
  (``Search.examined``), a count of work independent of the machine's load.

Each figure is the median over a window of trials around trial 1 (trials 1-10), 100 (95-105)
and 300 (291-300); times are both wall clock and CPU time of this process
(``time.process_time``; the PostgreSQL server's own CPU is not in it, its wall time is). The
machine is shared, so run each storage a few times (``--runs``) and take the median of the
runs' medians. SQLite is a file on local disk (every commit an fsync); PostgreSQL a local
pgserver.

    python benchmarks/sweeps/sweep_overhead.py [--trials 300] [--runs 2]
        [--storages memory,sqlite,postgres]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 31 trials, one run, in memory and SQLite.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import pallas_tune as pt  # noqa: E402
from pallas_tune.measure.evaluate import Evaluator  # noqa: E402
from pallas_tune.measure.records import Measurement, Outcome, TrialRecord  # noqa: E402


@pt.tunable(a=list(range(12)), b=list(range(12)), c=list(range(12)), name="bench.synthetic")
def synthetic(x, *, a, b, c):
    return x


def cost(config):
    return 1.0 + abs(config["a"] - 6) + abs(config["b"] - 6) + 0.5 * (config["c"] % 3)


class Stub(Evaluator):
    """Claims each candidate's program (configs differing only in ``c`` by a multiple of 3 are
    one program) and "times" it by the formula above."""

    kind = "stub"

    def __init__(self):
        super().__init__()
        self.cpu = self.wall = 0.0

    def start(self):
        self.device = {"chip": "cpu", "platform": "cpu", "device_kind": "stub"}
        return self.device

    def _evaluate(self, candidates):
        t0, c0 = time.perf_counter(), time.process_time()
        out = []
        for number, config in candidates:
            program = f"{config['a']}.{config['b']}.{config['c'] % 3}"
            original = self._answer(("claim", program, number))
            m = Measurement(times_ms=(cost(config),), compile_ms=0.0)
            record = TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                                 measurement=None if original is not None else m,
                                 fingerprint=program, duplicate_of=original)
            self._note(record)
            out.append(record)
        self.wall += time.perf_counter() - t0
        self.cpu += time.process_time() - c0
        return out

    def roofline(self, configs, chip):
        return [0.0 for _ in configs]


class Meter:
    """Times the sampler; ``reads``: the trials the tuning loop's reads of the study went
        through (``Search.examined``)."""

    def __init__(self):
        from pallas_tune.search import gp
        from pallas_tune.tuning import study

        self.wall = self.cpu = 0.0
        meter = self
        sample = gp.CandidateSampler.sample_relative
        init = study.Search.__init__

        def timed(sampler, *args):
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return sample(sampler, *args)
            finally:
                meter.wall += time.perf_counter() - t0
                meter.cpu += time.process_time() - c0

        def kept(search, *args, **kwargs):
            init(search, *args, **kwargs)
            meter.search = search

        gp.CandidateSampler.sample_relative = timed
        study.Search.__init__ = kept

    @property
    def reads(self):
        return getattr(getattr(self, "search", None), "examined", 0)


def one_run(storage, trials, meter):
    import jax.numpy as jnp

    from pallas_tune.tuning import TuneOptions, run

    evaluator = Stub()
    marks = []

    def mark(record, progress):
        marks.append((time.perf_counter(), time.process_time(), meter.wall, meter.cpu,
                      evaluator.wall, evaluator.cpu, meter.reads))

    opts = TuneOptions(trials=trials, seed=0, write=False, retime_top=0, storage=storage,
                       callbacks=[mark], warm_start=0,
                       study_name=f"overhead-{time.time_ns()}")
    run(synthetic, (jnp.ones((8, 128)),), {}, opts, evaluator=evaluator)
    rows = []
    for a, b in itertools.pairwise(marks):
        d = [y - x for x, y in zip(a, b)]
        rows.append({"wall": d[0] - d[2] - d[4], "cpu": d[1] - d[3] - d[5],
                     "sampler wall": d[2], "sampler cpu": d[3], "reads": d[6]})
    return rows


def windows(n):
    """Row ranges (row i: from trial i+1's record to trial i+2's) around trials 1, 100, 300
    (around n/3 and n for shorter runs)."""
    mid = 100 if n >= 200 else n // 3
    return [(0, 10), (mid - 5, mid + 5), (n - 10, n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=bench.smoke(300, 31))
    ap.add_argument("--runs", type=int, default=bench.smoke(2, 1))
    ap.add_argument("--storages", default=bench.smoke("memory,sqlite,postgres", "memory,sqlite"))
    args = ap.parse_args()
    import contextlib

    import jax
    import optuna

    meter = Meter()
    spans = ", ".join(f"{lo + 2}-{hi + 1}" for lo, hi in windows(args.trials - 1))
    when = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    lines = [
        f"# $ {bench.command(__file__)}   ({when})",
        (f"# host: {bench.host()}, shared with other engineers' jobs; jax {jax.__version__}; "
         f"optuna {optuna.__version__}; Python {platform.python_version()}."),
        (f"# {args.trials} trials of a 1728-config space, GP sampler, stub evaluation; "
         f"per-trial medians over windows of 10 trials ({spans}), then the median of "
         f"{args.runs} runs. ms per trial; reads: trials the loop's reads of the study went "
         "through, per trial (Search.examined)."),
        (f"{'storage':<10} {'figure':<22} {'trial 1':>9} {'trial 100':>10} "
         f"{'trial 300':>10} {'300/1':>7}")]
    for name in args.storages.split(","):
        with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
            if name == "memory":
                url = None
            elif name == "sqlite":
                url = f"sqlite:///{os.path.join(tmp, 'studies.db')}"
            else:
                import pgserver

                server = pgserver.get_server(os.path.join(tmp, "pg"), cleanup_mode="stop")
                stack.callback(server.cleanup)
                url = server.get_uri()
            runs = [one_run(url, args.trials, meter) for _ in range(args.runs)]
        for figure, key, scale in (("bookkeeping wall", "wall", 1e3),
                                   ("bookkeeping CPU", "cpu", 1e3),
                                   ("sampler wall", "sampler wall", 1e3),
                                   ("sampler CPU", "sampler cpu", 1e3),
                                   ("reads (trials)", "reads", 1)):
            cells = []
            for lo, hi in windows(len(runs[0])):
                cells.append(statistics.median(
                    statistics.median(r[key] * scale for r in rows[lo:hi]) for rows in runs))
            ratio = cells[2] / cells[0] if cells[0] else float("nan")
            lines.append(f"{name:<10} {figure:<22} {cells[0]:>9.1f} {cells[1]:>10.1f} "
                         f"{cells[2]:>10.1f} {ratio:>7.2f}")
        print("\n".join(lines), flush=True)  # Each storage's rows as soon as they are known.
        lines = []


if __name__ == "__main__":
    main()
