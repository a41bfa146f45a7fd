"""Chips: which one a call runs on (or is compiled for), its facts, and interpret mode.

The chip name is normalised from ``device_kind`` ("TPU v6 lite" → ``tpu_v6e``,
"NVIDIA H100 80GB HBM3" → ``nvidia_h100``, "cpu" → ``cpu``). It is detected once per process;
:func:`target` overrides it for code that lowers or compiles for a TPU from a CPU host.
:func:`chip_spec` gives a chip's hardware facts (:class:`ChipSpec`); this module is their only
home. :class:`interpret_mode` and :func:`should_interpret` say how kernels run on a CPU host.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Iterator
from typing import Any, Final

from pallas_tune import _settings

__all__ = [
    "ChipSpec", "chip_spec", "current_chip", "interpret_mode", "known_chips", "normalize_chip",
    "recognized", "should_interpret", "target", "tpu_device_kind"
]

# Canonical chip name -> device_kind strings seen from jax (notes/pallas-on-cpu.md §6).
_TPU_KINDS: Final[dict[str, tuple[str, ...]]] = {
    "tpu_v2": ("TPU v2",),
    "tpu_v3": ("TPU v3",),
    "tpu_v4": ("TPU v4",),
    "tpu_v4i": ("TPU v4 lite",),
    "tpu_v5e": ("TPU v5 lite", "TPU v5e"),
    "tpu_v5p": ("TPU v5", "TPU v5p"),
    "tpu_v6e": ("TPU v6 lite", "TPU v6e"),
    "tpu_7x": ("TPU7x", "TPU7", "TPU v7", "TPU v7x"),
}
_BY_KIND: Final = {k.lower(): name for name, kinds in _TPU_KINDS.items() for k in kinds}


def normalize_chip(name: str) -> str:
    """Normalises a device_kind or short name ("v6e", "TPU v6 lite", "tpu_v6e") to a chip name.

    >>> normalize_chip("TPU v6 lite"), normalize_chip("v5p"), normalize_chip("NVIDIA H100 80GB HBM3")
    ('tpu_v6e', 'tpu_v5p', 'nvidia_h100')
    """
    s = name.strip()
    low = s.lower()
    if low in _BY_KIND:
        return _BY_KIND[low]
    if low in _TPU_KINDS:
        return low
    short = low.removeprefix("tpu").strip(" _-")
    for cand in (f"tpu_{short}", f"tpu_v{short}"):
        if cand in _TPU_KINDS:
            return cand
    m = re.match(r"nvidia\s+([a-z]+\d+[a-z]*)", low)
    if m:
        return f"nvidia_{m.group(1)}"
    if low in ("cpu", "host"):
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "_", low).strip("_")
    return slug or "unknown"


def tpu_device_kind(chip: str) -> str:
    """The canonical device_kind string of a TPU chip name ("v6e" → "TPU v6 lite")."""
    name = normalize_chip(chip)
    if name not in _TPU_KINDS:
        raise ValueError(f"{chip!r} is not a known TPU chip; known: {sorted(_TPU_KINDS)}.")
    return _TPU_KINDS[name][0]


_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("pallas_tune_target", default=None)


@contextlib.contextmanager
def target(chip: str, *, abstract_mesh: bool = True) -> Iterator[str]:
    """Compiles for ``chip`` from this host: cache lookups use its configs, kernels are not interpreted.

    Use it to lower or compile ahead of time (or deviceless) for a TPU from a CPU host::

        with pallas_tune.target("v6e"):
            jax.jit(matmul).trace(x, y).lower(lowering_platforms=("tpu",))

    Args:
      chip: a chip name or device_kind ("v6e", "TPU v6 lite").
      abstract_mesh: for TPU chips, also enter ``jax.sharding.use_abstract_mesh`` with an abstract
        device of that kind, so that Pallas' TPU lowering knows the target generation.
    """
    name = normalize_chip(chip)
    token = _TARGET.set(name)
    try:
        with contextlib.ExitStack() as stack:
            if abstract_mesh and name in _TPU_KINDS:
                mesh = _abstract_tpu_mesh(name)
                if mesh is not None:
                    import jax

                    stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
            yield name
    finally:
        _TARGET.reset(token)


def _abstract_tpu_mesh(name: str) -> Any:
    import jax

    try:
        device = jax.sharding.AbstractDevice(
            device_kind=tpu_device_kind(name), num_cores=1, platform="tpu"
        )
        # Auto, not JAX 0.12's default Explicit: under an Explicit mesh every op needs an
        # explicit sharding rule, and some XLA references have none (lax.ragged_dot: "Explicit
        # sharding inference for ragged_dot_general is not currently implemented").
        auto = getattr(jax.sharding, "AxisType", None)
        kinds = {"axis_types": (auto.Auto,)} if auto is not None else {}
        return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device, **kinds)
    except (AttributeError, TypeError):  # Older JAX without abstract devices.
        return None


def _abstract_mesh_device() -> Any:
    """The device of the mesh being traced for (a shard_map's, a deviceless topology's)."""
    import jax

    get = getattr(jax.sharding, "get_abstract_mesh", None)
    try:
        return getattr(get(), "abstract_device", None) if get is not None else None
    except Exception:  # noqa: BLE001 - no mesh context is fine.
        return None


def _detected_chip() -> str:
    import jax

    return normalize_chip(jax.devices()[0].device_kind)


def _default_backend() -> str:
    import jax

    return jax.default_backend()


# Process-wide facts read once (the chip, the backend and the knobs); see _settings.reload().
_HOST: dict[str, object] = {}


@_settings.on_reload
def _refresh() -> None:
    _HOST.clear()


def _host() -> dict[str, object]:
    if not _HOST:
        override = _settings.chip_override()
        _HOST["chip"] = normalize_chip(override) if override else _detected_chip()
        _HOST["interpret"] = _settings.interpret()
        _HOST["cpu"] = _default_backend() == "cpu"
    return _HOST


def current_chip() -> str:
    """The chip whose cache entries a call resolves against.

    Order: the innermost :func:`target`; on a CPU host, the TPU or GPU of the mesh traced for
    (a deviceless multi-chip compile); ``PALLAS_TUNE_CHIP``; the first local device.
    """
    t = _TARGET.get()
    if t is not None:
        return t
    host = _HOST or _host()
    if host["cpu"]:  # On a CPU host, a mesh of TPU devices (deviceless compiles) is the chip.
        device = _abstract_mesh_device()
        if getattr(device, "platform", None) in ("tpu", "gpu") and device.device_kind:
            return normalize_chip(device.device_kind)
    return host["chip"]  # type: ignore[no-any-return]


def should_interpret() -> bool:
    """Whether Pallas kernels traced now should run in interpret mode.

    ``PALLAS_TUNE_INTERPRET=1/0`` forces it; otherwise kernels are interpreted when the default
    backend is the CPU, unless a :func:`target` or an abstract TPU mesh says we compile for a TPU.
    """
    host = _HOST or _host()
    setting = host["interpret"]
    if setting != "auto":
        return setting == "on"
    if not host["cpu"] or _TARGET.get() is not None:
        return False
    return getattr(_abstract_mesh_device(), "platform", None) not in ("tpu", "gpu")


# ---- interpret mode ------------------------------------------------------------------------

def _interpret_state() -> Any:
    """JAX's interpret-mode override, read when a pallas_call is traced.

    Setting it to ``True`` selects the HLO interpreter. ``pltpu.force_tpu_interpret_mode()``
    sets an ``InterpretParams`` instead, which selects the TPU simulator: 12-20x slower on the
    shipped matmul (benchmarks/runtime/interpret_modes.py).
    """
    from jax._src import config as jax_config

    return jax_config.pallas_tpu_interpret_mode_context_manager


class interpret_mode:  # noqa: N801 - used like a function, as a context manager.
    """Context manager: traces Pallas kernels inside it in interpret mode (HLO interpreter)."""

    __slots__ = ("_prev", "_active")
    _state: Any = None

    def __enter__(self) -> None:
        state = interpret_mode._state
        if state is None:
            state = interpret_mode._state = _interpret_state()
        self._active = not state.value
        if self._active:  # Keep a user's own interpret setting (e.g. InterpretParams).
            self._prev = state.swap_local(True)

    def __exit__(self, *exc: Any) -> None:
        if self._active:
            interpret_mode._state.set_local(self._prev)


# ---- chip facts ---------------------------------------------------------------------------
# One table, the only home of hardware numbers in pallas-tune. TPU rows take JAX's own
# ``pltpu.get_tpu_info_for_chip`` record where the installed JAX has it (per-TensorCore VMEM,
# SMEM, lanes, sublanes, MXU, peak ops, HBM), and add what JAX does not carry: the compiler's
# default scoped-VMEM limit and the usable physical VMEM, both measured with a deviceless libtpu
# 0.0.50.1 compile (notes/pallas-on-cpu.md §0.2), and the deviceless topology name. Without that
# JAX API the fallback numbers below (copied from the same JAX table) are used; ``ChipSpec.source``
# says which.

MiB: Final = 1024 * 1024
KiB: Final = 1024


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ChipSpec:
    """Hardware facts of one chip. Memory and throughput are per TensorCore unless named _chip."""

    name: str  # Canonical pallas-tune name: tpu_v6e, nvidia_h100, cpu.
    device_kind: str
    platform: str  # "tpu", "gpu" or "cpu".
    generation: int = 0
    tensorcores_per_chip: int = 1
    megacore: bool = False
    # TPU memory.
    vmem_bytes: int = 0
    scoped_vmem_default_bytes: int = 0  # The compiler's limit when a kernel sets none.
    vmem_usable_bytes: int = 0  # The most vmem_limit_bytes can raise it to.
    smem_bytes: int = 0
    # TPU vector and matrix units.
    lanes: int = 128
    sublanes: int = 8
    vregs: int = 64  # Not in JAX; 32 on v4 (scaling book), 64 assumed later. A soft signal only.
    mxu_dim: int = 128
    num_mxus: int = 0
    # Throughput.
    bf16_flops: float = 0.0
    int8_ops: float = 0.0
    fp8_flops: float = 0.0
    hbm_bw_bytes_per_s: float = 0.0
    hbm_bytes: int = 0
    clock_hz: float = 0.0  # For converting compiler cycle estimates (0: unknown).
    # GPU.
    sms: int = 0
    smem_per_block_bytes: int = 0
    registers_per_sm: int = 0
    # Deviceless compile.
    topology: str = ""
    source: str = "pallas-tune table"

    @property
    def vreg_file_bytes(self) -> int:
        return self.vregs * self.sublanes * self.lanes * 4

    def sublane_tiling(self, itemsize: int) -> int:
        """Rows of the native (sublane, 128) tile for an element size (as in jax tpu_info)."""
        bits = itemsize * 8
        if self.platform != "tpu":
            return 1
        if self.generation < 7 and bits in (16, 32):
            return self.sublanes
        return self.sublanes * max(1, 32 // bits)

    def ridge_flops_per_byte(self) -> float:
        return self.bf16_flops / self.hbm_bw_bytes_per_s if self.hbm_bw_bytes_per_s else 0.0


# Per chip: JAX ChipVersion value, deviceless topology, default scoped VMEM (MiB), usable physical
# VMEM (MiB), TensorCores, and the clock used to turn compiler cycle estimates into time. Clocks:
# v4/v5e/v5p = peak bf16 FLOP/s per TensorCore / (4 MXUs x 128^2 MACs x 2); v6e = 1.75 GHz, from
# the compiler estimate's own MXU asymptote (notes/libtpu-static-cost.md; the same formula with
# JAX's 2 MXUs of 256^2 gives 3.5 GHz, so the estimate models 4 MXU-equivalents). 7x: the same
# derivation: its estimate's MXU asymptote is the same (230k MAC/cycle for an 8192^3 bf16 Pallas
# matmul with 1024 tiles, 231k on v6e; libtpu 0.0.50.1), so 4 x 256^2 MACs at the bf16 peak of
# one 7x device (1.155e15 FLOP/s) gives 2.2 GHz. Like v6e's, a calibration, not a measured clock.
_TPU: Final[dict[str, dict[str, Any]]] = {
    "tpu_v4": dict(version="v4", topology="v4:1x1x1", scoped=16, usable=16.0, cores=2,
                   megacore=True, vregs=32, clock_hz=1.05e9,
                   fallback=dict(generation=4, vmem=16, smem=1024, mxu=128, n_mxu=4,
                                 bf16=1.38e14, int8=0, fp8=0, bw=6.15e11, hbm=17.2e9)),
    "tpu_v5e": dict(version="v5e", topology="v5e:1x1", scoped=16, usable=127.9375, cores=1,
                    megacore=False, clock_hz=1.5e9,
                    fallback=dict(generation=5, vmem=128, smem=1024, mxu=128, n_mxu=4,
                                  bf16=1.97e14, int8=3.94e14, fp8=0, bw=8.2e11, hbm=17.2e9)),
    "tpu_v5p": dict(version="v5p", topology="v5p:1x1x1", scoped=16, usable=63.9375, cores=2,
                    megacore=True, clock_hz=1.75e9,
                    fallback=dict(generation=5, vmem=64, smem=1024, mxu=128, n_mxu=4,
                                  bf16=2.30e14, int8=4.59e14, fp8=0, bw=1.23e12, hbm=51.5e9)),
    "tpu_v6e": dict(version="v6e", topology="v6e:1x1", scoped=32, usable=127.9375, cores=1,
                    megacore=False, clock_hz=1.75e9,
                    fallback=dict(generation=6, vmem=128, smem=1024, mxu=256, n_mxu=2,
                                  bf16=9.20e14, int8=1.84e15, fp8=9.20e14, bw=1.64e12,
                                  hbm=34.4e9)),
    "tpu_7x": dict(version="7x", topology="tpu7x:1x1x1", scoped=32, usable=63.9375, cores=2,
                   megacore=False, clock_hz=2.2e9,
                   fallback=dict(generation=7, vmem=64, smem=1024, mxu=256, n_mxu=2,
                                 bf16=1.155e15, int8=0, fp8=2.30e15, bw=3.7e12, hbm=103.0e9)),
}
_DEVICE_KIND: Final = {"tpu_v4": "TPU v4", "tpu_v5e": "TPU v5 lite", "tpu_v5p": "TPU v5",
                       "tpu_v6e": "TPU v6 lite", "tpu_7x": "TPU7x"}

# NVIDIA (Pallas Mosaic GPU / Triton): SM count, max dynamic shared memory per block, registers.
_GPU: Final[dict[str, dict[str, Any]]] = {
    "nvidia_h100": dict(device_kind="NVIDIA H100 80GB HBM3", sms=132, smem=227 * KiB,
                        regs=65536, bf16=9.89e14, bw=3.35e12, hbm=80e9),
    "nvidia_h200": dict(device_kind="NVIDIA H200", sms=132, smem=227 * KiB, regs=65536,
                        bf16=9.89e14, bw=4.8e12, hbm=141e9),
    "nvidia_a100": dict(device_kind="NVIDIA A100-SXM4-80GB", sms=108, smem=163 * KiB,
                        regs=65536, bf16=3.12e14, bw=2.04e12, hbm=80e9),
}


def _jax_tpu_info(version: str) -> Any | None:
    try:
        from jax.experimental.pallas import tpu as pltpu

        cv = pltpu.ChipVersion(version)
        return pltpu.get_tpu_info_for_chip(cv, 1)
    except Exception:  # noqa: BLE001 - older JAX: no table, use ours.
        return None


def chip_spec(chip: str) -> ChipSpec:
    """The ChipSpec of a chip name or device_kind ("v6e", "TPU v6 lite", "nvidia_h100", "cpu")."""
    name = normalize_chip(chip)
    if name not in known_chips():
        raise ValueError(
            f"unknown chip {chip!r} (normalised {name!r}); known: {known_chips()}. Use a short "
            "name such as 'v6e' or a device_kind such as 'TPU v6 lite'."
        )
    return _chip_spec(name)


@functools.cache
def _chip_spec(name: str) -> ChipSpec:
    if name in _TPU:
        row = _TPU[name]
        fb = row["fallback"]
        info = _jax_tpu_info(row["version"])
        common = dict(
            name=name, device_kind=_DEVICE_KIND[name], platform="tpu",
            tensorcores_per_chip=row["cores"], megacore=row["megacore"],
            scoped_vmem_default_bytes=row["scoped"] * MiB,
            vmem_usable_bytes=int(row["usable"] * MiB), topology=row["topology"],
            vregs=row.get("vregs", 64), clock_hz=row.get("clock_hz", 0.0),
        )
        if info is not None:
            return ChipSpec(
                **common, generation=info.generation, vmem_bytes=info.vmem_capacity_bytes,
                smem_bytes=info.smem_capacity_bytes, lanes=info.num_lanes,
                sublanes=info.num_sublanes, mxu_dim=info.mxu_column_size,
                num_mxus=info.num_mxus, bf16_flops=float(info.bf16_ops_per_second),
                int8_ops=float(info.int8_ops_per_second),
                fp8_flops=float(info.fp8_ops_per_second),
                hbm_bw_bytes_per_s=float(info.mem_bw_bytes_per_second),
                hbm_bytes=int(info.hbm_capacity_bytes), source="jax tpu_info + pallas-tune")
        return ChipSpec(
            **common, generation=fb["generation"], vmem_bytes=fb["vmem"] * MiB,
            smem_bytes=fb["smem"] * KiB, mxu_dim=fb["mxu"], num_mxus=fb["n_mxu"],
            bf16_flops=fb["bf16"], int8_ops=fb["int8"], fp8_flops=fb["fp8"],
            hbm_bw_bytes_per_s=fb["bw"], hbm_bytes=int(fb["hbm"]))
    if name in _GPU:
        g = _GPU[name]
        return ChipSpec(name=name, device_kind=g["device_kind"], platform="gpu", sms=g["sms"],
                        smem_per_block_bytes=g["smem"], registers_per_sm=g["regs"],
                        bf16_flops=g["bf16"], hbm_bw_bytes_per_s=g["bw"], hbm_bytes=int(g["hbm"]),
                        lanes=32, sublanes=1)
    assert name == "cpu", name  # chip_spec admits only known names.
    # Interpret mode: no VMEM limit applies; a kernel's blocks live in host memory.
    return ChipSpec(name="cpu", device_kind="cpu", platform="cpu")


def known_chips() -> list[str]:
    return [*_TPU, *_GPU, "cpu"]


_VENDORS: Final = ("tpu_", "nvidia_", "amd_")


def recognized(chip: str) -> bool:
    """Whether ``chip`` names a chip: a known one, one of a known vendor (a TPU, NVIDIA or AMD
    chip newer than this table), or this host's, if already detected. Never detects it."""
    name = normalize_chip(chip)
    return (name in known_chips() or name.startswith(_VENDORS)
            or name == _HOST.get("chip"))


LIBTPU_DEFAULTS: dict[str, str] = {}  # What ``import pallas_tune`` set (quiet_tpu_probe_env).


def tpu_devices_here() -> bool:
    """Whether a TPU may be here, looked up cheaply (no JAX): a TPU device node (``/dev/accel*``,
    ``/dev/vfio/N``) or a TPU's PCI id (as JAX's hardware_utils reads them). In doubt: yes."""
    import glob
    from pathlib import Path

    with contextlib.suppress(OSError):
        if glob.glob("/dev/accel*") or set(os.listdir("/dev/vfio")) - {"vfio"}:
            return True
    ids = "0x0027 0x0056 0x005e 0x0062 0x0063 0x006f 0x0076".split()  # Google's, 0x1ae0.
    try:  # Other vendors' device ids are not read.
        return any(v.read_text().strip() == "0x1ae0" and (v.parent / "device").read_text().strip()
                   in ids for v in map(Path, glob.glob("/sys/bus/pci/devices/*/vendor")))
    except OSError:
        return True


def quiet_tpu_probe_env() -> dict[str, str]:
    """No TPU here: the unset variables that keep libtpu (JAX loads it wherever installed) from
    printing start-up errors ("Failed to find host bounds") and writing /tmp/tpu_logs (a fatal
    abort's only; our run directories set it back); deviceless compiles unchanged (measured)."""
    if tpu_devices_here():
        return {}
    env = {} if {"TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"} & set(os.environ) else {
        "TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v6e-1"}
    if not {"TPU_LOG_DIR", "TPU_MIN_LOG_LEVEL"} & set(os.environ):
        env["TPU_MIN_LOG_LEVEL"] = "3"
    return env
