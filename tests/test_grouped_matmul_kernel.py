import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals
from model_kernel_checks import oracle

import pallas_tune as pt
from pallas_tune.kernels.grouped_matmul import (grouped_matmul, grouped_matmul_reference,
                                                make_group_metadata)


def _inputs(m, k, n, sizes, dtype):
    lhs, rhs = normals(0, [(m, k), (len(sizes), k, n)], dtype)
    return lhs, rhs, jnp.array(sizes, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes", [[128, 128, 256], [100, 0, 300, 112], [0, 512, 0],
                                   [1, 2, 3, 506]])
def test_matches_reference(dtype, sizes):
    lhs, rhs, gs = _inputs(512, 256, 256, sizes, dtype)
    out = grouped_matmul(lhs, rhs, gs, tm=128, tk=128, tn=128)
    ref = oracle(grouped_matmul_reference, lhs, rhs, gs)
    tol = 3e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=tol * 16, rtol=tol)


@pytest.mark.parametrize("m,k,n,sizes,tiles", [
    (1000, 512, 256, [100, 0, 300, 600], (128, 128, 128)),  # Issue 12: m=1000 raised.
    (250, 300, 130, [7, 0, 243], (128, 256, 128)),           # Groups start mid-tile.
    (257, 129, 383, [0, 0, 257], (256, 128, 256)),
    (1, 5, 7, [0, 1, 0], (128, 128, 128)),
])
def test_ragged_shapes_match_reference(m, k, n, sizes, tiles):
    lhs, rhs = normals(2, [(m, k), (len(sizes), k, n)])
    gs = jnp.array(sizes, jnp.int32)
    tm, tk, tn = tiles
    out = grouped_matmul(lhs, rhs, gs, tm=tm, tk=tk, tn=tn)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(out, oracle(grouped_matmul_reference, lhs, rhs, gs), rtol=1e-4,
                               atol=1e-3)


def test_bad_group_sizes_are_a_clear_error():
    lhs, rhs, gs = _inputs(256, 128, 128, [128, 128], jnp.float32)
    with pytest.raises(ValueError, match="integers"):
        grouped_matmul(lhs, rhs, gs.astype(jnp.float32), tm=128, tk=128, tn=128)


@pytest.mark.libtpu
def test_ragged_shape_compiles_for_tpu():
    from pallas_tune.feasibility.compile import compile_deviceless

    lhs = jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((4, 1000, 1000), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((4,), jnp.int32)
    res = compile_deviceless(grouped_matmul.fn, [lhs, rhs, gs], dict(tm=128, tk=256, tn=256),
                             chip="v6e")
    assert res.ok, res.message


def test_metadata_visits_every_group_tile_pair():
    starts, ends, group, tile = make_group_metadata(jnp.array([100, 0, 300, 112]), 512, 128)
    pairs = sorted(set(zip(np.asarray(group).tolist(), np.asarray(tile).tolist())))
    assert pairs == [(0, 0), (2, 0), (2, 1), (2, 2), (2, 3), (3, 3)]
    assert len(group) == 512 // 128 + 4 - 1


def test_tile_choice_does_not_change_result():
    lhs, rhs, gs = _inputs(512, 512, 256, [200, 0, 312], jnp.float32)
    a = grouped_matmul(lhs, rhs, gs, tm=128, tk=128, tn=128)
    b = grouped_matmul(lhs, rhs, gs, tm=256, tk=512, tn=256)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-3)


def test_lowers_for_tpu_at_mixtral_shape():
    lhs = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 4096, 14336), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((8,), jnp.int32)
    with pt.target("v6e"):
        for cfg in list(grouped_matmul.space)[::5]:
            if grouped_matmul.violations(cfg, (lhs, rhs, gs), {}):
                continue
            text = jax.jit(lambda a, b, c: grouped_matmul(a, b, c, **cfg)).trace(
                lhs, rhs, gs).lower(lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
