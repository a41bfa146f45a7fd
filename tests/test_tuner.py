"""The tuning loop: outcomes, no duplicate or infeasible measurement, strategies, storage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.measure.timing import compare


def test_tune_writes_cache_and_returns_result(cache_dir, fresh):
    x = fresh.ones()
    res = fresh.scale.tune(x, trials=6, seed=0, repeats=2)
    df = res.trials
    assert {"br", "bc", "buffering", "outcome", "median_ms", "error"} <= set(df.columns)
    ok = df[df.outcome == "ok"]
    assert len(ok) == 6  # Search path: space of 16 > 6 trials, 6 measured.
    assert res.provenance["strategy"] == "gp"
    # The winner is the best of the 3 fastest after interleaved re-timing.
    assert res.best_ms in sorted(ok.median_ms)[:3]
    table = res.provenance["retimed_interleaved"]
    assert len(table) == 3 and res.best == min(table, key=lambda r: r["interleaved_median_ms"])[
        "config"]
    assert res.best in fresh.scale.space
    fresh.scale._memo.clear()
    cfg = fresh.scale.config_for(x)
    assert cfg.source == "cache" and cfg == res.best
    entry = fresh.scale.cache.lookup("cpu", fresh.scale.name, fresh.scale.cache_key(x))[0]
    prov = entry["provenance"]
    assert prov["device_kind"] and prov["timer"] == "wallclock" and prov["interpret"] is True
    assert "jax" in prov["versions"] and "jaxlib" in prov["versions"] and prov["date"]
    assert len(fresh.scale.cache.trials("cpu", fresh.scale.name, fresh.scale.cache_key(x))) \
        == len(df)  # The history lives in the ledger beside the winners (issue 14).


def test_block_rule_violations_never_measured_and_mismatch_rejected(cache_dir, fresh):
    x = fresh.ones((64, 256))
    res = fresh.scale_checked.tune(x, trials=32, seed=0, repeats=2)
    df = res.trials
    assert res.provenance["strategy"] == "exhaustive"
    assert len(df) == fresh.scale_checked.space.size == 12
    bad_tiles = df[(df.br == 12) | (df.bc == 100)]
    assert (bad_tiles.outcome == "infeasible").all() and bad_tiles.median_ms.isna().sum() == 0
    assert np.isinf(bad_tiles.median_ms).all()
    assert bad_tiles.error.str.contains("multiple of 8|multiple of 128|does not divide").all()
    good_tiles = df[(df.br != 12) & (df.bc != 100)]
    assert (good_tiles[good_tiles.wrong].outcome == "mismatch").all()
    assert (good_tiles[~good_tiles.wrong].outcome == "ok").all()
    assert res.best["wrong"] is False


@pytest.mark.parametrize("sampler", ["gp", "tpe"])
def test_no_config_is_measured_twice(cache_dir, fresh, sampler):
    res = fresh.scale.tune(fresh.ones(), trials=12, seed=3, repeats=1, sampler=sampler)
    configs = [tuple(sorted(r.config.items())) for r in res.records]
    assert len(configs) == len(set(configs))
    assert res.provenance["strategy"] == sampler


def test_unknown_sampler_is_rejected(cache_dir, fresh):
    with pytest.raises(ValueError, match="sampler='cma' must be one of"):
        fresh.scale.tune(fresh.ones(), trials=4, sampler="cma")


def test_all_failing_raises_with_summary(cache_dir):
    @pt.tunable(b=[3, 5], name="tests.bad")  # Local kernels need a name (issue 14).
    def bad(x, *, b):
        raise RuntimeError(f"boom {b}")

    with pytest.raises(pt.NoFeasibleConfigError, match="none of 2 candidates.*boom"):
        bad.tune(jnp.ones((8,)), trials=4)


def test_storage_makes_studies_resumable(cache_dir, fresh, tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    x = fresh.ones()
    first = fresh.scale.tune(x, trials=4, seed=0, repeats=1, storage=url)
    assert sum(r.measurement is not None for r in first.records) == 4
    second = fresh.scale.tune(x, trials=6, seed=0, repeats=1, storage=url)
    fresh_measured = [r for r in second.records
                      if r.measurement is not None and "stored study" not in r.error]
    assert len(fresh_measured) == 2  # Only the missing two were measured.
    first_configs = {tuple(sorted(r.config.items())) for r in first.records}
    assert not first_configs & {tuple(sorted(r.config.items())) for r in fresh_measured}


def test_tune_accepts_shape_dtype_structs(cache_dir, fresh):
    x = jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)
    res = fresh.scale.tune(x, trials=2, seed=0, repeats=1)
    assert res.key == "x=64x256:bfloat16,factor=2.0"


def test_compare_is_dtype_aware_and_catches_nan():
    ref = np.ones((4, 4), np.float32)
    assert compare(ref + 1e-5, ref)[0]
    assert not compare(ref + 1e-2, ref)[0]
    bf = jnp.ones((4, 4), jnp.bfloat16)
    assert compare(bf + jnp.bfloat16(0.0078), bf)[0]
    nan = ref.copy()
    nan[0, 0] = np.nan
    ok, _, why = compare(nan, ref)
    assert not ok and "NaN" in why


def test_parallel_compile_serial_measure(cache_dir, fresh):
    res = fresh.scale.tune(fresh.ones(), trials=8, seed=1, repeats=2, compile_workers=2)
    df = res.trials
    assert (df.outcome == "ok").sum() == 8 and df.compile_ms.notna().all()
    configs = [tuple(sorted(r.config.items())) for r in res.records]
    assert len(configs) == len(set(configs))


def test_profiler_timer_falls_back_and_says_so_on_cpu(cache_dir, fresh):
    res = fresh.scale.tune(fresh.ones(), trials=3, seed=0, repeats=2, timer="profiler")
    ok = [r for r in res.records if r.measurement is not None]
    assert ok and all(r.measurement.timer.startswith("wallclock (profiler saw no device")
                      for r in ok)
    assert res.provenance["timer"] == "profiler"


def test_warm_start_from_a_neighbour_shape_beats_a_cold_start(cache_dir):
    """A synthetic landscape whose optimum moves little between neighbouring shapes."""
    import jax.numpy as jnp

    import pallas_tune as pt
    from pallas_tune.tuning.loop import warm_start_configs

    # Cost depends on the config only: the optimum (a=6, b=6, c=6) is hard to hit by chance.
    @pt.tunable(a=list(range(12)), b=list(range(12)), c=list(range(12)), name="synthetic")
    def synthetic(x, *, a, b, c):
        return x

    fake = {}

    def fake_measure(fn, args, kwargs, **_):
        from pallas_tune.measure.timing import Measurement, Outcome

        cost = 1.0 + abs(kwargs["a"] - 6) + abs(kwargs["b"] - 6) + abs(kwargs["c"] - 6)
        fake[len(fake)] = cost
        return Outcome.OK, Measurement(times_ms=(cost,), compile_ms=0.0), args[0], "", 0.0

    import pallas_tune.tuning.loop as tuner_mod

    orig = tuner_mod.measure
    tuner_mod.measure = fake_measure
    try:
        neighbour = jnp.ones((256, 128))
        synthetic.tune(neighbour, trials=300, seed=0, retime_top=0)  # Exhaustive-ish: finds it.
        here = jnp.ones((512, 128))
        assert warm_start_configs(synthetic, (here,), {}, "cpu", synthetic.cache_key(here))[1] \
            == {"a": 6, "b": 6, "c": 6}
        cold_first = []
        warm_first = []
        for seed in range(3):
            cold = synthetic.tune(here, trials=12, seed=seed, warm_start=0, write=False,
                                  retime_top=0)
            warm = synthetic.tune(here, trials=12, seed=seed, write=False, retime_top=0)
            cold_first.append(cold.best_ms)
            warm_first.append(warm.best_ms)
        assert max(warm_first) == 1.0 and min(cold_first) > 1.0
    finally:
        tuner_mod.measure = orig


def test_warm_start_uses_roofline_picks_for_tpu_chips(cache_dir):
    import jax
    import jax.numpy as jnp

    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.tuning.loop import warm_start_configs

    x = jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16)  # No tuned neighbour that fits.
    picks = warm_start_configs(matmul, (x, x), {}, "tpu_v6e", matmul.cache_key(x, x), limit=4)
    assert picks[0] == dict(matmul.space.default)
    assert len(picks) == 4 and all(p in matmul.space for p in picks)
    # The roofline prefers big tiles over the 256^3 default.
    assert all(p["bm"] * p["bn"] >= 512 * 512 for p in picks[1:])
