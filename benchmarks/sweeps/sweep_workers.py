"""Distributed sweeps, repeated: the multi-worker PostgreSQL scenario and kill -9 resumes in a
loop, and sweep throughput with 1, 2 and 4 workers on one storage.

Every worker is a real ``pallas-tune sweep`` process (``python -m pallas_tune``) on
``toy_kernels:scale`` (tests/toy_kernels.py: a space of 16 configs, 8 distinct programs in
interpret mode); PostgreSQL is a real server started by pgserver. Each run uses its own study
(``--study-name``) and cache directory. Counted from the stored study after each run:
duplicates (a config evaluated by more than one trial), lost trials (fewer timed trials than
``--trials`` while configs were left, or trials left RUNNING), crashed workers (non-zero exit or
a traceback; the killed process excepted).

    python benchmarks/sweeps/sweep_workers.py loops --runs 10
    python benchmarks/sweeps/sweep_workers.py throughput

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): ``loops`` runs each scenario once, ``throughput`` one
worker.

Without an accelerator these are CPU interpret-mode wall-clock figures: they measure the sweep
machinery (process start, storage, claims), not kernel speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

sys.path.insert(0, bench.TESTS)
import sweep_harness as h  # noqa: E402

SPACE = 16
TP_SHAPES = "x=256x1024:float32"  # Bigger than the loops' shape: a trial costs ~1 s here.


def _header(lines: list[str]) -> str:
    import jax

    return "\n".join([
        f"# $ {bench.command(__file__)}   ({bench.today()})",
        f"# host: {bench.host()}, shared with other engineers' jobs (timings taken under that "
        f"load); no accelerator; jax {jax.__version__}; Python {platform.python_version()}.",
        "# CPU interpret-mode wall clock of real `pallas-tune sweep` processes: sweep "
        "machinery, not kernel speed.", *lines]) + "\n"


def _cmd(storage: str | None, trials: int, study: str, *extra: str, shapes: str = h.SHAPES
         ) -> list[str]:
    return h.sweep_command(storage, trials, "-q", "--study-name", study, *extra, shapes=shapes)


def _judge(storage: str, study: str, results: list[tuple[int, str, str]], trials: int,
           killed: int = 0) -> dict:
    acc = h.accounts(storage, study)
    crashed = sum(rc != 0 or "Traceback" in err for rc, _, err in results)
    short = acc["timed"] < trials and acc["evaluated"] < SPACE
    lost = acc["running"] + (trials - acc["timed"] if short else 0)
    return {**acc, "crashed": crashed, "lost": lost, "killed": killed}


def _multi(url: str, i: int, tmp: str, workers: int = 3, trials: int = 6) -> dict:
    study, cache = f"multi-{i}", os.path.join(tmp, f"c{i}")
    procs = [subprocess.Popen(_cmd(url, trials, study), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=h.worker_env(cache))
             for _ in range(workers)]
    return _judge(url, study, h.wait_all(procs), trials)


def _kill9(url: str | None, i: int, tmp: str, trials: int = 6) -> dict:
    study, cache = f"kill-{i}", os.path.join(tmp, f"k{i}")
    stored = url or f"sqlite:///{os.path.join(cache, '.studies', 'studies.db')}"
    first = subprocess.Popen(_cmd(url, trials, study), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=h.worker_env(cache))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # Kill at a varying moment: after 1..3 timed trials.
        try:
            if h.accounts(stored, study)["timed"] >= 1 + i % 3:
                break
        except Exception:  # noqa: BLE001  Not created yet.
            pass
        time.sleep(0.1 + 0.07 * (i % 4))
    h.kill9(first)
    again = subprocess.run(_cmd(url, trials, study), capture_output=True, text=True,
                           env=h.worker_env(cache), timeout=900)
    return _judge(stored, study, [(again.returncode, again.stdout, again.stderr)], trials,
                  killed=1)


def loops(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp, h.postgres_url(os.path.join(tmp, "pg")) as url:
        for i in range(args.runs):
            for name, fn in (("3 workers, postgres", lambda: _multi(url, i, tmp)),
                             ("kill -9 + rerun, postgres", lambda: _kill9(url, i, tmp)),
                             ("kill -9 + rerun, sqlite default", lambda: _kill9(None, i, tmp))):
                t0 = time.perf_counter()
                r = fn()
                r.update(scenario=name, run=i, wall=time.perf_counter() - t0)
                rows.append(r)
                print(f"{name:32s} run {i}: {r}", flush=True)
    lines = [f"# {args.runs} runs of each scenario; trials=6 of a space of 16 per study.",
             "# duplicates: configs evaluated twice; lost: trials missing or left RUNNING; "
             "crashed: workers exiting non-zero or with a traceback (the killed one excepted).",
             f"{'scenario':34s} {'runs':>4s} {'dupl':>5s} {'lost':>5s} {'crashed':>7s} "
             f"{'timed/run':>10s} {'workers seen':>12s} {'wall s (median)':>15s}"]
    for name in dict.fromkeys(r["scenario"] for r in rows):
        rs = [r for r in rows if r["scenario"] == name]
        walls = sorted(r["wall"] for r in rs)
        lines.append(f"{name:34s} {len(rs):4d} {sum(r['duplicates'] for r in rs):5d} "
                     f"{sum(r['lost'] for r in rs):5d} {sum(r['crashed'] for r in rs):7d} "
                     f"{min(r['timed'] for r in rs):>4d}-{max(r['timed'] for r in rs):<5d} "
                     f"{min(r['workers'] for r in rs):>6d}-{max(r['workers'] for r in rs):<5d} "
                     f"{walls[len(walls) // 2]:15.1f}")
    lines.append("# per run (states: the study's trial states; PRUNED = a worker backed off a "
                 "config another worker held; FAIL = the killed worker's trial, requeued):")
    lines += [f"# {r['scenario']:32s} run {r['run']}: {r['states']}" for r in rows]
    bench.write(args.out or bench.result("sweep_workers.txt"), _header(lines))


def throughput(args: argparse.Namespace) -> None:
    trials = SPACE  # Every config once: the same work for every worker count.
    rows = []
    with tempfile.TemporaryDirectory() as tmp, h.postgres_url(os.path.join(tmp, "pg")) as url:
        for workers in bench.smoke((1, 2, 4), (1,)):
            study, cache = f"tp-{workers}", os.path.join(tmp, f"t{workers}")
            t0 = time.perf_counter()
            procs = [subprocess.Popen(_cmd(url, trials, study, shapes=TP_SHAPES),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env=h.worker_env(cache)) for _ in range(workers)]
            res = h.wait_all(procs, timeout=1800)
            wall = time.perf_counter() - t0
            r = _judge(url, study, res, trials)
            rows.append((workers, wall, r))
            print(workers, wall, r, flush=True)
    base = rows[0][1]
    lines = [f"# one PostgreSQL storage; each worker count sweeps its own study of all {trials}"
             " configs (trials=16, exhaustive: every config enqueued once, claimed by one "
             "worker);",
             f"# shape {TP_SHAPES}; wall: first worker start to last worker exit (JAX import "
             "and tracing included); configs/min = evaluated configs per minute of wall time;",
             "# programs timed: configs whose program was run (a config whose lowered program "
             "another config already ran is a duplicate and not timed; that check is per "
             "process, so concurrent workers can time one program twice);",
             "# dupl: configs evaluated by more than one worker.",
             f"{'workers':>7s} {'wall s':>8s} {'configs':>7s} {'programs timed':>14s} "
             f"{'configs/min':>11s} {'speed-up':>8s} {'dupl':>5s} {'crashed':>7s} "
             f"{'workers seen':>12s}"]
    for workers, wall, r in rows:
        lines.append(f"{workers:7d} {wall:8.1f} {r['evaluated']:7d} {r['timed']:14d} "
                     f"{60 * r['evaluated'] / wall:11.1f} {base / wall:8.2f} "
                     f"{r['duplicates']:5d} {r['crashed']:7d} {r['workers']:12d}")
    lines.append(f"# On this {os.cpu_count()}-core shared host more workers are slower, not "
                 "faster: every worker pays its own start (JAX import, tracing) on the same "
                 "cores, and concurrent workers time programs that one worker skips as "
                 "duplicates. It shows the sharing is correct under contention (0 dupl); a "
                 "speed-up needs workers with their own cores and devices.")
    bench.write(args.out or bench.result("sweep_throughput.txt"), _header(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    sub = p.add_subparsers(dest="what", required=True)
    lp = sub.add_parser("loops")
    lp.add_argument("--runs", type=int, default=bench.smoke(10, 1))
    lp.add_argument("--out")
    lp.set_defaults(func=loops)
    tp = sub.add_parser("throughput")
    tp.add_argument("--out")
    tp.set_defaults(func=throughput)
    args = p.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
