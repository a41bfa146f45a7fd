"""The tuning loop: outcomes, each program measured once, strategies, storage, the winner's
number, real values in Optuna, options."""

import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.measure.evaluate import Evaluator
from pallas_tune.measure.records import Measurement, Outcome, TrialRecord
from pallas_tune.measure.timing import compare


def test_tune_writes_cache_and_returns_result(cache_dir, fresh):
    x = fresh.ones()
    res = fresh.scale.tune(x, trials=6, seed=0, repeats=2)
    df = res.trials
    assert {"br", "bc", "buffering", "outcome", "median_ms", "error", "duplicate_of"} <= set(
        df.columns)
    assert res.counts["timed"] == 6  # Search path: space of 16 > 6 trials; 6 programs timed.
    assert res.provenance["strategy"] == "gp"
    assert res.study.metric_names == ["median_ms"]  # Named in Optuna's plots and dashboard.
    # The winner is the first of the interleaved re-ranking of the 3 fastest, and best_ms is
    # its median there; the search-phase median stays in its row.
    table = res.provenance["retimed_interleaved"]
    assert len(table) in (3, 4) and res.best == table[0]["config"]
    # The default (the space's first point: none declared) is re-timed in the same runs, so
    # the speed-up compares like with like (issue 26.3/26.8).
    defaults = [r for r in table if r.get("default")]
    assert len(defaults) == 1 and defaults[0]["config"] == next(
        fresh.scale.space.ordered_candidates())
    assert res.default_ms == defaults[0]["median_ms"]
    assert res.speedup == res.default_ms / res.best_ms >= 1.0
    assert len(repr(res)) < 300 and "x the default" in repr(res)
    assert res.best_ms == table[0]["median_ms"] == min(r["median_ms"] for r in table)
    assert res.best_record.median_ms == table[0]["search_median_ms"]
    assert res.best in fresh.scale.space
    fresh.scale._memo.clear()
    cfg = fresh.scale.config_for(x)
    assert cfg.source == "cache" and cfg == res.best
    entry = fresh.scale.cache.lookup("cpu", fresh.scale.name, fresh.scale.cache_key(x))[0]
    assert entry["median_ms"] == res.best_ms and entry["search_median_ms"] != entry["median_ms"]
    assert entry["default_ms"] == res.default_ms
    prov = entry["provenance"]
    assert prov["device_kind"] and prov["timer"] == "wallclock" and prov["interpret"] is True
    assert prov["ranked_by"] == "interleaved re-ranking" and prov["evaluator"] == "in-process"
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
    assert np.isinf(bad_tiles.median_ms).all() and (bad_tiles.runs == 0).all()
    assert bad_tiles.error.str.contains("multiple of 8|multiple of 128|does not divide").all()
    good_tiles = df[(df.br != 12) & (df.bc != 100)]
    assert (good_tiles[good_tiles.wrong].outcome == "mismatch").all()
    assert good_tiles[~good_tiles.wrong].outcome.isin(["ok", "slow"]).all()
    assert res.best["wrong"] is False


def test_feasibility_off_means_off(cache_dir, fresh):
    res = fresh.scale_checked.tune(fresh.ones((64, 256)), trials=32, repeats=1, write=False,
                                   feasibility="off", retime_top=0)
    assert "infeasible" not in set(res.trials.outcome)  # No block rules: only the trace.
    assert "infeasible" in set(fresh.scale_checked.tune(
        fresh.ones((64, 256)), trials=32, repeats=1, write=False, retime_top=0).trials.outcome)


def test_each_program_is_measured_once(cache_dir, fresh):
    """Clamped tiles and (in interpret mode) the buffer depth make 10 configs 2 programs."""
    x = fresh.ones((16, 128))
    res = fresh.clamped.tune(x, trials=32, seed=0, repeats=2, write=False)
    df = res.trials
    assert len(df) == 10 and res.counts["programs"] == 2 and res.counts["timed"] == 2
    originals = df[df.duplicate_of.isna()]
    assert len(originals) == 2 and originals.fingerprint.nunique() == 2
    dups = df[df.duplicate_of.notna()]
    assert len(dups) == 8 and (dups.runs > 0).all()  # The original's runs, not new ones.
    for _, row in dups.iterrows():
        original = df.loc[int(row.duplicate_of)]
        assert row.fingerprint == original.fingerprint and row.median_ms == original.median_ms
        assert min(row.b, 16) == min(original.b, 16) and row.outcome == original.outcome
    # The study was told every trial, duplicates at their original's value.
    values = [t.value for t in res.study.trials]
    assert len(values) == 10 and all(math.isfinite(v) for v in values)


def test_declared_clamps_search_effective_configs(cache_dir, fresh):
    """With its clamp declared, the same kernel is searched over its 4 distinct effective
    configs at 16 rows (b in {8, 16} x buffering), not 10; the result and the cache entry
    say what the winner runs as (issue 26.1)."""
    x = fresh.ones((16, 128))
    k = fresh.clamped_declared
    space, dims = k.call_space(x)
    assert dims == {"b": 16} and space.size == 4 and k.space.size == 10
    assert [p.choices for p in space.params] == [(8, 16), (1, 2)]
    res = k.tune(x, trials=32, seed=0, repeats=1)
    assert len(res.trials) == 4 and res.provenance["strategy"] == "exhaustive"
    assert res.provenance["space"] == {"declared": 10, "distinct_for_call": 4}
    assert res.best in space and res.effective is None  # 8 and 16 run as themselves.
    # At 20 rows b=32 is kept as the representative of everything >= 20 and runs as 20.
    y = fresh.ones((20, 128))
    space20, _ = k.call_space(y)
    assert space20.params[0].choices == (8, 16, 32)
    assert k.effective({"b": 128, "buffering": 2}, y) == {"b": 20, "buffering": 2}
    res = k.tune(y, trials=32, seed=0, repeats=1, write=False)
    assert len(res.trials) == 6
    runs_as = k.effective(res.best, y)
    assert res.effective == (runs_as if runs_as != res.best else None)
    assert res.to_entry().get("effective") == res.effective
    entry = k.cache.lookup("cpu", k.name, k.cache_key(x))[0]
    assert entry["config"]["b"] in (8, 16) and "effective" not in entry
    for bad in ({"nope": "x.shape[0]"}, {"b": 3}, {"b": "x.shape["}):
        with pytest.raises(pt.SearchSpaceError):
            pt.tunable(b=[8], clamp=bad, name="t")(lambda x, *, b: x)


@pytest.mark.parametrize("sampler", ["gp", "tpe"])
def test_no_config_or_program_is_measured_twice(cache_dir, fresh, sampler):
    res = fresh.scale.tune(fresh.ones(), trials=12, seed=3, repeats=1, sampler=sampler,
                           write=False)
    configs = [tuple(sorted(r.config.items())) for r in res.records]
    assert len(configs) == len(set(configs))
    timed = [r.fingerprint for r in res.records if r.spent_device_time]
    # In interpret mode the buffer depth changes nothing: 8 programs among the 16 configs, so
    # the 12-program budget cannot be spent, and every config is seen.
    assert len(timed) == len(set(timed)) == res.counts["programs"] == 8
    assert len(res.records) == 16
    assert res.provenance["strategy"] == sampler


def test_unknown_sampler_and_bad_options_are_rejected(cache_dir, fresh):
    with pytest.raises(ValueError, match="sampler='cma' must be one of"):
        fresh.scale.tune(fresh.ones(), trials=4, sampler="cma")
    bad = {"patience": -1, "trials": 1.5, "retime_top": -5, "repeats": 0, "max_time_s": 0,
           "timeout_s": {"bogus": 1}, "slow_factor": 1.0, "workers": True}
    for name, value in bad.items():
        with pytest.raises(pt.TuneOptionError, match=name if name != "timeout_s" else "bogus"):
            pt.TuneOptions(**{name: value})
    with pytest.raises(pt.TuneOptionError, match="max_time_s=0.5 is below min_time_s=1"):
        pt.TuneOptions(min_time_s=1, max_time_s=0.5)
    with pytest.raises(pt.TuneOptionError, match="did you mean 'trials'"):
        fresh.scale.tune(fresh.ones(), trails=4)


def test_options_object_and_the_three_entry_points_agree(cache_dir, fresh):
    opts = pt.TuneOptions(trials=2, seed=0, repeats=1, write=False, retime_top=0)
    a = pt.tune(fresh.scale, fresh.ones(), options=opts)
    b = fresh.scale.tune(fresh.ones(), options=opts)
    assert a.options == b.options == opts
    assert a.provenance["ranked_by"] == "search median" and a.best_ms == a.best_record.median_ms
    # With options=, keywords are the kernel's: factor reaches the kernel, and the key.
    c = pt.tune(fresh.scale, fresh.ones(), factor=3.0, options=opts)
    assert c.key.endswith("factor=3.0")


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
    assert first.counts["timed"] == 4
    second = fresh.scale.tune(x, trials=6, seed=0, repeats=1, storage=url)
    assert second.counts["from_storage"] == len(first.records)
    assert second.counts["timed"] == 2  # Only the missing two were measured.
    fresh_measured = [r for r in second.records if r.spent_device_time
                      and "stored study" not in r.error]
    first_configs = {tuple(sorted(r.config.items())) for r in first.records}
    assert not first_configs & {tuple(sorted(r.config.items())) for r in fresh_measured}
    # Stored with real values: the resumed study's parameters are block sizes.
    assert set(second.study.best_params) == {"br", "bc", "buffering"}
    assert second.study.best_params["br"] in (8, 16, 32, 64)


def test_optuna_sees_real_values_and_keeps_its_logging(cache_dir, fresh):
    import optuna

    from pallas_tune.tuning.study import ParamCodec

    root = logging.getLogger("optuna")
    handlers, verbosity = list(root.handlers), optuna.logging.get_verbosity()
    x = jax.ShapeDtypeStruct((512, 512), jnp.float32)
    from pallas_tune.kernels.matmul import matmul

    codec = ParamCodec(matmul.space)
    sem = ("parallel", "parallel", "arbitrary")
    cfg = dict(vmem_limit_bytes=0, bm=512, bn=256, bk=128, buffering=1, semantics=sem)
    assert codec.encode(cfg) == {"vmem_limit_bytes": 0, "bm": 512, "bn": 256, "bk": 128,
                                 "buffering": 1}
    assert codec.decode(codec.encode(cfg)) == cfg  # semantics: a single choice, not a param.
    two = pt.SearchSpace.from_choices({"sem": [sem, ("arbitrary",) * 3], "n": [None, 1]})
    enc = ParamCodec(two)
    assert enc.distributions["sem"].choices == ("(parallel, parallel, arbitrary)",
                                               "(arbitrary, arbitrary, arbitrary)")
    for c in two:
        assert enc.decode(enc.encode(c)) == c
    res = fresh.scale.tune(fresh.ones(), trials=3, seed=0, repeats=1, write=False)
    assert set(res.study.best_params.values()) <= {8, 16, 32, 64, 128, 256, 1, 2}
    df = res.study.trials_dataframe()
    assert set(df.params_br) <= {8, 16, 32, 64} and "user_attrs_fingerprint" in df
    assert list(root.handlers) == handlers and optuna.logging.get_verbosity() == verbosity
    del x


def test_optuna_plots_show_block_sizes(cache_dir, fresh):
    pytest.importorskip("plotly", reason="Optuna's plots need plotly")
    import optuna

    res = fresh.scale.tune(fresh.ones(), trials=4, seed=0, repeats=1, write=False)
    fig = optuna.visualization.plot_slice(res.study, params=["br"])
    # The block sizes themselves (Optuna draws categorical values as their text), not indices.
    assert {str(v) for v in fig.data[0].x} <= {"8", "16", "32", "64"}


def test_callbacks_see_every_trial_with_progress(cache_dir, fresh):
    seen = []
    res = fresh.clamped.tune(fresh.ones((16, 128)), trials=32, repeats=1, write=False,
                             callbacks=[lambda rec, prog: seen.append((rec.number, prog))])
    assert [n for n, _ in seen] == [r.number for r in res.records]
    last = seen[-1][1]
    assert last.evaluated == 10 and last.timed == 2 and last.duplicates == 8
    assert last.budget == 32 and last.best in fresh.clamped.space and math.isfinite(last.best_ms)


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
    res = fresh.scale.tune(fresh.ones(), trials=8, seed=1, repeats=2, compile_workers=2,
                           write=False)
    df = res.trials
    assert res.counts["timed"] == 8 and df[df.runs > 0].compile_ms.notna().all()
    configs = [tuple(sorted(r.config.items())) for r in res.records]
    assert len(configs) == len(set(configs))


def test_profiler_timer_falls_back_and_says_so_on_cpu(cache_dir, fresh):
    res = fresh.scale.tune(fresh.ones(), trials=3, seed=0, repeats=2, timer="profiler",
                           write=False)
    ok = [r for r in res.records if r.spent_device_time]
    assert ok and all(r.measurement.timer.startswith("wallclock (profiler saw no device")
                      for r in ok)
    assert res.provenance["timer"] == "profiler"


class Landscape(Evaluator):
    """A fake evaluator: a synthetic cost per config, no device (the loop's seam for tests)."""

    kind = "fake"

    def __init__(self, cost):
        super().__init__()
        self.cost = cost
        self.evaluated = []

    def start(self):
        self.device = {"chip": "cpu", "platform": "cpu", "device_kind": "fake"}
        return self.device

    def _evaluate(self, candidates):
        out = []
        for number, config in candidates:
            self.evaluated.append(config)
            ms = self.cost(config)
            rec = TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                              measurement=Measurement(times_ms=(ms,), compile_ms=0.0),
                              fingerprint=str(sorted(config.items())))
            self._note(rec)
            out.append(rec)
        return out

    def roofline(self, configs, chip):
        return [0.0 for _ in configs]


def test_warm_start_from_a_neighbour_shape_beats_a_cold_start(cache_dir):
    """A synthetic landscape whose optimum moves little between neighbouring shapes."""
    from pallas_tune.tuning import TuneOptions, run
    from pallas_tune.tuning.loop import warm_start_configs

    # Cost depends on the config only: the optimum (a=6, b=6, c=6) is hard to hit by chance.
    @pt.tunable(a=list(range(12)), b=list(range(12)), c=list(range(12)), name="synthetic")
    def synthetic(x, *, a, b, c):
        return x

    def cost(cfg):
        return 1.0 + abs(cfg["a"] - 6) + abs(cfg["b"] - 6) + abs(cfg["c"] - 6)

    neighbour = jnp.ones((256, 128))  # Tuned before: its winner is in the cache.
    synthetic.cache.write("cpu", synthetic.name, synthetic.cache_key(neighbour),
                          {"config": {"a": 6, "b": 6, "c": 6}, "median_ms": 1.0})
    here = jnp.ones((512, 128))
    assert warm_start_configs(synthetic, (here,), {}, "cpu", synthetic.cache_key(here))[1] \
        == {"a": 6, "b": 6, "c": 6}
    cold_first, warm_first = [], []
    for seed in range(3):
        opts = TuneOptions(trials=12, seed=seed, write=False, retime_top=0)
        cold = run(synthetic, (here,), {}, TuneOptions(**{**_fields(opts), "warm_start": 0}),
                   evaluator=Landscape(cost))
        warm = run(synthetic, (here,), {}, opts, evaluator=Landscape(cost))
        cold_first.append(cold.best_ms)
        warm_first.append(warm.best_ms)
    assert max(warm_first) == 1.0 and min(cold_first) > 1.0


def _fields(opts):
    import dataclasses

    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}


def test_warm_start_uses_roofline_picks_for_tpu_chips(cache_dir):
    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.tuning.loop import warm_start_configs

    x = jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16)  # No tuned neighbour that fits.
    picks = warm_start_configs(matmul, (x, x), {}, "tpu_v6e", matmul.cache_key(x, x), limit=4)
    assert picks[0] == dict(matmul.space.default)
    assert len(picks) == 4 and all(p in matmul.space for p in picks)
    # The roofline prefers big tiles over the 256^3 default.
    assert all(p["bm"] * p["bn"] >= 512 * 512 for p in picks[1:])


def test_roofline_warm_starts_fit_the_scoped_vmem_limit_they_set(cache_dir):
    """At 4096^3 the roofline's favourite tiles (2048 rows) overflow the default 32 MiB scoped
    VMEM; the picks are tiles the VMEM model accepts, at a raised limit where they need one."""
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model
    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.tuning.loop import warm_start_configs

    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    picks = warm_start_configs(matmul, (x, x), {}, "tpu_v6e", matmul.cache_key(x, x), limit=6)
    assert len(picks) == 6
    for p in picks:
        calls = _inspect.find_pallas_calls(matmul.fn, (x, x), p)
        assert model.model_verdict(calls, chip_spec("tpu_v6e")).status != "infeasible", p
    # Some pick needs (and sets) a raised limit: the big tiles are still proposed.
    assert any(p["vmem_limit_bytes"] > 0 for p in picks[1:]), picks


def test_the_tuner_never_measures_what_the_declared_constraints_refuse(cache_dir):
    """The kernel's one validity check reaches the tuner: a declared constraint refuses a config
    before it is traced or timed, and the trial says which constraint."""
    import jax
    import jax.numpy as jnp

    from pallas_tune.kernels.matmul import matmul

    # It reads the call's x, so the sampler cannot apply it beforehand (a rule between tuned
    # parameters alone it does: test_a_rule_between_parameters_is_never_proposed).
    constrained = pt.tunable(matmul.fn, space=matmul.space, name="tests.constrained_matmul",
                             constraints={"square_tiles": "bm == bn or x.shape[0] > 4096"})
    x = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    # Half of the 48 points are non-square: 8 trials, seeded, always ask for some.
    result = constrained.tune(x, x, trials=8, seed=0, repeats=1, retime_top=0, write=False)
    refused = [r for r in result.records if r.detail == "constraint"]
    assert refused, "the search should have asked for some non-square tiles"
    assert all(r.config["bm"] != r.config["bn"] for r in refused)
    assert all("square_tiles" in r.error for r in refused)
    assert all(r.config["bm"] == r.config["bn"] for r in result.records if r.outcome.timed)
    assert result.best["bm"] == result.best["bn"]
    rule = pt.tunable(matmul.fn, space=matmul.space, name="tests.rule_matmul",
                      constraints={"square_tiles": "bm == bn"})
    # Fewer trials than the rule's square programs: the GP's candidates last the whole run
    # (once every one is measured, Optuna's independent fallback may propose any point).
    result = rule.tune(x, x, trials=4, seed=0, repeats=1, retime_top=0, write=False)
    assert not [r for r in result.records if r.detail == "constraint"]  # Never proposed.
    assert all(r.config["bm"] == r.config["bn"] for r in result.records)


def test_a_retune_warm_starts_from_the_entry_it_may_replace(cache_dir):
    """--force re-tunes a cached key: its own winner is measured first after the default, so a
    short re-tune cannot end on a worse config without having measured the old one."""
    from pallas_tune.tuning.loop import warm_start_configs

    @pt.tunable(a=list(range(12)), b=list(range(12)), name="own_entry")
    def own(x, *, a, b):
        return x

    here = jnp.ones((512, 128))
    own.cache.write("cpu", own.name, own.cache_key(here), {"config": {"a": 7, "b": 3},
                                                            "median_ms": 1.0})
    own.cache.write("cpu", own.name, own.cache_key(jnp.ones((256, 128))),
                    {"config": {"a": 1, "b": 1}, "median_ms": 1.0})
    picks = warm_start_configs(own, (here,), {}, "cpu", own.cache_key(here))
    assert picks[1:3] == [{"a": 7, "b": 3}, {"a": 1, "b": 1}], picks


def test_one_error_for_every_first_candidate_stops_the_run(cache_dir):
    """int8 (or float16) operands fail every matmul config at trace time with one error: the
    run stops after FAIL_FAST_TRACE candidates (tracing spends no compile) and says so,
    instead of spending 20 trials (issue 26.6)."""
    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.tuning.loop import FAIL_FAST_TRACE

    for dtype in (jnp.int8, jnp.float16):
        x = jnp.ones((256, 256), dtype)
        with pytest.raises(pt.NoFeasibleConfigError,
                           match=rf"first {FAIL_FAST_TRACE} candidates all failed the same way"
                                 rf".*tracing failed.*{jnp.dtype(dtype).name}"):
            matmul.tune(x, x, trials=20, repeats=1, write=False)
    assert not list((cache_dir).glob("**/*.json"))  # Nothing written.


def test_compile_errors_need_more_candidates_than_trace_errors_to_stop(cache_dir):
    """A failure past tracing (compile, run) can depend on the config in ways its text does
    not show, so only FAIL_FAST first candidates failing alike stop the run."""
    from pallas_tune.measure.records import Outcome, TrialRecord
    from pallas_tune.tuning import loop

    class Log:
        records = [TrialRecord(number=i, config={"a": i}, outcome=Outcome.COMPILE_ERROR,
                               error="Mosaic failed: VMEM") for i in range(loop.FAIL_FAST - 1)]

    loop._fail_fast(type("K", (), {"name": "k"}), Log)  # Below FAIL_FAST: goes on.
    Log.records = Log.records + [TrialRecord(number=9, config={"a": 9},
                                             outcome=Outcome.COMPILE_ERROR,
                                             error="Mosaic failed: VMEM")]
    with pytest.raises(pt.NoFeasibleConfigError, match="first 5 candidates"):
        loop._fail_fast(type("K", (), {"name": "k"}), Log)


def test_xla_wins_where_it_is_faster_and_calls_then_run_it(cache_dir, fresh, tmp_path,
                                                            monkeypatch):
    """The reference (XLA) is timed in the final ranking with the same timer (asked for
    here: interpret-mode timings say nothing of TPU speed, so it is off by default on a CPU);
    where it wins the entry says so, calls run the reference, config_for and the receipts say
    which implementation runs (issue 28)."""
    import json

    k = fresh.scale_or_xla
    x = jnp.ones((1024, 128), jnp.float32)
    plain = k.tune(x, trials=2, repeats=2, write=False)
    assert math.isnan(plain.xla_ms) and plain.implementation == "pallas"  # Off on a CPU.
    res = k.tune(x, trials=2, repeats=3, xla=True)
    rows = res.provenance["retimed_interleaved"]
    xla_row = next(r for r in rows if r.get("implementation") == "xla")
    assert res.xla_ms == xla_row["median_ms"] and len(xla_row["times_ms"]) >= 3
    assert res.implementation == ("xla" if res.xla_ms < res.best_ms else "pallas")
    assert res.implementation == "xla", rows  # >= 50 ms a run (see scale_or_xla) vs a multiply.
    entry = k.cache.lookup("cpu", k.name, k.cache_key(x))[0]
    assert entry["implementation"] == "xla" and entry["xla_ms"] == res.xla_ms
    assert entry["margin_over_xla"] == res.xla_ms / res.best_ms < 1
    k._memo.clear()
    receipts = tmp_path / "ran.jsonl"
    monkeypatch.setenv("PALLAS_TUNE_RECEIPTS", str(receipts))
    assert k.config_for(x).implementation == "xla"
    before = fresh.CALLS["reference"]
    np.testing.assert_allclose(jax.jit(lambda a: k(a))(x), 2 * x)
    assert fresh.CALLS["reference"] == before + 1  # Traced once, through the reference.
    assert json.loads(receipts.read_text().splitlines()[0])["implementation"] == "xla"
    assert k.config_for(x, br=8).implementation == "pallas"  # Explicit keywords: the kernel.


def test_the_work_of_a_trial_does_not_grow_with_the_study(cache_dir, tmp_path, monkeypatch):
    """Each trial reads only what changed in the stored study since the last (issue 25: a
    300-trial sweep's bookkeeping grew with every trial). Counted, not timed: the trials the
    loop's reads go through, per trial, are as many at trial 60 as at trial 10."""
    from pallas_tune.tuning import TuneOptions, run
    from pallas_tune.tuning.study import Search

    @pt.tunable(a=list(range(12)), b=list(range(12)), name="flat_work")
    def flat(x, *, a, b):
        return x

    searches = []
    init = Search.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        searches.append(self)

    monkeypatch.setattr(Search, "__init__", kept)
    examined = []  # (trials the reads went through, configs asked) at each trial's record.
    opts = TuneOptions(trials=60, seed=0, write=False, retime_top=0, warm_start=0,
                       storage=f"sqlite:///{tmp_path / 'work.db'}", sampler="tpe",
                       callbacks=[lambda record, progress: examined.append(
                           (searches[-1].examined, progress.asked))])
    result = run(flat, (jnp.ones((8, 128)),), {}, opts,
                 evaluator=Landscape(lambda c: 1.0 + abs(c["a"] - 6) + abs(c["b"] - 3)))
    assert result.counts["timed"] == 60 and len(examined) == 60

    def per_ask(lo, hi):  # A config asked again (TPE repeats some) is a pass of the loop too.
        return (examined[hi][0] - examined[lo][0]) / (examined[hi][1] - examined[lo][1])

    early, late = per_ask(1, 16), per_ask(44, 59)
    assert 0 < late <= early * 1.2 and late <= 12, (early, late)


def test_candidates_that_did_not_run_are_fail_trials_for_optuna(cache_dir, fresh):
    """Infeasible and failed candidates are FAIL trials with their outcome attached (issue
    26.4): Optuna's plots show the study without a warning per trial, and the metric is named;
    a resumed study still knows them (they are not evaluated again)."""
    import warnings

    import optuna

    res = fresh.scale_checked.tune(fresh.ones((64, 256)), trials=32, seed=0, repeats=1,
                                   write=False, retime_top=0)
    states = {t.state for t in res.study.trials}
    failed = [t for t in res.study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert failed and optuna.trial.TrialState.COMPLETE in states
    assert all(t.user_attrs["outcome"] in ("infeasible", "mismatch", "compile_error",
                                           "runtime_error") for t in failed)
    assert all(t.value is None for t in failed)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Trial N is omitted ... inf" would raise here.
        optuna.visualization.plot_optimization_history(res.study)
        optuna.visualization.plot_slice(res.study)


def test_tune_learns_from_trials_at_a_neighbour_shape(cache_dir):
    """Transfer (issue 29): the ledger's trials at another shape are the GP's prior, and the
    provenance names them. The optimum (a=b=c=9, corners of a 12^3 space) is found in the
    neighbour's trials' region within 10 trials with the prior; without, a cold GP search
    (no warm starts either way) finds it later on every seed."""
    from pallas_tune.cache import ledger
    from pallas_tune.tuning import TuneOptions, run

    @pt.tunable(a=list(range(12)), b=list(range(12)), c=list(range(12)), name="transfer_toy")
    def toy(x, *, a, b, c):
        return x

    def cost(cfg):
        return 1.0 + abs(cfg["a"] - 9) + abs(cfg["b"] - 9) + 0.5 * abs(cfg["c"] - 9)

    neighbour = jnp.ones((256, 128))
    rng = np.random.default_rng(0)
    trials = [{"number": i, "config": cfg, "outcome": "ok", "median_ms": 1.1 * cost(cfg)}
              for i, cfg in enumerate({"a": int(a), "b": int(b), "c": int(c)}
                                      for a, b, c in rng.integers(0, 12, (30, 3)))]
    path = toy.cache.ledger_path("cpu", toy.name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ledger.append(path, [{"key": toy.cache_key(neighbour), "kind": "measured", "trials": trials}])
    here = jnp.ones((512, 128))
    found = {True: [], False: []}
    for seed in range(3):
        for transfer in (True, False):
            ev = Landscape(cost)
            res = run(toy, (here,), {}, TuneOptions(trials=25, seed=seed, write=False,
                                                    retime_top=0, warm_start=0,
                                                    transfer=transfer), evaluator=ev)
            first = next((i + 1 for i, c in enumerate(ev.evaluated) if cost(c) == 1.0), 99)
            found[transfer].append(first)
            if transfer:
                distinct = len({tuple(t["config"].values()) for t in trials})
                assert res.provenance["prior"] == {"tasks": [f"cpu:{toy.cache_key(neighbour)}"],
                                                   "trials": distinct}
            else:
                assert "prior" not in res.provenance
    assert max(found[True]) <= 10 and np.mean(found[True]) < np.mean(found[False]), found


def test_a_rule_between_parameters_is_never_proposed(cache_dir):
    """A declared constraint that reads only tuned parameters (flash_attention_bwd's "not fused
    or (bq_dq == 128 and bkv_dq == 128)": the dQ blocks do not matter when fused, so one config
    per program) is applied to the GP's candidates before any is proposed, and to the warm
    starts: a sweep of the 8192-token backward spent 2 of its 10 trials on fused configs the
    rule refuses, the roofline's ties (one program under several dQ blocks), as 'infeasible'.
    The baseline (the default) is kept whatever it is."""
    from pallas_tune.constraints import config_admits
    from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd
    from pallas_tune.tuning.study import ParamCodec, _sampler
    from pallas_tune.tuning.warm import warm_start_configs

    space = flash_attention_bwd.space
    assert not config_admits(space.constraints, {**space.default, "fused": True})
    assert config_admits(space.constraints, {**space.default, "bq_dq": 128, "bkv_dq": 128,
                                             "fused": True})
    codec = ParamCodec(space)
    sampler = _sampler(space, codec, "gp", 0, 10)
    proposed = [dict(zip(codec.distributions, c, strict=True)) for c in sampler._bo.candidates]
    assert len(proposed) == 5 ** 4 + 5 ** 2  # Unfused: every dQ block; fused: 128 only.
    assert all(config_admits(space.constraints, codec.decode(c)) for c in proposed)

    q = jax.ShapeDtypeStruct((1, 4, 1024, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 1, 1024, 128), jnp.bfloat16)
    args = (q, kv, kv, q, jax.ShapeDtypeStruct((1, 4, 1024), jnp.float32), q)

    def refused_first(configs, chip):  # A roofline that ranks what the rule refuses first.
        return [0.0 if not config_admits(space.constraints, c) else 1.0 + i
                for i, c in enumerate(configs)]

    picks = warm_start_configs(flash_attention_bwd, args, {"causal": True}, "tpu_v6e",
                               flash_attention_bwd.cache_key(*args, causal=True), limit=4,
                               rank=refused_first)
    assert picks[0] == dict(space.default) and len(picks) == 4
    assert all(config_admits(space.constraints, p) for p in picks), picks
