"""Will a candidate fit? A VMEM/VREG model per chip, checked against the real TPU compiler.

The model needs no estimator from the kernel author: it traces the function with abstract inputs,
finds its ``pallas_call``\\ s and adds up, per kernel,

- every VMEM window: block bytes (last dim padded to 128 lanes, rows to 8) × its buffer count
  (``pipeline_mode``, default 2; 1 for a window that covers the whole array, which Mosaic
  single-buffers),
- VMEM scratch (padded likewise); SMEM scratch is counted against SMEM,
- compiler temporaries: values larger than the vector register file spill to VMEM. The point
  estimate takes the largest live non-dot value (an f32 score tile, an upcast row block; times
  the copies an unrolled loop keeps), or, for dots accumulated straight into a ref, a share of
  the f32 result when the contraction is long (calibrated on matmul compiles).

against the limit the traced call sets (``vmem_limit_bytes`` in its ``pltpu.CompilerParams``),
capped at the chip's usable physical VMEM (a larger limit cannot give more: the compiler then runs
out of physical VMEM), or, where the call sets none, the chip's default scoped limit. A kernel
makes the limit a tuning dimension by declaring it as a tunable keyword passed to its compiler
params (kernels/matmul.py: ``vmem_limit_bytes``, 0 for the default).

The point estimate is off by a measured amount: on the calibration kernels (pallas-tune's own
matmul, flash attention and RMS norm, deviceless compiles for v5e/v6e/7x with the scoped limit
raised so that every candidate reports its need), the compiler needed between ``BAND_OVER`` less
and ``BAND_UNDER`` more than the estimate. The verdict is

- ``infeasible``: a block rule fails (:mod:`.rules`), SMEM or physical VMEM overflows, or even
  the band's low edge (or the windows and scratch alone) exceed the limit;
- ``ok``: even the band's high edge fits;
- ``uncertain``: the limit lies inside the band. The two-stage filter asks the compiler (a
  deviceless libtpu compile), whose word is final; without libtpu the candidate is tried.

Which check runs at which stage of the tuner is in ``STAGE_CHECKS``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from pallas_tune.feasibility import compile as _compile
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.feasibility import rules as _rules
from pallas_tune.chips import ChipSpec, chip_spec

__all__ = ["STAGE_CHECKS", "KernelVmem", "Verdict", "check_feasible", "estimate_vmem",
           "model_calls", "model_verdict", "need_band"]

# What the compiler adds for a dot whose contraction is >= 1024 long (and whose f32 result is
# bigger than the vreg file), fitted on v6e deviceless compiles of the matmul at 4096^3
# (benchmarks/results/data/feasibility_limits_rows_2026-11-25.csv, buffering 2): a relayout
# copy of a 16-bit lhs tile (bm x bk), independent of bn, plus about 1 KiB per lhs row (0.36,
# 0.85 and 1.84 MiB at bm = 512, 1024, 2048; 0.83 MiB at 1024^3 f32, which has no copy). Nothing
# with bk <= 512. The copy is whole from bn = 1024, partial below (v6e 2048x512x2048: 6.5 of
# 8 MiB; 7x: less), none at bn = 256 on v6e: counted as bn / 1024 of the tile, so that no
# compilable candidate is rejected. The earlier rule, a share of the f32 result (bm x bn), was
# off by up to 18% both ways.
_TEMP_COPY_COLS: Final = 1024
_TEMP_ROW_BYTES: Final = 1024
_TEMP_ROW_FLOOR: Final = 160 << 10
_TEMP_MIN_CONTRACTION: Final = 1024
# Windows the compiler allocates may come out slightly below our padded sum (seen: -0.17 MiB at
# 23 MiB); an estimate this close above the limit is still sent to the compiler.
_LOW_SLACK: Final = 0.02
# The model's measured error near the limit (benchmarks/results/feasibility_accuracy.txt): on
# the 143 calibration candidates (pallas-tune's matmul and RMS norm on v5e, v6e, 7x) whose
# estimate or need lay within 0.5x-2x of the limit, the compiler's scoped need was between
# 15.1% below (7x matmul 2048x512x2048: a smaller lhs copy than v6e's) and 29.2% above (v5e
# matmul) the estimate; BAND_OVER rounded up to the next percent. BAND_UNDER keeps the 47%
# measured with the earlier dot rule (v5e 2048x256x2048), wider than needed now.
BAND_UNDER: Final = 0.47
BAND_OVER: Final = 0.16

# What the tuner checks before it measures a candidate, per ``feasibility`` mode. "trace": the
# kernel is traced with the config (InvalidConfig raised by the kernel itself rejects it);
# "block_rules": rules.block_rule_violations for the chip; "model": SMEM, physical and scoped
# VMEM, vreg_limit and the kernel's own vmem_estimate (model_verdict); "compile": a deviceless
# compile of the "uncertain" candidates (libtpu). "off" filters nothing: a candidate that breaks
# a rule fails when measured and is recorded with the compiler's classified error.
STAGE_CHECKS: Final = {
    "off": ("trace",),
    "model": ("trace", "block_rules", "model"),
    "compile": ("trace", "block_rules", "model", "compile"),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class KernelVmem:
    """The model's numbers for one pallas_call."""

    name: str
    windows_bytes: int
    scratch_bytes: int
    smem_bytes: int
    temp_bytes: int  # Point estimate of compiler temporaries.
    temp_max_bytes: int  # Upper bound: every large dot result spills.
    # The part of temp_bytes that may refuse a candidate: the dot rule's (fitted on compiler
    # needs). Large live values (an f32 upcast of a block) count towards the estimate, never
    # towards a refusal: the compiler may keep them in vregs or stream them (tpu-inference's
    # quantized matmul on v6e: its need 30% to 54% below an estimate made of them, at configs
    # the model had refused; benchmarks/results/feasibility_accuracy.txt).
    dot_temp_bytes: int
    limit_bytes: int  # What the need is checked against: the requested limit, capped.
    # The call's vmem_limit_bytes, or the chip's default scoped limit where it sets none. Above
    # the usable physical VMEM it is capped (limit_bytes): the compiler's failure is physical.
    requested_limit_bytes: int
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
    """Whether a candidate fits.

    ``status``: "ok" (fits, even at the far edge of the model's error band), "infeasible"
    (cannot run: a block rule, SMEM, or over the limit even at the near edge of the band) or
    "uncertain" (the limit lies inside the band: a deviceless compile decides, or without
    libtpu the candidate is tried). ``ok`` is the point estimate's guess for "uncertain"."""

    ok: bool
    status: str
    reason: str
    vmem_bytes: int  # Model estimate (max over the kernels), or the compiler's figure.
    # The limit it was checked against: the kernel's vmem_limit_bytes capped at the usable
    # physical VMEM, else the chip's default scoped limit.
    limit_bytes: int
    stage: str  # "model" or "compiler".
    detail: str = ""  # Failure kind: vmem_scoped_oom, vmem_physical_oom, smem_oom, block_rule...
    vreg_pressure: float = 0.0
    kernels: tuple[KernelVmem, ...] = ()
    compiler: _compile.CompileResult | None = None
    usable_bytes: int = 0  # The most any vmem_limit_bytes can give on this chip.
    # Where the compiler's need is expected (the estimate's measured error band), model only.
    band_bytes: tuple[int, int] = (0, 0)

    def __bool__(self) -> bool:
        return self.ok

    @property
    def min_limit_bytes(self) -> int:
        """A ``vmem_limit_bytes`` that should suffice for this candidate: the top of the model's
        error band (estimate + 5% without one), rounded up to whole MiB.

        Declare ``vmem_limit_bytes`` as a tunable keyword of the kernel (passed to
        ``pltpu.CompilerParams``) to let the tuner try candidates above the default limit; a value
        above ``usable_bytes`` can never compile."""
        need = self.band_bytes[1] if self.band_bytes[1] else int(self.vmem_bytes * 1.05)
        return -(-need // 2**20) * 2**20


def _padded_bytes(shape: Sequence[int | None], bits: int, spec: ChipSpec) -> int:
    """Bytes of a VMEM buffer as the compiler lays it out: the last dim padded to 128 lanes, the
    second-to-last to 8 rows (a row count below 8 to one packed row). Measured with libtpu
    0.0.50.1 on v5e/v6e/7x: the compiler pads rows to 8 for every dtype, not to the dtype's
    native tile (int8 (8, 1024) windows take 8 KiB, bf16 (100, 1024) 208 KiB)."""
    dims = [d if d is not None else 1 for d in shape]
    if spec.platform == "tpu" and dims:
        dims[-1] = -(-dims[-1] // spec.lanes) * spec.lanes
        if len(dims) >= 2:
            rows, sub = dims[-2], spec.sublanes
            step = sub if rows > sub else max(1, 32 // bits)
            dims[-2] = -(-rows // step) * step
    return -(-math.prod(dims) * bits // 8)


def model_calls(calls: Sequence[_inspect.PallasCallInfo], spec: ChipSpec) -> list[KernelVmem]:
    out = []
    for call in calls:
        windows = 0
        smem = 0
        for b in call.blocks:
            if b.memory_space in ("any", "hbm", "memoryspace.any", "semaphore"):
                continue  # Stays in HBM; copied by hand.
            nbytes = _padded_bytes(b.block_shape, _rules.itemsize_bits(b.dtype), spec)
            if "smem" in b.memory_space:
                smem += nbytes
                continue
            whole = all(d is not None and d == a for d, a in zip(b.block_shape, b.array_shape,
                                                                 strict=True))
            count = 1 if (whole or b.trivial_window) else (b.buffer_count or 2)
            windows += count * nbytes
        scratch = 0
        for shape, dtype, space in call.scratch:
            nbytes = _padded_bytes(shape, _rules.itemsize_bits(dtype), spec)
            if "smem" in space:
                smem += nbytes
            elif "semaphore" in space or "hbm" in space or "any" in space:
                continue
            else:
                scratch += nbytes
        temp = temp_max = dot_temp = 0
        for shape, dtype, k, lhs_dtype, operands in call.dots:
            # Upper bound: the operands may be relaid out in VMEM too (seen on v5e: bk=2048
            # matmuls needing > 4 MiB beyond a 1 MiB result).
            for op_shape, op_dtype in operands:
                op_bytes = _padded_bytes(op_shape, _rules.itemsize_bits(op_dtype), spec)
                if op_bytes > spec.vreg_file_bytes:
                    temp_max += op_bytes
            nbytes = _padded_bytes(shape, 32, spec)
            if nbytes <= spec.vreg_file_bytes:
                continue
            temp_max += nbytes
            if k >= _TEMP_MIN_CONTRACTION and operands:
                lhs_shape, _ = operands[0]
                rows = math.prod(lhs_shape) // max(1, k)
                cols = math.prod(shape) // max(1, rows)  # The result's other dimension (bn).
                copy = (_padded_bytes(lhs_shape, _rules.itemsize_bits(lhs_dtype), spec)
                        * min(1.0, cols / _TEMP_COPY_COLS) if lhs_dtype.itemsize <= 2 else 0)
                dot_temp = max(dot_temp, int(copy) + max(0, rows * _TEMP_ROW_BYTES
                                                         - _TEMP_ROW_FLOOR))
        temp = dot_temp
        for shape, _, copies in call.live_values:
            nbytes = _padded_bytes(shape, 32, spec)
            if nbytes <= spec.vreg_file_bytes:
                continue
            # An unrolled loop keeps one instance per unrolled iteration (JAX's TPU flash
            # attention: block_k_major // block_k copies of each (block_q, block_k) tile).
            temp_max += nbytes * copies
            temp = max(temp, nbytes * copies)
        largest = 0
        if call.largest_value is not None:
            shape, dtype = call.largest_value
            largest = _padded_bytes(shape, 32, spec)
        requested = int(call.vmem_limit_bytes or spec.scoped_vmem_default_bytes)
        limit = min(requested, spec.vmem_usable_bytes) if spec.vmem_usable_bytes else requested
        out.append(KernelVmem(
            name=call.name, windows_bytes=windows, scratch_bytes=scratch, smem_bytes=smem,
            temp_bytes=temp, temp_max_bytes=max(temp, temp_max), dot_temp_bytes=dot_temp,
            limit_bytes=limit,
            requested_limit_bytes=requested,
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
                  vreg_limit: float | None = None, native_tiling: bool = False) -> Verdict:
    """The model's verdict on traced pallas_calls for ``spec``'s chip (see the module doc).

    Block rules (for this chip; ``native_tiling`` as in
    :func:`~pallas_tune.feasibility.rules.block_rule_violations`), SMEM, physical VMEM and the
    scoped limit with the measured error band: "ok", "uncertain" or "infeasible"."""
    if spec.platform != "tpu":
        return Verdict(ok=True, status="ok", reason=f"no VMEM model for {spec.name}",
                       vmem_bytes=0, limit_bytes=0, stage="model")
    problems = _inspect.block_rule_violations(calls, spec=spec, native_tiling=native_tiling)
    models = model_calls(calls, spec)
    worst = max(models, key=lambda m: m.estimate_bytes / max(1, m.limit_bytes), default=None)
    est = worst.estimate_bytes if worst else 0
    limit = worst.limit_bytes if worst else spec.scoped_vmem_default_bytes
    pressure = max((m.vreg_pressure for m in models), default=0.0)
    common = dict(vmem_bytes=est, limit_bytes=limit, stage="model", vreg_pressure=pressure,
                  kernels=tuple(models), usable_bytes=spec.vmem_usable_bytes,
                  band_bytes=need_band(est))
    if problems:
        return Verdict(ok=False, status="infeasible", reason="; ".join(problems),
                       detail=_compile.BLOCK_RULE, **common)
    for m in models:
        if m.smem_bytes > spec.smem_bytes:
            return Verdict(ok=False, status="infeasible", detail=_compile.SMEM,
                           reason=f"{m.name}: SMEM {_mib(m.smem_bytes)} > {_mib(spec.smem_bytes)}",
                           **common)
        # A limit at or above the usable physical VMEM is capped there: a need above it is the
        # compiler's physical OOM, not a scoped one.
        physical = m.requested_limit_bytes >= spec.vmem_usable_bytes > 0
        if physical and m.low_bytes > spec.vmem_usable_bytes:
            return Verdict(ok=False, status="infeasible", detail=_compile.VMEM_PHYSICAL,
                           reason=f"{m.name}: windows+scratch {_mib(m.low_bytes)} exceed the "
                                  f"physical VMEM {_mib(spec.vmem_usable_bytes)}", **common)
        low_need = need_band(m.low_bytes + m.dot_temp_bytes)[0]
        if m.low_bytes > m.limit_bytes * (1 + _LOW_SLACK) or low_need > m.limit_bytes:
            what = ("windows+scratch " + _mib(m.low_bytes) if low_need <= m.limit_bytes
                    else f"estimate {_mib(m.low_bytes + m.dot_temp_bytes)} of windows, "
                         f"scratch and dot temporaries (at least {_mib(low_need)} with the "
                         "model's measured error)")
            where = (f"the physical VMEM {_mib(m.limit_bytes)} (vmem_limit_bytes "
                     f"{_mib(m.requested_limit_bytes)})" if physical
                     else f"the scoped VMEM limit {_mib(m.limit_bytes)}")
            return Verdict(ok=False, status="infeasible",
                           detail=_compile.VMEM_PHYSICAL if physical else _compile.VMEM_SCOPED,
                           reason=f"{m.name}: {what} exceeds {where}", **common)
    if vreg_limit is not None and pressure > vreg_limit:
        return Verdict(ok=False, status="infeasible", detail="vreg_pressure",
                       reason=f"largest in-kernel value is {pressure:.1f} vreg files "
                              f"(> vreg_limit={vreg_limit})", **common)
    near = [m for m in models if need_band(m.estimate_bytes)[1] > m.limit_bytes]
    if near:
        m = near[0]
        lo, hi = need_band(m.estimate_bytes)
        live = m.temp_bytes - m.dot_temp_bytes
        why = (f"estimate {_mib(m.estimate_bytes)} against a limit of {_mib(m.limit_bytes)}, "
               f"{_mib(live)} of it large live values, which the compiler may keep out of VMEM"
               if lo > m.limit_bytes else
               f"estimate {_mib(m.estimate_bytes)} (compiler's need expected in {_mib(lo)} to "
               f"{_mib(hi)}) against a limit of {_mib(m.limit_bytes)}")
        return Verdict(ok=m.estimate_bytes <= m.limit_bytes, status="uncertain",
                       reason=f"{m.name}: {why}: the compiler decides", **common)
    return Verdict(ok=True, status="ok", reason=f"fits: estimate {_mib(est)} of {_mib(limit)}",
                   **common)


def need_band(estimate_bytes: int) -> tuple[int, int]:
    """The range the compiler's scoped-VMEM need is expected in for a model estimate: the
    estimate widened by the error measured on the calibration kernels (``BAND_OVER`` below,
    ``BAND_UNDER`` above; benchmarks/feasibility/feasibility_accuracy.py)."""
    return (int(estimate_bytes * (1 - BAND_OVER)), int(math.ceil(estimate_bytes * (1 + BAND_UNDER))))


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
