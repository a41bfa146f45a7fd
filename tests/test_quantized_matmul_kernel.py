"""The weight-quantized matmul: int8 and fp8 weights, per-token int8 activations, against a
float64 reference at ragged shapes (hypothesis, interpret mode); clear errors; v6e compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallas_tune.kernels.quantized_matmul import (quantized_matmul, quantized_matmul_reference,
                                                  row_scales)

SIZES = st.one_of(st.sampled_from([1, 7, 127, 128, 129, 255, 256, 257, 383, 640, 1000]),
                  st.integers(1, 1100))
CASES = st.sampled_from([(jnp.int8, False), (jnp.int8, True), (jnp.float8_e4m3fn, False)])


def operands(rng, m, k, n, w_dtype):
    x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32)).astype(jnp.bfloat16)
    w = rng.integers(-127, 128, size=(k, n)).astype(np.float32)
    if w_dtype != jnp.int8:
        w = w / 16.0  # e4m3 holds these exactly up to its 3 mantissa bits.
    w = jnp.asarray(w).astype(w_dtype)
    s = jnp.asarray((rng.random(n, dtype=np.float32) + 0.5) / 64.0)
    return x, w, s


def float64_reference(x, w, s, quantize_x):
    """The product in float64 from the kernel's own inputs: x as given (or its per-token int8
    quantization: each step round(x · inverse scale), one f32 multiply as in the kernel), the 8-bit weights widened
    exactly, then one scale per column."""
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    if quantize_x:  # Each element's int8 step, as the kernel takes it (an f32 divide), exactly.
        scale, inverse = (np.asarray(a) for a in row_scales(x))
        steps = np.clip(np.round(np.asarray(x.astype(jnp.float32)) * inverse), -127, 127)
        x64 = steps.astype(np.float64) * scale.astype(np.float64)
    return x64 @ np.asarray(w.astype(jnp.float32), np.float64) * np.asarray(s, np.float64)


def assert_close(out, want, k):
    out = np.asarray(out.astype(jnp.float32), np.float64)
    assert np.isfinite(out).all()
    # bf16 output rounding (2^-8 relative) plus f32 accumulation over K.
    bound = 2 ** -8 * np.abs(want) + 1e-5 * np.sqrt(k) * np.abs(want).max(initial=1.0) + 1e-6
    assert (np.abs(out - want) <= bound).all(), float(np.max(np.abs(out - want) - bound))


@given(m=SIZES, k=SIZES, n=SIZES, case=CASES,
       blocks=st.sampled_from([(128, 256, 256), (256, 512, 512), (128, 256, 1024)]),
       buffering=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_matches_float64_reference_at_ragged_shapes(m, k, n, case, blocks, buffering, seed):
    w_dtype, quantize_x = case
    x, w, s = operands(np.random.default_rng(seed), m, k, n, w_dtype)
    bm, bn, bk = blocks
    out = quantized_matmul(x, w, s, quantize_x=quantize_x, bm=bm, bn=bn, bk=bk,
                           buffering=buffering, vmem_limit_bytes=0)
    assert out.shape == (m, n) and out.dtype == jnp.bfloat16
    assert_close(out, float64_reference(x, w, s, quantize_x), k)


@pytest.mark.parametrize("w_dtype,quantize_x", [(jnp.int8, False), (jnp.int8, True),
                                                (jnp.float8_e4m3fn, False)])
def test_xla_reference_matches_float64(w_dtype, quantize_x):
    x, w, s = operands(np.random.default_rng(0), 100, 700, 300, w_dtype)
    assert_close(quantized_matmul_reference(x, w, s, quantize_x=quantize_x),
                 float64_reference(x, w, s, quantize_x), 700)


def test_an_all_zero_row_quantizes_to_zero():
    x, w, s = operands(np.random.default_rng(1), 4, 256, 256, jnp.int8)
    x = x.at[2].set(0)
    out = quantized_matmul(x, w, s, quantize_x=True, bm=128, bn=256, bk=256, buffering=2,
                           vmem_limit_bytes=0)
    assert np.all(np.asarray(out[2], np.float32) == 0)


CONFIG = dict(bm=128, bn=256, bk=256, buffering=2, vmem_limit_bytes=0)


def _run(path, x, w, s, quantize_x):
    """The call by one backend path: the kernel (interpret mode) eager or jitted, or the
    reference (XLA's candidate, which a cache entry may dispatch to)."""
    if path == "reference":
        return quantized_matmul_reference(x, w, s, quantize_x=quantize_x)
    call = lambda x, w, s: quantized_matmul(x, w, s, quantize_x=quantize_x, **CONFIG)  # noqa
    return (jax.jit(call) if path == "kernel jit" else call)(x, w, s)


PATHS = ["kernel", "kernel jit", "reference"]


@pytest.mark.parametrize("path", PATHS)
def test_a_nan_or_inf_in_x_makes_its_row_nan_when_quantized(path):
    """A row holding NaN or inf has no int8 scale: its output row is NaN (it was a finite row
    quantized with scale 1), on every path; the other rows are untouched. K = 300 is ragged
    for bk = 256: the last two bad values sit in the masked tail step."""
    x, w, s = operands(np.random.default_rng(2), 6, 300, 200, jnp.int8)
    bad = {1: (3, np.nan), 2: (7, np.inf), 3: (0, -np.inf), 4: (290, np.nan), 5: (299, np.inf)}
    for row, (col, value) in bad.items():
        x = x.at[row, col].set(value)
    out = np.asarray(_run(path, x, w, s, True).astype(jnp.float32))
    assert np.isnan(out[1:]).all(), np.isnan(out).sum(axis=1)
    assert_close(jnp.asarray(out[:1]), float64_reference(x[:1], w, s, True), 300)
    # As without quantization, and as x @ w in plain JAX: the row is not finite.
    plain = np.asarray(_run(path, x, w, s, False).astype(jnp.float32))
    assert not np.isfinite(plain[1:]).any() and np.isfinite(plain[0]).all()


def test_the_issues_row_is_nan_not_nine():
    """The row reported (finite values summing to 7.75 and a NaN) gave a finite [9, 9, 9, 9]."""
    x = jnp.asarray([[np.nan, 1.0, 2.0, 4.75]], jnp.bfloat16)
    w, s = jnp.ones((4, 4), jnp.int8), jnp.ones((4,), jnp.float32)
    assert np.isnan(np.asarray(quantized_matmul(x, w, s, quantize_x=True, **CONFIG),
                               np.float32)).all()
    scale, inverse = row_scales(x)
    assert np.isnan(np.asarray(scale)).all() and np.isnan(np.asarray(inverse)).all()


def test_kernel_and_reference_round_alike_on_one_backend():
    """What the docstring promises about rounding: on one backend the kernel and the reference
    quantize every element to the same step (their scales come from one function, outside the
    kernel), eager or jitted. Against IEEE division (numpy), which a backend's f32 divide need
    not match (XLA's CPU divide is off by an ulp on some rows), a step moves by at most one."""
    x, w, s = operands(np.random.default_rng(3), 300, 256, 128, jnp.int8)
    outs = [np.asarray(_run(p, x, w, s, True).astype(jnp.float32)) for p in PATHS]
    outs.append(np.asarray(jax.jit(lambda *a: quantized_matmul_reference(
        *a, quantize_x=True))(x, w, s).astype(jnp.float32)))
    for out in outs[1:]:
        np.testing.assert_array_equal(out, outs[0])
    xf = np.asarray(x.astype(jnp.float32))
    top = np.max(np.abs(xf), axis=1, keepdims=True)
    ieee = np.float32(1) / (top / np.float32(127))
    steps = lambda inverse: np.clip(np.round(xf * inverse), -127, 127)  # noqa: E731
    _, inverse = row_scales(x)
    assert np.abs(steps(np.asarray(inverse)) - steps(ieee)).max() <= 1


BAD_INPUTS = [
    (((4, 8), jnp.bfloat16, (7, 4), jnp.int8, (4,)), {}, "needs x"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.int8, (8,)), {}, "one scale per output channel"),
    (((4, 8), jnp.float32, (8, 4), jnp.int8, (4,)), {}, "bfloat16 activations"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.bfloat16, (4,)), {}, "int8 or float8_e4m3fn"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.float16, (4,)), {}, "int8 or float8_e4m3fn"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.int4, (4,)), {}, "int8 or float8_e4m3fn"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.float8_e4m3fn, (4,)), {"quantize_x": True},
     "needs int8 weights"),
    (((0, 8), jnp.bfloat16, (8, 4), jnp.int8, (4,)), {}, r"at least one element.*x \(0, 8\)"),
    (((4, 0), jnp.bfloat16, (0, 4), jnp.int8, (4,)), {}, "at least one element"),
    (((4, 8), jnp.bfloat16, (8, 0), jnp.int8, (0,)), {}, "at least one element"),
]


@pytest.mark.parametrize("config", [CONFIG, {}, {"bm": 128}], ids=["explicit", "resolved",
                                                                   "partial"])
@pytest.mark.parametrize("args,kwargs,match", BAD_INPUTS)
def test_bad_input_is_a_clear_error_before_any_candidate(args, kwargs, match, config,
                                                         monkeypatch):
    """One check, before a config is resolved or any candidate traced: a ValueError naming the
    problem, with the tuned keywords given or not (it was a NoFeasibleConfigError after 256
    traced candidates, or a ZeroDivisionError for M=0)."""
    from pallas_tune.runtime import dispatch

    def no_candidate(*a, **k):
        raise AssertionError("a candidate was checked before the inputs")

    monkeypatch.setattr(dispatch, "check", no_candidate)
    monkeypatch.setattr(dispatch, "resolve", no_candidate)
    xs, xd, ws, wd, ss = args
    x, w, s = jnp.zeros(xs, xd), jnp.zeros(ws, wd), jnp.ones(ss)
    with pytest.raises(ValueError, match=match):
        quantized_matmul(x, w, s, **kwargs, **config)
    with pytest.raises(ValueError, match=match):
        quantized_matmul.config_for(x, w, s, **kwargs)


def test_bad_input_to_tune_is_refused_before_tuning(cache_dir, monkeypatch):
    from pallas_tune import tuning

    def no_tuning(*a, **k):
        raise AssertionError("tuning started before the inputs were checked")

    monkeypatch.setattr(tuning, "tune", no_tuning)
    spec = jax.ShapeDtypeStruct
    with pytest.raises(ValueError, match="one scale per output channel"):
        quantized_matmul.tune(spec((4, 8), jnp.bfloat16), spec((8, 4), jnp.int8),
                              spec((8,), jnp.float32), trials=2)
    assert not list(cache_dir.rglob("*.json"))


def test_an_argument_that_is_not_an_array_is_named():
    with pytest.raises(ValueError, match="x must be an array.*list"):
        quantized_matmul([[1.0] * 8] * 4, jnp.zeros((8, 4), jnp.int8), jnp.ones(4))


@pytest.mark.libtpu
@pytest.mark.parametrize("w_dtype,quantize_x", [(jnp.int8, False), (jnp.int8, True),
                                                (jnp.float8_e4m3fn, False)])
def test_compiles_for_v6e_at_a_ragged_shape(w_dtype, quantize_x):
    from pallas_tune.feasibility.compile import compile_deviceless

    args = [jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16),
            jax.ShapeDtypeStruct((1000, 1000), w_dtype), jax.ShapeDtypeStruct((1000,), jnp.float32)]
    r = compile_deviceless(quantized_matmul.fn, args,
                           dict(quantize_x=quantize_x, bm=256, bn=512, bk=512, buffering=2,
                                vmem_limit_bytes=0), chip="v6e")
    assert r.ok, r.message


def test_the_space_and_shape_sets_load():
    from pallas_tune.space import load_space

    loaded = load_space("quantized_matmul")
    assert loaded["kernel"] == "pallas_tune.kernels.quantized_matmul:quantized_matmul"
    assert loaded["fallback"] == "reference" and len(loaded["shapes"]) >= 6
    names = {n for c in quantized_matmul.space for n in c}
    assert {"bm", "bn", "bk", "buffering", "vmem_limit_bytes"} <= names
