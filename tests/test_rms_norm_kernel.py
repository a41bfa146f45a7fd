import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normal

import pallas_tune as pt
from pallas_tune.kernels.rms_norm import rms_norm, rms_norm_reference


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape,block_rows", [((64, 256), 8), ((2, 64, 512), 32), ((40, 128), 64),
                                              ((1000, 300), 256), ((3, 13, 7), 8), ((1, 5), 8)])
def test_matches_reference(dtype, shape, block_rows):
    x = normal(0, shape, dtype)
    w = (1 + normal(1, shape[-1:], jnp.float32, 0.1)).astype(dtype)
    out = rms_norm(x, w, block_rows=block_rows)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(np.asarray(out, np.float32),
                               np.asarray(rms_norm_reference(x, w), np.float32), atol=tol, rtol=tol)


def test_bad_weight_is_a_clear_error():
    with pytest.raises(ValueError, match="weight"):
        rms_norm(jnp.zeros((8, 128)), jnp.zeros((64,)), block_rows=8)


def test_lowers_for_tpu_for_every_valid_block():
    x = jax.ShapeDtypeStruct((8192, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096,), jnp.bfloat16)
    with pt.target("v6e"):
        for cfg in rms_norm.space:
            assert not rms_norm.violations(cfg, (x, w), {})
            text = jax.jit(lambda a, b: rms_norm(a, b, **cfg)).trace(x, w).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text
