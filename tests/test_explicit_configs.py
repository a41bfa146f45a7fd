"""Tuned keywords given explicitly pass the one validity check a cache entry passes (issue 53
item 10): refused with the same reasons, checked once per distinct config and call shapes."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.kernels.matmul import matmul

X = jnp.ones((256, 256), jnp.float32)
DEFAULT = dict(matmul.space.default)


@pytest.mark.parametrize("name,value,reason", [
    ("bm", 0, "bm=0 is not positive"),                # Was ZeroDivisionError.
    ("bm", -8, "bm=-8 is not positive"),              # Was a broadcast TypeError.
    ("bm", 128.5, "bm=128.5 is a float, not a int"),  # Was a shape TypeError.
    ("buffering", 0, "buffering=0 is not positive"),  # Was accepted in interpret mode.
    ("bk", 3, "block dim 1 = 3 must be a multiple of 128"),  # Was accepted too.
])
def test_a_bad_explicit_block_is_refused_with_the_reason(cache_dir, name, value, reason):
    config = {**DEFAULT, name: value}
    with pytest.raises(pt.InvalidConfig, match=reason) as e:
        matmul(X, X, **config)
    assert "cannot run the call 'x=256x256:float32,y=256x256:float32'" in str(e.value)
    # The one validity check says the same of that config.
    assert any(reason in p for p in matmul.violations(config, (X, X), {}))


def test_a_partial_explicit_config_is_checked_with_the_resolved_rest(cache_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # The miss warning of the resolved rest.
        with pytest.raises(pt.InvalidConfig, match="bk=3|block dim"):
            matmul(X, X, bk=3)


def test_numpy_ints_are_python_ints_and_a_good_config_runs(cache_dir):
    config = {**DEFAULT, "bm": np.int64(128), "bn": np.int32(128)}
    np.testing.assert_allclose(matmul(X, X, **config), X @ X, rtol=1e-6)
    with pytest.raises(pt.InvalidConfig, match="bm=0 is not positive"):
        matmul(X, X, **{**DEFAULT, "bm": np.int64(0)})


def test_the_check_runs_once_per_config_and_shapes(cache_dir, monkeypatch):
    calls = []
    check = matmul.violations

    def counting(config, args, kwargs):
        calls.append(dict(config))
        return check(config, args, kwargs)

    monkeypatch.setattr(matmul, "violations", counting)
    matmul._checked.clear()  # noqa: SLF001
    config = {**DEFAULT, "bm": 128}
    for _ in range(3):
        matmul(X, X, **config)
    assert len(calls) == 1
    matmul(X, X, **{**config, "bn": 128})  # Another config.
    y = jnp.ones((256, 512), jnp.float32)
    matmul(X, y, **config)  # Other shapes.
    matmul(X, y, **config)
    assert len(calls) == 3


def test_the_reason_is_the_one_a_cache_entry_gets(cache_dir):
    """An explicit config and a cache entry with the same values are refused for one reason."""
    import dispatch_kernels as dk

    dk.rowsum._memo.clear()  # noqa: SLF001
    dk.rowsum._warned.clear()  # noqa: SLF001
    x = jnp.ones((16, 384), jnp.float32)
    dk.rowsum.cache.write("cpu", dk.rowsum.name, dk.rowsum.cache_key(x),
                          {"config": {"br": 16, "bc": 256}})
    with pytest.warns(pt.PallasTuneWarning) as cached:
        dk.rowsum.config_for(x)
    with pytest.raises(pt.InvalidConfig) as explicit:
        dk.rowsum(x, br=16, bc=256)
    reason = "constraint bc_divides_cols (x.shape[1] % bc == 0) does not hold for bc=256"
    assert reason in str(explicit.value)
    assert any(reason in str(w.message) for w in cached)
    dk.rowsum._memo.clear()  # noqa: SLF001
    dk.rowsum._warned.clear()  # noqa: SLF001


def test_a_setting_the_space_pins_off_takes_any_explicit_value():
    """``megacore_mode`` declared ``[None]`` (paged attention): ``"kv_head"`` given explicitly
    is for the kernel to judge, not refused as "a str, not a NoneType"."""
    from pallas_tune.space import Param

    pinned = Param(name="megacore_mode", choices=(None,))
    assert pinned.value_problem("kv_head", outside_ok=True) is None
    assert pinned.value_problem("kv_head") is not None  # Inside the space: None only.
    assert "is a float" in Param(name="bm", choices=(128, 256)).value_problem(128.5, outside_ok=True)
