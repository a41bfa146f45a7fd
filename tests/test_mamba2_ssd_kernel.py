"""Mamba-2 SSD kernel: every accepted shape matches the exact recurrence, in interpret mode.

Property tests draw ragged sequence lengths (1, primes, chunk multiples and their neighbours),
head layouts, groups, configs from the kernel's own space and both float dtypes; the oracle is
the step-by-step recurrence (``mamba2_ssd_scan``), compared by
``pallas_tune.measure.timing.compare`` with NaN/Inf checked explicitly.
``HYPOTHESIS_PROFILE=long`` runs many more examples.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from model_kernel_checks import (
    assert_every_config_lowers_for_tpu,
    assert_matches_reference,
    estimate_sweep,
    oracle,
)
from pallas_tune.kernels.mamba2_ssd import (
    heads_per_block_for,
    mamba2_ssd,
    mamba2_ssd_reference,
    mamba2_ssd_scan,
)

import pallas_tune as pt
from pallas_tune.measure.timing import compare

# (heads, head_dim, groups, d_state): head blocks exist for each (see heads_per_block_for).
LAYOUTS = [(4, 64, 1, 128), (2, 64, 1, 64), (8, 32, 2, 16), (6, 64, 3, 32), (3, 128, 1, 8),
           (1, 16, 1, 8)]
LENGTHS = [1, 2, 7, 61, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 513]


def _inputs(b, t, h, p, g, n, dtype, seed):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s, dtype=np.float32)  # noqa: E731
    x = jnp.asarray(f(b, t, h * p)).astype(dtype)
    dt = jnp.asarray(np.log1p(np.exp(f(b, t, h) - 1.0)))  # softplus: positive steps
    A = jnp.asarray(-np.exp(rng.uniform(0.0, 2.5, h)).astype(np.float32))
    B = jnp.asarray(f(b, t, g * n) / np.sqrt(n)).astype(dtype)
    C = jnp.asarray(f(b, t, g * n) / np.sqrt(n)).astype(dtype)
    D = jnp.asarray(f(h))
    return x, dt, A, B, C, D


@st.composite
def cases(draw):
    layout = draw(st.sampled_from(LAYOUTS))
    t = draw(st.one_of(st.sampled_from(LENGTHS), st.integers(1, 600)))
    config = draw(st.sampled_from([dict(c) for c in mamba2_ssd.space]))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    return draw(st.integers(1, 2)), t, layout, config, dtype, draw(st.integers(0, 2**16))


@given(case=cases())
@example(case=(1, 300, (4, 64, 1, 128), dict(chunk=128, heads_per_block=2), jnp.float32, 0))
@example(case=(2, 129, (8, 32, 2, 16), dict(chunk=128, heads_per_block=16), jnp.bfloat16, 1))
@example(case=(1, 1, (1, 16, 1, 8), dict(chunk=512, heads_per_block=1), jnp.float32, 2))
def test_matches_recurrence(case):
    b, t, (h, p, g, n), config, dtype, seed = case
    args = _inputs(b, t, h, p, g, n, dtype, seed)
    assert_matches_reference(mamba2_ssd(*args, groups=g, **config),
                             oracle(mamba2_ssd_scan, *args, groups=g))


@pytest.mark.parametrize("t,chunk", [(1, 256), (100, 64), (256, 256), (257, 128), (700, 64)])
def test_chunked_reference_is_the_recurrence(t, chunk):
    args = _inputs(2, t, 4, 32, 2, 16, jnp.float32, t)
    ok, err, why = compare(mamba2_ssd_reference(*args, groups=2, chunk=chunk),
                           mamba2_ssd_scan(*args, groups=2))
    assert ok, why


def test_head_block_choice():
    assert heads_per_block_for(4, heads=80, groups=1, head_dim=64) == 4
    assert heads_per_block_for(3, heads=80, groups=1, head_dim=64) == 2  # Odd: 192 lanes.
    assert heads_per_block_for(1, heads=80, groups=1, head_dim=64) == 2  # Smallest above.
    assert heads_per_block_for(16, heads=8, groups=1, head_dim=64) == 8
    assert heads_per_block_for(2, heads=3, groups=1, head_dim=32) == 3  # All heads.
    with pytest.raises(ValueError, match="no head block fits"):
        heads_per_block_for(4, heads=6, groups=3, head_dim=32)


def test_bad_shapes_are_clear_errors():
    x, dt, A, B, C, D = _inputs(1, 64, 4, 64, 1, 16, jnp.float32, 0)
    with pytest.raises(ValueError, match="shapes do not match"):
        mamba2_ssd(x, dt[:, :, :3], A, B, C, D, chunk=64, heads_per_block=2)
    with pytest.raises(ValueError, match="groups=3"):
        mamba2_ssd(x, dt, A, B, C, D, groups=3, chunk=64, heads_per_block=2)
    with pytest.raises(pt.InvalidConfig, match="multiple of 128"):
        mamba2_ssd(x, dt, A, B, C, D, chunk=32, heads_per_block=2)
    x, dt, A, B, C, D = _inputs(1, 64, 6, 32, 3, 16, jnp.float32, 0)
    with pytest.raises(ValueError, match="no head block fits"):
        mamba2_ssd(x, dt, A, B, C, D, groups=3, chunk=64, heads_per_block=2)


def test_lowers_for_tpu_at_mamba2_2_7b():
    S = jax.ShapeDtypeStruct
    args = (S((1, 2048, 5120), jnp.bfloat16), S((1, 2048, 80), jnp.float32),
            S((80,), jnp.float32), S((1, 2048, 128), jnp.bfloat16),
            S((1, 2048, 128), jnp.bfloat16), S((80,), jnp.float32))
    assert_every_config_lowers_for_tpu(mamba2_ssd, args)


@pytest.mark.libtpu
def test_sweep_with_the_compiler_estimate(cache_dir, capsys):
    shapes = ("x=1x512x512:bfloat16,dt=1x512x8:float32,A=8:float32,B=1x512x128:bfloat16,"
              "C=1x512x128:bfloat16,D=8:float32")
    rc, out, _ = estimate_sweep("pallas_tune.kernels.mamba2_ssd:mamba2_ssd", shapes, capsys)
    assert rc == 0, out
    (path,) = cache_dir.glob("tpu_v6e/*mamba2_ssd*.estimate.json")
    (entry,) = json.loads(path.read_text())["entries"].values()
    assert entry["provenance"]["kind"] == "estimate" and entry["median_ms"] > 0
