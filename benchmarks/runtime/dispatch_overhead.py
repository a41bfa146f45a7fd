"""Cost of cached dispatch: per eager call and per trace-time lookup.

Prints, for the shipped matmul at a cached shape:
- eager per-call overhead: ``matmul(x, y)`` (lookup + call) minus the hand-bound kernel
  ``matmul.__wrapped__(x, y, **config)`` called the same way;
- one trace-time lookup on a memoized key (what every later trace of that shape pays);
- a lookup whose cache key was already resolved under another argument signature (e.g. a
  tracer instead of an array): the key is built, the config comes from the per-key memo;
- the first resolution of a key, its cache file already read: the entry is validated for the
  call's shapes by the one validity check, which traces the kernel once (issue 12/14);
- the first resolution of a key in a process (reads the cache file, then validates).
Targets (issue 2): ≤ 5 µs per eager call, ≤ 50 µs per memoized lookup.

    python benchmarks/runtime/dispatch_overhead.py
    PALLAS_TUNE_BENCH_SMOKE=1 python benchmarks/runtime/dispatch_overhead.py  # a few calls
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

if not os.environ.get("PALLAS_TUNE_CACHE_DIR"):  # A cache of this run's own.
    os.environ["PALLAS_TUNE_CACHE_DIR"] = bench.scratch("pt-bench-")

import pallas_tune as pt  # noqa: E402
from pallas_tune.kernels.matmul import matmul  # noqa: E402


def _per_call_us(fn, n: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(samples)


def _seed(kernel, key: str, tiles: dict) -> dict:
    """Writes a cache entry for ``key`` whose config is the kernel's declared default with
    ``tiles`` over it (so that it names every parameter the space declares, as lookups require),
    and returns that config; refuses, naming why, an entry the kernel would skip."""
    config = {**(kernel.space.default or {}), **tiles}
    entry = {"key": key, "config": config, "median_ms": 1e-3,
             "provenance": {"kind": "measured", "timer": "benchmark seed"}}
    problems = kernel.entry_problems(entry)
    if problems:
        raise SystemExit(f"the seeded entry for {kernel.name} would be skipped: {problems}")
    kernel.cache.write(pt.current_chip(), kernel.name, key, entry)
    return config


def main() -> None:
    x = jnp.ones((256, 256), jnp.float32)
    key = matmul.cache_key(x, x)
    config = _seed(matmul, key, {"bm": 128, "bn": 128, "bk": 256})

    # Eager calls: jit both so the measured difference is dispatch, not retracing.
    cached = jax.jit(matmul)
    by_hand = jax.jit(lambda a, b: matmul.__wrapped__(a, b, **config))
    with pt.interpret_mode():
        jax.block_until_ready(by_hand(x, x))
    jax.block_until_ready(cached(x, x))

    def lookup() -> None:
        matmul._resolve((x, x), {})

    def eager_wrapper_only() -> None:
        # The work __call__ does before reaching the kernel function: what an eager call adds.
        explicit = {}
        c = matmul._resolve((x, x), {})
        if pt.chips.should_interpret():
            with pt.interpret_mode():
                pass
        del explicit, c

    n = bench.smoke(20000, 50)
    lookup_us = _per_call_us(lookup, n)
    wrapper_us = _per_call_us(eager_wrapper_only, n)

    # Eager overhead, isolated: a tunable whose body does nothing, decorated vs hand-bound.
    # (An eager Pallas call retraces its pallas_call every time, ~0.1 s in interpret mode, which
    # would bury a few microseconds.)
    @pt.tunable(block=[128, 256], name="benchmarks.dispatch_overhead.noop")
    def noop(a, *, block):
        return a

    _seed(noop, noop.cache_key(x), {"block": 256})
    noop(x)
    decorated_us = _per_call_us(lambda: noop(x), n)
    hand_us = _per_call_us(lambda: noop.__wrapped__(x, block=256), n)

    # Jitted: the compiled programs are identical, so steady-state dispatch is the same.
    m = bench.smoke(200, 3)
    jit_cached = _per_call_us(lambda: jax.block_until_ready(cached(x, x)), m, rounds=5)
    with pt.interpret_mode():  # The interpret flag is part of jit's cache key: call under it.
        jit_hand = _per_call_us(lambda: jax.block_until_ready(by_hand(x, x)), m, rounds=5)

    matmul._memo.clear()
    matmul.cache.invalidate()
    t = time.perf_counter()
    first = matmul.config_for(x, x)
    first_us = (time.perf_counter() - t) * 1e6
    if first.source != "cache":
        raise SystemExit(f"the seeded entry was not served ({first.source}): {first}")
    # A new argument signature whose cache key is already resolved: key build + per-key memo.
    samples = []
    for _ in range(bench.smoke(200, 3)):
        for k in [k for k in matmul._memo if k[0] != "key"]:
            del matmul._memo[k]
        t = time.perf_counter()
        matmul._resolve((x, x), {})
        samples.append((time.perf_counter() - t) * 1e6)
    by_key_us = statistics.median(samples)
    # A key not yet resolved, its cache file already loaded: validated (one trace).
    samples = []
    for _ in range(bench.smoke(50, 2)):
        matmul._memo.clear()
        t = time.perf_counter()
        matmul._resolve((x, x), {})
        samples.append((time.perf_counter() - t) * 1e6)
    unmemo_us = statistics.median(samples)

    rows = [
        ("trace-time lookup, memoized key", lookup_us, "≤ 50 µs"),
        ("wrapper work before the kernel (matmul)", wrapper_us, ""),
        ("eager call, decorated no-op kernel", decorated_us, ""),
        ("eager call, hand-bound no-op kernel", hand_us, ""),
        ("  eager per-call overhead", decorated_us - hand_us, "≤ 5 µs"),
        ("jitted matmul 256², served from cache", jit_cached, ""),
        ("jitted matmul 256², config by hand", jit_hand, "(same program)"),
        ("new signature, cache key already resolved", by_key_us, "≤ 50 µs"),
        ("first resolution of a key (validates: 1 trace)", unmemo_us, "once per key"),
        ("first lookup in a process (reads the file)", first_us, "once per kernel"),
    ]
    print(f"pallas-tune dispatch overhead; jax {jax.__version__}, backend {jax.default_backend()}")
    print(f"{'what':45s} {'µs per call':>12s}  target")
    for what, us, target in rows:
        print(f"{what:45s} {us:12.2f}  {target}")


if __name__ == "__main__":
    main()
