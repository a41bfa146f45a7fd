"""A trial ledger read as a prior is advice, never an order: a hostile or huge ledger (in the
user cache, a ``PALLAS_TUNE_CACHE_PATH`` root or a shipped cache) never stops a tune, and what a
prior reads is bounded."""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings

import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pallas_tune as pt
from pallas_tune.cache import ledger
from pallas_tune.cache.store import TuningCache
from pallas_tune.errors import PallasTuneWarning
from pallas_tune.tuning import transfer
from pallas_tune.tuning.transfer import prior_for

NAMES = ["a", "b"]
HERE_KEY = "x=512x128:float32"


def _cost(cfg):
    return 1.0 + abs(cfg["a"] - 5) + abs(cfg["b"] - 2)


def _good(key="x=256x128:float32", n=12):
    trials = [{"number": i, "config": {"a": i % 8, "b": i % 4}, "outcome": "ok",
               "median_ms": _cost({"a": i % 8, "b": i % 4})} for i in range(n)]
    return {"key": key, "kind": "measured", "trials": trials}


def _kernel(root):
    class Kernel:
        name = "pkg.mod.kern"
        cache = TuningCache(str(root), use_shipped=False)
    return Kernel


def _write_lines(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for line in lines:
            f.write(line + "\n")


HOSTILE = {
    "config value is an object": {
        "key": "x=128x128:float32", "trials": [
            {"config": {"a": {"nested": 1}, "b": 1}, "outcome": "ok", "median_ms": 1.0}] * 4},
    "median_ms of 400 digits": {
        "key": "x=128x128:float32", "trials": [
            {"config": {"a": i, "b": 1}, "outcome": "ok", "median_ms": 10 ** 400}
            for i in range(4)]},
    "a key dimension of 400 digits": {
        "key": f"x={10 ** 400}x128:float32", "trials": _good()["trials"]},
    "a key nested 3000 parentheses deep": {
        "key": "x=" + "(" * 3000 + "8:float32" + ")" * 3000, "trials": _good()["trials"]},
    "config keys that are not names": {
        "key": "x=64x128:float32", "trials": [
            {"config": {"a": 1, "b": 1, "": [[[[1]]]]}, "outcome": "ok", "median_ms": 2.0}] * 3},
    "trials that are not a list of objects": {
        "key": "x=32x128:float32", "trials": [1, "two", None, [3]]},
    "a config value that is a long list": {
        "key": "x=16x128:float32", "trials": [
            {"config": {"a": list(range(10_000)), "b": 1}, "outcome": "ok", "median_ms": 1.0}
            for _ in range(4)]},
}


@pytest.mark.parametrize("what", sorted(HOSTILE))
def test_one_hostile_ledger_record_is_skipped_with_one_warning(tmp_path, what):
    """Each record the issue found fatal (TypeError: unhashable, OverflowError, ValueError:
    math domain error, RecursionError) is skipped with a warning naming the file; the good
    record beside it still informs the prior."""
    kernel = _kernel(tmp_path)
    path = kernel.cache.ledger_path("cpu", kernel.name)
    _write_lines(path, [json.dumps(_good()), json.dumps(HOSTILE[what])])
    transfer._WARNED.clear()
    with pytest.warns(PallasTuneWarning, match="skipped") as got:
        prior, record = prior_for(kernel, "cpu", HERE_KEY, NAMES, kind="measured")
    assert record["tasks"] == ["cpu:x=256x128:float32"]
    assert sum("skipped" in str(w.message) for w in got) == 1
    assert path in str(got[0].message)
    scores = prior.scores([(5, 2), (0, 0)], [list(range(8)), list(range(4))])
    assert scores.shape == (1, 2) and scores[0][0] < scores[0][1]
    with warnings.catch_warnings():  # Once per file and process, not per tune.
        warnings.simplefilter("error")
        prior_for(kernel, "cpu", HERE_KEY, NAMES, kind="measured")


def test_key_distance_survives_hostile_keys():
    from pallas_tune import keys

    assert keys.key_distance(f"x={10 ** 400}x128:float32", "x=1x128:float32") == pytest.approx(
        math.log2(10 ** 400))
    deep = "x=" + "(" * 3000 + "8:float32" + ")" * 3000
    assert keys.key_distance(deep, deep) == math.inf or keys.key_distance(deep, deep) == 0
    assert keys.key_distance(deep, "x=8:float32") == math.inf


def test_a_huge_ledger_is_read_from_its_newest_end_and_the_prior_says_so(tmp_path,
                                                                         monkeypatch):
    """What a prior reads of one ledger is bounded (the newest bytes: records are appended),
    and the provenance says it was cut."""
    monkeypatch.setattr(transfer, "LEDGER_BYTES", 64 * 1024)
    kernel = _kernel(tmp_path)
    path = kernel.cache.ledger_path("cpu", kernel.name)
    old = json.dumps(_good(key="x=1024x128:float32"))
    lines = [old] * 400 + [json.dumps(_good())]
    _write_lines(path, lines)
    assert os.path.getsize(path) > 5 * transfer.LEDGER_BYTES
    transfer._WARNED.clear()
    with pytest.warns(PallasTuneWarning, match="newest"):
        prior, record = prior_for(kernel, "cpu", HERE_KEY, NAMES, kind="measured")
    assert "cpu:x=256x128:float32" in record["tasks"]  # The newest record is read.
    assert record["truncated"] == [path]


def test_records_per_key_and_trials_per_record_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(transfer, "TASK_TRIALS", 5)
    kernel = _kernel(tmp_path)
    path = kernel.cache.ledger_path("cpu", kernel.name)
    _write_lines(path, [json.dumps(_good(n=40))])
    prior, record = prior_for(kernel, "cpu", HERE_KEY, NAMES, kind="measured")
    assert record["trials"] == 5


def _tree_digest(root):
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[p] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture
def toy(cache_dir):
    @pt.tunable(a=list(range(8)), b=list(range(4)), name="prior_hostile_toy")
    def toy(x, *, a, b):
        return x
    return toy


def _run(toy, root, monkeypatch, seed=0):
    from test_tuner import Landscape

    from pallas_tune.tuning import TuneOptions, run

    monkeypatch.setenv("PALLAS_TUNE_CACHE_PATH", str(root))
    ev = Landscape(_cost)
    res = run(toy, (jnp.ones((512, 128)),), {},
              TuneOptions(trials=12, seed=seed, write=False, retime_top=0, warm_start=0,
                          transfer=True), evaluator=ev)
    return res, ev


def test_a_tune_with_every_hostile_record_in_a_search_root_finishes(toy, tmp_path, monkeypatch):
    root = tmp_path / "root"
    path = TuningCache(str(root), use_shipped=False).ledger_path("cpu", toy.name)
    good = _good()
    _write_lines(path, [json.dumps(good)] + [json.dumps(r) for r in HOSTILE.values()])
    before = _tree_digest(root)
    transfer._WARNED.clear()
    with pytest.warns(PallasTuneWarning, match="skipped"):
        res, ev = _run(toy, root, monkeypatch)
    assert res.provenance["prior"]["tasks"] == ["cpu:x=256x128:float32"]
    assert min(_cost(c) for c in ev.evaluated) == _cost(res.best)
    assert _tree_digest(root) == before


# Arbitrary JSON: what any writer, careless or hostile, could have left in a ledger.
_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True)
    | st.text(max_size=8) | st.sampled_from([10 ** 400, -1, 0, 1e308, "(((", "x=8:float32"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                 max_size=4),
    max_leaves=12)
_trial = st.fixed_dictionaries(
    {"config": st.dictionaries(st.sampled_from(["a", "b", "c"]), _json, max_size=3)
     | _json, "outcome": st.sampled_from(["ok", "slow", None, 1]), "median_ms": _json})
_record = st.fixed_dictionaries(
    {"key": st.sampled_from(["x=256x128:float32", "x=1x1:float32", "", "(((", "x=" + "(" * 500])
     | _json, "trials": st.lists(_trial, max_size=6) | _json})


@pt.tunable(a=list(range(8)), b=list(range(4)), name="prior_hostile_fuzz")
def _fuzz_toy(x, *, a, b):
    return x


@given(records=st.lists(_record | _json, max_size=6), raw=st.lists(st.binary(max_size=40),
                                                                    max_size=3))
def test_fuzzed_ledger_records_never_break_a_tune(tmp_path_factory, records, raw):
    """Hypothesis over ledger records used as a prior: nothing escapes the tune, its winner is
    the best config it evaluated, and the ledger it read as a prior is unchanged."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        root = tmp_path_factory.mktemp("fuzz")
        monkeypatch.setenv("PALLAS_TUNE_CACHE_DIR", str(root / "user"))
        path = TuningCache(str(root / "roots"), use_shipped=False).ledger_path(
            "cpu", _fuzz_toy.name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write((json.dumps(_good()) + "\n").encode())
            for r in records:
                f.write(json.dumps(r).encode() + b"\n")
            for b in raw:
                f.write(b + b"\n")
        before = _tree_digest(root)
        transfer._WARNED.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", PallasTuneWarning)
            res, ev = _run(_fuzz_toy, root / "roots", monkeypatch)
        assert min(_cost(c) for c in ev.evaluated) == _cost(res.best)
        assert _tree_digest(root) == before
