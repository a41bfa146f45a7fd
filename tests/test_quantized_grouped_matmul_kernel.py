"""The grouped matmul with 8-bit experts: int8 and fp8, against a float64 reference at ragged
shapes and uneven (empty, mid-tile) groups (hypothesis, interpret mode); its lhs gradient; clear
errors; v6e compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_tune.kernels.quantized_grouped_matmul import (quantized_grouped_matmul,
                                                          quantized_grouped_matmul_reference)

SIZES = st.one_of(st.sampled_from([1, 7, 127, 128, 129, 255, 256, 257, 640]),
                  st.integers(1, 700))


def operands(rng, m, k, n, sizes, w_dtype):
    g = len(sizes)
    lhs = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(jnp.bfloat16)
    w = rng.integers(-127, 128, size=(g, k, n)).astype(np.float32)
    if w_dtype != jnp.int8:
        w = w / 16.0
    scale = (rng.random((g, n), dtype=np.float32) + 0.5) / 64.0
    return (lhs, jnp.asarray(w).astype(w_dtype), jnp.asarray(scale),
            jnp.asarray(sizes, jnp.int32))


def float64_reference(lhs, w, scale, sizes):
    m = lhs.shape[0]
    ends = np.cumsum(np.asarray(sizes))
    row = np.minimum(np.searchsorted(ends, np.arange(m), side="right"), w.shape[0] - 1)
    x = np.asarray(lhs.astype(jnp.float32), np.float64)
    w64 = np.asarray(w.astype(jnp.float32), np.float64)
    return np.einsum("mk,mkn->mn", x, w64[row]) * np.asarray(scale, np.float64)[row]


def assert_close(out, want, k):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all()
    bound = 2 ** -8 * np.abs(want) + 1e-5 * np.sqrt(k) * np.abs(want).max(initial=1.0) + 1e-6
    assert (np.abs(out - want) <= bound).all(), float(np.max(np.abs(out - want) - bound))


@st.composite
def cases(draw):
    m, k, n = draw(SIZES), draw(SIZES), draw(SIZES)
    groups = draw(st.integers(1, 6))
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=groups - 1, max_size=groups - 1)))
    sizes = np.diff([0, *cuts, m]).tolist()  # Empty groups and mid-tile starts included.
    return m, k, n, sizes


@given(case=cases(), w_dtype=st.sampled_from([jnp.int8, jnp.float8_e4m3fn]),
       tiles=st.sampled_from([(128, 256, 256), (256, 512, 512)]), seed=st.integers(0, 2**16))
def test_matches_float64_reference_at_ragged_shapes(case, w_dtype, tiles, seed):
    m, k, n, sizes = case
    lhs, w, scale, gs = operands(np.random.default_rng(seed), m, k, n, sizes, w_dtype)
    tm, tk, tn = tiles
    out = quantized_grouped_matmul(lhs, w, scale, gs, tm=tm, tk=tk, tn=tn)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert_close(out, float64_reference(lhs, w, scale, gs), k)


def test_xla_reference_matches_float64():
    lhs, w, scale, gs = operands(np.random.default_rng(0), 300, 200, 384, [42, 85, 0, 173],
                                 jnp.int8)
    assert_close(quantized_grouped_matmul_reference(lhs, w, scale, gs),
                 float64_reference(lhs, w, scale, gs), 200)


def test_lhs_gradient_is_xla_s():
    lhs, w, scale, gs = operands(np.random.default_rng(1), 64, 128, 128, [30, 34], jnp.int8)

    def loss(fn):
        return lambda x: fn(x, w, scale, gs).astype(jnp.float32).sum()

    got = jax.grad(loss(lambda *a: quantized_grouped_matmul(*a, tm=128, tk=128, tn=128)))(lhs)
    want = jax.grad(loss(quantized_grouped_matmul_reference))(lhs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("config", [dict(tm=128, tk=256, tn=256), {}, {"tm": 128}],
                         ids=["explicit", "resolved", "partial"])
@pytest.mark.parametrize("shapes,match", [
    (((4, 8), jnp.bfloat16, (2, 7, 4), jnp.int8, (2, 4), (2,)), "needs lhs"),
    (((4, 8), jnp.bfloat16, (2, 8, 4), jnp.int8, (4,), (2,)), "one scale per expert"),
    (((4, 8), jnp.float32, (2, 8, 4), jnp.int8, (2, 4), (2,)), "bfloat16 lhs"),
    (((4, 8), jnp.bfloat16, (2, 8, 4), jnp.bfloat16, (2, 4), (2,)), "int8 or float8_e4m3fn"),
    (((4, 8), jnp.bfloat16, (2, 8, 4), jnp.int4, (2, 4), (2,)), "int8 or float8_e4m3fn"),
    (((4, 8), jnp.bfloat16, (2, 8, 4), jnp.int8, (2, 4), (3,)), "needs lhs"),
    (((0, 8), jnp.bfloat16, (2, 8, 4), jnp.int8, (2, 4), (2,)), r"at least one.*lhs \(0, 8\)"),
    (((4, 8), jnp.bfloat16, (0, 8, 4), jnp.int8, (0, 4), (0,)), "at least one element"),
])
def test_bad_input_is_a_clear_error_before_any_candidate(shapes, match, config, monkeypatch):
    """One check, before a config is resolved or any candidate traced, whether the tiles are
    given or not (without them it was a NoFeasibleConfigError after every candidate; M=0 with
    them a ZeroDivisionError)."""
    from pallas_tune.runtime import dispatch

    def no_candidate(*a, **k):
        raise AssertionError("a candidate was checked before the inputs")

    monkeypatch.setattr(dispatch, "check", no_candidate)
    monkeypatch.setattr(dispatch, "resolve", no_candidate)
    ls, ld, ws, wd, ss, gs = shapes
    args = (jnp.zeros(ls, ld), jnp.zeros(ws, wd), jnp.ones(ss), jnp.zeros(gs, jnp.int32))
    with pytest.raises(ValueError, match=match):
        quantized_grouped_matmul(*args, **config)
    with pytest.raises(ValueError, match=match):
        quantized_grouped_matmul.config_for(*args)


def test_float_group_sizes_are_refused_before_any_candidate():
    lhs, w, scale, _ = operands(np.random.default_rng(0), 4, 8, 4, [2, 2], jnp.int8)
    for config in ({}, dict(tm=128, tk=256, tn=256)):
        with pytest.raises(ValueError, match="group_sizes must be integers"):
            quantized_grouped_matmul(lhs, w, scale, jnp.asarray([2.0, 2.0]), **config)


@pytest.mark.libtpu
@pytest.mark.parametrize("w_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_compiles_for_v6e_at_a_ragged_shape(w_dtype):
    from pallas_tune.feasibility.compile import compile_deviceless

    args = [jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16),
            jax.ShapeDtypeStruct((4, 1000, 1000), w_dtype),
            jax.ShapeDtypeStruct((4, 1000), jnp.float32), jax.ShapeDtypeStruct((4,), jnp.int32)]
    r = compile_deviceless(quantized_grouped_matmul.fn, args, dict(tm=128, tk=512, tn=512),
                           chip="v6e")
    assert r.ok, r.message


def test_the_scale_row_is_a_small_block_noted_not_refused():
    """The expert scale's (1, tn) block follows the group table like the weights do, but moves
    1/128 of a weight tile's bytes per step: the estimate notes it, and does not refuse the
    config (the weights, refetched along k, are counted by the profile)."""
    from pallas_tune.measure.loops import kernel_census

    args = [jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((8, 4096, 4096), jnp.int8),
            jax.ShapeDtypeStruct((8, 4096), jnp.float32), jax.ShapeDtypeStruct((8,), jnp.int32)]
    census = kernel_census(quantized_grouped_matmul.fn, args, dict(tm=128, tk=512, tn=512),
                           chip="v6e")
    assert census.prefetch_kernels == 1 and census.blind_inputs == ()
    assert census.unseen_write_bytes > 0
