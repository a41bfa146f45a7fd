"""One space for every shape: before the sampler proposes anything, each parameter loses the
choices that no config passing the kernel's declared constraints for this call uses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_tune as pt
from pallas_tune.tuning.loop import call_space


def _copy(x, *, bm, bn):
    del bm, bn
    return x * 1.0


divisible = pt.tunable(
    _copy, name="tests.divisible_copy", bm=[96, 128, 256, 512], bn=[128, 384, 512],
    constraints={"bm_divides": "x.shape[0] % bm == 0", "bn_divides": "x.shape[1] % bn == 0"},
    default={"bm": 128, "bn": 128})


def test_choices_no_valid_config_uses_are_dropped_before_sampling():
    x = jax.ShapeDtypeStruct((256, 384), jnp.float32)
    space, _ = call_space(divisible, [x], {})
    assert space["bm"].choices == (128, 256)  # 96 and 512 divide no 256-row tiling.
    assert space["bn"].choices == (128, 384)
    assert all(not divisible.declared_problems(c, [x], {}) for c in space)
    x = jax.ShapeDtypeStruct((1536, 1536), jnp.float32)  # Another shape: others survive.
    space, _ = call_space(divisible, [x], {})
    assert space["bm"].choices == (96, 128, 256, 512) and space["bn"].choices == (128, 384, 512)


def test_the_default_stays_and_a_space_with_no_valid_point_is_left_whole():
    x = jax.ShapeDtypeStruct((96, 384), jnp.float32)  # bm=128, the default, divides nothing.
    space, _ = call_space(divisible, [x], {})
    assert space["bm"].choices == (96, 128) and space.default == {"bm": 128, "bn": 128}
    x = jax.ShapeDtypeStruct((7, 7), jnp.float32)  # Nothing passes: the tune says why.
    space, _ = call_space(divisible, [x], {})
    assert space is divisible.space


def test_a_tune_proposes_only_configs_that_can_run(tmp_path, monkeypatch):
    monkeypatch.setenv("PALLAS_TUNE_CACHE_DIR", str(tmp_path))
    x = jnp.ones((256, 384), jnp.float32)
    result = divisible.tune(x, trials=4, seed=0, write=False, xla=False)
    assert result.records and all(r.outcome.timed for r in result.records)
    assert {r.config["bm"] for r in result.records} <= {128, 256}
