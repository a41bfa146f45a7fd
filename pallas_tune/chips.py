"""Which chip a call runs on (or is compiled for), named the way cache files are named.

The chip name is normalised from ``device_kind`` ("TPU v6 lite" → ``tpu_v6e``,
"NVIDIA H100 80GB HBM3" → ``nvidia_h100``, "cpu" → ``cpu``). It is detected once per process;
:func:`target` overrides it for code that lowers or compiles for a TPU from a CPU host.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Iterator
from typing import Any, Final

__all__ = ["current_chip", "normalize_chip", "should_interpret", "target", "tpu_device_kind"]

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
        return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    except (AttributeError, TypeError):  # Older JAX without abstract devices.
        return None


def _abstract_mesh_platform() -> str | None:
    import jax

    get = getattr(jax.sharding, "get_abstract_mesh", None)
    if get is None:
        return None
    try:
        device = getattr(get(), "abstract_device", None)
    except Exception:  # noqa: BLE001 - no mesh context is fine.
        return None
    return getattr(device, "platform", None)


def _detected_chip() -> str:
    import jax

    return normalize_chip(jax.devices()[0].device_kind)


def _default_backend() -> str:
    import jax

    return jax.default_backend()


# Process-wide facts read once (the chip, the backend and the knobs); see _settings.reload().
_HOST: dict[str, object] = {}


def _refresh() -> None:
    _HOST.clear()


def _host() -> dict[str, object]:
    if not _HOST:
        from pallas_tune import _settings

        override = _settings.chip_override()
        _HOST["chip"] = normalize_chip(override) if override else _detected_chip()
        _HOST["interpret"] = _settings.interpret()
        _HOST["cpu"] = _default_backend() == "cpu"
    return _HOST


def current_chip() -> str:
    """The chip whose cache entries a call resolves against.

    Order: the innermost :func:`target`, then ``PALLAS_TUNE_CHIP``, then the first local device.
    """
    t = _TARGET.get()
    if t is not None:
        return t
    return (_HOST or _host())["chip"]  # type: ignore[return-value]


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
    return _abstract_mesh_platform() not in ("tpu", "gpu")
