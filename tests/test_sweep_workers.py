"""Distributed sweeps: several `pallas-tune sweep` processes on one storage, started at the same
moment, and kill -9 resumes. Real PostgreSQL (pgserver) where it can start; SQLite always.

The same scenarios repeated in a loop, kill -9 on PostgreSQL too, and two workers on SQLite:
benchmarks/sweeps/sweep_workers.py (results in benchmarks/results/sweep_workers.txt)."""

from __future__ import annotations

import subprocess

import pytest
from sweep_harness import (accounts, kill9, postgres_url, program_timings, start_workers,
                           sweep_command, wait_all, wait_for_timed, worker_env)

TRIALS = 6  # Of a space of 16 configs (8 distinct programs): the sampler proposes, so
SPACE = 16  # workers can collide on a config.


def _assert_clean(storage: str, results, trials: int = TRIALS) -> dict:
    for rc, out, err in results:
        assert rc == 0, (out[-2000:], err[-3000:])
        assert "Traceback" not in err, err[-3000:]
    acc = accounts(storage)
    assert acc["duplicates"] == 0, acc
    # --trials is the study's total, not each worker's: reached exactly, unless the space ran
    # out first (configs differing only in buffering are one program in interpret mode).
    assert acc["timed"] == trials or (acc["evaluated"] == SPACE and acc["timed"] < trials), acc
    assert acc["running"] == 0, acc
    return acc


def test_three_workers_on_postgres_start_together(tmp_path):
    with postgres_url(str(tmp_path / "pg")) as url:
        procs = start_workers(3, url, TRIALS, str(tmp_path / "cache"), "-q")
        acc = _assert_clean(url, wait_all(procs))
        assert acc["workers"] >= 2, acc  # The work was shared, not done thrice.


# The same on PostgreSQL, and both repeated: benchmarks/sweeps/sweep_workers.py loops.
@pytest.mark.parametrize("backend", ["sqlite-default"])
def test_kill9_then_the_same_command_resumes(tmp_path, backend):
    cache = str(tmp_path / "cache")
    if backend == "postgres":
        ctx = postgres_url(str(tmp_path / "pg"))
    else:  # No --storage: the embedded default in the user cache directory.
        import contextlib

        ctx = contextlib.nullcontext(None)
    with ctx as url:
        stored = url or f"sqlite:///{tmp_path / 'cache' / '.studies' / 'studies.db'}"
        first = subprocess.Popen(sweep_command(url, TRIALS, "-q"), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=worker_env(cache))
        # Killed at its first timed trial: each poll of the study takes a while on a loaded host,
        # and a worker allowed to reach 3 first was seen finishing all 6 before the kill landed.
        wait_for_timed(stored, 1)
        kill9(first)
        before = accounts(stored)
        assert 1 <= before["timed"] < TRIALS, before
        again = subprocess.run(sweep_command(url, TRIALS, "-q"), capture_output=True,
                               text=True, env=worker_env(cache), timeout=600)
        acc = _assert_clean(stored, [(again.returncode, again.stdout, again.stderr)])
        assert acc["workers"] == 2, acc  # The killed run's trials were kept, not redone.


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_workers_never_time_one_program_twice(tmp_path, backend):
    """toy_kernels.clamped at 16 rows: 10 configs, 2 programs (clamped tiles; the buffer depth
    changes nothing in interpret mode), every config enqueued. The workers pop neighbouring
    configs of one program; each program is timed by one trial, the others are duplicates."""
    import contextlib

    ctx = (postgres_url(str(tmp_path / "pg")) if backend == "postgres" else
           contextlib.nullcontext(f"sqlite:///{tmp_path / 'study.db'}"))
    with ctx as url:
        procs = start_workers(2, url, 10, str(tmp_path / "cache"), "-q", "--study-name",
                              "programs", kernel="toy_kernels:clamped",
                              shapes="x=16x128:float32")
        for rc, out, err in wait_all(procs):
            assert rc == 0 and "Traceback" not in err, (out[-2000:], err[-3000:])
        timings = program_timings(url, "programs")
        assert len(timings) == 2 and set(timings.values()) == {1}, timings
        assert accounts(url, "programs")["evaluated"] == 10
