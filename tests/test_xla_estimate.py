"""XLA as a candidate under the tpu-estimate timer: the kernel's reference estimated whole
beside the winner, both on the v6e compiler's terms (issue 28)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

import pallas_tune as pt
from pallas_tune.tuning.footing import xla_decision

X = jax.ShapeDtypeStruct((256, 512), jnp.float32)


def test_xla_runs_only_past_the_margin_on_one_footing():
    from pallas_tune.tuning.footing import MARGIN, PALLAS_BIAS, XLA_MODEL_BIAS

    row = {"implementation": "xla", "timer": "tpu-estimate", "median_ms": 0.5, "partial": 0}
    ms, impl, note = xla_decision(row, 1.0)  # Same kind (libtpu both), 2x ahead: XLA runs.
    assert (ms, impl) == (0.5, "xla") and "libtpu's estimate of both" in note
    assert xla_decision(row, 0.4) == (0.5, "pallas", "")  # Pallas is faster.
    ms, impl, note = xla_decision(row, 0.5 * MARGIN * 0.99)  # Ahead, but within the margin.
    assert impl == "pallas" and "margin" in note
    # Below the time the call's own data takes to move: not credible, never decides.
    ms, impl, note = xla_decision({**row, "floor_ms": 0.6}, 1.0)
    assert impl == "pallas" and "not credible" in note
    # Measured on a device: as timed, no footing and no margin.
    timed = {"implementation": "xla", "median_ms": 0.9, "spread_ms": 0.01}
    assert xla_decision(timed, 1.0) == (0.9, "xla", "")
    assert xla_decision({**timed, "median_ms": 1.1}, 1.0) == (1.1, "pallas", "")


def test_a_partial_xla_estimate_never_decides():
    row = {"implementation": "xla", "timer": "tpu-estimate", "median_ms": 0.5, "partial": 3}
    ms, impl, note = xla_decision(row, 1.0)  # A lower bound below Pallas, no cost model.
    assert (ms, impl) == (0.5, "pallas") and "lower bound" in note and "3 of its ops" in note
    assert xla_decision(row, 0.4) == (0.5, "pallas", "")  # The lower bound is slower already.
    ms, impl, note = xla_decision({"implementation": "xla", "error": "compile failed"}, 1.0)
    assert impl == "pallas" and math.isnan(ms) and note == "compile failed"
    assert xla_decision(None, 1.0)[1] == "pallas"


def test_a_partial_sum_gives_way_to_xla_s_cost_model_on_the_footing():
    from pallas_tune.tuning.footing import MARGIN, PALLAS_BIAS, XLA_MODEL_BIAS

    footed = PALLAS_BIAS / XLA_MODEL_BIAS
    row = {"implementation": "xla", "timer": "tpu-estimate", "median_ms": 0.1, "partial": 2,
           "model_ms": 1.0}
    # The partial sum (0.1) is far below Pallas (0.6); the cost model on the footing is not.
    ms, impl, note = xla_decision(row, footed * MARGIN * 0.99)
    assert impl == "pallas" and ms == pytest.approx(footed) and "cost model" in note
    ms, impl, note = xla_decision(row, footed * MARGIN * 1.01)
    assert impl == "xla" and ms == pytest.approx(footed) and "cost model" in note


def test_xla_s_cost_model_decides_where_libtpu_s_profiled_compile_died():
    """libtpu's static profiler can die compiling XLA's program (seen: ragged_dot, out of the
    worker's address space); the compile without the flag still carries XLA's cost model,
    which then decides on the footing, the floor and the margin as a partial sum's would."""
    from pallas_tune.measure.estimate import EstimateResult
    from pallas_tune.tuning.footing import MARGIN, PALLAS_BIAS, XLA_MODEL_BIAS, xla_row

    died = EstimateResult(ok=False, kind="worker_crashed",
                          message="the worker died from signal SIGSEGV\nmmap error: 12",
                          model_cycles=1_000_000)
    row = xla_row(died, clock_hz=1e9)
    assert row["model_ms"] == pytest.approx(1.0) and "median_ms" not in row
    assert row["error"] == "the worker died from signal SIGSEGV"  # Not the worker's log.
    footed = PALLAS_BIAS / XLA_MODEL_BIAS
    ms, impl, note = xla_decision(row, footed * MARGIN * 1.01)
    assert impl == "xla" and ms == pytest.approx(footed) and "profiled one failed" in note
    ms, impl, note = xla_decision(row, footed * MARGIN * 0.99)
    assert impl == "pallas" and "margin" in note
    ms, impl, note = xla_decision(row, footed * 0.5)
    assert impl == "pallas" and "is slower" in note
    assert xla_decision({**row, "floor_ms": 2 * footed}, 10.0)[1] == "pallas"  # Below floor.
    no_model = xla_row(EstimateResult(ok=False, kind="worker_crashed", message="died"), 1e9)
    assert math.isnan(xla_decision(no_model, 1.0)[0])


def test_the_footing_is_the_one_measured():
    """The constants are benchmarks/results/xla_footing.md's: its rule with these constants is
    the one that agreed with the chip on every key (checked there), so changing them without a
    new measurement fails here."""
    import json
    import pathlib

    from pallas_tune.tuning import footing

    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "results" / "xla_footing.json"
    data = json.loads(path.read_text())
    assert data["footing"] == {"pallas_bias": footing.PALLAS_BIAS,
                               "xla_model_bias": footing.XLA_MODEL_BIAS,
                               "margin": footing.MARGIN}


@pytest.mark.libtpu
def test_estimates_pick_xla_where_its_estimate_is_lower(cache_dir, fresh):
    res = fresh.poor_scale.tune(X, trials=2, timer="tpu-estimate", chip="v6e")
    assert res.provenance["kind"] == "estimate"
    xla = res.provenance["xla"]
    assert xla["timer"] == "tpu-estimate" and "estimate" in xla["note"] and not xla["partial"]
    assert res.implementation == "xla" and res.xla_ms < res.best_ms  # Tiny tiles lose.
    entry = res.to_entry()
    assert entry["implementation"] == "xla" and entry["xla_ms"] == res.xla_ms
    assert entry["margin_over_xla"] < 1 and "xla_partial" not in entry
    assert res.cache_path.endswith(".estimate.json")
    fresh.poor_scale._memo.clear()
    with pt.target("v6e"):  # The estimate entry dispatches to the reference on that chip.
        assert fresh.poor_scale.config_for(X).implementation == "xla"
    fresh.poor_scale._memo.clear()


@pytest.mark.libtpu
def test_a_partial_xla_estimate_is_recorded_and_keeps_pallas(fresh, monkeypatch):
    from pallas_tune.measure.estimate import EstimateEvaluator, EstimateResult

    def partial(self):  # As libtpu reports programs with fusions it gives no estimate.
        return EstimateResult(ok=True, kind="ok", cycles=10, ops_without_estimate=2)

    monkeypatch.setattr(EstimateEvaluator, "estimate_reference", partial)
    with pytest.warns(pt.PallasTuneWarning, match="lower bound"):
        res = fresh.poor_scale.tune(X, trials=2, timer="tpu-estimate", chip="v6e", write=False)
    assert res.implementation == "pallas" and res.xla_partial == 2
    assert res.xla_ms < res.best_ms and res.to_entry()["xla_partial"] == 2
    assert "lower bound" in res.provenance["xla"]["note"]
    off = fresh.poor_scale.tune(X, trials=2, timer="tpu-estimate", chip="v6e", write=False,
                                xla=False)
    assert "xla" not in off.provenance and math.isnan(off.xla_ms)


@pytest.mark.libtpu
def test_whole_step_estimates_sum_every_op_under_three_settings(cache_dir, fresh, tmp_path):
    def program(x):  # Two tunable calls and XLA's own ops between them.
        return jnp.tanh(fresh.poor_scale(x)) + fresh.scale(x) * 3.0

    fresh.poor_scale._memo.clear()
    res = pt.autotune(program, X, trials=2, timer="tpu-estimate", chip="v6e", step_time=True)
    assert [c.source for c in res.calls] == ["tuned", "tuned"]
    assert {c.kernel: c.implementation for c in res.calls}[fresh.poor_scale.name] == "xla"
    assert set(res.step_ms) == {"default", "tuned", "xla"}
    assert "ESTIMATE" in res.step_timer and "not a measurement" in res.step_timer
    for name, d in res.step_detail.items():
        assert d["cycles"] > 0 and d["compile_s"] >= 0 and d["dynamic_loops"] == 0, (name, d)
        assert d["partial"] == bool(d["ops_without_estimate"])
    # XLA for poor_scale (chosen by tuning) beats its default's 64 tiny tiles.
    assert res.step_ms["tuned"] < res.step_ms["default"]
    res.dump(tmp_path / "step.json")
    again = pt.AutotuneResult.load(tmp_path / "step.json")
    assert again.step_detail == res.step_detail and again.step_timer == res.step_timer
    fresh.poor_scale._memo.clear()


@pytest.mark.libtpu
def test_recheck_xla_adds_xla_to_entries_tuned_without_it(cache_dir, fresh, capsys):
    """pallas-tune recheck-xla: an estimate entry tuned before XLA was a candidate gets XLA's
    estimate beside it and, where XLA is faster, dispatches to XLA (issue 28)."""
    import os

    from conftest import TESTS_DIR

    from pallas_tune.cli import main

    kernel = fresh.poor_scale
    res = kernel.tune(X, trials=2, timer="tpu-estimate", chip="v6e", xla=False)
    key = res.key
    (entry,) = [e for k, e, _ in kernel.cache.entries("tpu_v6e", kernel.name) if k == key]
    assert "xla_ms" not in entry and "implementation" not in entry
    ref = f"{kernel.fn.__module__}:{kernel.fn.__name__}"
    assert main(["recheck-xla", ref, "--chip", "v6e", "--path", TESTS_DIR]) == 0
    out = capsys.readouterr().out
    assert f"{key}: tuned" in out and "runs xla" in out and "entries rewritten" in out
    (entry,) = [e for k, e, _ in kernel.cache.entries("tpu_v6e", kernel.name) if k == key]
    assert entry["implementation"] == "xla" and entry["xla_ms"] < entry["median_ms"]
    assert entry["margin_over_xla"] == pytest.approx(entry["xla_ms"] / entry["median_ms"])
    assert "recheck-xla" in entry["provenance"]["xla"]["note"]
    assert entry["config"] == res.best  # The Pallas winner is kept, and still valid.
    kernel._memo.clear()
    with pt.target("v6e"):
        assert kernel.config_for(X).implementation == "xla"
    kernel._memo.clear()
    assert main(["recheck-xla", ref, "--chip", "v6e", "--path", TESTS_DIR]) == 0
    assert "no estimate entry without an XLA figure" in capsys.readouterr().out
    # --again: decided once more under the current footing, the same way here (XLA far ahead).
    assert main(["recheck-xla", ref, "--chip", "v6e", "--path", TESTS_DIR, "--again"]) == 0
    assert "runs xla" in capsys.readouterr().out
    (again,) = [e for k, e, _ in kernel.cache.entries("tpu_v6e", kernel.name) if k == key]
    assert again["implementation"] == "xla" and "floor_ms" in again["provenance"]["xla"]
    assert os.path.isdir(cache_dir)


@pytest.mark.libtpu
def test_autotune_starts_the_compile_workers_once_for_all_its_calls(fresh, monkeypatch):
    """A program's calls share one pool of estimate workers (each loads libtpu once): the
    second call's run retargets the workers the first one started; each run still tunes its
    own kernel against its own reference, and the pool closes when autotune returns."""
    from pallas_tune.measure import estimate, pool

    started, closed = [], []
    real_worker, real_close = pool._Worker, pool.Pool.close

    def worker(spec):
        started.append(spec.factory)
        return real_worker(spec)

    def close(self):
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(pool, "_Worker", worker)
    monkeypatch.setattr(pool.Pool, "close", close)

    def program(x):
        return jnp.tanh(fresh.poor_scale(x)) + fresh.scale(x) * 3.0

    fresh.poor_scale._memo.clear()
    res = pt.autotune(program, X, trials=2, timer="tpu-estimate", chip="v6e", workers=1)
    assert [c.source for c in res.calls] == ["tuned", "tuned"]
    impl = {c.kernel: c.implementation for c in res.calls}
    assert impl[fresh.poor_scale.name] == "xla" and impl[fresh.scale.name] == "pallas"
    assert all(math.isfinite(c.best_ms) for c in res.calls)
    assert started == [estimate._SESSION] and len(closed) == 1  # One worker, one pool.
    # Outside autotune, each tuning run has its pool of its own, as before.
    fresh.scale.tune(X, trials=1, timer="tpu-estimate", chip="v6e", workers=1, write=False)
    assert len(started) == 2 and len(closed) == 2
    fresh.poor_scale._memo.clear()


def test_the_data_floor_counts_arguments_and_outputs_at_libtpu_s_bandwidth():
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.fitted import V6E
    from pallas_tune.kernels.quantized_matmul import quantized_matmul
    from pallas_tune.tuning.footing import data_floor_ms

    args = [jax.ShapeDtypeStruct((16, 4096), jnp.bfloat16),
            jax.ShapeDtypeStruct((4096, 28672), jnp.int8),
            jax.ShapeDtypeStruct((28672,), jnp.float32)]
    spec = chip_spec("v6e")
    data = 16 * 4096 * 2 + 4096 * 28672 + 28672 * 4 + 16 * 28672 * 2  # Output bf16 too.
    want = data / (spec.hbm_bw_bytes_per_s * V6E.bw_eff) * 1e3  # Decode: memory-bound.
    assert data_floor_ms(quantized_matmul, args, {}, "v6e") == pytest.approx(want)
    assert data_floor_ms(quantized_matmul, args, {}, "cpu") == 0.0  # No bandwidth known.
    # Prefill: compute-bound. The reference widens the weights: a bf16 dot, at the bf16 peak;
    # with activations quantized the dot is int8 x int8, at the int8 peak.
    args[0] = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    flops = 2.0 * 2048 * 4096 * 28672
    assert data_floor_ms(quantized_matmul, args, {}, "v6e") == pytest.approx(
        flops / spec.bf16_flops * 1e3)
    assert data_floor_ms(quantized_matmul, args, {"quantize_x": True}, "v6e") == pytest.approx(
        flops / spec.int8_ops * 1e3)
