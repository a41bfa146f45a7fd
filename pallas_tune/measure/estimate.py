"""The ``tpu-estimate`` timer: the TPU compiler's own static cycle estimate, on a CPU host.

With ``--xla_jf_dump_static_llo_profile_to=<dir>`` in ``LIBTPU_INIT_ARGS`` when libtpu loads, a
deviceless compile annotates each Pallas kernel's custom call with ``"estimated_cycles"``: the
whole kernel, every grid step, DMA/compute overlap modelled (notes/libtpu-static-cost.md). The
flag adds 1.4-4 ms of compile time per grid step and must be set before libtpu initialises, so
estimates run in worker processes of their own (spawned, each with its own dump directory and
``ALLOW_MULTIPLE_LIBTPU_LOAD=1``), in parallel, leaving the calling process's libtpu untouched.

Cost control: a kernel may declare ``standin=`` on ``@tunable``: a function returning a smaller
problem with the same tiles (fewer steps along parallel grid axes) and the factor to scale its
estimate by. The shipped kernels do; benchmarks/tpu_estimate.py checks the scaled figures
against full compiles.

Figures are compiler estimates converted with the chip's clock, never measurements; cache entries
written from them are of kind ``estimate`` and lose to any measured entry.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing
import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pallas_tune._refs import kernel_ref, load

__all__ = ["EstimateResult", "Estimator", "data_dependent_loops", "estimate_flag_missing_message"]

FLAG: Final = "--xla_jf_dump_static_llo_profile_to"


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EstimateResult:
    ok: bool
    kind: str  # "ok" or a compile failure kind (see _compile), or "no_estimate".
    cycles: int | None = None  # Scaled to the full problem.
    standin_cycles: int | None = None
    scale: float = 1.0
    compile_s: float = 0.0
    scoped_vmem_bytes: int | None = None
    message: str = ""
    ops_without_estimate: int = 0  # Compiled ops whose LLO estimate was 0 (not counted).
    model_cycles: int | None = None  # XLA's cost model, summed over fusions (XLA programs).


def _init_worker(memory_limit_bytes: int | None = None) -> None:
    if memory_limit_bytes:
        # A pathological compile (seen: a (2048, 2048) f32 attention tile at S=8192 grew past
        # 24 GB) must fail in its worker, not take down the host through the OOM killer.
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
    dump = tempfile.mkdtemp(prefix=f"pallas-tune-llo-{os.getpid()}-")
    args = os.environ.get("LIBTPU_INIT_ARGS", "")
    if FLAG not in args:
        os.environ["LIBTPU_INIT_ARGS"] = f"{args} {FLAG}={dump}".strip()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _to_specs(args: Any) -> Any:
    import jax

    def conv(a: Any) -> Any:
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return ("__array__", tuple(a.shape), str(a.dtype))
        return a

    return jax.tree_util.tree_map(conv, args)


def _from_specs(args: Any) -> Any:
    import jax

    def conv(a: Any) -> Any:
        if isinstance(a, tuple) and len(a) == 3 and a[0] == "__array__":
            return jax.ShapeDtypeStruct(a[1], a[2])
        return a

    return jax.tree_util.tree_map(conv, args, is_leaf=lambda x: isinstance(x, tuple)
                                  and len(x) == 3 and x[0] == "__array__")


def _job(ref: str, args: Any, kwargs: dict[str, Any], config: dict[str, Any], chip: str,
         use_standin: bool) -> EstimateResult:
    from pallas_tune.feasibility import compile as _compile

    kernel = load(ref)
    fn = getattr(kernel, "fn", kernel)
    args, kwargs = _from_specs(args), _from_specs(kwargs)
    scale = 1.0
    standin = getattr(kernel, "standin", None)
    if use_standin and standin is not None:
        args, kwargs, scale = standin(list(args), dict(kwargs), dict(config))
    loops = data_dependent_loops(fn, args, {**kwargs, **config}, chip=chip)
    if loops:
        return EstimateResult(ok=False, kind="no_estimate", scale=scale,
                              message=dynamic_loop_message(ref, loops))
    result = _compile.compile_deviceless(fn, args, {**kwargs, **config}, chip=chip)
    if not result.ok:
        return EstimateResult(ok=False, kind=result.kind, message=result.message,
                              compile_s=result.compile_s, scale=scale)
    if not result.estimated_cycles:
        return EstimateResult(ok=False, kind="no_estimate", compile_s=result.compile_s,
                              scale=scale, message=estimate_flag_missing_message())
    cycles = sum(result.estimated_cycles)
    return EstimateResult(ok=True, kind="ok", cycles=int(round(cycles * scale)),
                          standin_cycles=cycles, scale=scale, compile_s=result.compile_s,
                          scoped_vmem_bytes=result.scoped_vmem_bytes,
                          ops_without_estimate=sum(c == 0 for c in result.estimated_cycles),
                          model_cycles=int(round(sum(result.model_cycles) * scale))
                          if result.model_cycles else None)


def data_dependent_loops(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                         chip: str) -> int:
    """How many loops inside the Pallas kernels of ``fn(*args, **kwargs)`` have a trip count
    that is not static (``while`` in a kernel's jaxpr: ``lax.while_loop``, or ``fori_loop``
    over traced bounds, e.g. a length read from memory), outside the else branches of
    conditionals.

    libtpu's static profile cannot know such a trip count and counts a fixed guess whatever the
    data (libtpu 0.0.50.1: JAX's ragged paged attention over 2.1 GB of KV cache "estimated" at
    14 us), so an estimate of such a kernel would rank configs on made-up work.
    """
    import jax

    from pallas_tune import chips
    from pallas_tune.feasibility import inspect as _inspect

    def count(jaxpr: Any, inside: bool) -> int:
        n = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            n += inside and name == "while"
            if name == "pallas_call":
                subs = [eqn.params["jaxpr"]]
            elif name == "cond" and len(eqn.params["branches"]) == 2:
                # The profile follows the true branch of a data-dependent if (pl.when bodies
                # count as taken; a loop in an else branch changed nothing: JAX's paged
                # attention estimates identically with that loop removed).
                subs = [eqn.params["branches"][1]]
            else:
                subs = list(_inspect._subjaxprs(eqn.params))
            for sub in subs:
                n += count(getattr(sub, "jaxpr", sub), inside or name == "pallas_call")
        return n

    flat_fn, arrays = _inspect.array_function(fn, args, kwargs)
    with chips.target(chip, abstract_mesh=True):
        closed = jax.make_jaxpr(flat_fn)(*arrays)
    return count(closed.jaxpr, False)


def dynamic_loop_message(ref: str, loops: int) -> str:
    return (f"no static estimate for {ref}: its Pallas kernel has {loops} loop(s) whose trip "
            "count is only known at run time (while_loop, or fori_loop over values read from "
            "the inputs), and libtpu's static profile counts such a loop as a fixed guess, not "
            "by the data. Time it on a TPU (--timer wallclock), or use a config without such "
            "loops.")


def estimate_flag_missing_message() -> str:
    from importlib import metadata

    try:
        version = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        version = "not installed"
    return (f"libtpu {version} compiled the kernel but reported no \"estimated_cycles\" with "
            f"{FLAG}; the flag is internal to libtpu and may have changed. Pin libtpu 0.0.42-0.0.50 "
            "(tested), or allow the roofline fallback (tune(..., estimate_fallback='roofline')).")


def _default_memory_limit(workers: int) -> int | None:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    return max(4 << 30, total // (workers + 1))


class Estimator:
    """A pool of worker processes that compile candidates deviceless and return estimates.

    A worker that dies (a compiler abort, a memory limit) costs only its candidate: the pool is
    restarted, the other candidates are retried one at a time, and the culprit is recorded as a
    ``compile_error`` with detail ``worker_crashed``. Each worker's address space is capped
    (default: host memory / (workers + 1)) so one runaway compile cannot exhaust the host.
    """

    def __init__(self, workers: int = 2, *, memory_limit_bytes: int | None = -1):
        self.workers = max(1, workers)
        self._limit = (_default_memory_limit(self.workers) if memory_limit_bytes == -1
                       else memory_limit_bytes)
        self._pool = self._new_pool()

    def _new_pool(self) -> concurrent.futures.ProcessPoolExecutor:
        return concurrent.futures.ProcessPoolExecutor(
            max_workers=self.workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker, initargs=(self._limit,))

    def _restart(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._new_pool()

    def map(self, kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
            configs: Sequence[Mapping[str, Any]], chip: str, *, standin: bool = True
            ) -> list[EstimateResult]:
        ref = kernel_ref(kernel)
        a, k = _to_specs(list(args)), _to_specs(dict(kwargs))
        job = (ref, a, k)
        futures = [self._pool.submit(_job, *job, dict(c), chip, standin) for c in configs]
        out: list[EstimateResult | None] = []
        broken = False
        for f in futures:
            try:
                out.append(f.result())
            except concurrent.futures.process.BrokenProcessPool:
                out.append(None)
                broken = True
            except Exception as e:  # noqa: BLE001 - a failed job is a failed candidate.
                out.append(EstimateResult(ok=False, kind="compile_error",
                                          message=f"{type(e).__name__}: {e}"))
        if broken:
            # Retry each lost candidate alone in a fresh pool, to find the one that kills it.
            for i, c in enumerate(configs):
                if out[i] is not None:
                    continue
                self._restart()
                try:
                    out[i] = self._pool.submit(_job, *job, dict(c), chip, standin).result()
                except concurrent.futures.process.BrokenProcessPool:
                    out[i] = EstimateResult(
                        ok=False, kind="worker_crashed",
                        message="the compile worker died (compiler abort or the worker memory "
                                f"limit of {(self._limit or 0) >> 20} MiB); candidate skipped")
                    self._restart()
        assert all(r is not None for r in out)
        return out  # type: ignore[return-value]

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Estimator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def cycles_to_ms(cycles: int, clock_hz: float) -> float:
    return cycles / clock_hz * 1e3


def shrink_parallel(blocks: Sequence[int], other_steps: int, target_steps: int = 128
                    ) -> tuple[list[int], float]:
    """Fewer blocks along parallel grid axes (identical work per block), keeping at least
    ``target_steps`` grid steps in all. Returns the new block counts and the scale factor."""
    new = list(blocks)
    full = other_steps
    for b in blocks:
        full *= b
    for i in range(len(new)):
        rest = other_steps
        for j, b in enumerate(new):
            if j != i:
                rest *= b
        need = -(-target_steps // max(1, rest))
        new[i] = max(1, min(new[i], need))
    steps = other_steps
    for b in new:
        steps *= b
    return new, full / steps
