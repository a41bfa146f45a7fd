"""CLI conventions and the cache tools: --version, exit statuses, errors on stderr, --shapes
checked before tracing, show --format, check, merge, PALLAS_TUNE_RECORD + --from-record,
Ctrl-C (exit 130, one resume line), library caches and their rank."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import subprocess_env
from sweep_harness import toy_study

SHAPES = "x=64x256:float32"
KEY = "x=64x256:float32,factor=2.0"


def _cli(args, cache_dir, **env):
    return subprocess.run([sys.executable, "-m", "pallas_tune", *args], capture_output=True,
                          text=True, timeout=600,
                          env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir, **env))


def test_version_and_usage_errors(cache_dir):
    from pallas_tune.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    with pytest.raises(SystemExit) as e:
        main(["sweep", "--trials", "many"])
    assert e.value.code == 2


@pytest.mark.parametrize("shapes,message", [
    ("x=8xZ:float32", "must be whole numbers"),
    ("x=128x128", "no dtype"),
    ("x=128x128:float32,y=64x128:float32", "reference refuses these shapes"),
    ("x=128x128:float32", "missing y"),
    ("x=128x128:float32,y=128x128:float32,bm=128", "sets bm, which"),
])
def test_bad_shapes_are_stopped_before_tracing(cache_dir, capsys, shapes, message):
    from pallas_tune.cli import main

    rc = main(["sweep", "pallas_tune.kernels.matmul:matmul", "--shapes", shapes, "-q",
               "--no-storage"])
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert err.startswith("pallas-tune sweep: error:") and "Traceback" not in err
    if "x=128x128:" in shapes:
        assert "right spec looks like 'x=1024x1024:float32,y=1024x1024:float32'" in err


def _main(capsys, *args):
    from pallas_tune.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_show_formats_check_and_merge(cache_dir, tmp_path, capsys):
    rc, _, err = _main(capsys, "sweep", "toy_kernels:scale", "--shapes", SHAPES, "--trials",
                       "3", "--repeats", "1", "-q", "--no-storage")
    assert rc == 0, err
    rc, out, err = _main(capsys, "show", "--format", "json", "--trials")
    assert rc == 0, err
    [entry] = [e for e in json.loads(out)["entries"] if e["key"] == KEY]
    assert entry["chip"] == "cpu" and entry["runs"] and entry["runs"][0]["trials"]
    rows = list(csv.reader(io.StringIO(_main(capsys, "show", "--format", "csv")[1])))
    assert rows[0][:3] == ["kernel", "chip", "key"] and any(r[2] == KEY for r in rows[1:])
    rc, out, err = _main(capsys, "check", str(cache_dir), "--import", "toy_kernels")
    assert rc == 0 and ": OK" in out, out + err
    # Another host's cache: a config outside the space, under a chip name not normalized.
    other = tmp_path / "other" / "v6e"
    other.mkdir(parents=True)
    good = (cache_dir / "cpu" / "toy_kernels.scale.json").read_text()
    (other / "toy_kernels.scale.json").write_text(
        good.replace('"chip": "cpu"', '"chip": "tpu_v6e"').replace('"br": ', '"br": 7 + '))
    rc, out, _ = _main(capsys, "check", str(tmp_path / "other"))
    assert rc == 1 and "rename it to 'tpu_v6e'" in out and "problem:" in out, out
    # merge: two hosts' files into one root.
    host_b = tmp_path / "b" / "cpu"
    host_b.mkdir(parents=True)
    (host_b / "toy_kernels.scale.json").write_text(
        good.replace(KEY, "x=128x256:float32,factor=2.0"))
    into = tmp_path / "merged"
    rc, out, err = _main(capsys, "merge", str(cache_dir / "cpu" / "toy_kernels.scale.json"),
                         str(host_b / "toy_kernels.scale.json"), "--into", str(into))
    assert rc == 0, out + err
    from pallas_tune.cache import read_file

    merged = read_file(str(into / "cpu" / "toy_kernels.scale.json"))
    assert set(merged["entries"]) == {KEY, "x=128x256:float32,factor=2.0"}


def test_record_then_sweep_from_record(cache_dir, tmp_path, capsys):
    record = tmp_path / "misses.jsonl"
    code = ("import jax.numpy as jnp, toy_kernels as t\n"
            "t.scale(jnp.ones((64, 256), jnp.float32))\n"
            "t.scale(jnp.ones((64, 256), jnp.float32))\n"  # Same key: recorded once.
            "t.scale(jnp.ones((32, 128), jnp.float32), factor=3.0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir,
                                                       PALLAS_TUNE_RECORD=record))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(x) for x in record.read_text().splitlines()]
    assert [x["shapes"] for x in lines] == [KEY, "x=32x128:float32,factor=3.0"], lines
    assert lines[0]["ref"] == "toy_kernels:scale" and lines[0]["chip"] == "cpu"
    with open(record, "a") as f:
        f.write("not json\n")
    from pallas_tune.cli import main

    assert main(["sweep", "--from-record", str(record), "--trials", "2", "--repeats", "1",
                 "--no-storage", "-q", "--import", "toy_kernels"]) == 0
    assert "1 line(s)" in capsys.readouterr().err  # The bad line is named, not fatal.
    from pallas_tune.cache import read_file

    entries = read_file(str(cache_dir / "cpu" / "toy_kernels.scale.json"))["entries"]
    assert set(entries) == {KEY, "x=32x128:float32,factor=3.0"}


@contextlib.contextmanager
def _sigint_not_ignored():
    """SIGINT handled while a child starts, so that it starts with SIGINT at its default: a shell
    ignores SIGINT in background jobs, children inherit that, and Python then never raises
    KeyboardInterrupt (the sweep ran to the end when the suite ran as a background job)."""
    old = signal.getsignal(signal.SIGINT)
    if old is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def test_ctrl_c_exits_130_with_one_resume_line_and_resumes(cache_dir, tmp_path):
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir)
    cmd = [sys.executable, "-m", "pallas_tune", "sweep", "toy_kernels:scale", "--shapes",
           SHAPES, "--trials", "8", "--repeats", "1"]
    with _sigint_not_ignored():
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env)
    deadline = time.monotonic() + 300
    seen = 0
    while seen < 2 and time.monotonic() < deadline:  # Two progress lines: a trial is told.
        seen += " timed, " in p.stdout.readline()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, (out, err)
    assert "Traceback" not in err, err
    assert err.count("to resume, run again:") == 1, err
    again = _cli(["sweep", "toy_kernels:scale", "--shapes", SHAPES, "--trials", "8",
                  "--repeats", "1", "-q"], cache_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    import optuna

    study = optuna.load_study(
        study_name=toy_study(KEY),
        storage=f"sqlite:///{cache_dir / '.studies' / 'studies.db'}")
    evaluated = [tuple(sorted(t.params.items())) for t in study.trials
                 if "worker" in t.user_attrs]
    assert len(evaluated) == len(set(evaluated))  # Nothing measured twice across the two runs.
    assert len({t.user_attrs["worker"] for t in study.trials if "worker" in t.user_attrs}) == 2


def test_library_caches_rank_after_the_user_cache(cache_dir, tmp_path, monkeypatch):
    import pallas_tune as pt
    from pallas_tune.cache import TuningCache

    lib = tmp_path / "lib_caches"
    TuningCache(str(lib), use_shipped=False).write("cpu", "lib.kern", "k", {
        "config": {"b": 2}, "median_ms": 1.0})
    path = tmp_path / "path_caches"
    TuningCache(str(path), use_shipped=False).write("cpu", "lib.kern", "k", {
        "config": {"b": 4}, "median_ms": 1.0})
    monkeypatch.setenv("PALLAS_TUNE_CACHE_PATH", str(path))

    @pt.tunable(b=[1, 2, 4], name="lib.kern", cache=lib)
    def kern(x, *, b):
        return x

    roots = kern.cache.roots()
    assert roots[:3] == [str(cache_dir), str(lib), str(path)], roots
    assert kern.cache.lookup("cpu", "lib.kern", "k")[0]["config"] == {"b": 2}
    kern.cache.write("cpu", "lib.kern", "k", {"config": {"b": 1}, "median_ms": 1.0})
    assert kern.cache.lookup("cpu", "lib.kern", "k")[0]["config"] == {"b": 1}
    assert os.path.exists(cache_dir / "cpu")  # Only the user root was written.


def _records():
    from pallas_tune.measure.records import Measurement, Outcome, TrialRecord

    def rec(n, config, ms, outcome=Outcome.OK):
        m = Measurement(times_ms=(ms,), compile_ms=1.0, timer="wallclock") if ms else None
        return TrialRecord(number=n, config=config, outcome=outcome, measurement=m,
                           error="" if ms else "does not fit\nmore")
    return [rec(0, {"b": 1}, 4.0), rec(1, {"b": 2}, 1.0), rec(2, {"b": 4}, None,
                                                             Outcome.INFEASIBLE)]


def _progress(n, best_ms, best):
    from pallas_tune.tuning.result import Progress

    return Progress(asked=n + 1, evaluated=n + 1, timed=min(n + 1, 2), duplicates=0, budget=3,
                    best_ms=best_ms, best=best, elapsed_s=0.1)


@pytest.mark.parametrize("mode", ["lines", "live"])
def test_progress_shows_done_outcomes_best_vs_default_and_eta(mode):
    pytest.importorskip("rich") if mode == "live" else None
    from pallas_tune.cli.progress import SweepProgress

    out = io.StringIO()
    p = SweepProgress(label="k", total=3, default={"b": 1}, mode=mode, stream=out)
    bests = [(4.0, {"b": 1}), (1.0, {"b": 2}), (1.0, {"b": 2})]
    for n, r in enumerate(_records()):
        p.callback(r, _progress(n, *bests[n]))
    p.close()
    text = out.getvalue()
    # One vocabulary (issue 26.2): the same tally as the final line, show and the report.
    assert "2/3" in text and "3 trials: 2 timed, 1 infeasible" in text, text
    assert "vs default 4 ms (4.00x)" in text, text
    if mode == "lines":
        assert text.count("\n") == 3 and "ETA" in text


@pytest.mark.parametrize("width", [80, 120])
def test_live_progress_row_reads_at_narrow_widths(width, monkeypatch):
    """The fixed columns (done/total, elapsed, ETA) never collapse to '1…'; the long key is
    on its own line and the status is cut with an ellipsis (issue 26.8)."""
    pytest.importorskip("rich")
    from pallas_tune.cli.progress import SweepProgress

    monkeypatch.setenv("COLUMNS", str(width))
    out = io.StringIO()
    label = "[1/1] " + "x=4096x4096:bfloat16," * 4
    p = SweepProgress(label=label, total=32, default={"b": 1}, mode="live", stream=out)
    bests = [(4.0, {"b": 1}), (1.0, {"b": 2}), (1.0, {"b": 2})]
    for n, r in enumerate(_records()):
        p.callback(r, _progress(n, *bests[n]))
    p.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert all(len(ln) <= width for ln in lines), lines
    row = next(ln for ln in lines if "/32" in ln)
    assert "2/32" in row and "ETA" in row and "0:00:0" in row, lines
    status = "".join(lines[lines.index(row) + 1:])
    assert "search best 1 ms vs default 4 ms (4.00x); 3 trials: 2 timed, 1 infeasible" in status, lines
    assert label in "".join(lines[:lines.index(row)]), lines  # The key whole, above.


def test_show_never_cuts_a_key(cache_dir, capsys):
    from pallas_tune.cache import TuningCache
    from pallas_tune.cli import main

    key = "x=" + "x".join(["8"] * 40) + ":float32,mode=" + "long" * 30
    TuningCache(str(cache_dir), use_shipped=False).write(
        "cpu", "k.long", key, {"config": {"b": 1}, "median_ms": 1.0})
    assert main(["show", "--kernel", "k.long", "--chip", "cpu"]) == 0
    assert key in capsys.readouterr().out


def test_fresh_study_starts_over_and_a_rerun_resumes(cache_dir, capsys):
    import optuna

    from pallas_tune.cli import main

    base = ["sweep", "toy_kernels:scale", "--shapes", SHAPES, "--trials", "2", "--repeats", "1",
            "-q"]
    storage = f"sqlite:///{cache_dir / '.studies' / 'studies.db'}"
    name = toy_study(KEY)

    def workers():
        s = optuna.load_study(study_name=name, storage=storage)
        return [t.user_attrs["worker"] for t in s.trials if "worker" in t.user_attrs]

    assert main(base) == 0
    assert len(workers()) == 2
    assert main([*base, "--force"]) == 0  # Resumed: the study has its 2 trials; none re-run.
    assert len(workers()) == 2
    assert main([*base, "--force", "--fresh-study"]) == 0
    assert len(workers()) == 2 and len(optuna.load_study(study_name=name,
                                                         storage=storage).trials) == 2


def test_the_resume_line_drops_fresh_study(monkeypatch, capsys):
    """The printed command resumes the interrupted study: with --fresh-study kept, it would
    start that shape's study over."""
    from pallas_tune.cli import sweep

    monkeypatch.setattr(sys, "argv", ["pallas-tune", "sweep", "--space", "matmul", "--force",
                                      "--fresh-study", "--trials", "4"])
    sweep._interrupted("sqlite:///s.db", "x=8x8:float32")
    err = capsys.readouterr().err
    assert "to resume, run again: pallas-tune sweep --space matmul --force --trials 4" in err
    assert "--fresh-study" not in err


def test_check_space_names_every_shape_without_an_entry(cache_dir, tmp_path, capsys):
    """--space/--chip: a shape of the set with no entry is a problem naming the sweep that
    fills it; once it is tuned the same check passes."""
    space = tmp_path / "toy_set.toml"
    space.write_text('kernel = "toy_kernels:scale"\n[params]\nbr = [8, 16]\nbc = [128]\n'
                     'buffering = [1]\n[[shapes]]\nx = "64x256:float32"\n'
                     '[[shapes]]\nx = "32x128:float32"\nfactor = 3.0\n')
    rc, _, err = _main(capsys, "sweep", "--space", str(space), "--shapes", SHAPES, "--trials",
                       "2", "--repeats", "1", "-q", "--no-storage")
    assert rc == 0, err
    rc, out, err = _main(capsys, "check", str(cache_dir), "--space", str(space), "--chip", "cpu")
    missing = "x=32x128:float32,factor=3.0"
    assert rc == 1, out + err
    assert f"no cpu entry for '{missing}'" in out and "--shapes" in out, out
    assert "1 of 2 shapes have an entry (1 measured, 1 current)" in out, out
    rc, _, err = _main(capsys, "sweep", "--space", str(space), "--trials", "2", "--repeats",
                       "1", "-q", "--no-storage")
    assert rc == 0, err
    rc, out, err = _main(capsys, "check", str(cache_dir), "--space", str(space), "--chip", "cpu")
    assert rc == 0 and "2 of 2 shapes have an entry" in out and ": OK" in out, out + err
    # An empty root holds no entry for any shape; --space without --chip is a usage error.
    (tmp_path / "empty").mkdir()
    rc, out, _ = _main(capsys, "check", str(tmp_path / "empty"), "--space", str(space),
                       "--chip", "cpu")
    assert rc == 1 and out.count("problem:") == 2 and "0 of 2 shapes" in out, out
    rc, _, err = _main(capsys, "check", str(cache_dir), "--space", str(space))
    assert rc == 2 and "--space needs --chip" in err, err


def test_check_finds_shipped_adapters_by_their_own_names(capsys):
    """The upstream adapters are registered as ``jax.ops.gpu.softmax`` etc., which no import
    path spells: check must still find them and check their configs, not only the format."""
    from pallas_tune.cli.registry import KernelRegistry

    registry = KernelRegistry()
    softmax, _ = registry.find("jax.ops.gpu.softmax")
    assert softmax is not None and softmax.name == "jax.ops.gpu.softmax"
    assert registry.find("jax.ops.gpu.no_such_kernel")[0] is None
    shipped = os.path.join(os.path.dirname(__file__), os.pardir, "caches", "nvidia_h100")
    rc, out, err = _main(capsys, "check", shipped)
    assert rc == 0, out + err
    assert "file format only" not in out, out


def test_a_sweeps_line_says_when_calls_run_xla(cache_dir, capsys):
    """The final line of a shape named the Pallas winner and its speed-up while the entry
    recorded implementation xla (only `show` said so): it now says XLA runs."""
    from pallas_tune.cli import main

    code = main(["sweep", "toy_kernels:scale_or_xla", "--path", os.path.dirname(os.path.abspath(__file__)), "--shapes",
                 "x=1024x128:float32", "--trials", "2", "--repeats", "3", "--xla",
                 "--no-storage"])
    out = capsys.readouterr().out
    assert code == 0
    assert "is faster: calls run XLA (the kernel's reference), not this config" in out, out
