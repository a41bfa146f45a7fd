"""`pallas-tune merge` carries each merged entry's trial ledger record too (issue 26.7): a
report or `show --trials` on the merged cache shows the evidence, not nothing."""

from __future__ import annotations

from pallas_tune.cache import TuningCache
from pallas_tune.cli import main


def test_merge_carries_the_trials(tmp_path, capsys):
    host = TuningCache(str(tmp_path / "host1"), use_shipped=False)
    trials = [{"number": 0, "config": {"b": 8}, "outcome": "ok", "median_ms": 2.0},
              {"number": 1, "config": {"b": 16}, "outcome": "ok", "median_ms": 1.0}]
    path = host.write("cpu", "k.merge", "x=8x128:float32", {
        "config": {"b": 16}, "median_ms": 1.0,
        "provenance": {"kind": "measured", "timer": "wallclock"}, "trials": trials})
    into = tmp_path / "merged"
    assert main(["merge", path, "--into", str(into)]) == 0
    merged = TuningCache(str(into), use_shipped=False)
    assert merged.lookup("cpu", "k.merge", "x=8x128:float32")[0]["config"] == {"b": 16}
    assert merged.trials("cpu", "k.merge", "x=8x128:float32") == trials
    capsys.readouterr()
