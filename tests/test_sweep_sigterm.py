"""SIGTERM (a job scheduler's stop, a preempted host) ends a sweep the way Ctrl-C does: what
finished is saved, one resume line, exit status 143, and the workers do not die first as a
failed candidate when the signal reaches the whole process group."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

from conftest import subprocess_env
from sweep_harness import toy_study

SHAPES = "x=64x256:float32"
KEY = "x=64x256:float32,factor=2.0"


def test_sigterm_to_the_process_group_saves_and_exits_143(cache_dir):
    cmd = [sys.executable, "-m", "pallas_tune", "sweep", "toy_kernels:scale", "--shapes",
           SHAPES, "--trials", "8", "--repeats", "1", "--workers", "1"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir),
                         start_new_session=True)
    deadline = time.monotonic() + 300
    seen = 0
    while seen < 2 and time.monotonic() < deadline:  # Two progress lines: a trial is told.
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            break
        seen += " timed, " in line
    assert seen == 2, p.communicate(timeout=60)
    os.killpg(p.pid, signal.SIGTERM)  # As a scheduler stops a job: the whole group.
    out, err = p.communicate(timeout=120)
    assert p.returncode == 143, (out, err)
    assert "Traceback" not in err, err
    assert err.count("to resume, run again:") == 1, err
    import optuna

    study = optuna.load_study(
        study_name=toy_study(KEY),
        storage=f"sqlite:///{cache_dir / '.studies' / 'studies.db'}")
    states = optuna.trial.TrialState
    done = [t for t in study.trials if t.state == states.COMPLETE]
    assert done, [t.state for t in study.trials]  # What finished is kept.
    # The worker outlived the signal: no evaluation is recorded as failed (+inf, a crash)...
    assert all(math.isfinite(t.value) for t in done), [(t.value, t.user_attrs) for t in done]
    assert not [t for t in study.trials if t.user_attrs.get("detail") == "worker_crashed"]
    # ...and the trial it was running is failed and queued again for the resume.
    interrupted = [t for t in study.trials if t.state == states.FAIL]
    waiting = [t for t in study.trials if t.state == states.WAITING]
    assert len(waiting) >= len(interrupted), [t.state for t in study.trials]
