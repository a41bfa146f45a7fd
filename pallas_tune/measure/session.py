"""Where a measured candidate runs: a :class:`MeasureSession` holds the inputs, the reference
output and the settings of one tuning run, and takes candidates through the whole path:
trace, screen, lower, fingerprint (:mod:`.candidate`), compile, check, time (:mod:`.timing`).

The same session object serves in this process (:class:`~.evaluate.InProcessEvaluator`) and
inside a worker (:class:`~.evaluate.PoolEvaluator`); its methods take a
:class:`~.pool.Channel`, through which they report phases and ask the parent about programs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.measure import candidate as cand
from pallas_tune.measure.records import Outcome, TrialRecord

__all__ = ["MeasureSession"]


class MeasureSession:
    """Measures candidates of one kernel on this host's device (interpret mode on a CPU)."""

    def __init__(self, parts: cand.KernelParts | cand.PartRefs, setup: cand.Setup):
        import jax

        from pallas_tune import chips

        self.parts = parts.load() if isinstance(parts, cand.PartRefs) else parts
        self.setup = setup
        host = chips.current_chip()
        self.chip = chips.normalize_chip(setup.chip) if setup.chip else host
        self.host_chip = host
        self.interpret = chips.should_interpret()
        self.stage = cand.resolve_stage(setup.feasibility, self.chip, estimating=False)
        self.args, self.kwargs = _materialize(self.parts, setup)
        self.reference = setup.reference
        device = jax.devices()[0]
        self.device = {"chip": host, "platform": device.platform,
                       "device_kind": device.device_kind, "interpret": self.interpret,
                       "stage": self.stage, "backend": jax.default_backend()}

    def info(self, channel: Any = None) -> dict[str, Any]:
        del channel  # Unused.
        return dict(self.device)

    def _context(self) -> contextlib.AbstractContextManager[Any]:
        from pallas_tune import chips

        return chips.interpret_mode() if self.interpret else cand.no_context()

    # ---- reference ------------------------------------------------------------------------

    def compute_reference(self, channel: Any = None) -> Any:
        """The kernel's reference output for these inputs (NumPy), or None without one."""
        if self.parts.reference is None:
            return None
        import jax
        import numpy as np

        if channel is not None:
            channel.phase("run")
        out = jax.block_until_ready(self.parts.reference(*self.args, **self.kwargs))
        self.reference = jax.tree_util.tree_map(np.asarray, out)
        return self.reference

    def set_reference(self, reference: Any, channel: Any = None) -> None:
        del channel  # Unused.
        self.reference = reference

    # ---- one candidate --------------------------------------------------------------------

    def prepare(self, number: int, config: Mapping[str, Any], channel: Any
                ) -> cand.Prepared | TrialRecord:
        return cand.prepare(self.parts, self.args, self.kwargs, number, config, chip=self.chip,
                            stage=self.stage, vreg_limit=self.setup.vreg_limit,
                            context=self._context, platforms=None, channel=channel)

    def compile(self, prepared: cand.Prepared, channel: Any = None) -> None:
        """Compiles a prepared candidate (thread-safe: compiles release the GIL)."""
        if channel is not None:
            channel.phase("compile")
        t0 = time.perf_counter()
        try:
            prepared.compiled = prepared.lowered.compile()
        except Exception as e:  # noqa: BLE001 - a candidate that fails to compile is data.
            prepared.compiled = e
        prepared.compile_ms = (time.perf_counter() - t0) * 1e3

    def run(self, prepared: cand.Prepared, best_ms: float, channel: Any
            ) -> tuple[TrialRecord, Any]:
        """Runs, checks and times a compiled candidate. Returns its record and, when its
        output became this session's reference (none was known), that output (NumPy)."""
        from pallas_tune.feasibility.compile import classify_error
        from pallas_tune.measure.timing import run_and_time, short_error

        def record(outcome: Outcome, **more: Any) -> TrialRecord:
            return TrialRecord(number=prepared.number, config=prepared.config, outcome=outcome,
                               fingerprint=prepared.fingerprint, vmem_bytes=prepared.vmem_bytes,
                               phase=channel.phase_name,
                               seconds=time.perf_counter() - prepared.started, **more)

        if isinstance(prepared.compiled, BaseException):
            text = short_error(prepared.compiled)
            kind = classify_error(text)
            return record(cand._failure_outcome(kind), error=f"[{kind}] {text}", detail=kind), None
        channel.phase("run")
        # Every device op of the candidate's program counts (event_regex None): the XLA ops
        # around its pallas_calls (a split-k reduction, a padding copy) are part of its cost;
        # counting only the kernels would favour configs that move work out of them.
        regex = None
        outcome, m, out, err, max_err = run_and_time(
            prepared.compiled, prepared.traced.arrays_for(self.args),
            reference=self.reference, policy=self.setup.timing, best_ms=best_ms,
            compile_ms=prepared.compile_ms, event_regex=regex)
        adopted = None
        if outcome.timed and self.reference is None:
            import jax
            import numpy as np

            adopted = self.reference = jax.tree_util.tree_map(np.asarray, out)
        return record(outcome, measurement=m, error=err, max_abs_err=max_err), adopted

    def evaluate(self, number: int, config: Mapping[str, Any], best_ms: float, channel: Any
                 ) -> tuple[TrialRecord, Any]:
        """The whole path of one candidate; see :meth:`run` for what it returns."""
        prepared = self.prepare(number, config, channel)
        if isinstance(prepared, TrialRecord):
            return prepared, None
        self.compile(prepared, channel)
        return self.run(prepared, best_ms, channel)

    # ---- after the search -----------------------------------------------------------------

    def rerank(self, configs: Sequence[Mapping[str, Any]], rounds: int,
               reference: bool = False, channel: Any = None) -> list[list[float]]:
        """The given (good) configs re-timed interleaved, ``rounds`` runs each, in ms; with
        ``reference``, the kernel's reference (plain JAX: XLA) last, timed in the same rounds
        by the same timer, so that Pallas and XLA compare like with like."""
        from pallas_tune.measure import fingerprint as fp
        from pallas_tune.measure.timing import interleave

        executables = []
        arrays = fp.Traced.arrays_for(self.args)
        for config in configs:
            if channel is not None:
                channel.phase("compile")
            with self._context():
                traced = fp.trace(self.parts.fn, self.args, {**self.kwargs, **config})
                executables.append(fp.lower(traced).compile())
        if reference and self.parts.reference is not None:
            executables.append(self._reference_program(arrays))
        if channel is not None:
            channel.phase("run")
        return interleave(executables, arrays, rounds, timer=self.setup.timing.timer)

    def _reference_program(self, arrays: Sequence[Any]) -> Any:
        """The reference compiled as a function of the same array leaves as the kernel."""
        import jax

        leaves, tree = jax.tree_util.tree_flatten(list(self.args))
        is_array = [hasattr(x, "shape") and hasattr(x, "dtype") for x in leaves]
        reference, kwargs = self.parts.reference, self.kwargs

        def program(*given: Any) -> Any:
            it = iter(given)
            full = [next(it) if a else x for x, a in zip(leaves, is_array, strict=True)]
            return reference(*jax.tree_util.tree_unflatten(tree, full), **kwargs)

        return jax.jit(program).lower(*arrays).compile()

    def roofline(self, config: Mapping[str, Any], chip: str, channel: Any = None
                 ) -> float | None:
        del channel  # Unused.
        return cand.roofline_time(self.parts, self.args, self.kwargs, config, chip)


def _materialize(parts: cand.KernelParts, setup: cand.Setup) -> tuple[list[Any], dict[str, Any]]:
    """Concrete inputs: NumPy arrays onto the device; ShapeDtypeStructs built by the kernel's
    ``inputs`` or at random from the seed (deterministic, so a fresh worker gets the same)."""
    import jax
    import jax.numpy as jnp

    from pallas_tune.measure.timing import make_inputs

    args, kwargs = list(cand.from_wire(list(setup.args))), dict(cand.from_wire(dict(setup.kwargs)))
    leaves = jax.tree_util.tree_leaves((args, kwargs))
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        if parts.inputs is not None:
            new_args, new_kwargs = parts.inputs(*args, **kwargs)
            args, kwargs = list(new_args), dict(new_kwargs)
        else:
            args = make_inputs(args, setup.seed)

    def place(a: Any) -> Any:
        return jnp.asarray(a) if type(a).__module__ == "numpy" and hasattr(a, "dtype") else a

    return jax.tree_util.tree_map(place, args), kwargs


def best_of(records: Sequence[TrialRecord]) -> float:
    ok = [r.median_ms for r in records if r.outcome is Outcome.OK]
    return min(ok, default=math.inf)
