"""Adapters for JAX's own Pallas TPU ops: run in interpret mode, lower for TPU, tune."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.kernels import upstream
from pallas_tune.kernels.flash_attention import flash_attention_reference
from pallas_tune.kernels.grouped_matmul import grouped_matmul_reference


def _qkv(shape, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(0), 3)
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in ks]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("adapter,blocks", [
    (upstream.flash_attention, dict(block_q=128, block_k_major=256, block_k=128)),
    (upstream.splash_attention, dict(block_q=128, block_kv=256, block_kv_compute=128)),
])
def test_attention_adapters_match_reference(adapter, blocks, causal):
    q, k, v = _qkv((1, 2, 256, 128))
    out = adapter(q, k, v, causal=causal, **blocks)
    ref = flash_attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3)


def test_invalid_block_combination_is_reported():
    q, k, v = _qkv((1, 2, 256, 128))
    with pytest.raises(pt.InvalidConfig, match="must divide"):
        upstream.flash_attention(q, k, v, block_q=128, block_k_major=128, block_k=256)


def test_megablox_adapter():
    k1, k2 = jax.random.split(jax.random.key(1))
    lhs = jax.random.normal(k1, (512, 256), jnp.float32)
    rhs = jax.random.normal(k2, (3, 256, 256), jnp.float32)
    gs = jnp.array([200, 0, 312], jnp.int32)
    out = upstream.megablox_gmm(lhs, rhs, gs, tm=128, tk=128, tn=128)
    np.testing.assert_allclose(out, grouped_matmul_reference(lhs, rhs, gs), rtol=1e-4, atol=1e-3)


def test_adapters_lower_for_tpu():
    q = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    lhs = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 4096, 1024), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((8,), jnp.int32)
    with pt.target("v6e"):
        for fn, args in ((upstream.flash_attention, (q, q, q)),
                         (upstream.splash_attention, (q, q, q)),
                         (upstream.megablox_gmm, (lhs, rhs, gs))):
            cfg = fn.space.default
            text = jax.jit(lambda *a: fn(*a, **cfg)).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


def test_tuner_records_invalid_upstream_configs_as_infeasible(cache_dir):
    q, k, v = _qkv((1, 1, 256, 128))
    res = upstream.flash_attention.tune(q, k, v, trials=6, seed=0, repeats=1)
    df = res.trials
    bkm, bk = df.block_k_major.clip(upper=256), df.block_k.clip(upper=256)  # Clamped to seq.
    assert (df[bkm % bk != 0].outcome == "infeasible").all()
    assert df[bkm % bk == 0].outcome.isin(["ok", "slow"]).all()  # slow: timed, cut short.
