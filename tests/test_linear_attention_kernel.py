import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals
from model_kernel_checks import oracle

import pallas_tune as pt
from pallas_tune.kernels.linear_attention import linear_attention, linear_attention_reference


def _qkv(shape, dtype):
    return normals(0, [shape] * 3, dtype, 0.3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("decay", [1.0, 0.9])
@pytest.mark.parametrize("shape,chunk", [((1, 2, 256, 128), 64), ((2, 1, 512, 128), 128)])
def test_matches_recurrence(dtype, decay, shape, chunk):
    q, k, v = _qkv(shape, dtype)
    out = linear_attention(q, k, v, decay=decay, chunk=chunk)
    ref = oracle(linear_attention_reference, q, k, v, decay=decay)
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol * max(1.0, scale), rtol=tol)


def test_chunk_choice_does_not_change_the_result():
    q, k, v = _qkv((1, 1, 512, 128), jnp.float32)
    a = linear_attention(q, k, v, decay=0.95, chunk=64)
    b = linear_attention(q, k, v, decay=0.95, chunk=256)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_bad_decay():
    q, k, v = _qkv((1, 1, 128, 128), jnp.float32)
    with pytest.raises(ValueError, match="decay"):
        linear_attention(q, k, v, decay=1.5, chunk=64)


def test_lowers_for_tpu():
    s = jax.ShapeDtypeStruct((1, 16, 2048, 128), jnp.bfloat16)
    with pt.target("v6e"):
        for cfg in linear_attention.space:
            text = jax.jit(lambda a, b, c: linear_attention(a, b, c, decay=0.97, **cfg)).trace(
                s, s, s).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


@pytest.mark.parametrize("t,chunk", [(300, 128), (1000, 256), (1, 64), (65, 64)])
def test_ragged_sequence_matches_recurrence(t, chunk):
    q, k, v = _qkv((1, 2, t, 64), jnp.float32)
    out = linear_attention(q, k, v, decay=0.96875, chunk=chunk)
    assert np.isfinite(np.asarray(out)).all()
    ref = oracle(linear_attention_reference, q, k, v, decay=0.96875)
    scale = float(jnp.max(jnp.abs(ref)))
    np.testing.assert_allclose(out, ref, atol=1e-4 * max(1.0, scale), rtol=1e-4)


@pytest.mark.libtpu
def test_ragged_sequence_compiles_for_tpu():
    from pallas_tune.feasibility.compile import compile_deviceless

    s = jax.ShapeDtypeStruct((1, 4, 1000, 128), jnp.bfloat16)
    res = compile_deviceless(linear_attention.fn, [s, s, s], dict(decay=0.97, chunk=128),
                             chip="v6e")
    assert res.ok, res.message
