"""The JSON cache: format, lookup order, concurrent merges, malformed files."""

import json
import multiprocessing
import os

import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.cache import SCHEMA_VERSION, TuningCache, read_file


def _entry(i, ms=1.0):
    return {"key": f"k{i}", "config": {"b": i}, "median_ms": ms,
            "provenance": {"kind": "measured"}}


def test_roundtrip_and_human_readable(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    path = c.write("tpu_v6e", "pkg.mod.kern", "x=8x128:float32", _entry(1))
    assert path == str(tmp_path / "tpu_v6e" / "pkg.mod.kern.json")
    text = open(path).read()
    assert "\n" in text and '"schema": 1' in text  # Indented JSON, schema-versioned.
    data = json.loads(text)
    assert data["schema"] == SCHEMA_VERSION and data["chip"] == "tpu_v6e"
    entry, where = c.lookup("tpu_v6e", "pkg.mod.kern", "x=8x128:float32")
    assert entry["config"] == {"b": 1} and where == path
    assert c.lookup("tpu_v5e", "pkg.mod.kern", "x=8x128:float32") is None


def test_user_cache_shadows_shipped_and_measured_beats_estimate(tmp_path):
    user, shipped = tmp_path / "user", tmp_path / "shipped"
    TuningCache(str(shipped), use_shipped=False).write("cpu", "k", "key", _entry(1))
    TuningCache(str(shipped), use_shipped=False).write("cpu", "k", "only-shipped", _entry(2))
    TuningCache(str(user), use_shipped=False).write("cpu", "k", "key", _entry(3))
    TuningCache(str(user), use_shipped=False).write("cpu", "k", "est", _entry(4), kind="estimate")
    TuningCache(str(shipped), use_shipped=False).write("cpu", "k", "est", _entry(5))
    c = TuningCache(str(user), str(shipped))
    assert c.lookup("cpu", "k", "key")[0]["config"] == {"b": 3}
    assert c.lookup("cpu", "k", "only-shipped")[0]["config"] == {"b": 2}
    assert c.lookup("cpu", "k", "est")[0]["config"] == {"b": 5}  # Shipped measured > user estimate.


def _writer(root, proc, n):
    c = TuningCache(root, use_shipped=False)
    for i in range(n):
        c.write("cpu", "kern", f"p{proc}-{i}", _entry(proc * 100 + i))


def test_concurrent_writers_lose_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), p, 25)) for p in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    data = read_file(str(tmp_path / "cpu" / "kern.json"))
    assert len(data["entries"]) == 100
    assert {f"p{p}-{i}" for p in range(4) for i in range(25)} == set(data["entries"])
    assert not [f for f in os.listdir(tmp_path / "cpu") if f.startswith(".tmp-")]


def test_truncated_file_warns_is_untouched_and_kernel_runs(cache_dir, fresh):
    x = fresh.ones()
    key = fresh.scale.cache_key(x)
    path = fresh.scale.cache.write("cpu", fresh.scale.name, key,
                                   {"config": {"br": 32, "bc": 256, "buffering": 2}})
    good = open(path).read()
    truncated = good[: len(good) // 2]
    with open(path, "w") as f:
        f.write(truncated)
    fresh.scale.cache.invalidate()
    with pytest.warns(pt.PallasTuneWarning) as record:
        out = fresh.scale(x)
    np.testing.assert_allclose(out, 2 * x)
    messages = " ".join(str(w.message) for w in record)
    assert path in messages and "not valid JSON" in messages
    assert open(path).read() == truncated
    # A write does not overwrite it either: the entry goes to a side file, with a warning.
    with pytest.warns(pt.PallasTuneWarning, match="recovered"):
        side = fresh.scale.cache.write("cpu", fresh.scale.name, "other", {"config": {"br": 8}})
    assert side != path and read_file(side)["entries"]["other"]["config"] == {"br": 8}
    assert open(path).read() == truncated


def test_malformed_file_is_an_error_in_strict_mode(cache_dir, fresh, monkeypatch):
    x = fresh.ones()
    path = cache_dir / "cpu" / f"{fresh.scale.name}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": 1, "entries": {"k": {"no_config": 1}}}))
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    with pytest.raises(pt.CacheFormatError, match="has no|not an object with a `config`"):
        fresh.scale(x)


def test_unknown_schema_names_the_fix(tmp_path):
    p = tmp_path / "cpu" / "k.json"
    p.parent.mkdir()
    p.write_text(json.dumps({"schema": 99, "entries": {}}))
    with pytest.raises(pt.CacheFormatError, match="schema 99.*pallas-tune sweep"):
        read_file(str(p))


def test_written_files_are_readable_by_others(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    path = c.write("cpu", "k", "key", _entry(1))
    assert os.stat(path).st_mode & 0o044  # Group/other read, as umask allows (not mkstemp's 0600).
