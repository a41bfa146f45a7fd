"""Running one compiled candidate: the correctness check against a reference, and timing.

Timings here are wall clock around ``block_until_ready`` after a warm-up (or, with the
``profiler`` timer, device time from a ``jax.profiler`` trace). On a CPU host (interpret mode)
they track grid steps and interpreter overhead, not TPU behaviour, and are labelled so in every
record. Timing stops early by the rules of :class:`TimingPolicy`: a time budget per candidate,
and a cut-off for candidates clearly slower than the best so far.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tune.measure.records import Measurement, Outcome, TrialRecord

__all__ = ["Measurement", "Outcome", "TimingPolicy", "TrialRecord", "compare", "make_inputs",
           "resolve_timer", "retime_interleaved", "run_and_time"]

TIMERS: Final = ("auto", "wallclock", "profiler", "tpu-estimate")
# Never time one candidate more often than this, whatever min_time_s says.
MAX_RUNS: Final = 1000
# A first call may carry one-time costs (allocation, program load: milliseconds), so it proves
# a candidate slow only when it exceeds the cut-off by more than this much; then no further run
# is made. At 2048^2 in interpret mode a 128^3 matmul tile takes 131 s a call against 1.4 s for
# the best: its first call alone is enough.
FIRST_CALL_SLACK_MS: Final = 1000.0


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TimingPolicy:
    """How a candidate is timed (validated by :class:`pallas_tune.tuning.TuneOptions`).

    The first call is the correctness check and counts as the first of ``warmup`` untimed
    calls. Then timed runs follow until ``repeats`` are done and ``min_time_s`` has passed, or
    ``max_time_s`` of timed runs have passed (at least one run), or, as soon as the fastest of
    at least two runs is more than ``slow_factor`` times the best median so far, the candidate
    is recorded as ``slow`` with the runs seen (``None``: never cut)."""

    timer: str = "auto"
    warmup: int = 1
    repeats: int = 5
    min_time_s: float = 0.0
    max_time_s: float = 1.0
    slow_factor: float | None = 2.0

    def cutoff_ms(self, best_ms: float) -> float:
        if self.slow_factor is None or not math.isfinite(best_ms):
            return math.inf
        return self.slow_factor * best_ms


def resolve_timer(timer: str, platform: str | None = None) -> str:
    """``"auto"`` → ``"profiler"`` where a device measures (GPU, TPU), else ``"wallclock"``.

    On a GPU a kernel call's wall clock is dominated by dispatch for short kernels (softmax
    8192x4096 bf16 on an H100: 0.157 ms wall clock, 0.046 ms device time; see
    benchmarks/results/gpu_probe.txt), so device time is the figure to rank by there."""
    if timer != "auto":
        return timer
    return "profiler" if (platform or jax.default_backend()) in ("gpu", "tpu") else "wallclock"


# Relative tolerance (times max(1, max|reference|)) for the correctness gate, per output dtype.
_TOLERANCE = {
    "float64": 1e-7,
    "float32": 1e-3,
    "float16": 1e-2,
    "bfloat16": 2e-2,
}


def compare(out: Any, ref: Any) -> tuple[bool, float, str]:
    """Compares a candidate's output with the reference; returns (ok, max_abs_err, why)."""
    outs, refs = jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)
    if len(outs) != len(refs):
        return False, math.inf, f"output has {len(outs)} leaves, reference {len(refs)}"
    worst = 0.0
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        o, r = np.asarray(o), np.asarray(r)
        if o.shape != r.shape:
            return False, math.inf, f"output {i} has shape {o.shape}, reference {r.shape}"
        if np.issubdtype(o.dtype, np.integer) or o.dtype == np.bool_:
            bad = int(np.sum(o != r))
            if bad:
                return False, math.inf, f"output {i}: {bad} integer elements differ"
            continue
        o64, r64 = o.astype(np.float64), r.astype(np.float64)
        finite_ref = np.isfinite(r64)
        if not np.all(np.isfinite(o64) == finite_ref):
            n = int(np.sum(~np.isfinite(o64) & finite_ref))
            return False, math.inf, f"output {i}: {n} NaN/Inf values where the reference is finite"
        if not finite_ref.any():
            continue
        err = float(np.max(np.abs(o64 - r64)[finite_ref]))
        scale = max(1.0, float(np.max(np.abs(r64[finite_ref]))))
        tol = _TOLERANCE.get(str(o.dtype), 0.1) * scale
        worst = max(worst, err)
        if err > tol:
            return False, err, f"output {i}: max abs error {err:.3g} > tolerance {tol:.3g}"
    return True, worst, ""


def make_inputs(args: Sequence[Any], seed: int = 0) -> list[Any]:
    """Concrete arrays for ShapeDtypeStruct arguments (normal floats, zero ints); others as is."""
    key = jax.random.key(seed)
    out = []

    def conv(a: Any) -> Any:
        nonlocal key
        if not isinstance(a, jax.ShapeDtypeStruct):
            return a
        key, sub = jax.random.split(key)
        if jnp.issubdtype(a.dtype, jnp.floating):
            return jax.random.normal(sub, a.shape, jnp.float32).astype(a.dtype)
        return jnp.zeros(a.shape, a.dtype)

    for a in args:
        out.append(jax.tree_util.tree_map(conv, a))
    return out


def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if len(text) > 4000:
        text = text[:2000] + "\n...\n" + text[-2000:]
    return text


def _check(out: Any, reference: Any | None) -> tuple[bool, float | None, str]:
    if reference is not None:
        ok, err, why = compare(out, reference)
        return ok, err, why
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
    if any(np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)) for x in leaves):
        return False, None, "output holds NaN/Inf"
    return True, None, ""


def run_and_time(compiled: Callable[..., Any], args: Sequence[Any], *, reference: Any | None,
                 policy: TimingPolicy, best_ms: float = math.inf, compile_ms: float = math.nan,
                 event_regex: str | None = None
                 ) -> tuple[Outcome, Measurement | None, Any, str, float | None]:
    """Runs a compiled candidate once, checks its output, times it by ``policy``.

    Returns (outcome, measurement, output, error text, max_abs_err). ``best_ms`` is the best
    median so far (for the slow cut-off)."""
    try:
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        first_ms = (time.perf_counter() - t0) * 1e3
    except Exception as e:  # noqa: BLE001 - a candidate that fails to run is data.
        return Outcome.RUNTIME_ERROR, None, None, short_error(e), None
    ok, err, why = _check(out, reference)
    if not ok:
        return Outcome.MISMATCH, None, out, why, err
    cutoff = policy.cutoff_ms(best_ms)
    if first_ms > cutoff + FIRST_CALL_SLACK_MS:
        m = Measurement(times_ms=(first_ms,), compile_ms=compile_ms,
                        timer=f"{resolve_timer(policy.timer)} (first call only)")
        return (Outcome.SLOW, m, out, f"stopped after its first call, {first_ms:.4g} ms: over "
                f"{policy.slow_factor:g}x the best so far ({best_ms:.4g} ms)", err)
    try:
        if first_ms <= cutoff:  # Already slower than the cut-off: timed runs decide.
            for _ in range(max(0, policy.warmup - 1)):
                jax.block_until_ready(compiled(*args))
        times, timer = None, resolve_timer(policy.timer)
        if timer == "profiler":
            n = max(1, min(policy.repeats, int(policy.max_time_s * 1e3 / max(first_ms, 1e-3))))
            times = profile_device_times(compiled, args, n, event_regex)
            timer = "profiler" if times else "wallclock (profiler saw no device events)"
        if not times:
            times = time_calls(lambda: jax.block_until_ready(compiled(*args)), policy, cutoff)
    except Exception as e:  # noqa: BLE001
        return Outcome.RUNTIME_ERROR, None, None, short_error(e), None
    m = Measurement(times_ms=tuple(times), compile_ms=compile_ms, timer=timer)
    if min(times) > cutoff:
        return (Outcome.SLOW, m, out, f"stopped after {len(times)} run(s): the fastest, "
                f"{min(times):.4g} ms, is over {policy.slow_factor:g}x the best so far "
                f"({best_ms:.4g} ms)", err)
    return Outcome.OK, m, out, "", err


def time_calls(call: Callable[[], Any], policy: TimingPolicy, cutoff_ms: float = math.inf
               ) -> list[float]:
    """Timed runs of ``call`` (which must block until done), in ms, by the policy's rules."""
    times: list[float] = []
    start = time.perf_counter()
    while True:
        t = time.perf_counter()
        call()
        now = time.perf_counter()
        times.append((now - t) * 1e3)
        elapsed = now - start
        if len(times) >= MAX_RUNS or elapsed >= policy.max_time_s:
            return times
        if min(times) > cutoff_ms and len(times) >= min(2, policy.repeats):
            return times  # Clearly slow: two runs (one noisy run proves nothing).
        if len(times) >= policy.repeats and elapsed >= policy.min_time_s:
            return times


def profile_device_times(compiled: Any, args: Sequence[Any], n: int,
                         event_regex: str | None) -> list[float] | None:
    """Per-call device time (ms) from an in-process profiler trace, or None without device events.

    Runs ``n`` calls under ``jax.profiler`` and sums, on every ``/device:`` plane, the events of
    its "XLA Ops" line (all lines if it has none) whose names match ``event_regex`` (e.g. the
    pallas_call names; default: every op), as tokamax's XprofProfileSession does on TPU. Events
    are split evenly into the ``n`` calls in start order.
    """
    import re
    import tempfile

    pattern = re.compile(event_regex) if event_regex else None
    with tempfile.TemporaryDirectory(prefix="pallas-tune-prof-") as d:
        jax.profiler.start_trace(d)
        try:
            for _ in range(n):
                jax.block_until_ready(compiled(*args))
        finally:
            data = jax.profiler.stop_trace()
        if data is None:  # Older JAX: read the xplane file.
            import glob

            from jax.profiler import ProfileData

            files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
            if not files:
                return None
            with open(files[0], "rb") as f:
                data = ProfileData.from_serialized_xspace(f.read())
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:") or "CUSTOM" in plane.name:
            continue
        lines = list(plane.lines)
        ops = [ln for ln in lines if ln.name == "XLA Ops"] or lines
        for line in ops:
            for ev in line.events:
                if pattern is None or pattern.search(ev.name):
                    events.append((ev.start_ns, ev.duration_ns))
    if not events or len(events) % n:
        return None
    events.sort()
    per_call = len(events) // n
    return [sum(d for _, d in events[i * per_call:(i + 1) * per_call]) / 1e6 for i in range(n)]


def interleave(executables: Sequence[Callable[..., Any]], args: Sequence[Any], rounds: int,
               *, timer: str = "auto") -> list[list[float]]:
    """Times executables interleaved (A B C A B C ...), ``rounds`` runs each after one warm-up,
    so that drift in clocks, thermals or host load hits every candidate alike. Returns ms.

    With the profiler timer (``"auto"`` on a GPU or TPU) each run is the median device time of
    3 calls under one trace, as in the search, so the winner is crowned by the same clock."""
    for c in executables:
        jax.block_until_ready(c(*args))
    profiled = resolve_timer(timer) == "profiler"
    times: list[list[float]] = [[] for _ in executables]
    for _ in range(rounds):
        for i, c in enumerate(executables):
            device = profile_device_times(c, args, 3, None) if profiled else None
            if device:
                times[i].append(statistics.median(device))
                continue
            t = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[i].append((time.perf_counter() - t) * 1e3)
    return times


def compile_candidate(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                      *, interpret: bool) -> tuple[Any, float]:
    """(compiled executable, or the exception that compiling raised; compile time in ms)."""
    from pallas_tune.chips import interpret_mode

    jitted = jax.jit(lambda *a: fn(*a, **kwargs))
    t0 = time.perf_counter()
    try:
        if interpret:
            with interpret_mode():
                compiled = jitted.lower(*args).compile()
        else:
            compiled = jitted.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is data.
        return e, (time.perf_counter() - t0) * 1e3
    return compiled, (time.perf_counter() - t0) * 1e3


def retime_interleaved(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                       configs: Sequence[Mapping[str, Any]], *, interpret: bool,
                       rounds: int = 5, timer: str = "auto") -> list[list[float]]:
    """Compiles ``fn`` for each config and times them interleaved (see :func:`interleave`)."""
    compiled = []
    for config in configs:
        executable, _ = compile_candidate(fn, args, {**kwargs, **config}, interpret=interpret)
        if isinstance(executable, BaseException):
            raise executable
        compiled.append(executable)
    return interleave(compiled, args, rounds, timer=timer)
