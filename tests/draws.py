"""Random test inputs drawn with numpy, not ``jax.random``: ``jax.random.normal`` compiles a
program for every new shape (0.3 to 0.5 s each on JAX 0.12's CPU backend), which the
property tests, drawing new shapes per example, paid many times over. The check scripts run in
subprocesses import it too (after setting their device count)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["normal", "normals", "standard"]


def standard(seed, shape, scale=1.0):
    """Standard normal values (times ``scale``) of ``shape`` from ``seed``: a float32 numpy
    array (for inputs built further in numpy)."""
    gen = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    return gen.standard_normal(shape, np.float32) * np.float32(scale)


def normal(seed, shape, dtype=jnp.float32, scale=1.0):
    """:func:`standard`'s values cast to ``dtype``: a JAX array."""
    return jnp.asarray(standard(seed, shape, scale), dtype)


def normals(seed, shapes, dtype=jnp.float32, scale=1.0):
    """One :func:`normal` array per shape, each from its own stream of ``seed``."""
    streams = np.random.SeedSequence(seed).spawn(len(shapes))
    return [normal(np.random.default_rng(s), shape, dtype, scale)
            for s, shape in zip(streams, shapes, strict=True)]
