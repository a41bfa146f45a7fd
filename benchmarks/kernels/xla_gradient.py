"""XLA's gradient of a kernel's plain-JAX reference, as a function the estimate workers import.

``xla_gradient(*args, g, forward="module:reference", **kwargs)`` is ``jax.vjp`` of the reference
at the forward's arguments ``args`` for the cotangent ``g`` (positional and last: keywords are
static in a compile). It is what a kernel declaring ``backward="xla"`` runs
(``pallas_tune.runtime.vjp``), and the XLA column of benchmarks/kernels/training_shapes.py's
backward rows. It has a module of its own, not the script, so that worker processes import it by
name.
"""

from __future__ import annotations

from typing import Any


def xla_gradient(*args_and_g: Any, forward: str, **kwargs: Any) -> tuple[Any, ...]:
    """The cotangents of ``forward``'s array arguments (None for integer ones)."""
    from pallas_tune.runtime import vjp as _vjp
    from pallas_tune._refs import load

    *args, g = args_and_g
    where = [i for i, a in enumerate(args) if hasattr(a, "shape")]
    return _vjp._xla_backward(load(forward), list(args), kwargs, g, where)


def ragged_dot_grouped(lhs: Any, rhs: Any, group_sizes: Any) -> Any:
    """XLA's own grouped matmul, ``jax.lax.ragged_dot`` (f32 accumulation, cast to lhs's dtype):
    the XLA alternative benchmarks/kernels/grouped_xla.py sets beside the tuned ``grouped_matmul``
    (whose reference, a per-row gather of expert weights, is a correctness oracle)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                              preferred_element_type=jnp.float32).astype(lhs.dtype)
