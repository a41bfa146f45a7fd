"""``module:qualname`` references to kernels: how worker processes and the CLI find them."""

from __future__ import annotations

import functools
import importlib
from typing import Any

__all__ = ["kernel_ref", "load"]


@functools.cache
def load(ref: str) -> Any:
    """Imports ``module:attr.path``. Raises ValueError, ImportError or AttributeError."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"{ref!r} must be MODULE:NAME, e.g. pallas_tune.kernels.matmul:matmul")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def kernel_ref(kernel: Any) -> str:
    """The reference under which another process can import the kernel (or raise ValueError)."""
    fn = getattr(kernel, "fn", kernel)
    ref = f"{fn.__module__}:{fn.__qualname__}"
    if fn.__module__ == "__main__" or "<locals>" in fn.__qualname__:
        raise ValueError(
            f"measuring or estimating in worker processes needs an importable kernel; {ref} is "
            "not importable. Define it at the top level of an importable module."
        )
    return ref
