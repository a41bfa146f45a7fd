"""The cache: file layout, strict JSON, lookup order, the ledger, merges that lose nothing
(concurrent and killed writers), damaged files and entries, names that cannot collide."""

import json
import math
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import subprocess_env

import pallas_tune as pt
from pallas_tune.cache import (
    SCHEMA_VERSION,
    TuningCache,
    atomic,
    files,
    kernel_filename,
    ledger,
    names,
    read_file,
)


def _entry(i, ms=1.0, trials=0):
    return {"key": f"k{i}", "config": {"b": i}, "median_ms": ms,
            "provenance": {"kind": "measured"},
            "trials": [{"number": t, "config": {"b": i}, "outcome": "ok", "median_ms": ms,
                        "times_ms": [ms] * 5} for t in range(trials)]}


def _strict_json(text):
    def no_constants(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=no_constants)


def test_roundtrip_layout_and_strict_json(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    entry = _entry(1, trials=3)
    entry["trials"][0]["median_ms"] = math.inf  # repeats=0 used to write Infinity.
    entry["provenance"]["noise"] = math.nan
    with pytest.raises(pt.CacheFormatError, match="median_ms"):  # Not a time: refused.
        c.write("tpu_v6e", "pkg.mod.kern", "x=8x128:float32", {**entry, "median_ms": math.nan})
    path = c.write("tpu_v6e", "pkg.mod.kern", "x=8x128:float32", entry)
    assert path == str(tmp_path / "tpu_v6e" / "pkg.mod.kern.json")
    text = open(path).read()
    lines = text.splitlines()
    assert lines[0].startswith('{"schema": 2,') and lines[0].endswith('"entries": {')
    assert lines[1].startswith('"x=8x128:float32": {"config": {"b": 1}') and lines[2] == "}}"
    raw, st = files.read_raw(path)
    indexed = files.parse_winners(raw, path, st)
    assert indexed._raw is not None and indexed.header["write_id"]  # Read line by line.
    data = _strict_json(text)  # Standard JSON: what JSON.parse accepts (no NaN, no Infinity).
    assert data["schema"] == SCHEMA_VERSION == 2 and data["chip"] == "tpu_v6e"
    winner = data["entries"]["x=8x128:float32"]
    assert winner["median_ms"] == 1.0 and "trials" not in winner and winner["trial_count"] == 3
    assert winner["provenance"]["noise"] is None
    entry_read, where = c.lookup("tpu_v6e", "pkg.mod.kern", "x=8x128:float32")
    assert entry_read["config"] == {"b": 1} and where == path
    assert c.lookup("tpu_v5e", "pkg.mod.kern", "x=8x128:float32") is None
    # The history lives in the ledger beside it, one strict-JSON line per tuning run.
    ledger_path = c.ledger_path("tpu_v6e", "pkg.mod.kern")
    assert data["ledger"] == os.path.basename(ledger_path)
    (record,) = [_strict_json(line) for line in open(ledger_path)]
    assert record["key"] == "x=8x128:float32" and len(record["trials"]) == 3
    assert record["trials"][0]["median_ms"] is None


def test_bulky_provenance_goes_to_the_ledger(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    entry = _entry(1, trials=1)
    entry["provenance"] = {"kind": "measured", "timer": "wallclock",
                           "retimed_interleaved": [{"interleaved_ms": [0.1] * 300}]}
    c.write("cpu", "k", "key", entry)
    winner = read_file(c.path("cpu", "k"))["entries"]["key"]
    assert winner["provenance"] == {"kind": "measured", "timer": "wallclock",
                                    "in_ledger": ["retimed_interleaved"]}
    (record,) = ledger.read(c.ledger_path("cpu", "k"))[0]
    assert len(record["provenance"]["retimed_interleaved"][0]["interleaved_ms"]) == 300


def test_a_rewrite_without_trials_keeps_the_runs_trials(tmp_path):
    """A winner rewritten with no run of its own (recheck-xla adds XLA's figure to an entry read
    back from the cache: no "trials") leaves the ledger's record of the run the latest: its
    trials still read, trial_count kept, and a bulky provenance field stays in the entry
    (moving it would need a record, which would read as a run of no trials)."""
    c = TuningCache(str(tmp_path), use_shipped=False)
    c.write("cpu", "k", "key", _entry(1, trials=3))
    (key, winner, _), = c.entries("cpu", "k")
    assert key == "key" and winner["trial_count"] == 3 and "trials" not in winner
    history = [{"from": "0" * 16, "why": "moved " * 100}]
    c.write("cpu", "k", "key", {**winner, "xla_ms": 2.0, "provenance": {
        **winner["provenance"], "refingerprinted": history, "xla": {"note": "recheck-xla"}}})
    (_, again, _), = c.entries("cpu", "k")
    assert again["trial_count"] == 3 and again["xla_ms"] == 2.0
    assert again["provenance"]["refingerprinted"] == history
    assert len(c.trials("cpu", "k", "key")) == 3
    assert len(ledger.read(c.ledger_path("cpu", "k"))[0]) == 1  # No record of no trials.


def test_write_normalises_the_chip(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    assert c.write("v6e", "k", "key", _entry(1)) == str(tmp_path / "tpu_v6e" / "k.json")
    assert c.write("TPU v6 lite", "k", "key2", _entry(2)) == str(tmp_path / "tpu_v6e" / "k.json")
    assert c.lookup("tpu_v6e", "k", "key2")[0]["config"] == {"b": 2}


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
        c.write("cpu", "kern", f"p{proc}-{i}", _entry(proc * 100 + i, trials=2))


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
    records, bad = ledger.read(str(tmp_path / "cpu" / "kern.trials.jsonl"))
    assert len(records) == 100 and bad == 0


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
    assert path in messages and "truncated" in messages
    assert open(path).read() == truncated
    # Writes do not overwrite it either: entries go to one side file, merged, with a warning;
    # four shapes written in the same second are four entries there (they used to overwrite
    # each other's side files).
    for i in range(4):
        with pytest.warns(pt.PallasTuneWarning, match="recovered"):
            side = fresh.scale.cache.write("cpu", fresh.scale.name, f"x={8 * (i + 1)}x256:"
                                           "float32,factor=2.0",
                                           {"config": {"br": 8, "bc": 256, "buffering": 2}})
    assert side != path and side.endswith(".recovered.json")
    assert len(read_file(side)["entries"]) == 4
    assert open(path).read() == truncated
    # And the side file serves, right after the damaged file.
    fresh.scale._memo.clear()
    assert fresh.scale.config_for(fresh.ones((8, 256))).origin == side


def test_malformed_file_and_entry_in_strict_mode(cache_dir, fresh, monkeypatch):
    x = fresh.ones()
    path = cache_dir / "cpu" / f"{fresh.scale.name}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": 1, "entries": {fresh.scale.cache_key(x): {"a": 1}}}))
    monkeypatch.setenv("PALLAS_TUNE_MODE", "strict")
    with pytest.raises(pt.CacheMissError, match="were refused.*has no `config`"):
        fresh.scale(x)
    path.write_text("{not json")
    fresh.scale.cache.invalidate()
    with pytest.raises(pt.CacheFormatError, match="not valid JSON"):
        fresh.scale(x)


def test_unknown_schema_names_the_fix(tmp_path):
    p = tmp_path / "cpu" / "k.json"
    p.parent.mkdir()
    p.write_text(json.dumps({"schema": 99, "entries": {}}))
    with pytest.raises(pt.CacheFormatError, match="schema 99.*pallas-tune sweep"):
        read_file(str(p))
    c = TuningCache(str(tmp_path), use_shipped=False)
    with pytest.warns(pt.PallasTuneWarning, match="schema 99"):
        assert c.lookup("cpu", "k", "key") is None


def test_written_files_are_readable_by_others(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    path = c.write("cpu", "k", "key", _entry(1))
    assert os.stat(path).st_mode & 0o044  # Group/other read, as umask allows (not mkstemp's 0600).


def test_schema1_files_are_read_and_converted_on_the_next_write(tmp_path):
    d = tmp_path / "cpu"
    d.mkdir()
    old = {"schema": 1, "kernel": "k", "chip": "cpu", "kind": "measured",
           "entries": {"a": _entry(1, trials=2), "b": _entry(2, trials=1)}}
    (d / "k.json").write_text(json.dumps(old, indent=1))
    c = TuningCache(str(tmp_path), use_shipped=False)
    assert c.lookup("cpu", "k", "a")[0]["config"] == {"b": 1}
    c.write("cpu", "k", "c", _entry(3, trials=1))
    data = read_file(str(d / "k.json"))
    assert data["schema"] == 2 and set(data["entries"]) == {"a", "b", "c"}
    assert all("trials" not in e for e in data["entries"].values())
    records, _ = ledger.read(str(d / "k.trials.jsonl"))
    assert sorted((r["key"], len(r["trials"])) for r in records) == [("a", 2), ("b", 1), ("c", 1)]


def test_file_names_are_injective(tmp_path):
    kernels = ["a/b", "a_b", "a%2Fb", "A_b", "a.estimate", "a.trials", "a.recovered", ".a", "a",
               "pkg.mod.<locals>.k", "pkg.Mod.k", "pkg.mod.k", "é", "e\u0301", "x" * 400,
               "x" * 401]
    stems = [kernel_filename(n) for n in kernels]
    assert len({s.lower() for s in stems}) == len(kernels)  # Even on case-insensitive disks.
    assert kernel_filename("pallas_tune.kernels.matmul.matmul") == \
        "pallas_tune.kernels.matmul.matmul"
    for stem in stems:
        assert len(stem) <= 200 and not stem.startswith(".") and "/" not in stem
        assert names.classify(stem + ".json") == ("winners", "measured")
        assert names.classify(stem + ".estimate.json") == ("winners", "estimate")
        assert names.classify(stem + ".trials.jsonl") == ("ledger", "measured")
    c = TuningCache(str(tmp_path), use_shipped=False)
    c.write("cpu", "a/b", "key", _entry(1))
    c.write("cpu", "a_b", "key", _entry(2))
    assert c.lookup("cpu", "a/b", "key")[0]["config"] == {"b": 1}
    assert c.lookup("cpu", "a_b", "key")[0]["config"] == {"b": 2}


def test_a_file_holding_another_kernel_is_not_served(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    c.write("cpu", "other.kernel", "key", _entry(1))
    os.replace(c.path("cpu", "other.kernel"), c.path("cpu", "this.kernel"))
    with pytest.warns(pt.PallasTuneWarning, match="holds kernel 'other.kernel'"):
        assert c.lookup("cpu", "this.kernel", "key") is None
    # pallas-tune 0.1 named `a/b`'s file a_b.json: read under its old name, for its own kernel.
    legacy = tmp_path / "cpu" / "pkg.Mod_k.json"
    legacy.write_text(json.dumps({"schema": 1, "kernel": "pkg.Mod/k", "chip": "cpu",
                                  "kind": "measured", "entries": {"key": _entry(7)}}))
    assert c.lookup("cpu", "pkg.Mod/k", "key")[0]["config"] == {"b": 7}
    assert c.lookup("cpu", "pkg.Mod_k", "key") is None  # Same old name, other kernel.


def test_damaged_lines_cost_only_their_entries(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    path = c.write_many("cpu", "k", {f"key{i}": _entry(i) for i in range(5)})
    lines = open(path, "rb").read().split(b"\n")
    lines[2] = lines[2][:40] + b"\xff\xfe garbage"  # key1: cut and not UTF-8.
    lines.insert(4, b"not an entry line")
    damaged = b"\n".join(lines)
    open(path, "wb").write(damaged)
    c.invalidate()
    with pytest.warns(pt.PallasTuneWarning) as record:
        assert c.lookup("cpu", "k", "key1") is None
        found = {k: e["config"]["b"] for k, e, _ in c.entries("cpu", "k")}
    assert found == {"key0": 0, "key2": 2, "key3": 3, "key4": 4}
    messages = " ".join(str(w.message) for w in record)
    assert "'key1'" in messages and path in messages and "line 5" in messages
    assert open(path, "rb").read() == damaged
    with pytest.warns(pt.PallasTuneWarning, match="recovered"):
        side = c.write("cpu", "k", "key9", _entry(9))  # Never merged into a damaged file.
    assert open(path, "rb").read() == damaged and side != path


def test_neighbours_by_shape(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    keys_ = ["x=128x256:float32", "x=256x256:float32", "x=1024x256:float32",
             "x=256x256:bfloat16", "x=256x256:float32,c=true", "x=8:float32"]
    c.write_many("cpu", "k", {k: _entry(i) for i, k in enumerate(keys_)})
    got = [(d, h.key) for d, h in c.neighbours("cpu", "k", "x=256x256:float32")]
    assert got == [(1.0, "x=128x256:float32"), (2.0, "x=1024x256:float32")]


def test_check_writable_and_unwritable_directory(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    assert c.check_writable("v6e", "k") == str(tmp_path / "tpu_v6e")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(pt.CacheFormatError, match="cannot write tuned configs"):
        TuningCache(str(blocker), use_shipped=False).check_writable("cpu", "k")


def test_temp_files_of_killed_writers_are_ignored_and_cleaned(tmp_path):
    c = TuningCache(str(tmp_path), use_shipped=False)
    path = c.write("cpu", "k", "key", _entry(1))
    d = os.path.dirname(path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    mine = atomic.temp_path(d).replace(f"-{os.getpid()}-", f"-{dead}-")
    old = os.path.join(d, ".tmp-abc_1234.json")  # pallas-tune 0.1's mkstemp names.
    fresh_foreign = os.path.join(d, ".tmp-otherhost-1-0123456789ab.json")
    for p in (mine, old, fresh_foreign):
        open(p, "w").write("{half a fil")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert c.lookup("cpu", "k", "key") is not None  # Readers never look at them.
    c.write("cpu", "k", "key2", _entry(2))
    left = sorted(f for f in os.listdir(d) if f.startswith(".tmp-"))
    assert left == [os.path.basename(fresh_foreign)]  # Another host's writer may be alive.


def test_temp_cleaning_removes_only_what_a_writer_made(tmp_path):
    """A cache directory may be one the user keeps other things in (PALLAS_TUNE_CACHE_DIR=~):
    only files named exactly as our writers name them, owned by us, are ever removed; a user's
    look-alike, a link named like a temp of ours and a directory are left, however old."""
    c = TuningCache(str(tmp_path), use_shipped=False)
    d = os.path.dirname(c.write("cpu", "k", "key", _entry(1)))
    outside = tmp_path / "outside.json"
    outside.write_text("the user's")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    kept = [".tmp-notes", ".tmp-notes.json", ".probe-mine", f".tmp-{atomic.HOST}-{dead}-x.json"]
    for name in kept:
        open(os.path.join(d, name), "w").write("mine")
    link = os.path.basename(atomic.temp_path(d)).replace(f"-{os.getpid()}-", f"-{dead}-")
    os.symlink(outside, os.path.join(d, link))
    os.mkdir(os.path.join(d, ".tmp-abc_1234.json"))
    kept += [link, ".tmp-abc_1234.json"]
    for name in kept:
        os.utime(os.path.join(d, name), (time.time() - 7200,) * 2, follow_symlinks=False)
    assert atomic.clean_stale_temps(d) == []
    assert all(os.path.lexists(os.path.join(d, name)) for name in kept)
    assert outside.read_text() == "the user's"


def test_ledger_survives_a_partial_line(tmp_path):
    p = str(tmp_path / "k.trials.jsonl")
    ledger.append(p, [{"key": "a", "trials": []}])
    with open(p, "a") as f:
        f.write('{"key": "b", "tri')  # A writer killed mid-line.
    ledger.append(p, [{"key": "c", "trials": [1]}])
    records, bad = ledger.read(p)
    assert [r["key"] for r in records] == ["a", "c"] and bad == 1


_KILL_WRITER = r"""
import sys
from pallas_tune.cache import TuningCache
root, proc = sys.argv[1], sys.argv[2]
c = TuningCache(root, use_shipped=False)
pad = [{"number": t, "outcome": "ok", "times_ms": [0.123456789] * 200} for t in range(32)]
i = 0
while True:
    key = f"{proc}-{i}"
    c.write("cpu", "kern", key, {"config": {"b": i}, "median_ms": 1.0, "trials": pad})
    print(key, flush=True)
    i += 1
"""


def kill9_loop(root, rounds, seed=0):
    """Writers killed with SIGKILL at random moments; returns the keys whose write completed
    and the temp files that killed writers left behind (each removed by a later writer)."""
    rng = random.Random(seed)
    done, left = set(), set()
    for r in range(rounds):
        procs = [subprocess.Popen([sys.executable, "-c", _KILL_WRITER, root, f"r{r}p{p}"],
                                  stdout=subprocess.PIPE, text=True, env=subprocess_env())
                 for p in range(3)]
        for p in procs:  # Each is writing (its first write done): kill at a random moment.
            done.add(p.stdout.readline().strip())
        for p in procs:
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(p.pid, signal.SIGKILL)
        for p in procs:
            out, _ = p.communicate()
            done.update(line for line in out.splitlines() if line)
        left.update(f for f in os.listdir(os.path.join(root, "cpu")) if f.startswith(".tmp-"))
    done.discard("")
    return done, left


def test_writers_killed_with_sigkill_lose_nothing_and_leave_no_temp_files(tmp_path):
    # 2 rounds of 3 writers in CI (about 10 s); PALLAS_TUNE_KILL_ROUNDS=200 for a long run.
    rounds = int(os.environ.get("PALLAS_TUNE_KILL_ROUNDS", "2"))
    root = str(tmp_path)
    # 2,000 entries already there: each write renders a ~1 MB file, so kills land mid-write.
    base = {f"base-{i}": {"config": {"b": i}, "median_ms": 1.0,
                          "provenance": {"timer": "wallclock", "note": "x" * 300}}
            for i in range(2000)}
    TuningCache(root, use_shipped=False).write_many("cpu", "kern", base)
    written, killed_mid_write = kill9_loop(root, rounds)
    done = written | set(base)
    print(f"{rounds} rounds of 3 writers killed with SIGKILL: {len(written)} completed writes, "
          f"{len(killed_mid_write)} temp files of writers killed mid-write")
    c = TuningCache(root, use_shipped=False)
    c.write("cpu", "kern", "final", {"config": {"b": -1}})  # The next writer cleans up.
    data = read_file(c.path("cpu", "kern"))
    assert done and done <= set(data["entries"])  # No completed entry lost.
    d = tmp_path / "cpu"
    assert not [f for f in os.listdir(d) if f.startswith(".tmp-")]
    records, _ = ledger.read(str(d / "kern.trials.jsonl"))
    assert written <= {r["key"] for r in records}  # Their histories too.


@pytest.mark.parametrize("what", ["directory", "fifo", "unreadable"])
def test_a_cache_path_that_is_no_file_never_blocks_nor_raises(cache_dir, fresh, what):
    x = fresh.ones()
    path = cache_dir / "cpu" / f"{fresh.scale.name}.json"
    path.parent.mkdir(parents=True)
    if what == "directory":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)  # Reading it would block forever.
    else:
        path.write_text("{}")
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("running as root: permissions do not apply")
    with pytest.warns(pt.PallasTuneWarning, match="cannot be read|not a regular file"):
        np.testing.assert_allclose(fresh.scale(x), 2 * x)
    with pytest.warns(pt.PallasTuneWarning, match="recovered"):
        side = fresh.scale.cache.write("cpu", fresh.scale.name, "k",
                                       {"config": {"br": 8, "bc": 128, "buffering": 1}})
    assert side.endswith(".recovered.json")
