"""The whole step's time, under three settings: every tunable call at its default config, at
the configs of an :class:`~pallas_tune.step.result.AutotuneResult`, and XLA (its reference)
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
counts such a loop as a fixed guess), and kernels whose input fetches follow a prefetched
table no grid axis moves (:class:`pallas_tune.measure.loops.Census`).

Composed (:func:`composed`): where the whole step is too large to compile on this host, its
glue plus each call, in three tiers: the call put back into the glue; where that program
fails, the call as a program of its own (``standalone``); where that fails too, the kernel's
stand-in, scaled (``standin_scale``). Each figure says which tier it came from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune import chips
from pallas_tune.config import Config
from pallas_tune.runtime.tunable import resolution_hook

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
               result: Any, rounds: int = 7) -> tuple[dict[str, float], str]:
    """Median wall time of the jitted step under each setting: each traced and compiled under
    its setting, then all timed interleaved, round by round (default, tuned, XLA, default, ...),
    so that a loaded host's drift hits all alike. The timer says where the tuned step is not
    clearly ahead of the default's (:func:`pallas_tune.tuning.noise.ahead`)."""
    import jax

    from pallas_tune.tuning import noise

    real = [_concrete(a) for a in args]
    compiled = {}
    for name, ctx in settings(result).items():
        with ctx:
            jax.clear_caches()
            compiled[name] = jax.jit(lambda *a: fn(*a, **kwargs)).lower(*real).compile()
            jax.block_until_ready(compiled[name](*real))  # Warm.
    times: dict[str, list[float]] = {name: [] for name in compiled}
    for _ in range(rounds):
        for name, step in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(*real))
            times[name].append((time.perf_counter() - t0) * 1e3)
    out = {name: statistics.median(t) for name, t in times.items()}
    timer = ("wall clock (interpret mode on CPU: grid steps, not TPU speed)"
             if chips.should_interpret() else "wall clock")
    if not noise.ahead(times["tuned"], times["default"]):
        timer += ("; the tuned step is not clearly faster than the default's in these "
                  f"{rounds} interleaved rounds")
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
            ctx: Any) -> tuple[bytes, list[Any], Any]:
    """The step under ``ctx``, exported for TPU and pickled; its array arguments; and what its
    Pallas kernels hide from a static estimate (:class:`pallas_tune.measure.loops.Census`)."""
    import pickle

    import jax
    from jax import export

    from pallas_tune.feasibility.inspect import array_function
    from pallas_tune.measure.loops import kernel_census

    flat_fn, arrays = array_function(fn, args, kwargs)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    with chips.target(chip, abstract_mesh=True), ctx:
        jax.clear_caches()  # Traced afresh: the configs in force now, not a cached trace's.
        census = kernel_census(flat_fn, specs, {}, chip=chip)
        exp = export.export(jax.jit(flat_fn), platforms=("tpu",))(*specs)
    # The VJP closure cannot cross a pipe and is not needed to compile the forward program.
    return pickle.dumps(dataclasses.replace(exp, _get_vjp=None)), specs, census


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
        detail[name] = {"cycles": r.cycles, "compile_s": round(r.compile_s, 2),
                        **_unmodelled(r, loops[name])}
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
    whole on this host (:mod:`pallas_tune.step.glue`): the glue (every tunable call stubbed)
    compiled once, plus each distinct call compiled alone under the setting (its inputs and
    results made and taken by stubs inside the program, so placed as intermediates), times the
    number of its occurrences the step uses. A call whose real form makes others disappear (a
    forward running XLA under ``jax.grad``: XLA's autodiff replaces its backward kernel) is
    compiled with its VJP and the others are not counted. Returns the figures, the timer's
    label and the detail (the glue's and each call's figures per setting); a setting missing
    one has none, with the compile's error. What happens between two calls (XLA fusing one into
    the next, a buffer kept in VMEM from one to the next) is not modelled."""
    import warnings

    import jax

    from pallas_tune.chips import chip_spec
    from pallas_tune.errors import PallasTuneWarning
    from pallas_tune.feasibility.inspect import array_function
    from pallas_tune.measure.estimate import Estimator, cycles_to_ms
    from pallas_tune.measure.loops import Census
    from pallas_tune.step import glue

    spec = chip_spec(chip)
    flat_fn, arrays = array_function(fn, args, kwargs)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]

    def traced(name: str | None, what: Callable[[], Any]) -> Any:
        with chips.target(chip, abstract_mesh=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", PallasTuneWarning)  # Misses: the settings decide.
            try:
                with settings(result)[name] if name else contextlib.nullcontext():
                    return what()
            finally:
                jax.clear_caches()  # Nothing stubbed or set stays in JAX's trace caches.

    calls, n_stubs = traced(None, lambda: glue.record(flat_fn, specs))
    live = traced(None, lambda: glue.live_counts(flat_fn, specs, calls))
    everything = {(c.kernel.name, c.key) for c in calls}

    def absorbed_by(c: Any, name: str) -> set[Any]:  # Calls gone when ``c`` runs as set.
        met, _ = traced(name, lambda: glue.record(flat_fn, specs, (c.kernel.name, c.key)))
        return everything - {(x.kernel.name, x.key) for x in met}

    with (Estimator(workers, memory_limit_bytes=memory_limit_bytes) as est,
          Estimator(workers, memory_limit_bytes=memory_limit_bytes, profile=False) as plain):
        def estimate(g: Callable[..., Any], g_specs: list[Any], stubs: int,
                     profiled: bool = True) -> Any:
            blob, g_specs, loops = _export(g, g_specs, {}, chip, contextlib.nullcontext())
            r = (est if profiled else plain).map(  # The stubs: ops expected without one.
                call_exported, g_specs, {}, [{"exported": blob}], spec.name, standin=False)[0]
            return dataclasses.replace(r, ops_without_estimate=max(
                0, r.ops_without_estimate - stubs)) if r.ok else r, loops

        def standalone(c: Any, config: Any, standin: bool = False) -> Any:  # Its own program.
            xla = config.implementation == "xla"
            return est.map(c.kernel.reference if xla else c.kernel, list(c.args), c.kwargs,
                           [{} if xla else dict(config)], spec.name, standin=standin)[0], Census()

        glue_fig = traced(None, lambda: _glue_figure(
            estimate, glue.glue_function(flat_fn), specs, n_stubs, spec.clock_hz))
        if "cycles" not in glue_fig:
            return {}, "", {"glue": glue_fig}
        detail: dict[str, Any] = {"glue": glue_fig, "calls": [
            {"kernel": c.kernel.name, "key": c.key, "count": c.count, "live": n}
            for c, n in zip(calls, live, strict=True)]}
        out: dict[str, float] = {}
        done: dict[Any, Any] = {}  # Programs compiled alone, by call, implementation, config.
        live_of = {(c.kernel.name, c.key): n for c, n in zip(calls, live, strict=True)}
        for name in only:
            gone = {(c.kernel.name, c.key): absorbed_by(c, name) for c in calls}
            absorbed = set().union(*gone.values())
            per = [{"absorbed": True} if (c.kernel.name, c.key) in absorbed else _alone(
                c, n, gone[(c.kernel.name, c.key)], name, traced, (estimate, standalone),
                spec.clock_hz, done, live_of, spec.bf16_flops)
                for c, n in zip(calls, live, strict=True)]
            figures = [r for r in per if "absorbed" not in r]
            detail[name] = {"calls": per, "partial": bool(
                detail["glue"]["partial"] or any(r.get("partial") for r in figures)),
                "standalone": sum(bool(r.get("standalone")) for r in figures),
                "standin": sum(bool(r.get("standin_scale")) for r in figures),
                "footing": sum(bool(r.get("footing")) for r in figures)}
            if all("cycles" in r for r in figures):
                total = glue_fig["cycles"] + sum(r["live"] * r["cycles"] for r in figures)
                out[name] = cycles_to_ms(total, spec.clock_hz)
    timer = (f"tpu-estimate, composed: {spec.name} compiler ESTIMATES (static profiles of "
             "deviceless compiles, every op summed) of the step's glue plus each tunable call "
             f"compiled alone, times its occurrences, at {spec.clock_hz / 1e9:g} GHz; "
             "not a measurement")
    return out, timer, detail


# One program of a layer's step (its glue, or one call) on XLA's cost model above this is the
# model's failure, not a figure: Mixtral's TP8 layer at 4096 tokens got 1.3e13 ms for its glue.
MODEL_CEILING_MS = 1000.0


def _incredible(fig: dict[str, Any]) -> str:
    return (f"XLA's cost model gives it {fig['ms']:.4g} ms, past {MODEL_CEILING_MS:g} ms: not "
            "credible, so no figure")


def _glue_figure(estimate: Callable[..., Any], glue_fn: Callable[..., Any], specs: list[Any],
                 stubs: int, clock_hz: float) -> dict[str, Any]:
    """The glue's figure: libtpu's profile of it, or where that dies (seen: Llama-3.1-8B's
    layer at 4096 tokens passed 24 GB in libtpu's profiler, where at 8192 it took 7.4 GB), the
    glue compiled again unprofiled, on XLA's cost model at the footing as an XLA call whose
    profile died (``model_only``, with the error). Every setting counts the same glue, so it
    shifts them alike and dilutes their ratios (at 8192 tokens, where both exist, the model at
    the footing read 3.3x the profile). ``{"error": ...}`` where neither gives a figure, or the
    model's is past :data:`MODEL_CEILING_MS`."""
    reply, loops = estimate(glue_fn, specs, stubs)
    if reply.ok and reply.cycles is not None:
        return _figure(reply, loops, clock_hz)
    error = (reply.message or reply.kind)[:500]
    plain, _ = estimate(glue_fn, specs, stubs, profiled=False)
    if not plain.model_cycles:
        return {"error": error}
    fig = _model_figure(plain, clock_hz)
    if fig["ms"] > MODEL_CEILING_MS:  # Seen: Mixtral's MoE glue (sort, gather, scatter).
        return {"error": f"{error}; {_incredible(fig)}"}
    return {**fig, "profile_error": error}


def _alone(call: Any, live: int, absorbs: set[Any], name: str, traced: Callable[..., Any],
           estimators: tuple[Callable[..., Any], Callable[..., Any]], clock_hz: float,
           done: dict[Any, Any], live_of: Mapping[Any, int], peak_flops: float = 0.0
           ) -> dict[str, Any]:
    """One call's figure under setting ``name``, compiled alone (see :func:`composed`); a
    program compiled under another setting (the same config, or XLA twice) is not again.

    A call compiled with its VJP (it ``absorbs`` backward calls) counts as often as the most
    used of it and them: under ``jax.grad`` the last forward of a step is dead (only the
    gradient is returned) while its backward is live, and its program then leaves the forward's
    results untaken, as the step does.

    Where that program fails to compile (libtpu's static profile dies on some programs of
    stubs and kernels that compile and profile as a program of their own: seen, libtpu 0.0.50,
    flash_attention_bwd at 512 tokens), a call without a VJP is estimated as its own program,
    its inputs parameters, and the figure says so (``standalone``, with the error). An XLA
    program whose profiled compile dies is compiled again without the profile and takes XLA's
    cost model at the footing (``model_only``, with the error)."""
    from pallas_tune.step import glue

    estimate, standalone = estimators
    config = traced(name, lambda: call.kernel.config_for(*call.args, **call.kwargs))
    xla = config.implementation == "xla"  # The reference: the same program at any config.
    forward = live > 0
    if absorbs:
        live = max(live, *(live_of.get(a, 0) for a in absorbs))
    mark = (call.kernel.name, call.key, xla, () if xla else tuple(sorted(config.items())),
            bool(absorbs), forward)
    if mark not in done:
        program = glue.alone(call, grad=bool(absorbs), forward=forward)
        done[mark] = traced(name, lambda: estimate(*program))
        done[(*mark, "program")] = program
    r, loops = done[mark]
    row: dict[str, Any] = {"live": live, "absorbs": sorted(absorbs),
                           **({} if forward else {"forward_dead": True})}
    if r.ok and r.cycles is not None:
        return {**row, **_figure(r, loops, clock_hz, xla)}
    error = (r.message or r.kind)[:300]
    if xla:  # Died profiled (seen: attention and the MLP dots at 8192 tokens, out of memory).
        if (*mark, "model") not in done:
            done[(*mark, "model")] = traced(name, lambda: estimate(
                *done[(*mark, "program")], profiled=False))
        plain, _ = done[(*mark, "model")]
        if plain.model_cycles:  # Unprofiled: no cycles of libtpu's (not ok), the model's.
            floor = traced(name, lambda: _dots_floor_cycles(done[(*mark, "program")],
                                                            peak_flops / clock_hz))
            fig = _model_figure(plain, clock_hz, floor)
            if fig["ms"] <= MODEL_CEILING_MS:
                return {**row, **fig, "profile_error": error}
            error = f"{error}; {_incredible(fig)}"
    if absorbs:
        return {**row, "error": error}
    if (*mark, "standalone") not in done:
        done[(*mark, "standalone")] = traced(name, lambda: standalone(call, config))
    r, loops = done[(*mark, "standalone")]
    how: dict[str, Any] = {"standalone": True}
    if (not r.ok or r.cycles is None) and not xla and call.kernel.standin is not None:
        # The whole call's profile died too (seen: 53,760 grid steps of 128 tiles past an 18
        # GB worker): the kernel's stand-in (fewer parallel tiles, the same tiles), scaled, as
        # the tuner estimates its candidates.
        if (*mark, "standin") not in done:
            done[(*mark, "standin")] = traced(name, lambda: standalone(call, config, True))
        r, loops = done[(*mark, "standin")]
        how["standin_scale"] = round(r.scale, 4)
    if not r.ok or r.cycles is None:
        return {**row, "error": error}
    return {**row, **_figure(r, loops, clock_hz, xla), **how, "in_step_error": error}


def _figure(r: Any, census: Any, clock_hz: float, xla: bool = False) -> dict[str, Any]:
    """A compile's figure. For XLA's program (``xla``) where libtpu's sum is partial (ops it
    gave 0 cycles: on attention 0.18-0.28x the chip's time), XLA's cost model at the Pallas
    estimate's footing (:mod:`pallas_tune.tuning.footing`) where that is higher, labelled
    ``footing`` with both figures: the footing the tuner's XLA decision uses."""
    from pallas_tune.measure.estimate import cycles_to_ms

    fig = {"ms": cycles_to_ms(r.cycles, clock_hz), "cycles": r.cycles,
           "compile_s": round(r.compile_s, 2), **_unmodelled(r, census)}
    if xla and r.ops_without_estimate and r.model_cycles:
        from pallas_tune.tuning.footing import on_footing

        footed = int(round(on_footing(r.model_cycles)))
        if footed > r.cycles:
            fig.update(libtpu_ms=fig["ms"], model_ms=cycles_to_ms(r.model_cycles, clock_hz),
                       ms=cycles_to_ms(footed, clock_hz), cycles=footed,
                       footing=True, partial=bool(census.loops or census.blind_inputs))
    return fig


def _dots_floor_cycles(program: tuple[Any, ...], flops_per_cycle: float) -> int:
    """The cycles of a program's dots at the MXU's peak (0 without a peak): no implementation
    is faster (:func:`pallas_tune.tuning.footing.data_floor_ms`'s dots). Only the dots its
    results need: a dead forward's dot (the last matmul under ``jax.grad``, whose VJP needs
    only its inputs and the cotangent) is left out, as XLA leaves it out."""
    import jax
    from jax._src.interpreters import partial_eval as pe

    from pallas_tune.measure.loops import floor_flops

    if not flops_per_cycle:
        return 0
    g, specs, _ = program
    jaxpr = jax.make_jaxpr(g)(*specs).jaxpr
    live, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
    return int(floor_flops(live) / flops_per_cycle)


def _model_figure(r: Any, clock_hz: float, floor_cycles: int = 0) -> dict[str, Any]:
    """XLA's program whose profiled compile died, compiled again without libtpu's profile: its
    cost model at the Pallas estimate's footing (:mod:`pallas_tune.tuning.footing`), the
    figure the tuner's XLA decision uses there too, and never below its dots at the MXU's peak
    (the footing's bias was measured on attention; on a dot the model is the peak itself);
    labelled ``footing`` and ``model_only`` (``floored`` where the floor decides)."""
    from pallas_tune.measure.estimate import cycles_to_ms
    from pallas_tune.tuning.footing import on_footing

    footed = int(round(on_footing(r.model_cycles)))
    cycles = max(footed, floor_cycles)
    return {"ms": cycles_to_ms(cycles, clock_hz), "cycles": cycles,
            "model_ms": cycles_to_ms(r.model_cycles, clock_hz), "libtpu_ms": None,
            "footing": True, "model_only": True, "partial": False,
            **({"floored": True, "floor_ms": cycles_to_ms(floor_cycles, clock_hz)}
               if floor_cycles > footed else {}),
            "compile_s": round(r.compile_s, 2)}


def _unmodelled(r: Any, census: Any) -> dict[str, Any]:
    """What an estimate leaves out: ops with no estimate, kernel loops with a run-time trip
    count, input blocks fetched by a table the profile takes as 0 (``blind_fetches``); any of
    them makes the figure ``partial``, a lower bound."""
    return {"ops_without_estimate": r.ops_without_estimate, "dynamic_loops": census.loops,
            "blind_fetches": len(census.blind_inputs),
            "partial": bool(r.ops_without_estimate or census.loops or census.blind_inputs)}
