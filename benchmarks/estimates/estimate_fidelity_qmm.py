"""estimate_fidelity's kernel: tpu-inference's int8 quantized matmul loaded without its package
``__init__`` (which imports vLLM), unmodified and as the proxy libtpu's static profiler can
estimate (see estimate_fidelity's docstring), its stand-in, and the figures other than libtpu's
(pallas-tune's roofline model and correction) computed from it.

tpu-inference is loaded WITHOUT its package ``__init__``: stub package modules whose ``__path__``
is the installed package's directories, and a stub ``tpu_inference.logger``, are put in
``sys.modules`` when this module is imported (so also in the estimate workers, which import it
to load the proxy)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

from estimate_fidelity_space import (  # noqa: E402
    CHIP, MISS_DEFAULT, Blocks, Key, blocks_text, standin_batch_blocks)

DIST = "tpu-inference"
PKG = "tpu_inference"
QMM = f"{PKG}.kernels.quantized_matmul"


# --- Loading tpu-inference without its __init__ (it imports vLLM) -------------------------

@functools.cache
def package_dir() -> str | None:
    """The installed ``tpu_inference`` package directory, from the distribution's file list
    (not by importing it: its ``__init__`` imports vLLM); None if it is not installed. Looked
    up once a process: the list has tens of thousands of files (about 50 ms a lookup)."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == f"{PKG}/__init__.py":
            return os.path.dirname(str(dist.locate_file(f)))
    return None


class _OnceLogger(logging.LoggerAdapter):
    """``init_logger``'s logger: a plain ``logging.getLogger`` with vLLM's ``*_once`` methods,
    which tpu-inference's block-size lookup calls (``get_device_vmem_limit`` on a CPU host)."""

    def __init__(self, name: str):
        super().__init__(logging.getLogger(name), {})
        self._said: set[tuple[str, Any]] = set()

    def _once(self, level: int, msg: str, *args: Any) -> None:
        key = (msg, args)
        if key not in self._said:
            self._said.add(key)
            self.log(level, msg, *args)

    def warning_once(self, msg: str, *args: Any, **_: Any) -> None:
        self._once(logging.WARNING, msg, *args)

    def info_once(self, msg: str, *args: Any, **_: Any) -> None:
        self._once(logging.INFO, msg, *args)

    def debug_once(self, msg: str, *args: Any, **_: Any) -> None:
        self._once(logging.DEBUG, msg, *args)


def _stub_package(name: str, path: str) -> types.ModuleType:
    import importlib.machinery

    module = types.ModuleType(name)
    module.__path__ = [path]
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__spec__.submodule_search_locations = [path]
    module.__file__ = None
    return module


def install_stubs() -> str | None:
    """Puts stub ``tpu_inference``, ``tpu_inference.kernels``,
    ``tpu_inference.kernels.quantized_matmul`` (their ``__path__``: the installed directories,
    so submodules import from the wheel unchanged) and ``tpu_inference.logger`` in
    ``sys.modules``, unless the real package is imported already. Returns the package
    directory, or None if tpu-inference is not installed."""
    root = package_dir()
    if root is None:
        return None
    if PKG in sys.modules and getattr(sys.modules[PKG], "__file__", None):
        return root  # The real package is loaded (vLLM present): nothing to stub.
    for name, path in ((PKG, root), (f"{PKG}.kernels", os.path.join(root, "kernels")),
                       (QMM, os.path.join(root, "kernels", "quantized_matmul"))):
        sys.modules.setdefault(name, _stub_package(name, path))
    if f"{PKG}.logger" not in sys.modules:
        logger = types.ModuleType(f"{PKG}.logger")
        logger.init_logger = _OnceLogger  # type: ignore[attr-defined]
        sys.modules[f"{PKG}.logger"] = logger
        sys.modules[PKG].logger = logger  # type: ignore[attr-defined]
    return root


TPU_INFERENCE_DIR = install_stubs()  # At import: the estimate workers import this script too.


def qmm() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """tpu-inference's quantized-matmul modules: (kernel, util, tuned_block_sizes). The stubs
    are put back first where they were taken out of ``sys.modules`` since this module's import
    (tests do), so that the package ``__init__`` (vLLM) is never imported."""
    import importlib

    install_stubs()
    return tuple(importlib.import_module(f"{QMM}.{m}")  # type: ignore[return-value]
                 for m in ("kernel", "util", "tuned_block_sizes"))


def tpu_inference_version() -> str:
    return bench.version(DIST)


# --- The kernel, unmodified and as the proxy ----------------------------------------------

def proxy_quantize_array(x: Any, x_abs_max: Any, quant_dtype: Any) -> tuple[Any, Any]:
    """``util.quantize_array`` with the scale row and its reciprocal computed in float32, the
    reciprocal cast back to the block's dtype (bf16) before it scales ``x`` (in bf16, as in
    0.32.0); the returned scale is float32 as there. The original computes ``x_abs_max /
    dtype_max`` and ``1 / scale`` on the bf16 row: libtpu 0.0.50's static profiler aborts on
    both (the divide by a packed bf16 constant, then the bf16 reciprocal's ``vpop.eup``), so
    computing only the scale in float32 is not enough."""
    import jax.numpy as jnp

    is_float = jnp.issubdtype(quant_dtype, jnp.floating)
    dtype_info = jnp.finfo(quant_dtype) if is_float else jnp.iinfo(quant_dtype)
    dtype_max = float(dtype_info.max)
    scale = jnp.transpose(x_abs_max.astype(jnp.float32) / dtype_max)
    scale_inv = jnp.nan_to_num(1 / scale, dtype_max)
    return (x * scale_inv.astype(x.dtype)).astype(quant_dtype), scale


@contextlib.contextmanager
def proxy_patch() -> Iterator[None]:
    """``util.quantize_array`` replaced by :func:`proxy_quantize_array` (the attribute of
    tpu-inference's util module object, which the kernel body looks up when traced), with the
    jitted kernel's trace cache cleared on entry and exit so that traces with and without the
    patch never stand in for each other."""
    kernel, util, _ = qmm()
    original = util.quantize_array
    kernel.quantized_matmul_kernel.clear_cache()
    util.quantize_array = proxy_quantize_array
    try:
        yield
    finally:
        util.quantize_array = original
        kernel.quantized_matmul_kernel.clear_cache()


@contextlib.contextmanager
def on_target_chip() -> Iterator[None]:
    """tpu-inference's TPU generation lookup (``tuned_block_sizes.get_tpu_version``, read from
    ``jax.devices()``) answers for the chip pallas-tune compiles for, not for this CPU host.

    The kernel caps its ``vmem_limit_bytes`` by the generation's VMEM limit
    (``DEVICE_VMEM_LIMIT``: 96 MiB on v6e, 48 MiB on v7). On a CPU host the lookup finds no
    TPU and falls back to 96 MiB, so a v7 compile here would admit configs that need 48 to 96
    MiB of scoped VMEM, which the kernel cannot run on a real v7 (its compile there fails with
    the scoped-VMEM OOM): such configs were never candidates for its measured table. Outside
    a target (``pallas_tune.target``, which every deviceless compile enters) nothing changes.
    The jitted kernel's trace cache is cleared on entry and exit, as in :func:`proxy_patch`.
    """
    from pallas_tune import chips

    kernel, _, tbs = qmm()
    original = tbs.get_tpu_version
    spec = chips.chip_spec(chips.current_chip())
    if spec.platform == "tpu" and spec.generation:
        tbs.get_tpu_version = lambda: spec.generation
    # The limit is read when the jitted kernel is traced: a trace for another chip (or none)
    # must not stand in for this one.
    kernel.quantized_matmul_kernel.clear_cache()
    try:
        yield
    finally:
        tbs.get_tpu_version = original
        kernel.quantized_matmul_kernel.clear_cache()


def unmodified_qmm(x: Any, w_q: Any, w_scale: Any, *, batch_block: int, out_block: int,
                   in_block: int) -> Any:
    """tpu-inference's ``quantized_matmul_kernel`` at the given block sizes, unmodified, with
    the activations quantized to the weights' dtype (int8 x int8, or float8_e4m3fn x
    float8_e4m3fn as in its v7 table), traced as on the target chip (:func:`on_target_chip`)."""
    kernel, _, tbs = qmm()
    with on_target_chip():
        return kernel.quantized_matmul_kernel(
            x, w_q, w_scale, x_q_dtype=w_q.dtype,
            tuned_value=tbs.TunedValue(batch_block, out_block, in_block))


def proxy_qmm(x: Any, w_q: Any, w_scale: Any, *, batch_block: int, out_block: int,
              in_block: int) -> Any:
    """The same kernel traced with :func:`proxy_patch` (see the module docstring)."""
    with proxy_patch():
        return unmodified_qmm(x, w_q, w_scale, batch_block=batch_block, out_block=out_block,
                              in_block=in_block)


def operands(key: Key, w_dtype: str = "int8") -> tuple[Any, Any, Any]:
    """x (n_batch, n_in) bf16, w_q (n_out, n_in) int8 (or ``w_dtype``), w_scale (n_out,) f32:
    shapes only."""
    import jax
    import jax.numpy as jnp

    n_batch, n_out, n_in = key
    return (jax.ShapeDtypeStruct((n_batch, n_in), jnp.bfloat16),
            jax.ShapeDtypeStruct((n_out, n_in), jnp.dtype(w_dtype)),
            jax.ShapeDtypeStruct((n_out,), jnp.float32))


def qmm_standin(args: Sequence[Any], kwargs: Mapping[str, Any], config: Mapping[str, int]
                ) -> tuple[list[Any], dict[str, Any], float]:
    """The proxy's stand-in (pallas-tune's ``standin=`` protocol): fewer batch blocks (the
    grid's one parallel axis; every batch block is the same work), see
    :func:`standin_batch_blocks`; returns the smaller operands and the scale."""
    import jax

    x, w_q, w_scale = args
    key = (x.shape[0], w_q.shape[0], x.shape[1])
    blocks = (config["batch_block"], config["out_block"], config["in_block"])
    nb = -(-key[0] // blocks[0])
    keep = standin_batch_blocks(key, blocks)
    rows = min(key[0], keep * blocks[0])
    return [jax.ShapeDtypeStruct((rows, key[2]), x.dtype), w_q, w_scale], dict(kwargs), nb / keep


def proxy_parts() -> Any:
    """The proxy as pallas-tune kernel parts (its function and stand-in), for ``Estimator``."""
    from pallas_tune.measure.candidate import KernelParts

    return KernelParts(name="tpu_inference.quantized_matmul_kernel (proxy)", fn=proxy_qmm,
                       standin=qmm_standin)


def config(blocks: Blocks) -> dict[str, int]:
    return dict(zip(("batch_block", "out_block", "in_block"), blocks, strict=True))

def roofline_figures(key: Key, blocks: Sequence[Blocks]) -> dict[Blocks, float]:
    """pallas-tune's roofline model (seconds) of the unmodified kernel, for configs the model
    accepts (block rules, the VMEM model)."""
    from pallas_tune.measure import candidate as cand

    parts = cand.KernelParts.of(unmodified_qmm)
    args = operands(key)
    out = {}
    for b in blocks:
        s = cand.roofline_time(parts, args, {}, config(b), CHIP)
        if s is not None:
            out[b] = s
    return out


def accepted_calls(key: Key, blocks: Sequence[Blocks], chip: str, w_dtype: str
                   ) -> dict[Blocks, Any]:
    """The unmodified kernel's traced pallas_calls per config (traced for ``chip``, with its
    VMEM limit), or None where it cannot be traced at those blocks or the block rules or the
    VMEM model refuse it (no model figure)."""
    from pallas_tune import chips
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model

    spec, args = chips.chip_spec(chip), operands(key, w_dtype)
    out: dict[Blocks, Any] = {}
    for b in blocks:
        try:
            with chips.target(chip, abstract_mesh=False):  # The chip's VMEM limit.
                calls = _inspect.find_pallas_calls(unmodified_qmm, args, config(b))
        except Exception:  # noqa: BLE001 - not traceable at these blocks: no figure.
            out[b] = None
            continue
        refused = (_inspect.block_rule_violations(calls)
                   or model.model_verdict(calls, spec).status == "infeasible")
        out[b] = None if refused else calls
    return out


def model_figures(key: Key, blocks: Sequence[Blocks], chip: str, w_dtype: str
                  ) -> tuple[dict[Blocks, float], dict[Blocks, float], dict[Blocks, float]]:
    """pallas-tune's roofline model, its model with the constants fitted to libtpu's v6e
    estimates (``feasibility.fitted.V6E``) and with the chip's constants fitted to real-TPU
    winners (``feasibility.fitted.constants_for``: what ``--estimate-fallback model`` ranks
    by), seconds, of the unmodified kernel, for the configs :func:`accepted_calls` accepts;
    one trace per config for all three."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.fitted import V6E, constants_for, fitted_calls
    from pallas_tune.feasibility.roofline import roofline_calls

    spec = chip_spec(chip)
    roof: dict[Blocks, float] = {}
    fitted: dict[Blocks, float] = {}
    public: dict[Blocks, float] = {}
    for b, calls in accepted_calls(key, blocks, chip, w_dtype).items():
        if calls is not None:
            roof[b] = roofline_calls(calls, spec).time_s
            fitted[b] = fitted_calls(calls, spec, V6E)
            public[b] = fitted_calls(calls, spec, constants_for(spec))
    return roof, fitted, public


def corrected_figures(key: Key, proxy_ms: Mapping[Blocks, float]) -> dict[Blocks, float]:
    """The proxy's figures (ms) plus pallas-tune's correction (``measure.correction``: what
    libtpu's v6e estimate leaves out on the chip), its terms read off the UNMODIFIED kernel's
    traced pallas_call (the proxy's differs in one row op, not in its blocks or grid)."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.measure.correction import corrected_ms

    spec, args = chip_spec(CHIP), operands(key)
    out = {}
    for b, ms in proxy_ms.items():
        calls = _inspect.find_pallas_calls(unmodified_qmm, args, config(b))
        out[b] = corrected_ms(ms, calls, spec)[0]
    return out


def unmodified_abort(est: Any, key: Key) -> str:
    """What libtpu's static profile does with the unmodified kernel (one config)."""
    (r,) = est.map(unmodified_qmm, operands(key), {}, [config(MISS_DEFAULT)], CHIP,
                   standin=False)
    if r.ok:
        return f"{blocks_text(MISS_DEFAULT)} at {key}: estimated ({r.cycles} cycles): no abort"
    from pallas_tune.measure.loops import profiler_abort

    signal = re.search(r"signal (SIG\w+)", r.message)
    why = profiler_abort(r.message) or (
        f"the worker died from {signal.group(1)} during the compile" if signal
        else r.message.splitlines()[0][:200])
    return f"at {blocks_text(MISS_DEFAULT)}, key {key}: `ok={r.ok}`, `kind={r.kind}`, {why}"
