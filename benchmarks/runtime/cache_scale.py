"""The cache at scale: first lookup, a write's lock, a cache miss, at 100 / 1,000 / 10,000 shapes.

For each size, a cache of the shipped matmul on the ``cpu`` chip is built with that many tuned
shapes, each with 32 trials of history (as the tuner writes them), and measured in fresh
processes:

- first lookup: ``cache.lookup`` of a cached key in a new process (reads the file), its time and
  the extra memory (the larger of the peak and the resident growth, on top of jax);
- first resolution: ``matmul.config_for`` right after it (this tree also validates the entry
  for the call's shapes: one trace of the kernel);
- write: one ``cache.write`` of a new shape into that cache, and how long it holds the lock;
- miss: ``config_for`` of an uncached shape (768^3) whose neighbours' configs (bm=512) are all
  invalid for it, so a search over neighbours cannot stop early; and how many times the kernel
  was traced. The declared default (256^3 tiles) is valid there.

Targets (issue 14): first lookup <= 50 ms and <= 50 MB at 10,000 shapes; lock held <= 50 ms; a
miss costs a few traces whatever the cache size.

    python benchmarks/runtime/cache_scale.py                 # this tree
    python benchmarks/runtime/cache_scale.py --old /tmp/old  # and an older tree ("before")
    PALLAS_TUNE_BENCH_SMOKE=1 python benchmarks/runtime/cache_scale.py  # 20 shapes, once

``--old`` takes a source tree of pallas-tune (e.g. ``git archive b871a4e | tar -x -C /tmp/old``);
its ``kernels``, ``caches`` and ``search_spaces`` are linked into its package so that it imports
on its own. Each measurement runs ``--repeats`` times (fresh processes); the table shows medians.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

NAME = "pallas_tune.kernels.matmul.matmul"
SEM = ["parallel", "parallel", "arbitrary"]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402


def _dims(i: int) -> tuple[int, int, int]:
    return 1024 * (1 + i % 64), 1024 * (1 + (i // 64) % 64), 1024 * (1 + (i // 4096) % 64)


def _key(m: int, k: int, n: int) -> str:
    return f"x={m}x{k}:bfloat16,y={k}x{n}:bfloat16"


def _entry(rng: random.Random, key: str, trials: int) -> dict:
    """A cache entry shaped like the tuner's (config, time, provenance, trials); its configs are
    the matmul's declared default with random tiles over it, so that they name every parameter
    of the tree's space (as lookups require)."""
    from pallas_tune.kernels.matmul import matmul

    default = {k: list(v) if isinstance(v, tuple) else v
               for k, v in (matmul.space.default or {}).items()}

    def config():
        return {**default, "bm": 512, "bn": rng.choice([128, 256, 512, 1024]),
                "bk": rng.choice([128, 256, 512, 1024]), "buffering": rng.choice([1, 2]),
                "semantics": SEM}

    def trial(number):
        times = [round(rng.uniform(0.1, 2.0), 6) for _ in range(5)]
        return {"number": number, "config": config(), "outcome": "ok",
                "median_ms": statistics.median(times), "spread_ms": 0.01, "times_ms": times,
                "compile_ms": round(rng.uniform(50, 400), 3), "timer": "wallclock"}

    best = config()
    retimed = [{"config": config(), "search_median_ms": 0.5, "interleaved_median_ms": 0.5,
                "interleaved_ms": [0.5] * 5} for _ in range(3)]
    return {
        "key": key, "config": best, "median_ms": 0.5, "spread_ms": 0.01,
        "provenance": {
            "kind": "measured", "chip": "cpu", "device_kind": "cpu", "platform": "cpu",
            "interpret": True, "timer": "wallclock", "repeats": 5, "strategy": "gp",
            "trials_measured": trials, "tuning_s": 12.5, "seed": 0, "retimed_interleaved": retimed,
            "versions": {"python": "3.12.1", "pallas-tune": "0.1.0", "jax": "0.12.0.1",
                         "jaxlib": "0.12.0.1", "optuna": "5.0.0"},
            "date": "2026-11-23T00:00:00+00:00"},
        "trials": [trial(t) for t in range(trials)],
    }


# ---- workers (run in fresh processes, against the tree on PYTHONPATH) ----------------------

def _maxrss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    """Resident memory now (Linux), to see what a lookup keeps after its peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def work_build(root: str, n: int, trials: int) -> dict:
    from pallas_tune.cache import TuningCache

    rng = random.Random(0)
    entries = {}
    for i in range(n):
        key = _key(*_dims(i))
        entries[key] = _entry(rng, key, trials)
    cache = TuningCache(root, use_shipped=False)
    t = time.perf_counter()
    if hasattr(cache, "write_many"):
        path = cache.write_many("cpu", NAME, entries)
    else:  # pallas-tune 0.1: one schema 1 file, written as its writer does.
        from pallas_tune import cache as old

        path = cache.path("cpu", NAME)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        old._atomic_write_json(path, {"schema": 1, "kernel": NAME, "chip": "cpu",
                                      "kind": "measured", "entries": dict(sorted(entries.items()))})
    d = os.path.dirname(path)
    sizes = {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)}
    winners = os.path.getsize(path)
    return {"build_s": time.perf_counter() - t, "winners_mb": winners / 1e6,
            "all_mb": sum(sizes.values()) / 1e6}


def _warm_jax() -> None:
    """What a process has done before its first lookup: traced its model (here: the kernel at
    another shape), so jax's one-time start-up is not charged to the cache."""
    import functools

    import jax
    import jax.numpy as jnp

    from pallas_tune.kernels.matmul import matmul

    s = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    cfg = {"bm": 128, "bn": 128, "bk": 128, "buffering": 2, "semantics": tuple(SEM)}
    jax.make_jaxpr(functools.partial(matmul.fn, **cfg))(s, s)


def _args(m: int, k: int, n: int) -> tuple:
    import jax
    import jax.numpy as jnp

    return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))


def work_first(root: str, n: int) -> dict:
    os.environ["PALLAS_TUNE_CACHE_DIR"] = root
    from pallas_tune.kernels.matmul import matmul

    _warm_jax()
    args = _args(*_dims(n // 2))
    key = matmul.cache_key(*args)
    base, base_now = _maxrss_mb(), _rss_mb()
    t = time.perf_counter()
    found = matmul.cache.lookup("cpu", NAME, key)
    lookup_ms = (time.perf_counter() - t) * 1e3
    extra_mb = max(_maxrss_mb() - base, _rss_mb() - base_now)
    assert found is not None
    t = time.perf_counter()
    config = matmul.config_for(*args)
    resolve_ms = (time.perf_counter() - t) * 1e3
    assert config.source == "cache", config
    return {"lookup_ms": lookup_ms, "lookup_mb": extra_mb, "resolve_ms": lookup_ms + resolve_ms}


def work_write(root: str, n: int, trials: int) -> dict:
    import filelock

    from pallas_tune.cache import TuningCache

    held: list[float] = []
    acquire, release = filelock.BaseFileLock.acquire, filelock.BaseFileLock.release

    def timed_acquire(self, *a, **k):
        out = acquire(self, *a, **k)
        if self.lock_counter == 1:
            self._bench_t0 = time.perf_counter()
        return out

    def timed_release(self, *a, **k):
        out = release(self, *a, **k)
        if self.lock_counter == 0 and hasattr(self, "_bench_t0"):
            held.append(time.perf_counter() - self._bench_t0)
            del self._bench_t0
        return out

    filelock.BaseFileLock.acquire, filelock.BaseFileLock.release = timed_acquire, timed_release
    cache = TuningCache(root, use_shipped=False)
    key = _key(128, 128, 128 * 65 + random.randrange(10**6))  # A new shape each run.
    entry = _entry(random.Random(1), key, trials)
    t = time.perf_counter()
    cache.write("cpu", NAME, key, entry)
    return {"write_ms": (time.perf_counter() - t) * 1e3, "lock_ms": sum(held) * 1e3}


def work_miss(root: str, n: int) -> dict:
    import warnings

    os.environ["PALLAS_TUNE_CACHE_DIR"] = root
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.kernels.matmul import matmul

    _warm_jax()
    traces = []
    real = _inspect.find_pallas_calls

    def counting(*a, **k):
        traces.append(1)
        return real(*a, **k)

    _inspect.find_pallas_calls = counting
    args = _args(768, 768, 768)
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = matmul.config_for(*args)
    return {"miss_ms": (time.perf_counter() - t) * 1e3, "miss_traces": len(traces),
            "miss_source": config.source}


# ---- driver --------------------------------------------------------------------------------

def _run(tree: str, mode: str, root: str, n: int, trials: int, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--root", root,
           "--n", str(n), "--trials", str(trials)]
    return bench.run_json(cmd, env={"PYTHONPATH": tree, "JAX_PLATFORMS": "cpu",
                                    "PALLAS_TUNE_CACHE_DIR": root}, cwd=tree, timeout=timeout)


def _prepare_old(tree: str) -> None:
    for sub in ("kernels", "caches", "search_spaces"):
        link = os.path.join(tree, "pallas_tune", sub)
        if not os.path.exists(link):
            os.symlink(os.path.join(tree, sub), link)


def measure(tree: str, label: str, sizes: list[int], args: argparse.Namespace) -> list[dict]:
    rows = []
    for n in sizes:
        root = bench.scratch(f"pt-cache-scale-{label}-{n}-")
        row = {"impl": label, "n": n, **_run(tree, "build", root, n, args.trials, 3600)}
        samples: dict[str, list] = {}
        for mode in ("first", "miss", "write"):
            repeats = args.miss_repeats if (mode == "miss" and n >= 10000) else args.repeats
            for _ in range(repeats):
                for k, v in _run(tree, mode, root, n, args.trials, 3600).items():
                    samples.setdefault(k, []).append(v)
        for k, vs in samples.items():
            row[k] = statistics.median(vs) if isinstance(vs[0], float | int) else vs[0]
        rows.append(row)
        print(f"  {label} n={n}: {row}", file=sys.stderr, flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=("build", "first", "write", "miss"))
    p.add_argument("--root")
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--trials", type=int, default=bench.smoke(32, 2))
    p.add_argument("--sizes", default=bench.smoke("100,1000,10000", "20"))
    p.add_argument("--old", help="an older pallas-tune source tree to measure as 'before'")
    p.add_argument("--repeats", type=int, default=bench.smoke(3, 1))
    p.add_argument("--miss-repeats", type=int, default=1, help="repeats of the miss at 10,000")
    args = p.parse_args()
    if args.worker:
        fn = {"build": lambda: work_build(args.root, args.n, args.trials),
              "first": lambda: work_first(args.root, args.n),
              "write": lambda: work_write(args.root, args.n, args.trials),
              "miss": lambda: work_miss(args.root, args.n)}[args.worker]
        print(json.dumps(fn()))
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    if args.old:
        _prepare_old(args.old)
        rows += measure(args.old, "before", sizes, args)
    rows += measure(bench.REPO, "after", sizes, args)
    print(f"# $ {bench.command(__file__)}   ({bench.today()}; {os.cpu_count()}-core CPU host, "
          "shared with other jobs: timings are noisy)")
    print(f"# {args.trials} trials per shape; medians of {args.repeats} fresh processes "
          f"({args.miss_repeats} for the miss at 10,000 shapes)")
    head = (f"{'shapes':>7} {'impl':7} {'winners MB':>10} {'on disk MB':>10} {'lookup ms':>9} "
            f"{'lookup MB':>9} {'resolve ms':>10} {'write ms':>9} {'lock ms':>8} {'miss ms':>9} "
            f"{'traces':>6}")
    print(head)
    for r in sorted(rows, key=lambda r: (r["n"], r["impl"] != "before")):
        print(f"{r['n']:>7} {r['impl']:7} {r['winners_mb']:10.2f} {r['all_mb']:10.2f} "
              f"{r['lookup_ms']:9.1f} {r['lookup_mb']:9.1f} {r['resolve_ms']:10.1f} "
              f"{r['write_ms']:9.1f} {r['lock_ms']:8.1f} {r['miss_ms']:9.1f} "
              f"{r['miss_traces']:6d}")


if __name__ == "__main__":
    main()
