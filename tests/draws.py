"""Random test inputs drawn with numpy, not ``jax.random``: ``jax.random.normal`` compiles a
program for every new shape (0.3 to 0.5 s each on JAX 0.12's CPU backend), which the
property tests, drawing new shapes per example, paid many times over."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["normal", "normals"]


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
    """Standard normal values (times ``scale``) of ``shape``, drawn in float32 from ``seed``,
    then cast to ``dtype`` (a JAX array)."""
    x = np.random.default_rng(seed).standard_normal(shape, np.float32)
    return jnp.asarray(x * np.float32(scale), dtype)


def normals(seed, shapes, dtype=jnp.float32, scale=1.0):
    """One :func:`normal` array per shape, each from its own stream of ``seed``."""
    streams = np.random.SeedSequence(seed).spawn(len(shapes))
    return [jnp.asarray(np.random.default_rng(s).standard_normal(shape, np.float32)
                        * np.float32(scale), dtype) for s, shape in zip(streams, shapes)]
