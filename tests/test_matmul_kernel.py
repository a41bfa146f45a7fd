"""The shipped matmul: correctness in interpret mode, TPU lowering for every valid config."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.kernels.matmul import matmul, matmul_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (512, 256, 512)])
@pytest.mark.parametrize("bm,bn,bk,buffering", [(128, 128, 128, 2), (256, 128, 256, 1)])
def test_matches_reference(dtype, m, k, n, bm, bn, bk, buffering):
    kx, ky = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    y = jax.random.normal(ky, (k, n), jnp.float32).astype(dtype)
    if n % bn:
        pytest.skip("tile does not divide N")
    out = matmul(x, y, bm=bm, bn=bn, bk=bk, buffering=buffering,
                 semantics=("parallel", "parallel", "arbitrary"))
    ref = matmul_reference(x, y)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol * np.sqrt(k))


def test_every_rule_abiding_config_lowers_for_tpu():
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    lowered = 0
    with pt.target("v6e"):
        for config in itertools.islice(matmul.space, 0, None, 5):  # Every 5th of 128.
            if matmul.violations(config, (x, x), {}):
                continue
            text = jax.jit(lambda a, b: matmul(a, b, **config)).trace(x, x).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
            lowered += 1
    assert lowered >= 20


def test_inspect_reads_blocks_buffering_and_semantics():
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
    calls = _inspect.find_pallas_calls(
        matmul.fn, (x, y), dict(bm=256, bn=128, bk=512, buffering=1,
                                semantics=("parallel", "parallel", "arbitrary")))
    (call,) = calls
    assert call.grid == (2, 2, 2)
    assert [b.block_shape for b in call.blocks] == [(256, 512), (512, 128), (256, 128)]
    assert [b.buffer_count for b in call.blocks] == [1, 1, None]
    assert call.scratch[0][0] == (256, 128)
    assert call.dimension_semantics == ("parallel", "parallel", "arbitrary")
    assert not _inspect.block_rule_violations(calls)
