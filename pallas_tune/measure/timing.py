"""Measuring one candidate: compile, run, check against a reference, time.

Every trial ends in one :class:`Outcome`. Timings here are wall clock around
``block_until_ready`` after a warm-up; on the CPU (interpret mode) they track grid steps and
interpreter overhead, not TPU behaviour, and are labelled so in every record.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Measurement", "Outcome", "TrialRecord", "compare", "make_inputs", "measure"]


class Outcome(str, enum.Enum):
    OK = "ok"
    INFEASIBLE = "infeasible"
    COMPILE_ERROR = "compile_error"
    RUNTIME_ERROR = "runtime_error"
    TIMEOUT = "timeout"
    MISMATCH = "mismatch"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Measurement:
    times_ms: tuple[float, ...]
    compile_ms: float
    timer: str = "wallclock"  # What produced times_ms (a profiler timer may fall back).

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.inf

    @property
    def spread_ms(self) -> float:
        """Interquartile range of the timed runs (0 with fewer than 4 runs)."""
        if len(self.times_ms) < 4:
            return 0.0
        q = statistics.quantiles(self.times_ms, n=4)
        return q[2] - q[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TrialRecord:
    number: int
    config: dict[str, Any]
    outcome: Outcome
    measurement: Measurement | None = None
    error: str = ""
    max_abs_err: float | None = None
    detail: str = ""  # Failure kind, e.g. vmem_scoped_oom, block_rule, smem_oom.
    vmem_bytes: int | None = None  # Model (or compiler) VMEM figure, where known.
    cycles: int | None = None  # Compiler cycle estimate (tpu-estimate timer).

    @property
    def median_ms(self) -> float:
        return self.measurement.median_ms if self.measurement else math.inf

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "number": self.number,
            "config": self.config,
            "outcome": self.outcome.value,
        }
        if self.measurement is not None:
            out["median_ms"] = self.measurement.median_ms
            out["spread_ms"] = self.measurement.spread_ms
            out["times_ms"] = list(self.measurement.times_ms)
            out["compile_ms"] = self.measurement.compile_ms
            out["timer"] = self.measurement.timer
        if self.max_abs_err is not None:
            out["max_abs_err"] = self.max_abs_err
        if self.error:
            out["error"] = self.error
        if self.detail:
            out["detail"] = self.detail
        if self.vmem_bytes is not None:
            out["vmem_bytes"] = self.vmem_bytes
        if self.cycles is not None:
            out["estimated_cycles"] = self.cycles
        return out


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


def _short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    if len(text) > 4000:
        text = text[:2000] + "\n...\n" + text[-2000:]
    return text


def measure(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    interpret: bool,
    reference_out: Any | None,
    warmup: int = 1,
    repeats: int = 5,
    min_time_s: float = 0.0,
    precompiled: tuple[Any, float] | None = None,
    timer: str = "wallclock",
    event_regex: str | None = None,
) -> tuple[Outcome, Measurement | None, Any, str, float | None]:
    """Compiles (unless ``precompiled`` = (executable or exception, compile ms)) and times
    ``fn(*args, **kwargs)``.

    Returns (outcome, measurement, output, error text, max_abs_err).
    """
    compiled, compile_ms = precompiled if precompiled is not None else compile_candidate(
        fn, args, kwargs, interpret=interpret)
    if isinstance(compiled, BaseException):
        text = _short_error(compiled)
        from pallas_tune.feasibility.compile import OOM_KINDS, classify_error

        kind = classify_error(text)
        outcome = Outcome.INFEASIBLE if kind in OOM_KINDS else Outcome.COMPILE_ERROR
        return outcome, None, None, f"[{kind}] {text}", None
    try:
        out = jax.block_until_ready(compiled(*args))
        for _ in range(max(0, warmup - 1)):
            jax.block_until_ready(compiled(*args))
    except Exception as e:  # noqa: BLE001
        return Outcome.RUNTIME_ERROR, None, None, _short_error(e), None
    err = None
    if reference_out is not None:
        ok, err, why = compare(out, reference_out)
        if not ok:
            return Outcome.MISMATCH, None, out, why, err
    else:
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(out)]
        if any(np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)) for x in leaves):
            return Outcome.MISMATCH, None, out, "output holds NaN/Inf", None
    if timer == "profiler":
        try:
            device_times = profile_device_times(compiled, args, repeats, event_regex)
        except Exception as e:  # noqa: BLE001
            return Outcome.RUNTIME_ERROR, None, None, _short_error(e), None
        if device_times:
            return (Outcome.OK, Measurement(times_ms=tuple(device_times), compile_ms=compile_ms,
                                            timer="profiler"), out, "", err)
        timer = "wallclock (profiler saw no device events)"
    times = []
    start = time.perf_counter()
    try:
        while len(times) < repeats or (time.perf_counter() - start) < min_time_s:
            t = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append((time.perf_counter() - t) * 1e3)
            if len(times) >= 1000:
                break
    except Exception as e:  # noqa: BLE001
        return Outcome.RUNTIME_ERROR, None, None, _short_error(e), None
    return (Outcome.OK, Measurement(times_ms=tuple(times), compile_ms=compile_ms, timer=timer),
            out, "", err)


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


def compile_candidate(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                      *, interpret: bool) -> tuple[Any, float]:
    """(compiled executable, or the exception that compiling raised; compile time in ms).
    Thread-safe: XLA compiles release the GIL, so a batch can compile concurrently."""
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
                       rounds: int = 5) -> list[list[float]]:
    """Times the given configs interleaved (A B C A B C ...), ``rounds`` runs each, so that
    drift in clocks, thermals or host load hits every candidate alike. Returns ms per config."""
    compiled = []
    for config in configs:
        executable, _ = compile_candidate(fn, args, {**kwargs, **config}, interpret=interpret)
        if isinstance(executable, BaseException):
            raise executable
        compiled.append(executable)
    for c in compiled:  # Warm up each once more.
        jax.block_until_ready(c(*args))
    times: list[list[float]] = [[] for _ in compiled]
    for _ in range(rounds):
        for i, c in enumerate(compiled):
            t = time.perf_counter()
            jax.block_until_ready(c(*args))
            times[i].append((time.perf_counter() - t) * 1e3)
    return times
