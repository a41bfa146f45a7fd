"""Trace-time dispatch: resolution order, explicit keywords, misses, modes, zero overhead."""

import re
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from conftest import subprocess_env


def _seed_cache(kernel, key, config, chip="cpu"):
    kernel.cache.write(chip, kernel.name, key, {"key": key, "config": config, "median_ms": 1.0,
                                                "provenance": {"kind": "measured"}})


def test_default_on_miss_warns_once(cache_dir, fresh):
    x = fresh.ones()
    with pytest.warns(pt.PallasTuneWarning, match="no tuned config.*pallas-tune sweep"):
        cfg = fresh.scale.config_for(x)
    assert cfg.source == "default"
    assert cfg == {"br": 8, "bc": 128, "buffering": 1}  # First point that passes the rules.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        np.testing.assert_allclose(fresh.scale(x), x * 2)  # Same key: no second warning.


def test_exact_hit_and_explicit_keywords_win(cache_dir, fresh):
    x = fresh.ones()
    key = fresh.scale.cache_key(x)
    assert key == "x=64x256:float32,factor=2.0"
    _seed_cache(fresh.scale, key, {"br": 32, "bc": 256, "buffering": 2})
    cfg = fresh.scale.config_for(x)
    assert cfg.source == "cache" and cfg == {"br": 32, "bc": 256, "buffering": 2}
    assert fresh.scale.config_for(x, br=16) == {"br": 16, "bc": 256, "buffering": 2}
    full = fresh.scale.config_for(x, br=8, bc=128, buffering=1)
    assert full.source == "explicit"
    np.testing.assert_allclose(fresh.scale(x, br=16), x * 2)


def test_static_kwargs_are_part_of_the_key(cache_dir, fresh):
    x = fresh.ones()
    _seed_cache(fresh.scale, fresh.scale.cache_key(x, factor=3.0),
                {"br": 64, "bc": 256, "buffering": 2})
    assert fresh.scale.config_for(x, factor=3.0).source == "cache"
    with pytest.warns(pt.PallasTuneWarning):
        assert fresh.scale.config_for(x).source == "default"


def test_nearest_tuned_shape_if_valid(cache_dir, fresh):
    _seed_cache(fresh.scale, "x=128x256:float32,factor=2.0", {"br": 64, "bc": 256, "buffering": 2})
    # 256x256 is nearest to 128x256, and br=64, bc=256 tile it: used.
    x = fresh.ones((256, 256))
    with pytest.warns(pt.PallasTuneWarning, match="nearest tuned shape"):
        cfg = fresh.scale.config_for(x)
    assert cfg.source == "nearest" and cfg["br"] == 64
    # 8x256: a 64-row block over 8 rows is allowed on TPU (edge blocks are padded): used.
    with pytest.warns(pt.PallasTuneWarning, match="nearest tuned shape"):
        assert fresh.scale.config_for(fresh.ones((8, 256)))["br"] == 64
    # br=12 tiles 12 rows (the full dim) but not 24 (12 is no multiple of 8): the default is used.
    _seed_cache(fresh.scale_checked, "x=12x256:float32,factor=2.0",
                {"br": 12, "bc": 128, "wrong": False})
    assert fresh.scale_checked.config_for(fresh.ones((12, 256))).source == "cache"
    with pytest.warns(pt.PallasTuneWarning, match="using the default"):
        cfg = fresh.scale_checked.config_for(fresh.ones((24, 256)))
    assert cfg.source == "default"


def test_declared_default_is_used(cache_dir, fresh):
    x = fresh.ones()
    with pytest.warns(pt.PallasTuneWarning):
        cfg = fresh.scale_checked.config_for(x)
    assert cfg == {"br": 16, "bc": 128, "wrong": False} and cfg.source == "default"


def test_strict_mode_miss_names_key_and_command(cache_dir, fresh, monkeypatch):
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    x = fresh.ones()
    with pytest.raises(pt.CacheMissError) as info:
        fresh.scale(x)
    msg = str(info.value)
    assert "x=64x256:float32,factor=2.0" in msg
    assert "pallas-tune sweep toy_kernels:scale --shapes 'x=64x256:float32,factor=2.0'" in msg
    assert isinstance(info.value, KeyError)


def test_tune_mode_tunes_on_miss_under_jit(cache_dir, fresh, monkeypatch):
    monkeypatch.setenv("PALLAS_TUNE_MODE", "tune")
    x = fresh.ones((32, 256))
    out = jax.jit(fresh.add)(x, x)  # Tunes inside the trace (on abstract inputs) and caches.
    np.testing.assert_allclose(out, 2 * x)
    assert fresh.add.cache.lookup("cpu", fresh.add.name, fresh.add.cache_key(x, x)) is not None
    fresh.add._memo.clear()
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    assert fresh.add.config_for(x, x).source == "cache"


def test_works_eagerly_and_under_jit(cache_dir, fresh):
    x = fresh.ones()
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), {"br": 32, "bc": 256, "buffering": 2})
    np.testing.assert_allclose(fresh.scale(x), 2 * x)
    np.testing.assert_allclose(jax.jit(fresh.scale)(x), 2 * x)
    np.testing.assert_allclose(jax.jit(lambda a: fresh.scale(a, factor=0.5))(x), 0.5 * x)
    assert fresh.scale.__wrapped__ is fresh.scale.fn
    assert fresh.scale.__name__ == "scale"


def _strip_module_name(text):
    return re.sub(r"module @\S+", "module @M", text)


def test_lowered_module_identical_to_explicit_config(cache_dir, fresh):
    x = fresh.ones((128, 512))
    cfg = {"br": 32, "bc": 256, "buffering": 2}
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), cfg)
    cached = jax.jit(fresh.scale).lower(x).as_text()
    explicit = jax.jit(lambda a: fresh.scale(a, **cfg)).lower(x).as_text()
    assert _strip_module_name(cached) == _strip_module_name(explicit)
    other = jax.jit(lambda a: fresh.scale(a, br=64, bc=256, buffering=2)).lower(x).as_text()
    assert _strip_module_name(cached) != _strip_module_name(other)  # The check can fail.


def test_tpu_lowering_identical_to_hand_written_call(cache_dir, fresh):
    from pallas_tune.kernels.matmul import matmul

    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    cfg = {"bm": 256, "bn": 512, "bk": 128, "buffering": 2,
           "semantics": ("parallel", "parallel", "arbitrary")}
    _seed_cache(matmul, matmul.cache_key(x, x), cfg, chip="tpu_v6e")
    matmul._memo.clear()
    with pt.target("v6e"):
        assert matmul.config_for(x, x).source == "cache"
        served = jax.jit(matmul).trace(x, x).lower(lowering_platforms=("tpu",)).as_text()
        by_hand = jax.jit(lambda a, b: matmul.__wrapped__(a, b, **cfg)).trace(x, x).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in served  # The real Mosaic kernel, not the interpreter.
    assert _strip_module_name(served) == _strip_module_name(by_hand)
    matmul._memo.clear()


def test_cpu_default_runs_interpreted_and_env_switch(cache_dir, fresh):
    from pallas_tune import chips

    x = fresh.ones()
    assert chips.should_interpret()
    with pt.target("v6e"):
        assert not chips.should_interpret()
        assert chips.current_chip() == "tpu_v6e"
    np.testing.assert_allclose(fresh.scale(x, br=8, bc=128, buffering=2), 2 * x)


def test_import_and_cached_call_do_not_import_optuna(cache_dir, fresh):
    x = fresh.ones()
    _seed_cache(fresh.scale, fresh.scale.cache_key(x), {"br": 32, "bc": 256, "buffering": 2})
    code = (
        "import sys, jax, numpy as np, pallas_tune, toy_kernels\n"
        "assert 'optuna' not in sys.modules\n"
        "x = toy_kernels.ones()\n"
        "c = toy_kernels.scale.config_for(x); assert c.source == 'cache', c\n"
        "np.testing.assert_allclose(jax.jit(toy_kernels.scale)(x), 2 * x)\n"
        "bad = [m for m in ('optuna', 'pandas', 'pallas_tune.tuning', 'pallas_tune.measure', 'pallas_tune.search') if m in sys.modules]\n"
        "assert not bad, bad\n"
        "print('OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir), timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
