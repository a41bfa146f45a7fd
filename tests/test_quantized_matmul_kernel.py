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


@pytest.mark.parametrize("args,kwargs,match", [
    (((4, 8), jnp.bfloat16, (7, 4), jnp.int8, (4,)), {}, "needs x"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.int8, (8,)), {}, "one scale per output channel"),
    (((4, 8), jnp.float32, (8, 4), jnp.int8, (4,)), {}, "bfloat16 activations"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.bfloat16, (4,)), {}, "int8 or float8_e4m3fn"),
    (((4, 8), jnp.bfloat16, (8, 4), jnp.float8_e4m3fn, (4,)), {"quantize_x": True},
     "needs int8 weights"),
])
def test_bad_input_is_a_clear_error(args, kwargs, match):
    xs, xd, ws, wd, ss = args
    with pytest.raises(ValueError, match=match):
        quantized_matmul(jnp.zeros(xs, xd), jnp.zeros(ws, wd), jnp.ones(ss), bm=128, bn=256,
                         bk=256, buffering=2, vmem_limit_bytes=0, **kwargs)


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
