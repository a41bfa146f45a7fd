"""The command line at its boundaries (issue 53, items 7, 9 and 13; issue 56, item 7): every
argument form a user writes ends in one clear line and the right exit status, never a
traceback; `recheck-xla` says whose entries it rewrites and keeps each as soon as it is done."""

from __future__ import annotations

import json
import os
import types

import jax
import jax.numpy as jnp
import pytest
from conftest import TESTS_DIR

from pallas_tune.cache import TuningCache
from pallas_tune.cli import main


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``pallas-tune ARGV`` in this process."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors.
        rc = e.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err[-2000:]
    return rc, out, err


# ---- 56.7: did you mean --------------------------------------------------------------------

def test_a_misspelt_command_is_answered_with_the_one_meant(capsys):
    rc, _, err = _run(["swep"], capsys)
    assert rc == 2 and "invalid choice: 'swep'" in err and "did you mean sweep?" in err


def test_a_misspelt_choice_is_answered_with_the_one_meant(capsys):
    rc, _, err = _run(["show", "--format", "jsn"], capsys)
    assert rc == 2 and "did you mean json?" in err


@pytest.mark.parametrize("flag", ["--chp", "--chp=x"])
def test_a_subcommand_s_unknown_option_is_reported_under_that_subcommand(flag, capsys):
    """Under `sweep`'s usage (its flags listed), with the flag meant, not the top level's."""
    rc, _, err = _run(["sweep", flag, "x", "toy_kernels:scale"], capsys)
    assert rc == 2
    assert err.startswith("usage: pallas-tune sweep ") and "--shapes SHAPES" in err
    assert "pallas-tune sweep: error: unrecognized arguments: --chp" in err
    assert "did you mean --chip?" in err


# ---- 53.9: malformed values are usage errors ------------------------------------------------

def test_warm_configs_nested_deeper_than_any_config_is_a_usage_error(capsys):
    deep = "[" * 10_000 + "]" * 10_000
    rc, _, err = _run(["sweep", "toy_kernels:scale", "--shapes", "x=8x128:float32",
                       "--no-storage", "--warm-configs", deep], capsys)
    assert rc == 2 and "nested more than 8 deep" in err and len(err) < 2000


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0.001", "-1", "1e20", "65537"])
def test_recheck_memory_cap_is_checked_at_the_edge(value, capsys):
    rc, _, err = _run(["recheck-xla", "toy_kernels:poor_scale", "--path", TESTS_DIR,
                       f"--memory-gb={value}"], capsys)
    assert rc == 2 and f"--memory-gb {float(value)}" in err and "from 1 to 65536" in err


@pytest.mark.parametrize("value", ["1e20", "0.001", "inf"])
def test_a_sweep_s_worker_memory_cap_is_checked_at_the_edge(value, capsys, monkeypatch):
    import pallas_tune.cli.sweep as sweep

    monkeypatch.setattr(sweep, "_sweep_kernel", lambda *a, **k: pytest.fail("got past the edge"))
    rc, _, err = _run(["sweep", "toy_kernels:scale", "--path", TESTS_DIR, "--shapes",
                       "x=8x128:float32", "--no-storage", "--worker-memory-gb", value], capsys)
    assert rc == 2 and "--worker-memory-gb" in err and "from 1 to 65536" in err


@pytest.mark.parametrize("argv", [
    ["recheck-xla", "../../etc/passwd:x"],
    ["sweep", "../../etc/passwd:x", "--shapes", "x=8x128:float32", "--no-storage"],
    ["sweep", ".toy_kernels:scale", "--shapes", "x=8x128:float32", "--no-storage"],
    ["feasibility", "../../etc/passwd:x", "--shapes", "x=8x128:float32"],
    ["sweep", "--program", "./step.py:step", "--shapes", "x=8x128:float32", "--no-storage"],
    ["report", "--kernel", "matmul", "--reference", "../ref:f"],
    ["show", "--import", "../mykernels"],
    ["check", "--import", "mykernels.py"],
])
def test_a_path_where_a_module_goes_is_a_usage_error_with_the_way_to_import_a_file(argv,
                                                                                    capsys):
    rc, _, err = _run(argv, capsys)
    assert rc == 2 and "is not a module's dotted name" in err and "--path" in err, err


def test_a_ref_whose_name_is_no_name_is_a_usage_error(capsys):
    rc, _, err = _run(["recheck-xla", "toy_kernels:scale()"], capsys)
    assert rc == 2 and "is not a name in a module" in err


# ---- 53.13: show --chip, merge --into FILE (a full disk: test_disk_full.py) -------------

def test_show_with_an_unknown_chip_names_the_known_ones(cache_dir, capsys):
    for fmt in ("table", "json"):
        rc, out, err = _run(["show", "--chip", "garbage", "--format", fmt], capsys)
        assert rc == 2 and out == ""
        assert "--chip garbage: no such chip; known chips: tpu_v4" in err and "cpu" in err
        assert "chips with entries in the caches: " in err


def test_check_space_with_an_unknown_chip_names_the_known_ones(cache_dir, capsys):
    """It had reported "0 of 9 shapes have an entry" on a chip named garbage."""
    rc, out, err = _run(["check", "--space", "matmul", "--chip", "garbage"], capsys)
    assert rc == 2 and out == "" and "--chip garbage: no such chip; known chips: " in err


def test_show_with_a_known_chip_without_entries_says_none_matched(cache_dir, capsys):
    rc, out, _ = _run(["show", "--chip", "v5e"], capsys)
    assert rc == 0 and "no cache entries for --chip tpu_v5e" in out


def _host_file(tmp_path):
    host = TuningCache(str(tmp_path / "host2"), use_shipped=False)
    return host.write("cpu", "toy_kernels.scale", "x=8x128:float32,factor=2.0", {
        "config": {"br": 8, "bc": 128, "buffering": 2}, "median_ms": 1.0,
        "provenance": {"kind": "measured", "timer": "wallclock"}})


def test_merge_into_a_winners_file_merges_the_entries_that_belong_in_it(tmp_path, capsys):
    path = _host_file(tmp_path)
    into = tmp_path / "mine" / "cpu" / "toy_kernels.scale.json"
    rc, out, err = _run(["merge", path, "--into", str(into)], capsys)
    assert rc == 0, err
    assert "PALLAS_TUNE_CACHE_DIR" not in err and f"into {into}" in out
    mine = TuningCache(str(tmp_path / "mine"), use_shipped=False)
    assert mine.lookup("cpu", "toy_kernels.scale", "x=8x128:float32,factor=2.0")[0][
        "median_ms"] == 1.0


@pytest.mark.parametrize("name", ["notes.json", "mine/tpu_v6e/toy_kernels.scale.json",
                                  "mine/cpu/other.json"])
def test_merge_into_a_file_the_entries_do_not_belong_in_explains_into(name, tmp_path,
                                                                         capsys):
    path = _host_file(tmp_path)
    into = tmp_path / name
    into.parent.mkdir(parents=True, exist_ok=True)
    into.write_text("my notes\n")
    rc, out, err = _run(["merge", path, "--into", str(into)], capsys)
    assert rc == 2 and "PALLAS_TUNE_CACHE_DIR" not in err
    assert "--into takes a cache root" in err
    assert into.read_text() == "my notes\n"
    assert not (tmp_path / "mine" / "cpu" / "toy_kernels.scale.json").exists()


# ---- 53.7: recheck-xla says whose entries it rewrites and writes each when done -------------

X = jax.ShapeDtypeStruct((64, 256), jnp.float32)


class _Estimates:
    """Stands in for the compile workers: XLA at 0.01 ms every time; ``stop_at``: the call
    that is interrupted (as a kill would stop the command mid-way)."""

    calls: list[str] = []
    stop_at: int | None = None

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def map(self, fn, args, kwargs, configs, chip, standin=True):
        type(self).calls.append(str(args[0].shape))
        if len(type(self).calls) == type(self).stop_at:
            raise KeyboardInterrupt
        return [types.SimpleNamespace(kind="ok", ok=True, cycles=10_000,
                                      ops_without_estimate=0, model_cycles=None, message="")]


def _entry(ms):  # Tuned on estimates before XLA was a candidate: no XLA figure.
    return {"config": {"br": 8, "bc": 128, "buffering": 2}, "median_ms": ms,
            "provenance": {"kind": "estimate", "timer": "tpu-estimate"}}


@pytest.fixture
def recheck(cache_dir, tmp_path, monkeypatch, fresh):
    """One estimate entry in the user cache, two in a read-only root on
    PALLAS_TUNE_CACHE_PATH (as a library ships them); the estimator stood in for."""
    from pallas_tune import cache
    from pallas_tune.measure import estimate

    kernel = fresh.poor_scale
    keys = [kernel.cache_key(jax.ShapeDtypeStruct((n, 256), jnp.float32)) for n in (64, 128, 256)]
    TuningCache(str(cache_dir), use_shipped=False).write(
        "tpu_v6e", kernel.name, keys[0], _entry(1.0), kind="estimate")
    shipped = TuningCache(str(tmp_path / "library"), use_shipped=False)
    ro = shipped.write_many("tpu_v6e", kernel.name, {k: _entry(2.0) for k in keys[1:]},
                            kind="estimate")
    monkeypatch.setenv("PALLAS_TUNE_CACHE_PATH", str(tmp_path / "library"))
    cache.reset_default_cache()
    monkeypatch.setattr(estimate, "Estimator", _Estimates)
    _Estimates.calls, _Estimates.stop_at = [], None
    with open(ro, "rb") as f:
        before = f.read()
    yield kernel, keys, ro, before
    with open(ro, "rb") as f:
        assert f.read() == before, "the read-only root's file was changed"
    cache.reset_default_cache()


def _user_entries(kernel, cache_dir):
    path = TuningCache(str(cache_dir), use_shipped=False).path("tpu_v6e", kernel.name,
                                                                kind="estimate")
    with open(path) as f:
        return json.load(f)["entries"]


def test_recheck_says_which_entries_are_whose_and_leaves_read_only_ones_alone(recheck,
                                                                              cache_dir,
                                                                              capsys):
    kernel, keys, ro, _ = recheck
    rc, out, err = _run(["recheck-xla", "toy_kernels:poor_scale", "--path", TESTS_DIR,
                         "--again"], capsys)
    assert rc == 0, err
    assert "3 estimate entries: 1 in your cache" in out
    assert f"2 from a library or PALLAS_TUNE_CACHE_PATH ({ro}, read-only)" in out
    assert "the 2 read-only entries are left alone: --shipped rechecks them too" in out
    assert _Estimates.calls == ["(64, 256)"]  # The user's entry only.
    entries = _user_entries(kernel, cache_dir)
    assert set(entries) == {keys[0]} and entries[keys[0]]["implementation"] == "xla"


def test_recheck_writes_each_entry_when_done_so_a_stop_loses_only_the_one_in_progress(
        recheck, cache_dir, capsys):
    """--shipped: the read-only entries too, each written to the user cache (said first); a
    stop at the third estimate keeps the two done, and the same command finishes the rest."""
    kernel, keys, _, _ = recheck
    _Estimates.stop_at = 3
    rc, out, _ = _run(["recheck-xla", "toy_kernels:poor_scale", "--path", TESTS_DIR,
                       "--again", "--shipped"], capsys)
    assert rc == 130 and "stopped: the 2 entries rechecked before are kept in" in out
    assert ("--shipped: the 2 read-only entries are rechecked too; each recheck is written "
            "to") in out
    assert set(_user_entries(kernel, cache_dir)) == set(keys[:2])
    _Estimates.calls, _Estimates.stop_at = [], None
    rc, out, _ = _run(["recheck-xla", "toy_kernels:poor_scale", "--path", TESTS_DIR,
                       "--shipped"], capsys)  # Without --again: only what is not done.
    assert rc == 0 and _Estimates.calls == ["(256, 256)"] and "1 entries rewritten" in out
    entries = _user_entries(kernel, cache_dir)
    assert set(entries) == set(keys)
    assert all(e["implementation"] == "xla" and e["xla_ms"] > 0 for e in entries.values())
