"""HSTU attention kernel: every accepted shape matches the plain-JAX reference, in interpret mode.

Property tests draw ragged sequence lengths, head dims, bias tables shorter and longer than the
sequence, configs from the kernel's own space and both float dtypes; outputs are compared by
``pallas_tune.measure.timing.compare`` with NaN/Inf checked explicitly.
``HYPOTHESIS_PROFILE=long`` runs many more examples.
"""

from __future__ import annotations

import math

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
from pallas_tune.kernels._hstu import relative_bias
from pallas_tune.kernels._hstu import table as _table
from pallas_tune.kernels.hstu_attention import hstu_attention, hstu_attention_reference

import pallas_tune as pt

LENGTHS = [1, 2, 7, 61, 127, 128, 129, 255, 256, 257, 383, 385, 513, 640]


def _inputs(b, h, s, d, dv, nb, dtype, seed):
    rng = np.random.default_rng(seed)
    f = lambda *shape: jnp.asarray(rng.standard_normal(shape, dtype=np.float32))  # noqa: E731
    return (f(b, h, s, d).astype(dtype), f(b, h, s, d).astype(dtype),
            f(b, h, s, dv).astype(dtype), f(nb))


@st.composite
def cases(draw):
    s = draw(st.one_of(st.sampled_from(LENGTHS), st.integers(1, 700)))
    d = draw(st.sampled_from([8, 64, 128]))
    dv = draw(st.sampled_from([d, 128]))
    nb = draw(st.sampled_from([1, 7, s, 2 * s + 3]))
    b, h = draw(st.sampled_from([(1, 1), (1, 2), (2, 1)]))
    return ((b, h, s, d, dv, nb),
            draw(st.sampled_from([jnp.float32, jnp.bfloat16])), draw(st.integers(0, 2**16)))


@given(case=cases(), config=st.sampled_from([dict(c) for c in hstu_attention.space]))
@example(case=((1, 1, 700, 128, 128, 700), jnp.float32, 0), config=dict(bq=256, bkv=512))
# Ragged last blocks: the masked path by absolute positions.
@example(case=((1, 2, 640, 128, 128, 640), jnp.float32, 3), config=dict(bq=256, bkv=256))
# Diagonal staircases (bkv divides bq and the sequence): 256-column strips, 128-column strips,
# columns past the diagonal square, blocks wholly below it, bias tables short and long.
@example(case=((1, 1, 1024, 128, 128, 1024), jnp.bfloat16, 5), config=dict(bq=1024, bkv=256))
@example(case=((1, 2, 768, 64, 128, 7), jnp.float32, 6), config=dict(bq=256, bkv=128))
@example(case=((2, 1, 1024, 128, 64, 2051), jnp.float32, 7), config=dict(bq=512, bkv=512))
@example(case=((1, 1, 1100, 64, 128, 2203), jnp.bfloat16, 4), config=dict(bq=512, bkv=512))
@example(case=((1, 1, 300, 64, 128, 7), jnp.bfloat16, 1), config=dict(bq=128, bkv=128))
@example(case=((2, 1, 100, 8, 8, 1), jnp.float32, 2), config=dict(bq=2048, bkv=128))
# A block wholly below the diagonal with bkv >= 1024: 256-column strips, and the bias from the
# table rotated outside the kernel (short table: its last bucket for far distances).
@example(case=((1, 1, 2048, 128, 128, 300), jnp.bfloat16, 8), config=dict(bq=1024, bkv=1024))
# The largest blocks (4096, the model shapes' winners) at a length no block divides: a full
# diagonal staircase of 16 strips, then a ragged second block row and column.
@example(case=((1, 1, 4400, 128, 128, 4400), jnp.float32, 9), config=dict(bq=4096, bkv=4096))
def test_matches_reference(case, config):
    shape, dtype, seed = case
    q, k, v, bias = _inputs(*shape, dtype, seed)
    norm = 1.0 / math.sqrt(shape[2])  # Outputs of order one at every length.
    assert_matches_reference(hstu_attention(q, k, v, bias, norm=norm, **config),
                             oracle(hstu_attention_reference, q, k, v, bias, norm=norm))


def test_defaults_are_hstu_scalings():
    q, k, v, bias = _inputs(1, 1, 256, 64, 64, 256, jnp.float32, 0)
    a = hstu_attention(q, k, v, bias, bq=128, bkv=128)
    b = hstu_attention(q, k, v, bias, alpha=1 / 8.0, norm=1 / 256, bq=128, bkv=128)
    np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.parametrize("pad,length,nb", [(10, 30, 4), (10, 30, 20), (10, 30, 50), (0, 5, 3)])
def test_table_is_the_clamped_bias_by_distance(pad, length, nb):
    bias = jnp.arange(nb, dtype=jnp.float32) + 1
    d = np.arange(length) - pad  # Entry x holds the bias of distance x - pad.
    expected = np.where(d >= 0, np.asarray(bias)[np.clip(d, 0, nb - 1)], 0)
    np.testing.assert_array_equal(_table(bias, pad=pad, length=length)[0], expected)


@given(s=st.integers(1, 300), nb=st.integers(1, 700), seed=st.integers(0, 3))
@example(s=1, nb=1, seed=0)
@example(s=300, nb=7, seed=1)
def test_the_references_bias_is_the_clamped_bias_by_distance_without_a_gather(s, nb, seed):
    """relative_bias(rel_bias, s)[q, k] == rel_bias[clip(q - k, 0, nb - 1)] exactly, for tables
    shorter and longer than the sequence; and the reference XLA compiles has no gather (a gather
    of (s, s) is slow to run and to compile on a TPU: XLA's candidate would be a strawman)."""
    bias = np.random.default_rng(seed).standard_normal(nb).astype(np.float32)
    dist = np.arange(s)[:, None] - np.arange(s)[None, :]
    got = np.asarray(relative_bias(jnp.asarray(bias), s))
    np.testing.assert_array_equal(got, bias[np.clip(dist, 0, nb - 1)])
    q = jax.ShapeDtypeStruct((1, 1, s, 8), jnp.float32)
    jaxpr = jax.make_jaxpr(hstu_attention_reference)(q, q, q, jnp.asarray(bias))
    assert "gather" not in str(jaxpr)


def test_bad_input_is_a_clear_error():
    q, k, v, bias = _inputs(1, 1, 300, 64, 64, 8, jnp.float32, 0)
    with pytest.raises(ValueError, match="shapes do not match"):
        hstu_attention(q, k[:, :, :200], v, bias, bq=128, bkv=128)
    with pytest.raises(ValueError, match="rel_bias"):
        hstu_attention(q, k, v, bias[:0], bq=128, bkv=128)
    with pytest.raises(pt.InvalidConfig, match="multiple of 128"):
        hstu_attention(q, k, v, bias, bq=100, bkv=128)


def test_lowers_for_tpu_at_dlrm_hstu_shapes():
    S = jax.ShapeDtypeStruct
    q = S((1, 4, 2048, 128), jnp.bfloat16)
    args = (q, q, q, S((2048,), jnp.float32))
    assert_every_config_lowers_for_tpu(hstu_attention, args)


@pytest.mark.libtpu
def test_sweep_with_the_compiler_estimate(cache_dir, capsys):
    shapes = ("q=1x2x512x128:bfloat16,k=1x2x512x128:bfloat16,v=1x2x512x128:bfloat16,"
              "rel_bias=512:float32")
    rc, out, _ = estimate_sweep("pallas_tune.kernels.hstu_attention:hstu_attention", shapes,
                                capsys)
    assert rc == 0, out
    assert "(compiler estimate)" in out
    assert list(cache_dir.glob("tpu_v6e/*hstu_attention*.estimate.json"))
