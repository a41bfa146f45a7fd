"""Trust at the cache's boundaries (issue 53, items 2 and 16): one validity rule for an entry,
its figures included (a time is a finite number of milliseconds > 0 and not absurdly large),
applied by every reader (a call's lookup, ``check``, ``show``), by ``merge`` and by
``cache.write``: ``merge`` never lets an entry a call would skip replace one it serves, and counts
every skip with its reason; ``cache.write`` refuses what a lookup would skip, naming the field.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import warnings

import dispatch_kernels as dk
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pallas_tune as pt
from pallas_tune.cache import TuningCache, read_file
from pallas_tune.cli import main

KERNEL = dk.rowsum
KEY = "x=16x384:float32"  # The user's cache holds GOOD for it.
NEW = "x=32x384:float32"  # The user's cache holds nothing for it.
SHAPES = {KEY: (16, 384), NEW: (32, 384)}
GOOD = {"config": {"br": 8, "bc": 128}, "median_ms": 1.0}
FASTER = {"br": 16, "bc": 128}  # In the space, valid for both shapes.


def _winners(path, entries, *, kernel=KERNEL.name):
    """A winners file holding ``entries`` (key -> any JSON, NaN and Infinity as Python writes
    them), as another host or tool might have written it."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    head = json.dumps({"schema": 2, "kernel": kernel, "chip": "cpu", "kind": "measured"})
    body = ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items())
    with open(path, "w") as f:
        f.write(head[:-1] + ', "entries": {\n' + body + ("\n" if body else "") + "}}\n")
    return str(path)


def _run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return rc, out, err


def _user_entry(root, key=KEY):
    path = os.path.join(root, "cpu", f"{KERNEL.name}.json")
    return read_file(path)["entries"].get(key) if os.path.exists(path) else None


def _served(root, key):
    """The config a call with ``key``'s shapes resolves to, ``root`` the only cache."""
    cache = TuningCache(str(root), use_shipped=False)
    KERNEL._cache, KERNEL._memo, KERNEL._warned = cache, {}, set()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            config = KERNEL.config_for(dk.data(SHAPES[key]))
    finally:
        KERNEL._cache, KERNEL._memo, KERNEL._warned = None, {}, set()
    return config, [str(w.message) for w in record if issubclass(w.category, pt.PallasTuneWarning)]


POISONED_TIMES = [
    (0.0, "median_ms <= 0"), (0, "median_ms <= 0"), (-1.0, "median_ms <= 0"),
    (-math.inf, "median_ms not finite"), (math.nan, "median_ms not finite"),
    (math.inf, "median_ms not finite"), (1e300, "median_ms too large"),
    (10**400, "median_ms too large"), ("0.5", "median_ms not a number"),
    (True, "median_ms not a number"),
]


@pytest.mark.parametrize("ms,reason", POISONED_TIMES)
def test_merge_never_lets_a_poisoned_time_replace_a_better_entry(tmp_path, capsys, ms, reason):
    user = tmp_path / "user"
    _winners(user / "cpu" / f"{KERNEL.name}.json", {KEY: GOOD})
    host = _winners(tmp_path / "host" / "cpu" / f"{KERNEL.name}.json",
                    {KEY: {"config": FASTER, "median_ms": ms}})
    rc, out, err = _run(["merge", host, "--into", str(user)], capsys)
    assert _user_entry(user) == GOOD  # The user's entry stays.
    assert f"0 entries written, 1 skipped: 1 {reason}" in out, out
    assert f"skipped {host}, key {KEY!r}: " in err and "median_ms" in err, err
    assert rc == 1, out  # Nothing merged, something skipped.


def test_merge_counts_each_skip_with_its_reason(tmp_path, capsys):
    """The issue's case: a zero and a NaN time, "0 written, 0 skipped" before, no reason."""
    user = tmp_path / "user"
    _winners(user / "cpu" / f"{KERNEL.name}.json", {KEY: GOOD})
    host = _winners(tmp_path / "host" / "cpu" / f"{KERNEL.name}.json", {
        KEY: {"config": FASTER, "median_ms": 0.0},
        NEW: {"config": FASTER, "median_ms": math.nan},
        "x=64x384:float32": {"config": {"br": 32, "bc": 128}, "median_ms": 0.5},  # br: no.
        "x=8x384:float32": {"config": {"br": 8, "bc": 128}, "median_ms": 2.0},  # Served.
    })
    rc, out, err = _run(["merge", host, "--into", str(user)], capsys)
    assert rc == 0, out + err
    summary = out.strip().splitlines()[-1]
    assert summary == ("pallas-tune merge: 1 entries written, 3 skipped: 1 median_ms <= 0, "
                       "1 median_ms not finite, 1 config not in the kernel's space"), summary
    assert err.count("merge: skipped ") == 3, err
    assert _user_entry(user) == GOOD and _user_entry(user, NEW) is None
    assert _user_entry(user, "x=8x384:float32")["config"] == {"br": 8, "bc": 128}


def test_merge_keeps_the_faster_entry_and_says_so(tmp_path, capsys):
    user = tmp_path / "user"
    _winners(user / "cpu" / f"{KERNEL.name}.json", {KEY: GOOD})
    host = _winners(tmp_path / "host" / "cpu" / f"{KERNEL.name}.json",
                    {KEY: {"config": FASTER, "median_ms": 2.0}})
    rc, out, _ = _run(["merge", host, "--into", str(user)], capsys)
    assert rc == 0 and _user_entry(user) == GOOD
    assert "0 entries written, 0 skipped; 1 not faster than the entry already there" in out, out
    host = _winners(tmp_path / "host2" / "cpu" / f"{KERNEL.name}.json",
                    {KEY: {"config": FASTER, "median_ms": 0.5}})
    rc, out, _ = _run(["merge", host, "--into", str(user)], capsys)
    assert rc == 0 and _user_entry(user)["config"] == FASTER, out


def test_merge_replaces_an_entry_no_call_serves(tmp_path, capsys):
    """A poisoned entry already in the user's cache (an older merge's) blocks nothing: a valid
    entry from a host replaces it, whatever the poisoned one's time."""
    user = tmp_path / "user"
    _winners(user / "cpu" / f"{KERNEL.name}.json", {KEY: {"config": FASTER, "median_ms": -5.0}})
    host = _winners(tmp_path / "host" / "cpu" / f"{KERNEL.name}.json", {KEY: GOOD})
    rc, out, _ = _run(["merge", host, "--into", str(user)], capsys)
    assert rc == 0 and _user_entry(user) == GOOD, out


def test_merge_skips_a_file_of_an_unknown_kind(tmp_path, capsys):
    path = tmp_path / "host" / "cpu" / f"{KERNEL.name}.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"schema": 2, "kernel": "tests.rowsum", "chip": "cpu", "kind": "guess", '
                    '"entries": {\n"x=16x384:float32": {"config": {"br": 8, "bc": 128}, '
                    '"median_ms": 1.0}\n}}\n')
    rc, out, err = _run(["merge", str(path), "--into", str(tmp_path / "user")], capsys)
    assert rc == 1 and "1 skipped: 1 file of an unknown kind" in out, out
    assert "'guess'" in err and "measured" in err, err


# ---- cache.write refuses what a lookup would skip --------------------------------------------

def test_write_refuses_an_entry_a_lookup_would_skip_naming_the_field(tmp_path):
    """The seed of benchmarks/runtime/dispatch_overhead.py: a matmul entry without
    ``vmem_limit_bytes``, which a lookup of the shipped matmul skips, and a time of 0."""
    from pallas_tune.kernels.matmul import matmul

    cache = TuningCache(str(tmp_path), use_shipped=False)
    seed = {"config": {"bm": 128, "bn": 128, "bk": 256, "buffering": 2,
                       "semantics": ("parallel", "parallel", "arbitrary")},
            "median_ms": 0.0, "provenance": {"kind": "measured", "timer": "benchmark seed"}}
    with pytest.raises(pt.CacheFormatError) as e:
        cache.write("cpu", matmul.name, "x=256x256:float32,y=256x256:float32", seed)
    said = str(e.value)
    assert "vmem_limit_bytes" in said and "median_ms" in said, said  # Both problems at once.
    assert "x=256x256:float32,y=256x256:float32" in said and matmul.name in said, said
    assert not os.path.exists(cache.path("cpu", matmul.name))  # Nothing written.
    fixed = {**seed, "median_ms": 1.0,
             "config": {**seed["config"], "vmem_limit_bytes": matmul.space.default[
                 "vmem_limit_bytes"]}}
    cache.write("cpu", matmul.name, "x=256x256:float32,y=256x256:float32", fixed)
    assert cache.lookup("cpu", matmul.name, "x=256x256:float32,y=256x256:float32")


@pytest.mark.parametrize("entry,field", [
    ({"config": {"br": 32, "bc": 128}, "median_ms": 1.0}, "br"),  # Outside the space.
    ({"config": {"br": 8}, "median_ms": 1.0}, "bc"),  # Missing.
    ({"config": {"br": 8, "bc": 128, "bz": 1}, "median_ms": 1.0}, "bz"),  # Unknown.
    ({"config": {"br": 8, "bc": 128}, "median_ms": -0.5}, "median_ms"),
    ({"config": {"br": 8, "bc": 128}, "median_ms": math.nan}, "median_ms"),
    ({"config": {"br": 8, "bc": 128}, "median_ms": 1.0, "spread_ms": -1.0}, "spread_ms"),
    ({"config": {"br": 8, "bc": 128}, "median_ms": 1.0, "default_ms": math.inf}, "default_ms"),
])
def test_write_and_write_many_refuse_what_a_lookup_skips(tmp_path, entry, field):
    cache = TuningCache(str(tmp_path), use_shipped=False)
    with pytest.raises(pt.CacheFormatError, match=re.escape(field)):
        cache.write("cpu", KERNEL.name, KEY, entry)
    with pytest.raises(pt.CacheFormatError, match=re.escape(field)):  # One bad: none written.
        cache.write_many("cpu", KERNEL.name, {NEW: GOOD, KEY: entry})
    assert not os.path.exists(cache.path("cpu", KERNEL.name))


def test_a_kernel_no_process_declared_gets_the_entry_checks_only(tmp_path):
    """A name no kernel of this process has: any config may be its (nothing to check it
    against), the figures are checked all the same."""
    cache = TuningCache(str(tmp_path), use_shipped=False)
    cache.write("cpu", "nowhere.declared", "k", {"config": {"anything": 1}, "median_ms": 1.0})
    with pytest.raises(pt.CacheFormatError, match="median_ms"):
        cache.write("cpu", "nowhere.declared", "k", {"config": {"anything": 1}, "median_ms": 0})


# ---- the class: every reader and merge, on arbitrary entries ---------------------------------

_numbers = st.sampled_from([0, 0.0, -0.0, -1, -1e-300, 1e-300, 0.5, 1.0, 2.0, 1e7, 1e8, 1e300,
                            10**400, math.nan, math.inf, -math.inf, True, False])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                     st.text(max_size=4), _numbers)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=6)
_values = st.one_of(_numbers, _numbers, _scalars, _json)
_configs = st.one_of(
    st.fixed_dictionaries({"br": st.sampled_from([8, 16]), "bc": st.sampled_from([128, 384])}),
    st.fixed_dictionaries({"br": st.sampled_from([8, 16, 32, 16.0, True, "16", None, 12]),
                           "bc": st.sampled_from([128, 256, 130, 128.0, math.nan])}),
    st.dictionaries(st.sampled_from(["br", "bc", "bz"]), _values, max_size=3),
    _json,
)
_entries = st.one_of(
    st.fixed_dictionaries({"config": _configs}, optional={
        "median_ms": _values, "spread_ms": _values, "default_ms": _values,
        "outside_space": st.sampled_from([True, False, "yes", None]),
        "provenance": _json, "trial_count": _values}),
    _json)


def _check(root, capsys):
    return _run(["check", str(root), "--import", "dispatch_kernels"], capsys)


def _merge_counts(out):
    """(written, skipped, {reason: n}, not faster) from merge's summary line."""
    line = out.strip().splitlines()[-1]
    m = re.fullmatch(r"pallas-tune merge: (\d+) entries written, (\d+) skipped(?:: (.*?))?"
                     r"(?:; (\d+) not faster than the entry already there)?", line)
    assert m, line
    reasons = {}
    for part in (m.group(3) or "").split(", ") if m.group(3) else []:
        n, _, why = part.partition(" ")
        reasons[why] = int(n)
    return int(m.group(1)), int(m.group(2)), reasons, int(m.group(4) or 0)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(entry=_entries, other=_entries)
@example(entry={"config": FASTER, "median_ms": 0.0}, other={"config": FASTER, "median_ms": -1})
@example(entry={"config": FASTER, "median_ms": math.nan}, other={"config": FASTER,
                                                                "median_ms": math.inf})
@example(entry={"config": FASTER, "median_ms": 1e300}, other={"config": FASTER,
                                                             "median_ms": 10**400})
@example(entry={"config": {"br": 32, "bc": 128}, "median_ms": 0.1},  # Outside the space.
         other={"config": {"br": 8}, "median_ms": 0.1})  # A parameter missing.
@example(entry={"config": {"br": "8", "bc": 128}, "median_ms": 0.1},  # Wrong types.
         other={"config": FASTER, "median_ms": "0.1"})
@example(entry={"median_ms": 0.1}, other=[FASTER])  # No config; not an object.
@example(entry={"config": {"br": 8, "bc": 256}, "median_ms": 0.5},  # In the space, but 256
         other={"config": {"br": 8, "bc": 256}, "median_ms": 0.5})  # does not divide 384.
@example(entry={"config": FASTER}, other={"config": FASTER, "median_ms": 0.5})  # Valid.
def test_no_entry_a_call_skips_replaces_a_served_one_nor_crashes_a_reader(entry, other, capsys):
    """For any entries another host's file holds for a key the user's cache serves (KEY) and
    one it does not (NEW): every reader reads the file without raising, and a call serves an
    entry exactly when ``check`` passes it and ``show`` lists it unmarked; ``merge`` counts
    each entry once (written, skipped with a reason, or not faster), replaces the user's entry
    only with one a call serves that is faster, and writes only what a call serves."""
    with tempfile.TemporaryDirectory() as d:
        user, host_root = os.path.join(d, "user"), os.path.join(d, "host")
        _winners(os.path.join(user, "cpu", f"{KERNEL.name}.json"), {KEY: GOOD})
        host = _winners(os.path.join(host_root, "cpu", f"{KERNEL.name}.json"),
                        {KEY: entry, NEW: other})
        # The readers: a call's lookup, check and show, on the host's file.
        served = {key: _served(host_root, key)[0].source == "cache" for key in (KEY, NEW)}
        rc, checked, _ = _check(host_root, capsys)
        assert rc == (0 if all(served.values()) else 1), (served, checked)
        for key in (KEY, NEW):
            assert (f"entry {key!r}" in checked) != served[key], (key, served, checked)
        os.environ["PALLAS_TUNE_CACHE_DIR"] = host_root
        try:
            pt.cache.reset_default_cache()
            rc, out, _ = _run(["show", "--format", "json", "--kernel", KERNEL.name,
                               "--import", "dispatch_kernels"], capsys)
        finally:
            del os.environ["PALLAS_TUNE_CACHE_DIR"]
            pt.cache.reset_default_cache()
        assert rc == 0, out
        rows = {e["key"]: e for e in json.loads(out)["entries"]}
        for key in (KEY, NEW):  # Show does not trace: it marks what no shapes would serve.
            skipped = str(rows[key]["best config"]).startswith("SKIPPED")
            assert not (skipped and served[key]), (key, rows[key], served)
            assert skipped or served[key] or "constraint" in checked, checked
        # Merge into the user's cache.
        rc, out, err = _run(["merge", host, "--into", user], capsys)
        written, skipped, reasons, slower = _merge_counts(out)
        assert written + skipped + slower == 2, out
        assert sum(reasons.values()) == skipped == err.count("merge: skipped "), (out, err)
        assert all(reasons), reasons  # Each skip has a reason.
        assert skipped == sum(not s for s in served.values()), (served, out)
        after = _user_entry(user)
        if after != GOOD:  # Replaced: by an entry a call serves, faster than GOOD's.
            assert served[KEY] and after["config"] == entry["config"], after
            assert isinstance(after.get("median_ms"), int | float) and after["median_ms"] < 1
        assert _served(user, KEY)[0].source == "cache"
        assert (_user_entry(user, NEW) is not None) == served[NEW]
        if served[NEW]:
            assert dict(_served(user, NEW)[0]) == other["config"]


def test_the_merge_command_checks_shipped_kernels_and_says_what_it_could_not(tmp_path):
    """In a fresh `pallas-tune merge` (no test module imported): a shipped kernel's entry
    outside its space is skipped with its reason; a kernel merge may not import gets a note
    that its configs were checked for format only."""
    import subprocess
    import sys

    from conftest import subprocess_env
    from pallas_tune.kernels.matmul import matmul

    key = "x=256x256:float32,y=256x256:float32"
    good = {"config": {**matmul.space.default, "semantics": list(matmul.space.default[
        "semantics"])}, "median_ms": 1.0}
    files = [_winners(tmp_path / "host" / "cpu" / f"{matmul.name}.json", {
        key: {**good, "config": {**good["config"], "bm": 7}, "median_ms": 0.5},
        "x=512x512:float32,y=512x512:float32": good}, kernel=matmul.name),
        _winners(tmp_path / "host" / "cpu" / "mine.kern.json",
                 {"k": {"config": {"b": 1}, "median_ms": 1.0}}, kernel="mine.kern")]
    r = subprocess.run([sys.executable, "-m", "pallas_tune", "merge", *files, "--into",
                        str(tmp_path / "user")], capture_output=True, text=True, timeout=300,
                       env=subprocess_env(), check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == (
        "pallas-tune merge: 2 entries written, 1 skipped: 1 config not in the kernel's space")
    assert f"key {key!r}: its config bm=7" in r.stderr, r.stderr
    assert "note: mine.kern is neither" in r.stderr and "format only" in r.stderr, r.stderr
    assert matmul.name not in r.stderr.split("note:")[1], r.stderr
