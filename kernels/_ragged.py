"""Masks for the last, partial block of a ragged axis, shared by the shipped kernels.

Pallas covers an axis that no block divides with a ``pl.cdiv`` grid: the out-of-bounds part of an
output block is dropped, but the out-of-bounds part of an *input* block holds whatever the buffer
held (NaN in interpret mode, stale data on a TPU). A reduction over such an axis must therefore
overwrite those positions before they reach a sum or a dot: a multiplication by zero is not
enough (``0 * NaN = NaN``). The kernels call these helpers only when the static shapes leave a
remainder, so shapes that divide compile to the same program as without them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["fill_tail"]


def fill_tail(x: jax.Array, valid: int, axis: int, value: float = 0.0) -> jax.Array:
    """``x`` with the positions at and after ``valid`` along ``axis`` replaced by ``value``.

    ``valid`` is a static Python int (the remainder of a ragged axis); a select, not a
    multiplication, so NaN or Inf in the replaced positions does not propagate.
    """
    position = lax.broadcasted_iota(jnp.int32, x.shape, axis)
    return jnp.where(position < valid, x, jnp.asarray(value, x.dtype))
