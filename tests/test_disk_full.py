"""A full disk is one clear error (:class:`pallas_tune.errors.DiskFullError`) that loses no
finished trial: told trials stay in the study storage and the same tune resumes from them."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import optuna
import pytest
import sqlalchemy

import pallas_tune as pt
from pallas_tune.errors import DiskFullError, is_disk_full

HERE = os.path.dirname(os.path.abspath(__file__))


def _cost(cfg):
    return 1.0 + abs(cfg["a"] - 5) + abs(cfg["b"] - 2)


@pt.tunable(a=list(range(8)), b=list(range(4)), name="disk_full_toy")
def toy(x, *, a, b):
    return x


def _tune(storage, trials=12, seed=0, write=False):
    from test_tuner import Landscape

    from pallas_tune.tuning import TuneOptions, run

    ev = Landscape(_cost)
    options = TuneOptions(trials=trials, seed=seed, write=write, retime_top=0, warm_start=0,
                          transfer=False, storage=storage, study_name="disk-full")
    return ev, lambda: run(toy, (jnp.ones((64, 128)),), {}, options, evaluator=ev)


def test_is_disk_full_reads_errno_and_the_databases_words():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    wrapped = sqlalchemy.exc.OperationalError(
        "UPDATE trials", {}, sqlite3.OperationalError("database or disk is full"))
    try:
        try:
            raise wrapped
        except sqlalchemy.exc.OperationalError as e:
            raise optuna.exceptions.StorageInternalError("An exception is raised") from e
    except optuna.exceptions.StorageInternalError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("disk"))


def test_a_storage_that_fills_up_mid_tune_is_one_error_and_the_tune_resumes(tmp_path,
                                                                            monkeypatch,
                                                                            cache_dir):
    """Fault injection where the study writes: after 4 trials are told, SQLite says the disk
    is full (as Optuna's storage raised it on the machine whose disk libtpu's logs filled).
    The tune ends with DiskFullError naming the storage; the 4 told trials are in it, and
    the same tune run again evaluates none of them again."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    real = optuna.storages.RDBStorage.set_trial_state_values
    told = []

    def full_after_four(self, trial_id, state, values=None):
        if state == optuna.trial.TrialState.COMPLETE and len(told) >= 4:
            raise optuna.exceptions.StorageInternalError(
                "An exception is raised during the commit.") from sqlalchemy.exc.OperationalError(
                "UPDATE trials", {}, sqlite3.OperationalError("database or disk is full"))
        out = real(self, trial_id, state, values)
        if state == optuna.trial.TrialState.COMPLETE:
            told.append(trial_id)
        return out

    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", full_after_four)
    ev, go = _tune(storage)
    with pytest.raises(DiskFullError) as err:
        go()
    text = str(err.value)
    assert text.startswith("the disk is full (StorageInternalError")
    assert "kept in the study storage sqlite:///" in text and "resumes" in text
    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", real)
    study = optuna.load_study(study_name="disk-full", storage=storage)
    done = [t.params for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 4
    ev2, go2 = _tune(storage)
    from pallas_tune.tuning import loop

    waits = []  # The failed run's trials are this process's, of a closed run: dead at once,
    monkeypatch.setattr(loop.time, "sleep", waits.append)  # not waited on (50 s before).
    result = go2()
    again = [c for c in ev2.evaluated if any(
        all(c[k] == p[k] for k in ("a", "b")) for p in done)]
    assert again == [] and result.best_ms == min(_cost(c) for c in ev.evaluated + ev2.evaluated)
    assert waits == []
    study = optuna.load_study(study_name="disk-full", storage=storage)
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,))


def test_a_closed_run_s_trials_are_dead_an_open_one_s_alive():
    """The owner tag host:pid:run: this process's trials are alive while their run is open;
    a tag without a run (pallas-tune before it) stays alive, as another host's does."""
    from pallas_tune.tuning import storage as st

    run = st.open_run()
    tag = st.owner(run)
    assert st._alive_here(tag)
    st.close_run(run)
    assert not st._alive_here(tag)
    assert st._alive_here(st.owner()) and st._alive_here("another-host:1:" + run)


def test_a_cache_write_on_a_full_disk_keeps_the_result_on_the_error(cache_dir, monkeypatch):
    ev, go = _tune(None, write=True)
    path = toy.cache.path("cpu", toy.name)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(type(toy.cache), "write", full)
    with pytest.raises(DiskFullError) as err:
        go()
    assert err.value.result is not None and err.value.result.best == {"a": 5, "b": 2}
    assert "its cache entry was not written" in str(err.value)
    assert "no study storage, so its trials are not kept" in str(err.value)
    assert not os.path.exists(path)


_SCENARIO = textwrap.dedent('''
    import json, os, subprocess, sys
    sys.path[:0] = [{here!r}]
    d = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", d], check=True)
    os.environ["PALLAS_TUNE_CACHE_DIR"] = os.path.join(d, "cache")
    import test_disk_full as t
    from pallas_tune.errors import DiskFullError
    import optuna
    storage = f"sqlite:///{{d}}/study.db"
    t._tune(storage, trials=1)[1]()  # The study and its schema, while there is room.
    ev, go = t._tune(storage, trials=64)
    filler = os.path.join(d, "filler")
    st = os.statvfs(d)
    with open(filler, "wb") as f:  # Room for a few more pages of the database only.
        f.write(b"f" * (st.f_bavail * st.f_frsize - 12 * 1024))
    out = {{}}
    try:
        go()
        out["error"] = None
    except DiskFullError as e:
        out["error"] = str(e)
    except BaseException as e:
        out["error"] = f"RAW {{type(e).__name__}}: {{e}}"
    study = optuna.load_study(study_name="disk-full", storage=storage)
    done = [t2.params for t2 in study.trials if t2.state.name == "COMPLETE"]
    out["stored"] = len(done)
    os.unlink(filler)
    ev2, go2 = t._tune(storage, trials=64)
    go2()
    out["again"] = sum(1 for c in ev2.evaluated if c in done)
    out["second"] = len(ev2.evaluated)
    print(json.dumps(out))
''')


def test_a_real_small_filesystem_fills_up_and_the_tune_resumes(tmp_path):
    """The same on a real 600 KiB tmpfs (a private mount namespace: nothing leaks), the
    study's SQLite file on it: SQLite's own 'database or disk is full'."""
    if not shutil.which("unshare") or not sys.platform.startswith("linux"):
        pytest.skip("needs unshare (util-linux) on Linux for a private small filesystem")
    probe = subprocess.run(["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=64k",
                            "tmpfs", str(tmp_path)], capture_output=True, text=True)
    if probe.returncode:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    d = tmp_path / "fs"
    d.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["unshare", "-rm", sys.executable, "-c",
                           _SCENARIO.format(here=HERE), str(d)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] and out["error"].startswith("the disk is full"), out
    assert "kept in the study storage" in out["error"]
    assert out["stored"] >= 1 and out["again"] == 0, out


def test_a_sweep_stops_at_a_full_disk_with_one_error(cache_dir, monkeypatch, capsys):
    """A full disk ends the sweep (every shape after would fail alike) with one line naming
    it, not one FAILED per shape; the CLI's exit status is 1."""
    import toy_kernels

    from pallas_tune.cli import main

    tried = []

    def full(*args, **kwargs):
        tried.append(args[0].shape)
        raise DiskFullError("the disk is full (OSError: [Errno 28] No space left on device)")

    monkeypatch.setattr(type(toy_kernels.scale), "tune", lambda self, *a, **k: full(*a, **k))
    code = main(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32",
                 "--shapes", "x=128x256:float32", "--trials", "2", "--no-storage",
                 "--path", HERE])
    err = capsys.readouterr().err
    assert code == 1 and len(tried) == 1
    assert "error: the disk is full" in err and "FAILED" not in err


def test_sweep_program_passes_a_specs_plain_values_as_static(cache_dir, tmp_path, capsys):
    """`--program` with `n=2` in the spec: n is the program's static argument (a loop count
    and a shape), as jax.jit's static_argnums makes it; before, it was traced and the
    sweep died with a traceback."""
    from pallas_tune.cli import main

    (tmp_path / "staticstep.py").write_text(
        "import jax.numpy as jnp\nimport toy_kernels as tk\n\n\ndef step(x, n):\n"
        "    for _ in range(n):\n        x = tk.scale(x)\n    return jnp.tile(x, (n, 1))\n")
    code = main(["sweep", "--program", "staticstep:step", "--path", str(tmp_path),
                 "--shapes", "x=64x256:float32,n=2", "--trials", "2", "--repeats", "1",
                 "--no-storage"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert "1 calls: 1 tuned" in captured.out or "1 call: 1 tuned" in captured.out, captured.out


def test_a_full_disk_tells_a_cli_user_what_to_do_not_the_api_s_result(cache_dir, tmp_path,
                                                                       capsys, monkeypatch):
    """The tune finishes, its cache entry hits a full disk: the CLI's line says where the
    trials are and to run the same command again; nothing of the API error's ``.result``
    (issue 53.13)."""
    from pallas_tune.cache import TuningCache
    from pallas_tune.cli import main

    def full(self, chip, kernel, key, entry, *, kind="measured"):
        raise OSError(errno.ENOSPC, "No space left on device", self.path(chip, kernel))

    monkeypatch.setattr(TuningCache, "write", full)
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    rc = main(["sweep", "toy_kernels:scale", "--path", HERE, "--shapes", "x=8x128:float32",
               "--trials", "2", "--repeats", "1", "-q", "--storage", storage])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err
    assert ".result" not in err and "this error" not in err
    assert "the disk is full (OSError: [Errno 28] No space left on device" in err
    assert "finished (best {" in err and "its cache entry could not be written" in err
    assert f"kept in the study storage {storage}" in err and "run the same command again" in err
