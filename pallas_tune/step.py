"""The whole step's time, under three settings: every tunable call at its default config, at
the configs of an :class:`~pallas_tune.program.AutotuneResult`, and XLA (its reference)
wherever a kernel has one.

Measured (:func:`wall_clock`): the jitted step run on this host, median of five runs.

Estimated (:func:`estimates`, for ``timer="tpu-estimate"``): the step is traced and exported
for TPU in this process under :func:`pallas_tune.target` (each setting's configs applied,
nothing run, no libtpu loaded here), and the exported program compiled deviceless for the chip
in a worker of :class:`~pallas_tune.measure.estimate.Estimator`, where libtpu's static profile
annotates every compiled op. The step's figure is the sum of every op's estimate (Pallas
kernels and XLA fusions alike) at the chip's clock: a compiler ESTIMATE, not a measurement.
Ops the compiler reports with no estimate (0 cycles) are counted and the figure is then
``partial``: a lower bound. Kernels looping over run-time lengths are counted too (libtpu
counts such a loop as a fixed guess).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune import chips
from pallas_tune.config import Config
from pallas_tune.tunable import resolution_hook

__all__ = ["composed", "estimates", "settings", "wall_clock"]

SETTINGS = ("default", "tuned", "xla")


def settings(result: Any) -> dict[str, Any]:
    """The three settings, as context managers applying them (each entered once)."""
    from pallas_tune.tuning.finish import default_config

    def defaults(kernel: Any, a: Any, kw: Any) -> Config | None:
        first = default_config(kernel.space)
        return Config(first, source="default") if first is not None else None

    def xla(kernel: Any, a: Any, kw: Any) -> Config | None:
        if kernel.reference is None:
            return None
        first = default_config(kernel.space)
        return Config(first or {}, source="default", implementation="xla")

    return {"default": resolution_hook(defaults), "tuned": result, "xla": resolution_hook(xla)}


def wall_clock(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
               result: Any) -> tuple[dict[str, float], str]:
    """Median wall time of the jitted step under each setting, traced afresh for each."""
    import jax

    def run(ctx: Any) -> float:
        real = [_concrete(a) for a in args]
        with ctx:
            jax.clear_caches()
            step = jax.jit(lambda *a: fn(*a, **kwargs))
            jax.block_until_ready(step(*real))
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                jax.block_until_ready(step(*real))
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    out = {name: run(ctx) for name, ctx in settings(result).items()}
    timer = ("wall clock (interpret mode on CPU: grid steps, not TPU speed)"
             if chips.should_interpret() else "wall clock")
    return out, timer


def _concrete(a: Any) -> Any:
    """Random inputs for an abstract argument (concrete ones as they are)."""
    import jax

    if isinstance(a, jax.ShapeDtypeStruct):
        import jax.numpy as jnp

        if jnp.issubdtype(a.dtype, jnp.floating):
            return jax.random.normal(jax.random.PRNGKey(0), a.shape, a.dtype)
        return jnp.zeros(a.shape, a.dtype)
    return a


def call_exported(*arrays: Any, exported: bytes) -> Any:
    """Runs (here: is compiled as) a step exported by :func:`_export`; a worker imports it."""
    import pickle

    return pickle.loads(exported).call(*arrays)


def _export(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], chip: str,
            ctx: Any) -> tuple[bytes, list[Any], int]:
    """The step under ``ctx``, exported for TPU and pickled; its array arguments; and how many
    loops inside its Pallas kernels have a run-time trip count."""
    import pickle

    import jax
    from jax import export

    from pallas_tune.feasibility.inspect import array_function
    from pallas_tune.measure.loops import data_dependent_loops

    flat_fn, arrays = array_function(fn, args, kwargs)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    with chips.target(chip, abstract_mesh=True), ctx:
        jax.clear_caches()  # Traced afresh: the configs in force now, not a cached trace's.
        loops = data_dependent_loops(flat_fn, specs, {}, chip=chip)
        exp = export.export(jax.jit(flat_fn), platforms=("tpu",))(*specs)
    # The VJP closure cannot cross a pipe and is not needed to compile the forward program.
    return pickle.dumps(dataclasses.replace(exp, _get_vjp=None)), specs, loops


def estimates(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
              result: Any, chip: str, *, workers: int = 1, only: Sequence[str] = SETTINGS,
              memory_limit_bytes: int | None = -1
              ) -> tuple[dict[str, float], str, dict[str, Any]]:
    """The step's compiler estimate (ms) under each setting (``only`` those named), the timer's
    label, and per setting the cycles, ops without an estimate, kernel loops with run-time
    bounds and compile time (see the module docstring). A setting whose compile fails (or whose
    worker dies, e.g. at ``memory_limit_bytes``: the LLO profile of many grid steps is large)
    has no figure and its error."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.measure.estimate import Estimator, cycles_to_ms

    spec = chip_spec(chip)
    blobs, specs, loops = {}, [], {}
    for name, ctx in settings(result).items():
        if name not in only:
            continue
        blobs[name], specs, loops[name] = _export(fn, args, kwargs, chip, ctx)
    with Estimator(workers, memory_limit_bytes=memory_limit_bytes) as est:
        replies = est.map(call_exported, specs, {}, [{"exported": b} for b in blobs.values()],
                          spec.name, standin=False)
    out: dict[str, float] = {}
    detail: dict[str, Any] = {}
    for name, r in zip(blobs, replies, strict=True):
        if not r.ok or r.cycles is None:
            detail[name] = {"error": (r.message or r.kind)[:500]}
            continue
        out[name] = cycles_to_ms(r.cycles, spec.clock_hz)
        detail[name] = {"cycles": r.cycles, "ops_without_estimate": r.ops_without_estimate,
                        "partial": bool(r.ops_without_estimate or loops[name]),
                        "dynamic_loops": loops[name], "compile_s": round(r.compile_s, 2)}
    partial = [n for n, d in detail.items() if d.get("partial")]
    timer = (f"tpu-estimate: {spec.name} compiler ESTIMATE of the whole step (every op's static "
             f"estimate summed, at {spec.clock_hz / 1e9:g} GHz), not a measurement"
             + (f"; partial (a lower bound) for {', '.join(partial)}" if partial else ""))
    return out, timer, detail


def composed(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
             result: Any, chip: str, *, workers: int = 1, only: Sequence[str] = SETTINGS,
             memory_limit_bytes: int | None = -1
             ) -> tuple[dict[str, float], str, dict[str, Any]]:
    """The step's compiler estimate (ms) per setting, composed for steps too large to compile
    whole on this host (:mod:`pallas_tune.glue`): the glue (every tunable call stubbed)
    compiled whole, then, per setting and distinct call, the glue with that call's kernel (or
    XLA) put back. A call's figure is what putting it back adds to the glue's estimate, in the
    program's own layouts and memory placement; the step's figure is the glue's plus every
    call's. Calls a call's real form makes disappear (the backward kernel of a forward that
    runs XLA: XLA's autodiff replaces it) are counted in it, not again. Each compile holds one
    call's kernel, not all of them. Returns the figures, the timer's label and the detail (the
    glue's and each call's cycles per setting); a setting missing a figure has none, with the
    compile's error. Interactions between two calls (XLA fusing one into the next, a buffer
    kept in VMEM between them) are not modelled."""
    import warnings

    from pallas_tune import glue
    from pallas_tune.chips import chip_spec
    from pallas_tune.errors import PallasTuneWarning
    from pallas_tune.feasibility.inspect import array_function
    from pallas_tune.measure.estimate import Estimator, cycles_to_ms

    import jax

    spec = chip_spec(chip)
    flat_fn, arrays = array_function(fn, args, kwargs)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]

    def variant(name: str | None, real: tuple[str, str] | None) -> tuple[Any, list[Any]]:
        with chips.target(chip, abstract_mesh=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", PallasTuneWarning)  # Misses: the settings decide.
            with settings(result)[name] if name else _null():
                met, stubs = glue.record(flat_fn, specs, real)
            try:  # _export clears JAX's trace caches first; nothing stubbed stays there.
                blob, g_specs, loops = _export(glue.glue_function(flat_fn, real), specs, {},
                                               chip, settings(result)[name] if name else _null())
            finally:
                jax.clear_caches()
        return (blob, g_specs, loops, stubs), met

    (base, calls) = variant(None, None)
    with Estimator(workers, memory_limit_bytes=memory_limit_bytes) as est:
        def estimate(job: Any) -> Any:  # The stubs are the ops without an estimate expected.
            blob, g_specs, _, stubs = job
            r = est.map(call_exported, g_specs, {}, [{"exported": blob}], spec.name,
                        standin=False)[0]
            return dataclasses.replace(r, ops_without_estimate=max(
                0, r.ops_without_estimate - stubs)) if r.ok else r

        glue_reply = estimate(base)
        if not glue_reply.ok or glue_reply.cycles is None:
            return {}, "", {"glue": {"error": (glue_reply.message or glue_reply.kind)[:500]}}
        detail: dict[str, Any] = {"glue": _figure(glue_reply, base[2], spec.clock_hz),
                                  "calls": [{"kernel": c.kernel.name, "key": c.key,
                                             "count": c.count} for c in calls]}
        out: dict[str, float] = {}
        for name in only:
            total, partial, absorbed, per = glue_reply.cycles, bool(
                glue_reply.ops_without_estimate or base[2]), set(), []
            for c in calls:
                if (c.kernel.name, c.key) in absorbed:
                    per.append({"absorbed": True})
                    continue
                job, met = variant(name, (c.kernel.name, c.key))
                absorbed |= ({(x.kernel.name, x.key) for x in calls}
                             - {(x.kernel.name, x.key) for x in met})
                r = estimate(job)
                if not r.ok or r.cycles is None:
                    per.append({"error": (r.message or r.kind)[:300]})
                    total = None
                    continue
                per.append(_figure(r, job[2], spec.clock_hz, minus=glue_reply.cycles))
                partial = partial or per[-1]["partial"]
                if total is not None:
                    total += r.cycles - glue_reply.cycles
            detail[name] = {"partial": partial, "calls": per}
            if total is not None:
                out[name] = cycles_to_ms(total, spec.clock_hz)
    timer = (f"tpu-estimate, composed: {spec.name} compiler ESTIMATES (static profiles of "
             "deviceless compiles, every op summed) of the step's glue, plus what each tunable "
             "call adds to it, compiled one call at a time, at "
             f"{spec.clock_hz / 1e9:g} GHz; not a measurement")
    return out, timer, detail


def _null() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _figure(r: Any, loops: int, clock_hz: float, minus: int = 0) -> dict[str, Any]:
    from pallas_tune.measure.estimate import cycles_to_ms

    return {"ms": cycles_to_ms(r.cycles - minus, clock_hz), "cycles": r.cycles - minus,
            "ops_without_estimate": r.ops_without_estimate, "dynamic_loops": loops,
            "partial": bool(r.ops_without_estimate or loops),
            "compile_s": round(r.compile_s, 2)}
