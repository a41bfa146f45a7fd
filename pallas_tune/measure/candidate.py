"""The first half of every candidate's path, shared by all evaluators: trace once, screen,
lower, fingerprint. Runs where the candidate runs (in a worker when isolated).

Screening stages (``stage``): ``off`` (nothing but the trace itself), ``rules`` (the TPU block
rules), ``model`` (block rules and the VMEM/SMEM/VREG model of the chip), ``compile`` (also a
deviceless compile of candidates the model is uncertain about; needs libtpu).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

from pallas_tune.measure.records import Outcome, TrialRecord

__all__ = ["KernelParts", "PartRefs", "Prepared", "Setup", "prepare", "resolve_stage", "screen"]

STAGES: Final = ("off", "rules", "model", "compile")
# Verdicts on which the compiler decides: "uncertain" (current name), "borderline" (older).
_UNCERTAIN: Final = ("uncertain", "borderline")
_PARTS: Final = ("fn", "reference", "inputs", "vmem_estimate", "standin")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelParts:
    """What evaluating needs of a kernel, as plain parts (not the decorator class): the
    function, its reference, its input builder, its VMEM estimator and its stand-in."""

    name: str
    fn: Callable[..., Any]
    reference: Callable[..., Any] | None = None
    inputs: Callable[..., Any] | None = None
    vmem_estimate: Callable[..., int] | None = None
    standin: Callable[..., Any] | None = None

    @classmethod
    def of(cls, kernel: Any) -> KernelParts:
        """The parts of a ``@tunable`` kernel (or of a plain function)."""
        return cls(name=getattr(kernel, "name", getattr(kernel, "__qualname__", "kernel")),
                   fn=getattr(kernel, "fn", kernel),
                   **{p: getattr(kernel, p, None) for p in _PARTS[1:]})

    def refs(self) -> PartRefs:
        """References another process can import the parts by (ValueError if one cannot)."""
        import sys

        refs = {p: _ref(self.name, p, getattr(self, p)) for p in _PARTS}
        uses_main = any(r and r.startswith("__main__:") for r in refs.values())
        main = sys.modules.get("__main__")
        main_path = getattr(main, "__file__", None) if uses_main else None
        if uses_main and not main_path:
            raise ValueError(f"{self.name}: parts defined in an interactive session cannot be "
                             "loaded by a worker process; define them in a module or a script.")
        return PartRefs(name=self.name, main_path=main_path, **refs)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PartRefs:
    """:class:`KernelParts` as ``module:qualname`` references, for worker processes."""

    name: str
    fn: str
    reference: str | None = None
    inputs: str | None = None
    vmem_estimate: str | None = None
    standin: str | None = None
    main_path: str | None = None  # The parent's script, where some part is defined there.

    def load(self) -> KernelParts:
        from pallas_tune._refs import load

        def get(ref: str | None, attr: str) -> Any:
            if ref is None:
                return None
            obj = load(ref)
            return getattr(obj, "fn", obj) if attr == "fn" else obj

        return KernelParts(name=self.name, **{p: get(getattr(self, p), p) for p in _PARTS})


def _ref(kernel: str, part: str, obj: Any) -> str | None:
    if obj is None:
        return None
    from pallas_tune._refs import load

    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    ref = f"{module}:{qualname}"
    try:
        found = load(ref) if module and "<" not in qualname else None
    except (ImportError, AttributeError, ValueError):
        found = None
    if found is not obj and getattr(found, "fn", None) is not obj:
        raise ValueError(
            f"{kernel}: its {part} {ref} cannot be imported by a worker process (a lambda, a "
            "local function or a renamed object). Define it at the top level of a module (a "
            "kernel you did not write: wrap it there, as examples/tune_third_party.py does). A "
            "measured tune may instead run in this process (isolate=False); a tpu-estimate "
            "tune cannot: libtpu must load with its profiling flag, in a worker.")
    return ref


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Setup:
    """What every candidate of one tuning run shares. ``args``/``kwargs``: concrete arrays or
    ``jax.ShapeDtypeStruct``\\ s (inputs are then built with ``inputs`` or at random from
    ``seed``); ``chip``: the target chip (None: this host's); ``reference``: the output every
    candidate must match, when already known."""

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    seed: int = 0
    chip: str | None = None
    feasibility: str = "auto"
    vreg_limit: float | None = None
    timing: Any = None  # measure.timing.TimingPolicy (a measuring session needs one).
    reference: Any = None
    estimate_correction: bool = False  # measure.correction on tpu-estimate figures.


def resolve_stage(feasibility: str, chip: str, *, estimating: bool) -> str:
    """The screening stage for ``feasibility`` on ``chip`` (see the module docstring).

    ``auto``: on a TPU chip ``compile`` where libtpu is installed and no TPU measures (else
    ``model``; on a TPU the measurement's own compile is the second stage; estimates are
    compiles anyway), on other chips ``rules``."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import compile as _compile

    if feasibility == "off":
        return "off"
    try:
        tpu = chip_spec(chip).platform == "tpu"
    except ValueError:
        tpu = False
    if not tpu:
        return "rules"
    if feasibility == "auto":
        if estimating or not _compile.libtpu_available():
            return "model"
        import jax

        return "model" if jax.default_backend() == "tpu" else "compile"
    if feasibility == "compile" and not _compile.libtpu_available():
        raise ValueError("feasibility='compile' compiles deviceless with libtpu: pip install "
                         "'pallas-tune[tpu]', or use feasibility='model'.")
    return feasibility


@dataclasses.dataclass(slots=True, kw_only=True)
class Prepared:
    """A candidate traced, screened and lowered, waiting to be compiled and run."""

    number: int
    config: dict[str, Any]
    traced: Any  # fingerprint.Traced
    calls: list[Any]
    lowered: Any
    fingerprint: str
    vmem_bytes: int | None
    started: float
    compiled: Any = None
    compile_ms: float = float("nan")


def prepare(parts: KernelParts, args: Sequence[Any], kwargs: Mapping[str, Any], number: int,
            config: Mapping[str, Any], *, chip: str, stage: str, vreg_limit: float | None,
            context: Callable[[], contextlib.AbstractContextManager[Any]],
            platforms: Sequence[str] | None, channel: Any, lower: bool = True
            ) -> Prepared | TrialRecord:
    """Trace → screen → lower → fingerprint → claim. Returns the prepared candidate, or its
    record when it ends here (rejected, failed, or a duplicate of an evaluated program:
    ``channel.ask(("claim", fingerprint, number))`` answers that program's trial number).
    With ``lower=False`` it stops after screening (no fingerprint, nothing claimed)."""
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.measure import fingerprint as fp

    started = time.perf_counter()
    config = dict(config)
    full = {**kwargs, **config}

    def ends(outcome: Outcome, error: str, detail: str = "", **more: Any) -> TrialRecord:
        return TrialRecord(number=number, config=config, outcome=outcome, error=error,
                           detail=detail, phase=channel.phase_name,
                           seconds=time.perf_counter() - started, **more)

    channel.phase("trace")
    try:
        with context():
            traced = fp.trace(parts.fn, args, full)
            calls = _calls(traced)
    except Exception as e:  # noqa: BLE001 - a candidate that cannot be traced cannot run.
        return ends(*_trace_failure(e))
    rejection, vmem = screen(parts, calls, args, full, chip=chip, stage=stage,
                             vreg_limit=vreg_limit, channel=channel)
    if rejection is not None:
        outcome, error, detail = rejection
        return ends(outcome, error, detail, vmem_bytes=vmem)
    if not lower:
        return Prepared(number=number, config=config, traced=traced, calls=calls, lowered=None,
                        fingerprint="", vmem_bytes=vmem, started=started)
    try:
        with context():
            lowered = fp.lower(traced, platforms=platforms)
    except Exception as e:  # noqa: BLE001 - Mosaic rejects some candidates while lowering.
        text = f"lowering failed: {type(e).__name__}: {e}"[:4000]
        kind = _compile.classify_error(text)
        return ends(_failure_outcome(kind), text, kind, vmem_bytes=vmem)
    digest = fp.digest(lowered)
    original = channel.ask(("claim", digest, number))
    if original is not None:
        return ends(Outcome.OK, "", fingerprint=digest, duplicate_of=original, vmem_bytes=vmem)
    return Prepared(number=number, config=config, traced=traced, calls=calls, lowered=lowered,
                    fingerprint=digest, vmem_bytes=vmem, started=started)


def _calls(traced: Any) -> list[Any]:
    from pallas_tune.feasibility import inspect as _inspect

    # Re-binding the traced jaxpr is cheap: the kernel's own Python code does not run again.
    return _inspect.find_pallas_calls(traced.function(renamed=False), list(traced.arrays), {})


def _trace_failure(e: Exception) -> tuple[Outcome, str, str]:
    from pallas_tune.errors import InvalidConfig

    if isinstance(e, InvalidConfig):
        return Outcome.INFEASIBLE, f"invalid config: {e}", "invalid_config"
    return Outcome.COMPILE_ERROR, f"tracing failed: {type(e).__name__}: {e}"[:4000], "trace_error"


def _failure_outcome(kind: str) -> Outcome:
    from pallas_tune.feasibility import compile as _compile

    return (Outcome.INFEASIBLE if kind in (*_compile.OOM_KINDS, _compile.BLOCK_RULE)
            else Outcome.COMPILE_ERROR)


def screen(parts: KernelParts, calls: Sequence[Any], args: Sequence[Any],
           kwargs: Mapping[str, Any], *, chip: str, stage: str, vreg_limit: float | None,
           channel: Any = None) -> tuple[tuple[Outcome, str, str] | None, int | None]:
    """Screens a traced candidate by ``stage``; returns ((outcome, error, detail) or None when
    it may run, the VMEM figure where known). ``kwargs`` include the config."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model

    if stage == "off":
        return None, None
    if stage == "rules":
        problems = _inspect.block_rule_violations(calls)
        return ((Outcome.INFEASIBLE, "; ".join(problems), _compile.BLOCK_RULE) if problems
                else None), None
    verdict = model.model_verdict(calls, chip_spec(chip), vreg_limit=vreg_limit)
    if parts.vmem_estimate is not None and verdict.detail != _compile.BLOCK_RULE:
        verdict = model.with_user_estimate(verdict, int(parts.vmem_estimate(*args, **kwargs)))
    if verdict.status == "infeasible":
        return (Outcome.INFEASIBLE, f"model: {verdict.reason}", verdict.detail), verdict.vmem_bytes
    if verdict.status in _UNCERTAIN and stage == "compile":
        if channel is not None:
            channel.phase("check")
        result = (_compile.compile_per_call(parts.fn, args, kwargs, chip=chip)
                  or _compile.compile_deviceless(parts.fn, args, kwargs, chip=chip))
        if not result.ok:
            return ((_failure_outcome(result.kind), f"compiler: {result.message[:2000]}",
                     result.kind), verdict.vmem_bytes)
        return None, result.scoped_vmem_bytes or verdict.vmem_bytes
    return None, verdict.vmem_bytes


def roofline_time(parts: KernelParts, args: Sequence[Any], kwargs: Mapping[str, Any],
                  config: Mapping[str, Any], chip: str, fitted: bool = False) -> float | None:
    """The roofline model's time (s) (``fitted``: feasibility.fitted's) for a candidate that
    passes the block rules and that the
    VMEM model does not refuse (at the scoped limit the config sets), else None (so it also
    tells valid from invalid configs: a warm start never proposes a tile that cannot fit)."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model
    from pallas_tune.feasibility.roofline import roofline_calls

    try:
        calls = _inspect.find_pallas_calls(parts.fn, args, {**kwargs, **config})
    except Exception:  # noqa: BLE001 - not traceable: no pick.
        return None
    if _inspect.block_rule_violations(calls):
        return None
    try:
        spec = chip_spec(chip)
    except ValueError:  # A chip we know nothing of: valid, unranked.
        return 0.0
    if spec.platform == "tpu" and model.model_verdict(calls, spec).status == "infeasible":
        return None
    if fitted:  # feasibility.fitted, with the chip's constants (constants_for).
        from pallas_tune.feasibility.fitted import fitted_calls

        return fitted_calls(calls, spec)
    return roofline_calls(calls, spec).time_s


@contextlib.contextmanager
def no_context() -> Iterator[None]:
    yield


def to_wire(tree: Any) -> Any:
    """Arrays to NumPy and ShapeDtypeStructs to plain tuples, for a pipe to a worker."""
    import jax
    import numpy as np

    def conv(a: Any) -> Any:
        if isinstance(a, jax.ShapeDtypeStruct):
            return ("__spec__", tuple(a.shape), str(a.dtype))
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return np.asarray(a)
        return a

    return jax.tree_util.tree_map(conv, tree)


def from_wire(tree: Any) -> Any:
    """The inverse of :func:`to_wire` (NumPy arrays stay NumPy)."""
    import jax

    def spec(a: Any) -> bool:
        return isinstance(a, tuple) and len(a) == 3 and a[0] == "__spec__"

    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a[1], a[2]) if spec(a) else a,
                                  tree, is_leaf=spec)
