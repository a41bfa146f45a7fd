"""Issue 25, items 2, 4 and 5: hostile files, flags and options end in a clear message (exit 2
for bad input, 1 for a problem found), never a traceback, an unbounded read or a stray file.

The CLI runs in this process (``pallas_tune.cli.main``) except where a read must be shown to
stay bounded under a memory cap: there a subprocess runs under ``RLIMIT_AS``."""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import subprocess
import sys
import warnings

import pytest
from conftest import subprocess_env

import pallas_tune as pt
from pallas_tune.cli import main
from pallas_tune.errors import PallasTuneWarning, TuneOptionError

KERNEL = "toy_kernels:scale"
GOOD = "x=8x128:float32"


def _run(argv, capsys):
    """(exit status, stdout, stderr) of ``pallas-tune ARGV`` run here."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's usage errors.
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _tree(root):
    """Every path under ``root`` with its bytes (what a command must not create or change)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.join(dirpath, d)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[p] = fh.read()
    return out


# ---- item 2: unbounded reads ----------------------------------------------------------------

def _capped(args, tmp_path):
    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 * 10**9, 2 * 10**9))

    return subprocess.run([sys.executable, "-m", "pallas_tune", *args], capture_output=True,
                          text=True, timeout=120, preexec_fn=limit,
                          env=subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /dev/zero")
@pytest.mark.parametrize("args", [["sweep", KERNEL, "--shapes", "@/dev/zero", "--no-storage"],
                                  ["sweep", "--from-record", "/dev/zero", "--no-storage"],
                                  ["sweep", "--space", "/dev/zero", "--no-storage"]])
def test_endless_files_are_refused_after_the_cap(tmp_path, args):
    r = _capped(args, tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "MemoryError" not in r.stderr
    assert "/dev/zero" in r.stderr and "MiB" in r.stderr
    assert not (tmp_path / "cache").exists()


def _oversize(path, size):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)  # Sparse: no disk used.


def test_hot_path_refuses_a_winners_file_over_the_cap_naming_size_cap_and_knob(
        cache_dir, monkeypatch):
    from pallas_tune.cache import TuningCache

    monkeypatch.delenv("PALLAS_TUNE_MAX_FILE_MB", raising=False)
    path = cache_dir / "cpu" / "k.json"
    _oversize(path, 64 * 2**20 + 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert TuningCache(str(cache_dir), use_shipped=False).lookup("cpu", "k", GOOD) is None
    texts = [str(x.message) for x in w if issubclass(x.category, PallasTuneWarning)]
    assert len(texts) == 1, texts
    assert str(path) in texts[0] and "64 MiB" in texts[0] and "67108865" in texts[0]
    assert "PALLAS_TUNE_MAX_FILE_MB" in texts[0]


def test_the_cap_knob_raises_and_lowers_the_limit(cache_dir, monkeypatch):
    from pallas_tune.cache import TuningCache

    c = TuningCache(str(cache_dir), use_shipped=False)
    entries = {f"x={i}x128:float32": {"config": {"br": 8}, "median_ms": 1.0, "pad": "p" * 600}
               for i in range(1, 3000)}
    c.write_many("cpu", "k", entries)
    assert os.path.getsize(c.path("cpu", "k")) > 2**20
    monkeypatch.setenv("PALLAS_TUNE_MAX_FILE_MB", "1")
    with pytest.warns(PallasTuneWarning, match="limit of 1 MiB"):
        assert TuningCache(str(cache_dir), use_shipped=False).lookup("cpu", "k",
                                                                    "x=5x128:float32") is None
    monkeypatch.setenv("PALLAS_TUNE_MAX_FILE_MB", "4")
    found = TuningCache(str(cache_dir), use_shipped=False).lookup("cpu", "k", "x=5x128:float32")
    assert found is not None and found[0]["config"] == {"br": 8}


@pytest.mark.parametrize("expr", ["'ab' * 100000 == ''", "(1,) * 100000 == ()",
                                  "100000 * x.shape == ()", "'%0100000d' % 1 == ''",
                                  "len('%s' * 60000) > 0"])
def test_constraint_results_are_bounded(expr):
    import numpy as np

    from pallas_tune.constraints import Constraint

    c = Constraint(name="c", check=expr)
    with pytest.raises(ValueError, match="out of range|too long|not allowed"):
        c.holds({"x": np.zeros((8, 128))})


def test_small_constraint_repetition_still_works():
    import numpy as np

    from pallas_tune.constraints import Constraint

    env = {"x": np.zeros((8, 128))}
    assert Constraint(name="c", check="'ab' * 3 == 'ababab'").holds(env)
    assert Constraint(name="c", check="x.shape * 2 == (8, 128, 8, 128)").holds(env)
    assert Constraint(name="c", check="x.shape[1] % 64 == 0").holds(env)


# ---- item 4: messages, not tracebacks -------------------------------------------------------

def _cpu_host_without_plugins(monkeypatch):
    """As on a CPU host without jax_plugins: no JAX_PLATFORMS, no backend initialised yet."""
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setitem(sys.modules, "jax_plugins", None)  # As if not installed.
    try:
        from jax._src import xla_bridge
    except ImportError:
        return
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False, raising=False)


def test_host_platform_without_jax_plugins(monkeypatch):
    """find_spec("jax_plugins.xla_cuda12") raises when jax_plugins is absent (any CPU host)."""
    from pallas_tune.measure.evaluate import host_platform

    _cpu_host_without_plugins(monkeypatch)
    platform, initialised = host_platform()
    assert platform in ("cpu", "gpu", "tpu") and initialised is False


@pytest.mark.parametrize("spec,words", [
    ("x=99999999999x99999999999:float32", "elements"),
    ("x=" + "8x" * 3000 + "8:float32", "elements"), ("x=", "no value"),
    ("x=axb:float32", "whole numbers"),
    ("x=-1x128:float32", "whole numbers"),
    ("x=0x128:float32", "at least 1"),
    ("x=(8x128:float32;0x8:float32)", "at least 1"),
    ("x=8x99999999999999999999999:float32", "elements"),
])
def test_bad_dims_are_usage_errors(cache_dir, capsys, spec, words):
    rc, _, err = _run(["sweep", KERNEL, "--shapes", spec, "--no-storage"], capsys)
    assert rc == 2, err
    assert spec[:40] in err and words in err and "Traceback" not in err
    assert not cache_dir.exists()


def test_storage_that_is_a_text_file_is_a_usage_error(cache_dir, tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    rc, _, err = _run(["sweep", KERNEL, "--shapes", GOOD, "--storage",
                       f"sqlite:///{text}"], capsys)
    assert rc == 2, err
    assert "not an SQLite database" in err and str(text) in err
    assert text.read_text() == "my notes\n" and not cache_dir.exists()


@pytest.mark.parametrize("url,words", [
    ("bogus://", "scheme"), ("sqlite:////no/such/dir/x.db", "no such directory"),
    ("notaurl", "URL"),
])
def test_storage_urls_are_checked_before_anything_is_created(cache_dir, tmp_path, capsys,
                                                             url, words):
    before = _tree(tmp_path)
    rc, _, err = _run(["sweep", KERNEL, "--shapes", GOOD, "--storage", url], capsys)
    assert rc == 2, err
    assert words in err and "Traceback" not in err
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("chip", ["bogus", "v6e"])
def test_chip_flag_on_a_cpu_host_is_a_message(cache_dir, capsys, monkeypatch, chip):
    _cpu_host_without_plugins(monkeypatch)
    rc, _, err = _run(["sweep", KERNEL, "--shapes", GOOD, "--chip", chip, "--no-storage",
                       "--trials", "1"], capsys)
    assert rc in (1, 2), err
    assert chip in err and "Traceback" not in err


@pytest.mark.parametrize("kwargs,words", [
    (dict(trials=10**12), "trials"), (dict(trials=1e12), "trials"),
    (dict(workers=10**9), "workers"), (dict(compile_workers=10**9), "compile_workers"),
    (dict(chip="bogus"), "chip"), (dict(storage="bogus://"), "storage"),
    (dict(storage="notaurl"), "storage"), (dict(seed=2**40), "seed"),
    (dict(repeats=10**12), "repeats"), (dict(max_attempts=10**15), "max_attempts"),
    (dict(worker_memory_gb=0), "worker_memory_gb"),
    (dict(worker_memory_gb=float("nan")), "worker_memory_gb"),
])
def test_tune_options_reject_absurd_values(kwargs, words):
    with pytest.raises(TuneOptionError, match=words):
        pt.TuneOptions(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(chip="v6e"), dict(chip="TPU v6 lite"), dict(chip="nvidia_h100"), dict(chip="cpu"),
    dict(chip="NVIDIA GH200 480GB"), dict(chip="tpu_v9"), dict(storage="sqlite:///tune.db"),
    dict(storage="postgresql+psycopg://user@host/db"), dict(storage="sqlite://"),
    dict(trials=100_000, workers=8, seed=2**32 - 1), dict(worker_memory_gb=9.5),
])
def test_tune_options_keep_accepting_real_values(kwargs):
    pt.TuneOptions(**kwargs)


# ---- item 5 ---------------------------------------------------------------------------------

def _entry(ms=0.5):
    return {"config": {"br": 8, "bc": 128, "buffering": 1}, "median_ms": ms}


def test_show_csv_escapes_control_characters(cache_dir, capsys):
    from pallas_tune.cache import TuningCache

    TuningCache(str(cache_dir), use_shipped=False).write(
        "cpu", "toy_kernels.scale", "x=\x1b[2J\x1b]0;pwned\x07:float32", _entry())
    rc, out, _ = _run(["show", "--format", "csv", "--kernel", "toy_kernels.scale"], capsys)
    assert rc == 0
    assert "\x1b" not in out and "\x07" not in out
    rows = list(csv.reader(io.StringIO(out)))
    assert any("\\x1b[2J" in cell for row in rows for cell in row)


def test_show_table_cuts_long_cells_but_json_keeps_them(cache_dir, capsys):
    from pallas_tune.cache import TuningCache

    long_key = "x=8x128:float32,tag=" + "k" * 100_000
    c = TuningCache(str(cache_dir), use_shipped=False)
    c.write("cpu", "toy_kernels.scale", long_key, _entry())
    for n in range(1, 30):
        c.write("cpu", "toy_kernels.scale", f"x={8 * n}x128:float32", _entry(0.25))
    rc, out, _ = _run(["show", "--kernel", "toy_kernels.scale"], capsys)
    assert rc == 0
    assert len(out) < 20_000, len(out)  # Not every row padded to the longest key.
    assert max(len(line) for line in out.splitlines()) < 1500
    assert "…" in out and "x=232x128:float32" in out and "--format json" in out
    rc, out, _ = _run(["show", "--format", "json", "--kernel", "toy_kernels.scale"], capsys)
    assert rc == 0 and long_key in {e["key"] for e in json.loads(out)["entries"]}


def test_merge_says_why_it_skipped(cache_dir, tmp_path, capsys):
    src = tmp_path / "host1" / "cpu" / "toy_kernels.scale.json"
    src.parent.mkdir(parents=True)
    src.write_text('{"schema": 2, "kernel": "toy_kernels.scale", "chip": "cpu", '
                   '"kind": "measured", "entries": {\n'
                   '"x=8x128:float32": {"config": {"br": 8}, "median_ms": "fast"}\n}}\n')
    rc, _, err = _run(["merge", str(src), "--into", str(tmp_path / "into")], capsys)
    assert rc == 1
    assert "x=8x128:float32" in err and "median_ms" in err and str(src) in err


@pytest.mark.parametrize("args", [
    ["sweep", "toy_kernels:nope", "--shapes", GOOD],
    ["sweep", KERNEL, "--shapes", GOOD, "--trials", "0"],
    ["sweep", KERNEL, "--shapes", "z=8x128:float32"],
])
def test_usage_errors_create_no_studies_db(cache_dir, capsys, args):
    rc, _, err = _run(args, capsys)
    assert rc == 2, err
    assert not cache_dir.exists(), _tree(cache_dir)


def _file_cache_dir(tmp_path, monkeypatch):
    from pallas_tune import _settings, cache

    f = tmp_path / "cachefile"
    f.write_text("not a directory\n")
    monkeypatch.setenv("PALLAS_TUNE_CACHE_DIR", str(f))
    cache.reset_default_cache()
    _settings.reload()
    return f


def test_cache_dir_that_is_a_file_warns_once_at_lookup(cache_dir, tmp_path, monkeypatch, fresh):
    f = _file_cache_dir(tmp_path, monkeypatch)
    from pallas_tune.cache import default_cache

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert default_cache().lookup("cpu", "toy_kernels.scale", GOOD) is None
        assert default_cache().lookup("cpu", "toy_kernels.add", GOOD) is None
    texts = [str(x.message) for x in w if issubclass(x.category, PallasTuneWarning)]
    assert len(texts) == 1, texts
    assert str(f) in texts[0] and "not a directory" in texts[0]
    assert "PALLAS_TUNE_CACHE_DIR" in texts[0]


def test_cache_dir_that_is_a_file_check_and_sweep(cache_dir, tmp_path, monkeypatch, capsys):
    f = _file_cache_dir(tmp_path, monkeypatch)
    rc, out, err = _run(["check"], capsys)
    assert rc == 1
    assert "not valid JSON" not in out + err
    assert "not a directory" in out + err and "PALLAS_TUNE_CACHE_DIR" in out + err
    rc, out, err = _run(["sweep", KERNEL, "--shapes", GOOD, "--trials", "1"], capsys)
    assert rc == 1, err
    assert err.count("not a directory") == 1 and "PALLAS_TUNE_CACHE_DIR" in err, err
    assert "Warning" not in err
    assert f.read_text() == "not a directory\n"


def test_read_only_cache_dir_names_the_dir_and_the_fix(cache_dir, tmp_path, monkeypatch,
                                                       capsys):
    """The cache directory cannot be created (read-only parent): simulated, since root may
    write anywhere."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_makedirs = os.makedirs

    def makedirs(name, *a, **k):
        if str(name).startswith(str(ro)):
            raise PermissionError(13, "Permission denied", str(name))
        return real_makedirs(name, *a, **k)

    monkeypatch.setattr(os, "makedirs", makedirs)
    from pallas_tune import _settings, cache

    monkeypatch.setenv("PALLAS_TUNE_CACHE_DIR", str(ro / "cache"))
    cache.reset_default_cache()
    _settings.reload()
    for extra in ([], ["--no-storage"]):
        rc, _, err = _run(["sweep", KERNEL, "--shapes", GOOD, "--trials", "1", *extra], capsys)
        assert rc == 1, err
        assert str(ro / "cache") in err and "PALLAS_TUNE_CACHE_DIR" in err, err
        assert "[Errno 13]" not in err


def test_ledger_lines_over_the_cap_are_skipped_not_held(tmp_path, monkeypatch):
    """``show --trials`` and reports read ledgers line by line; a line over the limit (a
    runaway writer, a sparse file of zeros) is skipped, read in pieces, never held whole."""
    from pallas_tune.cache import ledger

    path = tmp_path / "k.trials.jsonl"
    big = json.dumps({"key": "x=8x128:float32", "trials": [], "pad": "p" * (3 * 2**20)})
    small = json.dumps({"key": "x=8x128:float32", "trials": [{"number": 0}]})
    path.write_text(big + "\n" + small + "\n")
    monkeypatch.setenv("PALLAS_TUNE_MAX_FILE_MB", "1")
    records, bad = ledger.read(str(path))
    assert bad == 1 and records == [json.loads(small)]
    monkeypatch.setenv("PALLAS_TUNE_MAX_FILE_MB", "4")
    records, bad = ledger.read(str(path))
    assert bad == 0 and len(records) == 2
