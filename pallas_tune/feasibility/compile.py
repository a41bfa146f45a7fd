"""Deviceless TPU compiles on a CPU host (libtpu), and the classification of compiler errors.

``jax[tpu]`` ships libtpu, which compiles for any TPU generation against a compile-only device from
``jax.experimental.topologies``: the real Mosaic and XLA:TPU compiler, with the real VMEM
out-of-memory errors (notes/pallas-on-cpu.md §4). Compiles release the GIL, so threads in one
process parallelise them; several processes need ``ALLOW_MULTIPLE_LIBTPU_LOAD=1``, which this
module sets (unless already set) before libtpu loads.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

__all__ = ["CompileResult", "classify_error", "compile_deviceless", "compile_per_call",
           "libtpu_available", "kernel_calls"]

# Compiler failure kinds (the `detail` of an infeasible or compile_error outcome).
VMEM_SCOPED: Final = "vmem_scoped_oom"
VMEM_PHYSICAL: Final = "vmem_physical_oom"
SMEM: Final = "smem_oom"
MOSAIC: Final = "mosaic_rejected"
BLOCK_RULE: Final = "block_rule"
OTHER: Final = "compile_error"
OOM_KINDS: Final = (VMEM_SCOPED, VMEM_PHYSICAL, SMEM)

_PATTERNS: Final = (
    (VMEM_SCOPED, re.compile(r"Scoped allocation with size [\d.]+[KMG]? and limit [\d.]+[KMG]? "
                             r"exceeded scoped vmem limit|CompileTimeScopedVmemOom|"
                             r"scoped vmem limit", re.I)),
    (VMEM_PHYSICAL, re.compile(r"Ran out of memory in memory space vmem|"
                               r"Allocation \(size=\d+\) would exceed memory \(size=\d+\).*vmem",
                               re.I | re.S)),
    (SMEM, re.compile(r"Ran out of memory in memory space smem|smem capacity", re.I)),
    (BLOCK_RULE, re.compile(r"Pallas TPU lowering currently (requires|supports)|Only single \(1\) "
                            r"and double \(2\) buffering|Separate input/output buffer counts|"
                            r"not divisible by tiling evenly|E2002")),
    (MOSAIC, re.compile(r"Mosaic failed to compile TPU kernel|\bE20\d\d\b")),
)


def classify_error(text: str) -> str:
    """Maps compiler/lowering error text to a failure kind (see the module constants)."""
    # A scoped OOM message also says "Ran out of memory in memory space vmem": check it first.
    for kind, pattern in _PATTERNS:
        if pattern.search(text):
            return kind
    return OTHER


@functools.cache
def libtpu_available() -> bool:
    """Whether libtpu is installed (``pip install 'jax[tpu]'``), so deviceless compiles work."""
    return (importlib.util.find_spec("libtpu") is not None
            or importlib.util.find_spec("libtpu_nightly") is not None)


_TOPO_LOCK = threading.Lock()


@functools.cache
def _topology_device(topology: str) -> Any:
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    with _TOPO_LOCK:
        topo = topologies.get_topology_desc(topology, platform="tpu",
                                            chips_per_host_bounds=[1, 1, 1])
    return topo.devices[0]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CompileResult:
    ok: bool
    kind: str  # "ok" or one of the failure kinds.
    message: str
    compile_s: float
    scoped_vmem_bytes: int | None = None  # What the compiler allocated (max over kernels).
    estimated_cycles: tuple[int, ...] = ()  # Static cycle estimates, if the dump flag is set.
    # XLA's own per-fusion cost-model cycles (another source, present for XLA fusions only).
    model_cycles: tuple[int, ...] = ()
    hlo_text: str = ""
    kernels_alone: int = 0  # > 0: the sum of this many kernels compiled alone (and the rest).
    kernel_cycles: tuple[int, ...] = ()  # With kernels_alone: each kernel's own program's sum.


# What the compiler actually allocated, in each kernel's backend config (memory space 1 is VMEM).
_SCOPED_RE: Final = re.compile(
    r'used_scoped_memory_configs":\[\{"memory_space":"1","offset":"\d+","size":"(\d+)"')
# The LLO static profile of each compiled op (what libtpu's dump flag adds); 0 where an op had
# none. XLA fusions also carry their cost model's "estimated_cycles" next to their window bounds.
_CYCLES_RE: Final = re.compile(r'bundle_analysis_data":\{"estimated_cycles":"(\d+)"')
_MODEL_CYCLES_RE: Final = re.compile(r'"input_window_bounds":\[[^\]]*\],"estimated_cycles":"(\d+)"')


def compile_deviceless(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                       *, chip: str, keep_text: bool = False,
                       scoped_limit_bytes: int | None = None) -> CompileResult:
    """Compiles ``fn(*args, **kwargs)`` for ``chip`` with no TPU attached.

    Array arguments (arrays or ShapeDtypeStructs) are placed on a compile-only device of the chip's
    topology; other arguments are static. Raises RuntimeError when libtpu is missing.

    ``scoped_limit_bytes`` replaces the chip's default scoped-VMEM limit for kernels that set no
    ``vmem_limit_bytes`` (XLA's ``xla_tpu_scoped_vmem_limit_kib``): raised, every candidate
    compiles and reports the scoped VMEM it needs (the need does not depend on the limit; that is
    how the model's error is measured). Results then say nothing about the default limit.
    """
    from pallas_tune.chips import chip_spec

    spec = chip_spec(chip)
    if spec.platform != "tpu":
        raise ValueError(f"deviceless compile targets TPUs; {chip!r} is a {spec.platform}.")
    if not libtpu_available():
        raise RuntimeError(
            "deviceless TPU compiles need libtpu: pip install 'pallas-tune[tpu]' (jax[tpu])."
        )
    import jax
    from jax.sharding import SingleDeviceSharding

    from pallas_tune import chips
    from pallas_tune.feasibility import inspect as _inspect

    device = _topology_device(spec.topology)
    sharding = SingleDeviceSharding(device)
    flat_fn, arrays = _inspect.array_function(fn, args, kwargs)
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in arrays]

    t0 = time.perf_counter()
    try:
        # The abstract mesh tells Pallas' TPU lowering the target generation (some kernels need
        # it, e.g. for tiling); the placed arguments make XLA compile for the topology device.
        with chips.target(spec.name, abstract_mesh=True):
            lowered = jax.jit(flat_fn).trace(*placed).lower(lowering_platforms=("tpu",))
            options = ({"xla_tpu_scoped_vmem_limit_kib": -(-scoped_limit_bytes // 1024)}
                       if scoped_limit_bytes else None)
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        text = compiled.as_text()
    except Exception as e:  # noqa: BLE001 - compiler failures are results here.
        msg = f"{type(e).__name__}: {e}"
        return CompileResult(ok=False, kind=classify_error(msg), message=msg[:6000],
                             compile_s=time.perf_counter() - t0)
    sizes = [int(s) for s in _SCOPED_RE.findall(text)]
    cycles = tuple(int(c) for c in _CYCLES_RE.findall(text))
    model = tuple(int(c) for c in _MODEL_CYCLES_RE.findall(text))
    return CompileResult(ok=True, kind="ok", message="", compile_s=time.perf_counter() - t0,
                         scoped_vmem_bytes=max(sizes) if sizes else None,
                         estimated_cycles=cycles, model_cycles=model,
                         hlo_text=text if keep_text else "")


def kernel_calls(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
                 ) -> tuple[list[tuple[Callable[..., Any], list[Any]]], Any] | None:
    """``fn``'s program split where it calls two or more ``pallas_call``\\ s at its top level
    (a backward's dK/dV and dQ passes, its dx and dy products): ``(kernels, rest)``, each kernel
    a function of its own operands with those operands' shapes, and ``rest`` the program's
    other ops as one such pair (the kernels' operands made, their results used; None when
    there are none). None for any other program, which compiles whole: one kernel, a kernel
    whose result is dropped (the compiler drops it too), a literal operand, or kernels nested
    in another op."""
    import jax
    from jax.extend.core import Literal

    from pallas_tune.feasibility import inspect as _inspect

    flat_fn, arrays = _inspect.array_function(fn, args, kwargs)
    closed = jax.make_jaxpr(flat_fn)(*arrays)
    jaxpr = closed.jaxpr
    kernels = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
    others = [e for e in jaxpr.eqns if e.primitive.name != "pallas_call"]
    if len(kernels) < 2 or any(isinstance(v, Literal) for e in kernels for v in e.invars):
        return None
    used = {id(v) for v in jaxpr.outvars} | {id(v) for e in jaxpr.eqns for v in e.invars}
    if any(id(v) not in used for e in kernels for v in e.outvars) or any(
            next(_inspect._walk(sub), None) for e in others
            for sub in _inspect._subjaxprs(e.params)):
        return None
    calls = []
    for e in kernels:
        def one(*operands: Any, _e: Any = e) -> Any:
            return _e.primitive.bind(*operands, **_e.params)

        calls.append((one, [_struct(v) for v in e.invars]))
    return calls, (_rest(closed, kernels, others) if others else None)


def _struct(v: Any) -> Any:
    import jax

    return jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)


def _rest(closed: Any, kernels: Sequence[Any], others: Sequence[Any]
          ) -> tuple[Callable[..., Any], list[Any]]:
    """The program's ops other than ``kernels``, as a function of the program's inputs and the
    kernels' results, returning what the kernels take from those ops and the program's outputs
    those ops make (so that none is dropped)."""
    from jax.extend.core import ClosedJaxpr, jaxpr_as_fun

    jaxpr = closed.jaxpr
    made = {id(v) for e in others for v in e.outvars}
    ins = list(jaxpr.invars) + [v for e in kernels for v in e.outvars]
    outs = list({id(v): v for v in [*(v for e in kernels for v in e.invars), *jaxpr.outvars]
                 if id(v) in made}.values())
    rest = jaxpr.replace(invars=ins, outvars=outs, eqns=list(others))
    return jaxpr_as_fun(ClosedJaxpr(rest, closed.consts)), [_struct(v) for v in ins]


def compile_per_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                     *, chip: str) -> CompileResult | None:
    """Compiles each kernel of a program of several (:func:`kernel_calls`) in a program of its
    own, and the program's other ops in one more, and sums what the compiler reports; None
    for any other program.

    Why: libtpu's static profile of a program holding two large kernels can cost far more than
    the two profiled alone (measured, libtpu 0.0.42 and 0.0.50: matmul_bwd at 4096x4096x6144
    with 1024 tiles, 17.6 GB and 101 s whole; 2.2 GB and 17 s for both kernels alone, one
    after the other), or abort (libtpu 0.0.50: flash_attention_bwd, causal with GQA, from
    2048 tokens: a check failure in its static profile; each pass alone estimates fine). The
    sum is near a whole compile's: there the compiler hides part of a kernel's first DMAs
    behind the kernel before it, by an amount that moves with the libtpu version (measured,
    matmul_bwd at 2048x1024x1536 with 512 tiles: whole 1% below the sum on 0.0.50, 23%
    above it on 0.0.42); each kernel's own figure is unchanged. The other ops (e.g. the
    backward's row statistics) are compiled apart from the kernels they feed."""
    from pallas_tune import chips

    with chips.target(chips.normalize_chip(chip), abstract_mesh=True):  # Kernels may ask it.
        split = kernel_calls(fn, args, kwargs)
    if split is None:
        return None
    kernels, rest = split
    results = []
    for one, operands in kernels + ([rest] if rest is not None else []):
        r = compile_deviceless(one, operands, {}, chip=chip)
        if not r.ok:
            return dataclasses.replace(r, compile_s=sum(x.compile_s for x in results) + r.compile_s)
        results.append(r)
    scoped = [r.scoped_vmem_bytes for r in results if r.scoped_vmem_bytes is not None]
    return CompileResult(ok=True, kind="ok", message="",
                         compile_s=sum(r.compile_s for r in results),
                         scoped_vmem_bytes=max(scoped) if scoped else None,
                         estimated_cycles=tuple(c for r in results for c in r.estimated_cycles),
                         model_cycles=tuple(c for r in results for c in r.model_cycles),
                         kernels_alone=len(kernels),
                         kernel_cycles=tuple(sum(r.estimated_cycles)
                                             for r in results[:len(kernels)]))
