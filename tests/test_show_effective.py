"""`pallas-tune show` says what a call runs (issue 26.1, 26.8, 28): the effective config
where the entry records one, XLA where the reference won; JSON numbers as numbers; entries
for chips other than this host's pointed out."""

from __future__ import annotations

import json

from pallas_tune.cache import TuningCache
from pallas_tune.cli import main


def _entries(cache_dir):
    cache = TuningCache(str(cache_dir), use_shipped=False)
    cache.write("cpu", "k.eff", "x=200x128:float32", {
        "config": {"b": 256}, "effective": {"b": 200}, "median_ms": 1.5, "default_ms": 3.0,
        "provenance": {"kind": "measured", "timer": "wallclock"}})
    cache.write("cpu", "k.eff", "x=64x128:float32", {
        "config": {"b": 64}, "median_ms": 2.0, "implementation": "xla", "xla_ms": 0.5,
        "provenance": {"kind": "measured", "timer": "wallclock"}})
    cache.write("tpu_v6e", "k.eff", "x=64x128:float32", {
        "config": {"b": 64}, "median_ms": 0.01, "provenance": {"kind": "measured"}})


def test_show_table_says_effective_config_and_xla(cache_dir, capsys):
    _entries(cache_dir)
    assert main(["show", "--kernel", "k.eff"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[2]: line for line in out.splitlines() if line.startswith("k.eff")}
    assert "b=200" in rows["x=200x128:float32"] and "b=256" not in rows["x=200x128:float32"]
    assert "XLA 0.5 ms (beat b=64)" in out
    assert "this host is cpu; the entries for tpu_v6e are listed too" in out
    assert main(["show", "--kernel", "k.eff", "--chip", "cpu"]) == 0
    assert "tpu_v6e" not in capsys.readouterr().out


def test_show_json_has_numbers_and_what_runs(cache_dir, capsys):
    _entries(cache_dir)
    assert main(["show", "--kernel", "k.eff", "--chip", "cpu", "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    by_key = {e["key"]: e for e in data["entries"]}
    eff = by_key["x=200x128:float32"]
    assert eff["median_ms"] == 1.5 and eff["default_ms"] == 3.0  # Numbers, not strings.
    assert eff["config"] == {"b": 256} and eff["effective"] == {"b": 200}
    xla = by_key["x=64x128:float32"]
    assert xla["implementation"] == "xla" and xla["xla_ms"] == 0.5


def test_show_trials_marks_duplicates_and_counts_as_everywhere(cache_dir, capsys):
    """`show --trials` uses the one tally and marks a duplicate as such (issue 26.2)."""
    cache = TuningCache(str(cache_dir), use_shipped=False)
    trials = [{"number": 0, "config": {"b": 8}, "outcome": "ok", "median_ms": 2.0},
              {"number": 1, "config": {"b": 16}, "outcome": "ok", "median_ms": 2.0,
               "duplicate_of": 0},
              {"number": 2, "config": {"b": 32}, "outcome": "infeasible"}]
    cache.write("cpu", "k.dup", "x=8x128:float32", {
        "config": {"b": 8}, "median_ms": 2.0, "provenance": {"kind": "measured"},
        "trials": trials})
    assert main(["show", "--kernel", "k.dup", "--trials"]) == 0
    out = capsys.readouterr().out
    assert "3 trials: 1 timed, 1 infeasible, 1 duplicate" in out
    assert "duplicate" in out and "same program as #0" in out


def test_show_marks_an_estimate_with_a_caveat_and_json_carries_it(cache_dir, capsys):
    """An estimate entry whose provenance records what libtpu's profile could not follow
    (``estimate_caveat``) is marked in the table, and the text is in the JSON."""
    cache = TuningCache(str(cache_dir), use_shipped=False)
    note = "1 kernel(s) with scalar prefetch: taken as 0"
    for key, prov in (("x=8x128:float32", {"estimate_caveat": note}), ("x=16x128:float32", {}),
                      ("x=24x128:float32", {"estimate_caveat": "long " * 200})):
        cache.write("tpu_v6e", "k.cav", key, {
            "config": {"b": 8}, "median_ms": 0.5,
            "provenance": {"kind": "estimate", "timer": "tpu-estimate", **prov}}, kind="estimate")
    assert main(["show", "--kernel", "k.cav"]) == 0
    rows = {line.split()[2]: line for line in capsys.readouterr().out.splitlines()
            if line.startswith("k.cav")}
    assert "(caveat: see --format json)" in rows["x=8x128:float32"]
    assert "caveat" not in rows["x=16x128:float32"]
    assert "(caveat: see --format json)" in rows["x=24x128:float32"]
    assert main(["show", "--kernel", "k.cav", "--format", "json"]) == 0
    by_key = {e["key"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert by_key["x=8x128:float32"]["estimate_caveat"] == note
    assert by_key["x=16x128:float32"]["estimate_caveat"] is None
    # A caveat too long for the winners file lives in the trial ledger; show still says so.
    assert "trial ledger" in by_key["x=24x128:float32"]["estimate_caveat"]
