"""Will a candidate fit? A VMEM/VREG model per chip, checked against the real TPU compiler.

The model needs no estimator from the kernel author: it traces the function with abstract inputs,
finds its ``pallas_call``\\ s and adds up, per kernel,

- every VMEM window: block bytes (padded to the chip's (sublane tiling, 128) tile for its dtype)
  × its buffer count (``pipeline_mode``, default 2; 1 for a window that covers the whole array,
  which Mosaic single-buffers),
- VMEM scratch (padded likewise); SMEM scratch is counted against SMEM,
- compiler temporaries: values larger than the vector register file spill to VMEM. The point
  estimate takes the largest live non-dot value (an f32 score tile, an upcast row block: the
  compiler's extra matched it within ~10% on v5e/v6e), or, for dots accumulated straight into a
  ref, a share of the f32 result when the contraction is long (calibrated on matmul compiles).
  The upper bound lets every such value and dot result spill at once.

against the kernel's ``vmem_limit_bytes`` or the chip's default scoped limit. The verdict is
``ok`` when even the upper bound fits, ``infeasible`` when the windows and scratch alone exceed
the limit, and ``borderline`` in between: the two-stage filter then asks the compiler
(a deviceless libtpu compile), whose word is final.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from pallas_tune.feasibility import compile as _compile
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.chips import ChipSpec, chip_spec

__all__ = ["KernelVmem", "Verdict", "check_feasible", "estimate_vmem", "model_calls"]

# Share of a big f32 dot result that becomes compiler scratch, fitted on v6e deviceless compiles
# of the matmul (2.83 MiB extra for a 1024x1024 f32 result from bf16 inputs with bk=1024, 9.85 MiB
# for 2048x2048; 0.83 MiB at 1024^3 f32; none with bk <= 512).
_TEMP_SHARE_16BIT: Final = 0.7
_TEMP_SHARE_32BIT: Final = 0.21
_TEMP_MIN_CONTRACTION: Final = 1024
# Windows the compiler allocates may come out slightly below our padded sum (seen: -0.17 MiB at
# 23 MiB); an estimate this close above the limit is still sent to the compiler.
_LOW_SLACK: Final = 0.02


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelVmem:
    """The model's numbers for one pallas_call."""

    name: str
    windows_bytes: int
    scratch_bytes: int
    smem_bytes: int
    temp_bytes: int  # Point estimate of compiler temporaries.
    temp_max_bytes: int  # Upper bound: every large dot result spills.
    limit_bytes: int
    vreg_pressure: float  # Largest in-kernel value / vector register file (> 1: spills likely).

    @property
    def low_bytes(self) -> int:
        return self.windows_bytes + self.scratch_bytes

    @property
    def estimate_bytes(self) -> int:
        return self.low_bytes + self.temp_bytes

    @property
    def high_bytes(self) -> int:
        return self.low_bytes + self.temp_max_bytes


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """Whether a candidate fits. ``status`` is "ok", "borderline" or "infeasible"."""

    ok: bool
    status: str
    reason: str
    vmem_bytes: int  # Model estimate (max over the kernels), or the compiler's figure.
    limit_bytes: int  # The limit it was checked against (the kernel's, else the chip default).
    stage: str  # "model" or "compiler".
    detail: str = ""  # Failure kind: vmem_scoped_oom, vmem_physical_oom, smem_oom, block_rule...
    vreg_pressure: float = 0.0
    kernels: tuple[KernelVmem, ...] = ()
    compiler: _compile.CompileResult | None = None
    usable_bytes: int = 0  # The most any vmem_limit_bytes can give on this chip.

    def __bool__(self) -> bool:
        return self.ok

    @property
    def min_limit_bytes(self) -> int:
        """The smallest ``vmem_limit_bytes`` this candidate needs (estimate + 5%, 1 MiB steps).

        Declare ``vmem_limit_bytes`` as a tunable keyword of the kernel (passed to
        ``pltpu.CompilerParams``) to let the tuner try candidates above the default limit; a value
        above ``usable_bytes`` can never compile."""
        need = int(self.vmem_bytes * 1.05)
        return -(-need // 2**20) * 2**20


def _padded_bytes(shape: Sequence[int | None], itemsize: int, spec: ChipSpec) -> int:
    dims = [d if d is not None else 1 for d in shape]
    if spec.platform == "tpu" and dims:
        dims[-1] = -(-dims[-1] // spec.lanes) * spec.lanes
        if len(dims) >= 2:
            sub = spec.sublane_tiling(itemsize)
            dims[-2] = -(-dims[-2] // sub) * sub
    return math.prod(dims) * itemsize


def model_calls(calls: Sequence[_inspect.PallasCallInfo], spec: ChipSpec) -> list[KernelVmem]:
    out = []
    for call in calls:
        windows = 0
        smem = 0
        for b in call.blocks:
            if b.memory_space in ("any", "hbm", "memoryspace.any", "semaphore"):
                continue  # Stays in HBM; copied by hand.
            nbytes = _padded_bytes(b.block_shape, b.dtype.itemsize, spec)
            if "smem" in b.memory_space:
                smem += nbytes
                continue
            whole = all(d is not None and d == a for d, a in zip(b.block_shape, b.array_shape,
                                                                 strict=True))
            count = 1 if (whole or b.trivial_window) else (b.buffer_count or 2)
            windows += count * nbytes
        scratch = 0
        for shape, dtype, space in call.scratch:
            nbytes = _padded_bytes(shape, dtype.itemsize, spec)
            if "smem" in space:
                smem += nbytes
            elif "semaphore" in space or "hbm" in space or "any" in space:
                continue
            else:
                scratch += nbytes
        temp = temp_max = 0
        for shape, dtype, k, lhs_dtype, operands in call.dots:
            # Upper bound: the operands may be relaid out in VMEM too (seen on v5e: bk=2048
            # matmuls needing > 4 MiB beyond a 1 MiB result).
            for op_shape, op_dtype in operands:
                op_bytes = _padded_bytes(op_shape, op_dtype.itemsize, spec)
                if op_bytes > spec.vreg_file_bytes:
                    temp_max += op_bytes
            nbytes = _padded_bytes(shape, max(4, dtype.itemsize), spec)
            if nbytes <= spec.vreg_file_bytes:
                continue
            temp_max += nbytes
            if k >= _TEMP_MIN_CONTRACTION:
                share = _TEMP_SHARE_16BIT if lhs_dtype.itemsize <= 2 else _TEMP_SHARE_32BIT
                temp = max(temp, int(share * nbytes))
        for shape, dtype in call.live_values:
            nbytes = _padded_bytes(shape, max(4, dtype.itemsize), spec)
            if nbytes <= spec.vreg_file_bytes:
                continue
            temp_max += nbytes
            temp = max(temp, nbytes)
        largest = 0
        if call.largest_value is not None:
            shape, dtype = call.largest_value
            largest = _padded_bytes(shape, max(4, dtype.itemsize), spec)
        limit = call.vmem_limit_bytes or spec.scoped_vmem_default_bytes
        out.append(KernelVmem(
            name=call.name, windows_bytes=windows, scratch_bytes=scratch, smem_bytes=smem,
            temp_bytes=temp, temp_max_bytes=max(temp, temp_max), limit_bytes=int(limit),
            vreg_pressure=largest / spec.vreg_file_bytes if spec.vreg_file_bytes else 0.0))
    return out


def _trace(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], chip: str
           ) -> tuple[Callable[..., Any], list[_inspect.PallasCallInfo], dict[str, Any]]:
    """Resolves a TunableKernel's missing parameters for ``chip``; returns (fn, calls, kwargs)."""
    from pallas_tune import chips

    kwargs = dict(kwargs)
    if hasattr(fn, "config_for") and hasattr(fn, "space"):  # A @tunable kernel (duck-typed).
        with chips.target(chip, abstract_mesh=False):
            missing = [n for n in fn.space.names if n not in kwargs]
            if missing:
                cfg = fn.config_for(*args, **kwargs)
                kwargs.update({n: cfg[n] for n in missing})
        fn = fn.fn
    return fn, _inspect.find_pallas_calls(fn, args, kwargs), kwargs


def estimate_vmem(fn: Callable[..., Any], *args: Any, chip: str = "v6e", **kwargs: Any) -> int:
    """Bytes of VMEM the pallas_call(s) of ``fn(*args, **kwargs)`` need on ``chip`` (model).

    Works on any function that calls ``pl.pallas_call`` (JAX's own Pallas TPU ops included);
    ``args`` may be ``jax.ShapeDtypeStruct``\\ s. With several kernels, the largest need.
    """
    spec = chip_spec(chip)
    _, calls, _ = _trace(fn, args, kwargs, spec.name)
    models = model_calls(calls, spec)
    return max((m.estimate_bytes for m in models), default=0)


def check_feasible(fn: Callable[..., Any], *args: Any, chip: str = "v6e", compile: bool = False,
                   vreg_limit: float | None = None,
                   estimator: Callable[..., int] | None = None, **kwargs: Any) -> Verdict:
    """Does ``fn(*args, **kwargs)`` fit on ``chip``?

    Args:
      chip: short name or device_kind ("v6e", "TPU v6 lite").
      compile: also compile deviceless for the chip (needs libtpu) and return the compiler's
        verdict, which overrides the model's.
      vreg_limit: if set, reject candidates whose largest in-kernel value exceeds this many
        vector-register files (a spill-risk constraint; by default only reported).
      estimator: your own ``estimator(*args, **kwargs) -> bytes``, used instead of the model's
        estimate (block rules and the limit still come from the traced kernel and the chip).
    """
    spec = chip_spec(chip)
    try:
        fn_raw, calls, kwargs = _trace(fn, args, kwargs, spec.name)
    except Exception as e:  # noqa: BLE001 - a kernel that cannot be traced cannot run.
        return Verdict(ok=False, status="infeasible", reason=f"tracing failed: {e}",
                       vmem_bytes=0, limit_bytes=spec.scoped_vmem_default_bytes, stage="model",
                       detail="trace_error")
    verdict = model_verdict(calls, spec, vreg_limit=vreg_limit)
    if estimator is not None and verdict.detail != _compile.BLOCK_RULE:
        verdict = with_user_estimate(verdict, int(estimator(*args, **kwargs)))
    if compile and spec.platform == "tpu":
        result = _compile.compile_deviceless(fn_raw, args, kwargs, chip=spec.name)
        return compiler_verdict(verdict, result)
    return verdict


def model_verdict(calls: Sequence[_inspect.PallasCallInfo], spec: ChipSpec, *,
                  vreg_limit: float | None = None) -> Verdict:
    if spec.platform != "tpu":
        return Verdict(ok=True, status="ok", reason=f"no VMEM model for {spec.name}",
                       vmem_bytes=0, limit_bytes=0, stage="model")
    problems = _inspect.block_rule_violations(calls, sublanes=spec.sublanes, lanes=spec.lanes)
    models = model_calls(calls, spec)
    worst = max(models, key=lambda m: m.estimate_bytes / max(1, m.limit_bytes), default=None)
    est = worst.estimate_bytes if worst else 0
    limit = worst.limit_bytes if worst else spec.scoped_vmem_default_bytes
    pressure = max((m.vreg_pressure for m in models), default=0.0)
    common = dict(vmem_bytes=est, limit_bytes=limit, stage="model", vreg_pressure=pressure,
                  kernels=tuple(models), usable_bytes=spec.vmem_usable_bytes)
    if problems:
        return Verdict(ok=False, status="infeasible", reason="; ".join(problems),
                       detail=_compile.BLOCK_RULE, **common)
    for m in models:
        if m.smem_bytes > spec.smem_bytes:
            return Verdict(ok=False, status="infeasible", detail=_compile.SMEM,
                           reason=f"{m.name}: SMEM {_mib(m.smem_bytes)} > {_mib(spec.smem_bytes)}",
                           **common)
        if m.limit_bytes > spec.vmem_usable_bytes and m.low_bytes > spec.vmem_usable_bytes:
            return Verdict(ok=False, status="infeasible", detail=_compile.VMEM_PHYSICAL,
                           reason=f"{m.name}: windows+scratch {_mib(m.low_bytes)} exceed the "
                                  f"physical VMEM {_mib(spec.vmem_usable_bytes)}", **common)
        if m.low_bytes > m.limit_bytes * (1 + _LOW_SLACK):
            return Verdict(ok=False, status="infeasible", detail=_compile.VMEM_SCOPED,
                           reason=f"{m.name}: windows+scratch {_mib(m.low_bytes)} exceed the "
                                  f"scoped VMEM limit {_mib(m.limit_bytes)}", **common)
    if vreg_limit is not None and pressure > vreg_limit:
        return Verdict(ok=False, status="infeasible", detail="vreg_pressure",
                       reason=f"largest in-kernel value is {pressure:.1f} vreg files "
                              f"(> vreg_limit={vreg_limit})", **common)
    borderline = [m for m in models if m.high_bytes > m.limit_bytes
                  or m.low_bytes > m.limit_bytes]
    if borderline:
        m = borderline[0]
        likely = m.estimate_bytes <= m.limit_bytes
        return Verdict(ok=likely, status="borderline",
                       reason=f"{m.name}: {_mib(m.low_bytes)} to {_mib(m.high_bytes)} "
                              f"(estimate {_mib(m.estimate_bytes)}) against a limit of "
                              f"{_mib(m.limit_bytes)}: ask the compiler", **common)
    return Verdict(ok=True, status="ok", reason=f"fits: estimate {_mib(est)} of {_mib(limit)}",
                   **common)


def with_user_estimate(v: Verdict, est: int) -> Verdict:
    ok = est <= v.limit_bytes
    return dataclasses.replace(
        v, ok=ok, status="ok" if ok else "infeasible", vmem_bytes=est,
        detail="" if ok else _compile.VMEM_SCOPED,
        reason=f"user estimator: {_mib(est)} against a limit of {_mib(v.limit_bytes)}")


def compiler_verdict(model: Verdict, result: _compile.CompileResult) -> Verdict:
    if result.ok:
        used = result.scoped_vmem_bytes or model.vmem_bytes
        return dataclasses.replace(model, ok=True, status="ok", stage="compiler",
                                   reason=f"compiles: {_mib(used)} scoped VMEM of "
                                          f"{_mib(model.limit_bytes)}",
                                   vmem_bytes=used, compiler=result, detail="")
    return dataclasses.replace(model, ok=False, status="infeasible", stage="compiler",
                               reason=result.message.splitlines()[0][:500] if result.message
                               else result.kind, detail=result.kind, compiler=result)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
