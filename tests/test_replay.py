import gzip
import json
import math
import os

import pytest

from pallas_tune.search import replay

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _synthetic(tmp_path, gz=True):
    cache = {}
    for a in (1, 2, 4, 8, 16):
        for b in (32, 64, 128, 256):
            if a * b > 2048:
                continue  # Restricted space: not every product point is present.
            t = abs(math.log2(a) - 2) + abs(math.log2(b) - 6) + 1.0
            rec = {"a": a, "b": b, "time": t, "times": [t, t * 1.01, t * 0.99]}
            if (a, b) == (16, 32):
                rec["time"] = "RuntimeFailedConfig"
            cache[f"{a},{b}"] = rec
    data = {"device_name": "synthetic", "kernel_name": "toy", "problem_size": [1],
            "tune_params_keys": ["a", "b"], "tune_params": {"a": [1, 2, 4, 8, 16],
                                                            "b": [32, 64, 128, 256]},
            "objective": "time", "cache": cache}
    path = tmp_path / ("land.json.gz" if gz else "land.json")
    with (gzip.open(path, "wt") if gz else open(path, "w")) as f:
        json.dump(data, f)
    return str(path)


@pytest.mark.parametrize("strategy", sorted(replay.STRATEGIES))
def test_deterministic_and_no_duplicates(tmp_path, strategy):
    if strategy == "optuna-gp":
        pytest.importorskip("torch", reason="Optuna's GPSampler needs PyTorch")
    if strategy == "cmaes":
        pytest.importorskip("cmaes", reason="Optuna's CmaEsSampler needs cmaes (the bench extra)")
    path = _synthetic(tmp_path)
    a = replay.run(path, strategy=strategy, budget=12, seed=3)
    b = replay.run(path, strategy=strategy, budget=12, seed=3)
    assert a == b and len(a) == 12


def test_counts_failures_and_never_repeats(tmp_path):
    path = _synthetic(tmp_path, gz=False)
    land = replay.load(path)
    assert len(land.configs) == 19 and land.optimum == pytest.approx(1.0)
    seq = replay.run(path, strategy="random", budget=30, seed=0)
    assert len(seq) == 19 and sum(math.isinf(x) for x in seq) == 1  # Each config once.


def test_default_strategy_finds_the_optimum_on_the_shipped_estimate_landscape():
    path = os.path.join(REPO, "benchmarks", "landscapes", "matmul_2048_bf16_v6e_estimate.json")
    if not os.path.exists(path):
        pytest.skip("landscape not generated")
    land = replay.load(path)
    hits = [min(replay.run(land, "default", budget=40, seed=s)) <= land.optimum * 1.05
            for s in range(5)]
    assert sum(hits) >= 4


@pytest.mark.parametrize("strategy", ["default", "tpe", "tpe-mv"])
def test_warm_starts_are_measured_first_and_learned_from(tmp_path, strategy):
    path = _synthetic(tmp_path)
    land = replay.load(path)
    seq = replay.run(land, strategy, budget=8, seed=0,
                     warm_start=[{"a": 4, "b": 64}, (16, 32), {"a": 3, "b": 64}])
    # The optimum first (its recorded repeats are 1.0, 1.01, 0.99), then the failed config;
    # a config not in the file is skipped; the strategy then spends the rest of the budget.
    assert seq[0] in (1.0, 1.01, 0.99) and math.isinf(seq[1]) and len(seq) == 8



def test_trace_keeps_configs_and_scores_the_mean_of_the_best_measured(tmp_path):
    land = replay.load(_synthetic(tmp_path))
    tr = replay.trace(land, "default", budget=10, seed=1)
    assert len(tr.configs) == len(tr.values) == 10 and len(set(tr.configs)) == 10
    assert tr.seconds >= 0
    assert tr.values == replay.run(land, "default", budget=10, seed=1)
    for c, v in zip(tr.configs, tr.values):  # Each value is one of the config's repeats.
        assert (math.isinf(v) and land.times[c] is None) or v in land.times[c]
    assert land.means[(4, 64)] == pytest.approx(1.0) and math.isinf(land.means[(16, 32)])


def test_a_callable_strategy_and_default_settings(tmp_path):
    land = replay.load(_synthetic(tmp_path))

    def first_three(land, budget, seed, evaluate, measured):
        for c in land.configs[:3]:
            evaluate(c)

    assert replay.trace(land, first_three, budget=5).configs == land.configs[:3]
    seq = replay.run(land, replay.default_with(cycle="glt", init="maximin"), budget=12, seed=0)
    assert len(seq) == 12
    with pytest.raises(ValueError, match="must be one of"):
        replay.run(land, "no-such-strategy")

    def outside(land, budget, seed, evaluate, measured):
        evaluate((3, 3))

    with pytest.raises(ValueError, match="not in the landscape"):
        replay.run(land, outside)


def test_find_landscapes_by_argument_and_environment(tmp_path, monkeypatch):
    (tmp_path / "k").mkdir()
    path = _synthetic(tmp_path / "k")
    assert replay.find_landscapes(str(tmp_path)) == [os.path.normpath(path)]
    monkeypatch.setenv(replay.LANDSCAPES_ENV, str(tmp_path))
    assert replay.find_landscapes() == [os.path.normpath(path)]
    monkeypatch.setenv(replay.LANDSCAPES_ENV, str(tmp_path / "absent"))
    assert replay.find_landscapes() == []


def test_a_hostile_file_is_rejected_or_its_bad_records_skipped(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cache": {}}))
    with pytest.raises(ValueError, match="not a Kernel Tuner cache file"):
        replay.load(str(bad))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"tune_params_keys": ["a"], "cache": {"x": {"b": 1}}}))
    with pytest.raises(ValueError, match="holds no configs"):
        replay.load(str(empty))
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"tune_params_keys": ["a"], "cache": {
        "1": {"a": 1, "time": 2.0, "times": [2.0, "x", -1, 2.2]}, "2": {"a": 2, "time": "nan"},
        "3": "garbage", "4": {"a": 4, "time": float("nan")}}}))
    land = replay.load(str(mixed))
    assert land.times == {(1,): [2.0, 2.2], (2,): None, (4,): None}
