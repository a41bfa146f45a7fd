import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals
from model_kernel_checks import oracle

import pallas_tune as pt
from pallas_tune.kernels.flash_attention import flash_attention, flash_attention_reference


def _qkv(b, hq, hkv, s, d, dtype, seed=0):
    q, k, v = normals(seed, [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)], dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,s,bq,bkv", [(2, 2, 256, 128, 128), (4, 2, 512, 256, 128),
                                             (4, 1, 256, 128, 256)])
def test_matches_reference(dtype, causal, hq, hkv, s, bq, bkv):
    q, k, v = _qkv(1, hq, hkv, s, 128, dtype)
    out = flash_attention(q, k, v, causal=causal, bq=bq, bkv=bkv)
    ref = oracle(flash_attention_reference, q, k, v, causal=causal)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol, rtol=tol)


def test_sm_scale_default_is_inverse_sqrt_head_dim():
    q, k, v = _qkv(1, 2, 2, 128, 64, jnp.float32)
    a = flash_attention(q, k, v, bq=128, bkv=128)
    b = flash_attention(q, k, v, sm_scale=1 / 8.0, bq=128, bkv=128)
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bad_heads_is_a_clear_error():
    q, k, v = _qkv(1, 3, 2, 128, 128, jnp.float32)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        flash_attention(q, k, v, bq=128, bkv=128)


def test_lowers_for_tpu_at_llama_shapes():
    q = jax.ShapeDtypeStruct((1, 32, 2048, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    with pt.target("v6e"):
        for cfg in flash_attention.space:
            if flash_attention.violations(cfg, (q, kv, kv), {"causal": True}):
                continue
            text = jax.jit(lambda a, b, c: flash_attention(a, b, c, causal=True, **cfg)).trace(
                q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,sq,sk,d,bq,bkv", [
    (2, 1, 1000, 1000, 128, 256, 256),   # Issue 12: NaN at S=1000, causal.
    (2, 2, 300, 700, 64, 128, 256),      # Ragged and unequal lengths.
    (4, 2, 700, 300, 80, 256, 128),
    (1, 1, 129, 5, 16, 128, 128),
    (1, 1, 1, 1, 8, 128, 128),
])
def test_ragged_lengths_match_reference(causal, hq, hkv, sq, sk, d, bq, bkv):
    q, k, v = normals(3, [(1, hq, sq, d), (1, hkv, sk, d), (1, hkv, sk, d)])
    out = flash_attention(q, k, v, causal=causal, bq=bq, bkv=bkv)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, oracle(flash_attention_reference, q, k, v, causal=causal),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("causal,sq,sk,bq,bkv", [
    (True, 384, 512, 256, 128),    # Staircase writing each strip's output; ragged last q block.
    (True, 640, 512, 256, 128),    # q_len > kv_len: no diagonal block for the last queries.
    (True, 1024, 1024, 512, 256),  # Blocks below the diagonal cut into column strips.
    (False, 512, 512, 512, 512),   # A whole block in strips, software-pipelined.
    (True, 4400, 4400, 4096, 4096),  # The largest blocks at a length no block divides.
    (True, 4400, 4400, 4096, 2048),
])
def test_strips_and_early_output_match_reference(causal, sq, sk, bq, bkv):
    q, k, v = normals(5, [(1, 2, sq, 128), (1, 1, sk, 128), (1, 1, sk, 128)])
    q = q * 3
    out = np.asarray(flash_attention(q, k, v, causal=causal, bq=bq, bkv=bkv))
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle(flash_attention_reference, q, k, v, causal=causal),
                               atol=2e-5, rtol=2e-5)


def test_bad_dtype_is_a_clear_error():
    q, k, v = _qkv(1, 2, 2, 128, 128, jnp.float16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        flash_attention(q, k, v, bq=128, bkv=128)


@pytest.mark.libtpu
def test_ragged_lengths_compile_for_tpu():
    from pallas_tune.feasibility.compile import compile_deviceless

    q = jax.ShapeDtypeStruct((1, 4, 1000, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 2, 1000, 128), jnp.bfloat16)
    for causal in (False, True):
        res = compile_deviceless(flash_attention.fn, [q, kv, kv],
                                 dict(causal=causal, bq=256, bkv=256), chip="v6e")
        assert res.ok, res.message


@pytest.mark.parametrize("dtype,boost", [(jnp.float32, 12.0), (jnp.bfloat16, 7.0)])
@pytest.mark.parametrize("at", [100, 300])  # In the first KV block (past its first 8 keys), later.
def test_a_score_far_past_the_running_max_is_exact(dtype, boost, at):
    """Keys that every query scores far above all earlier ones (~150 log2 units at f32 boost
    12, ~90 at bf16 boost 7), in the first KV block past its first keys and in a later block:
    the running max must move to them, with no overflow and no weight lost. (A lazy variant
    that takes the exponent against the earlier blocks' max overflows here, or misweighs the
    four close top keys, unless it redoes such steps exactly: flash_profile.txt.)"""
    q, k, v = _qkv(1, 2, 1, 512, 128, jnp.float32, seed=5)
    q = jnp.abs(q)
    for r in range(4):
        k = k.at[:, :, at + r, :].set(boost + 0.01 * r)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    for causal in (False, True):
        out = np.asarray(flash_attention(q, k, v, causal=causal, bq=128, bkv=128), np.float32)
        ref = np.asarray(oracle(flash_attention_reference, q, k, v, causal=causal), np.float32)
        assert np.isfinite(out).all(), f"{np.isnan(out).sum()} NaN, {np.isinf(out).sum()} Inf"
        # f32: scores near 1,500 carry f32 rounding of ~1e-4 into the exponent, in the kernel
        # (the scale folded into q) and in the reference alike: 1e-3, not 2e-5.
        tol = 3e-2 if dtype == jnp.bfloat16 else 1e-3
        np.testing.assert_allclose(out, ref, atol=tol, rtol=tol)
