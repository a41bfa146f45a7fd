"""The shipped matmul: correctness in interpret mode, TPU lowering for every valid config."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals

import pallas_tune as pt
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.kernels.matmul import matmul, matmul_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n", [(256, 512, 384), (512, 256, 512), (384, 640, 256),
                                   (1000, 1000, 1000), (100, 300, 200), (256, 640, 384),
                                   (1, 129, 7)])
@pytest.mark.parametrize("bm,bn,bk,buffering", [(128, 128, 128, 2), (256, 128, 256, 1)])
def test_matches_reference(dtype, m, k, n, bm, bn, bk, buffering):
    x, y = normals(0, [(m, k), (k, n)], dtype)
    out = matmul(x, y, bm=bm, bn=bn, bk=bk, buffering=buffering,
                 semantics=("parallel", "parallel", "arbitrary"))
    ref = matmul_reference(x, y)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol * np.sqrt(k))


@pytest.mark.parametrize("x,y,match", [
    (jnp.zeros((4, 8)), jnp.zeros((7, 4)), "needs x"),
    (jnp.zeros((4, 8), jnp.float16), jnp.zeros((8, 4), jnp.float16), "float32 or bfloat16"),
    (jnp.zeros((4, 8)), jnp.zeros((8, 4), jnp.bfloat16), "one dtype"),
])
def test_bad_input_is_a_clear_error(x, y, match):
    with pytest.raises(ValueError, match=match):
        matmul(x, y, bm=128, bn=128, bk=128, buffering=2,
               semantics=("parallel", "parallel", "arbitrary"), vmem_limit_bytes=0)


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


def test_every_config_lowers_for_tpu_at_a_ragged_shape():
    x = jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16)
    with pt.target("v6e"):
        for config in itertools.islice(matmul.space, 0, None, 5):
            text = jax.jit(lambda a, b: matmul(a, b, **config)).trace(x, x).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


@pytest.mark.libtpu
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_ragged_shape_compiles_for_tpu(chip):
    from pallas_tune.feasibility.compile import compile_deviceless

    x = jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16)
    res = compile_deviceless(matmul.fn, [x, x], dict(bm=256, bn=256, bk=256, buffering=2,
                                                      semantics=("parallel", "parallel",
                                                                 "arbitrary")), chip=chip)
    assert res.ok, res.message


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
