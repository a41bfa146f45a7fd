"""Timings that cannot rank are said to be so: the final re-ranking judges its rows against
their own noise, re-times a top within noise once more before judging, and the result (its
table, repr, provenance and a warning) says what the runs support. AutotuneResult prints a
table and dumps strict JSON."""

from __future__ import annotations

import json
import math
import warnings

import jax.numpy as jnp
import pytest
from test_tuner import Landscape

import pallas_tune as pt
from pallas_tune.tuning import noise


def test_ahead_pairs_rounds_and_falls_back_to_spreads():
    assert noise.ahead([1.0, 1.1, 0.9], [1.2, 1.3, 1.0])        # Faster in every round.
    assert not noise.ahead([1.0, 1.4, 0.9], [1.2, 1.3, 1.0])    # Lost a round, gap < spread.
    assert noise.ahead([1.0] * 5, [3.0, 3.1, 2.9, 3.0, 3.2][:4])  # Unpaired: gap >> spread.
    assert not noise.ahead([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])    # Slower is never ahead.
    assert not noise.ahead([], [1.0])


def _row(trial, times, **kw):
    import statistics

    return {"trial": trial, "config": {"a": trial}, "times_ms": times,
            "median_ms": statistics.median(times), "spread_ms": max(times) - min(times), **kw}


def test_judge_names_what_is_within_noise():
    clear = noise.judge([_row(0, [1.0, 1.0, 1.0]), _row(1, [2.0, 2.1, 2.2], default=True)])
    assert clear == {"winner_ahead": True, "default_ahead_by": True, "noisy": []}
    tied = noise.judge([_row(0, [1.0, 1.5, 1.0]), _row(1, [1.2, 1.1, 1.1], default=True)])
    assert not tied["winner_ahead"] and tied["default_ahead_by"] is False
    assert "within noise of the runner-up" in tied["note"] and "no speed-up" in tied["note"]
    wild = noise.judge([_row(0, [0.1, 5.0, 0.2, 0.1]), _row(1, [9.0, 9.0, 9.0, 9.0])])
    assert wild["noisy"] == [0] and "spread wider than their median" in wild["note"]
    assert noise.judge([_row(0, [1.0])]) is None  # One row: nothing to rank.


class Jittery(Landscape):
    """Re-ranking rounds whose times are equal within noise for every config."""

    def __init__(self, cost):
        super().__init__(cost)
        self.reranks = []

    def rerank(self, configs, rounds, *, reference=False):
        self.reranks.append(rounds)
        wobble = [1.0, 1.3, 0.8, 1.2, 0.9, 1.1]
        return [[wobble[(i + r) % 6] for r in range(rounds)] for i in range(len(configs))]


def test_a_top_within_noise_is_retimed_then_said_not_claimed(cache_dir):
    from pallas_tune.tuning import TuneOptions, run

    @pt.tunable(a=[0, 1, 2, 3], name="noisy_synthetic")
    def synthetic(x, *, a):
        return x

    ev = Jittery(lambda c: 1.0 + c["a"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = run(synthetic, (jnp.ones((8, 128)),), {},
                  TuneOptions(trials=4, seed=0, write=False, retime_top=3, repeats=3),
                  evaluator=ev)
    assert ev.reranks == [3, 6]  # Within noise after 3 rounds: timed again, twice as long.
    assert all(row.get("retimed") == 2 and len(row["times_ms"]) == 9 for row in res.ranking)
    assert res.within_noise and "within noise" in repr(res)
    assert res.provenance["ranking_noise"]["winner_ahead"] is False
    text = str(res)
    assert "NOISE:" in text and "x the default" not in text
    assert any("cannot rank" in str(w.message) for w in caught)


def test_a_clear_winner_shows_its_ranking_and_speedup(cache_dir):
    from pallas_tune.tuning import TuneOptions, run

    @pt.tunable(a=[0, 1, 2, 3], default={"a": 3}, name="clear_synthetic")
    def synthetic(x, *, a):
        return x

    class Clear(Landscape):
        def rerank(self, configs, rounds, *, reference=False):
            return [[1.0 + c["a"]] * rounds for c in configs]

    res = run(synthetic, (jnp.ones((8, 128)),), {},
              TuneOptions(trials=4, seed=0, write=False, retime_top=2, repeats=3),
              evaluator=Clear(lambda c: 1.0 + c["a"]))
    assert not res.within_noise and res.best == {"a": 0}
    lines = str(res).splitlines()
    assert lines[1].split() == ["rank", "median", "ms", "spread", "ms", "x", "best", "config"]
    assert lines[2].split()[:2] == ["1", "1"] and lines[2].endswith("a=0")
    assert "[default]" in str(res) and "4.00x the default" in lines[-1]


def test_autotune_result_prints_a_table_and_dumps_strict_json(tmp_path):
    from pallas_tune.step.result import AutotuneResult, TunedCall

    calls = [TunedCall(kernel="pkg.mod.matmul", key="x=8x128:float32", chip="cpu",
                       config={"bm": 8}, source="tuned", default_ms=2.0, best_ms=1.0),
             TunedCall(kernel="pkg.mod.norm", key="x=8:float32", chip="cpu", config={},
                       source="untuned", error="no config fits")]
    res = AutotuneResult(calls, step_ms={"default": 3.0, "tuned": math.nan})
    text = str(res)
    assert "matmul" in text and "tuned 1 ms" in text and "XLA - ms" in text
    assert "no config fits" in text and "nan" not in text
    path = tmp_path / "r.json"
    res.dump(path)
    raw = path.read_text()
    assert "NaN" not in raw
    data = json.loads(raw)
    assert data["calls"][0]["xla_ms"] is None and data["step_ms"]["tuned"] is None
    back = AutotuneResult.load(path)
    assert math.isnan(back.calls[0].xla_ms) and back.calls[0].best_ms == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_no_non_finite_number_reaches_the_json(tmp_path, bad):
    from pallas_tune.step.result import AutotuneResult, TunedCall

    res = AutotuneResult([TunedCall(kernel="k", key="x", chip="cpu", config={}, source="tuned",
                                    best_ms=bad)], step_detail={"tuned": {"cycles": bad}})
    res.dump(tmp_path / "r.json")
    json.loads((tmp_path / "r.json").read_text(),
               parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
