"""Shared by the sweep tests and benchmarks/sweeps/sweep_workers.py: a PostgreSQL server, worker
processes of ``pallas-tune sweep`` on one storage, and the study's accounts."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
KERNEL = "toy_kernels:scale"  # A space of 16 configs.
SHAPES = "x=64x256:float32"


def toy_study(key: str = "x=64x256:float32,factor=2.0") -> str:
    """The default stored study of toy_kernels.scale for ``key`` on the CPU: it names the
    kernel's code fingerprint (the hash of toy_kernels.py), as the tuner does."""
    from pallas_tune._kernel_hash import source_fingerprint

    with open(os.path.join(TESTS_DIR, "toy_kernels.py"), encoding="utf-8") as f:
        fingerprint = source_fingerprint(f.read())
    return f"toy_kernels.scale|cpu|{key}|kernel={fingerprint}"


STUDY = toy_study()


def postgres_or_skip(tmp: str) -> Any:
    """A running pgserver (a real PostgreSQL) in ``tmp``; pytest.skip where it cannot start."""
    import pytest

    try:
        import pgserver
        import psycopg  # noqa: F401  SQLAlchemy 2.1's default PostgreSQL driver.
    except ImportError as e:
        pytest.skip(f"needs pgserver and psycopg ({e}): pip install "
                    "'pallas-tune[postgres,test]'")
    try:
        return pgserver.get_server(tmp, cleanup_mode="stop")
    except Exception as e:  # noqa: BLE001  No server here (no shared memory, no /tmp, ...).
        pytest.skip(f"PostgreSQL (pgserver) could not start here: {e}")


def worker_env(cache_dir: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env["JAX_PLATFORMS"] = "cpu"
    env["PALLAS_TUNE_CACHE_DIR"] = cache_dir
    env.update(extra)
    return env


def sweep_command(storage: str | None, trials: int, *extra: str, shapes: str = SHAPES,
                  kernel: str = KERNEL) -> list[str]:
    cmd = [sys.executable, "-m", "pallas_tune", "sweep", kernel, "--shapes", shapes,
           "--trials", str(trials), "--repeats", "1", "--max-time-s", "0.05", "--force",
           *extra]
    return cmd + (["--storage", storage] if storage else [])


def start_workers(n: int, storage: str | None, trials: int, cache_dir: str, *extra: str,
                  **command: str) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen(sweep_command(storage, trials, *extra, **command),
                             stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=worker_env(cache_dir))
            for _ in range(n)]


def wait_all(procs: Sequence[subprocess.Popen[str]], timeout: float = 600
             ) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append((p.returncode, stdout, stderr))
    return out


def accounts(storage: str, study: str = STUDY) -> dict[str, Any]:
    """What the stored study says: configs evaluated (by any worker) and how often, timed
    trials, trials still RUNNING, workers seen."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = optuna.load_study(study_name=study, storage=storage)
    evaluated: collections.Counter[tuple[Any, ...]] = collections.Counter()
    timed = 0
    workers = set()
    for t in s.get_trials(deepcopy=False):
        if t.state == TrialState.COMPLETE and "worker" in t.user_attrs:
            evaluated[tuple(sorted(t.params.items()))] += 1
            workers.add(t.user_attrs["worker"])
            timed += (t.value is not None and math.isfinite(t.value)
                      and not t.user_attrs.get("duplicate"))
    states = collections.Counter(t.state.name for t in s.get_trials(deepcopy=False))
    return {"evaluated": len(evaluated), "duplicates": sum(n - 1 for n in evaluated.values()),
            "timed": timed, "running": states.get("RUNNING", 0), "states": dict(states),
            "workers": len(workers)}


def program_timings(storage: str, study: str) -> collections.Counter[str]:
    """How many trials of the stored study timed each program (by fingerprint): a duplicate
    (the same program as an earlier trial) is not timed."""
    import optuna
    from optuna.trial import TrialState

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    s = optuna.load_study(study_name=study, storage=storage)
    return collections.Counter(
        t.user_attrs["fingerprint"] for t in s.get_trials(deepcopy=False)
        if t.state == TrialState.COMPLETE and t.user_attrs.get("fingerprint")
        and not t.user_attrs.get("duplicate") and t.value is not None
        and math.isfinite(t.value))


def wait_for_timed(storage: str, at_least: int, timeout: float = 300) -> None:
    """Polls the study until ``at_least`` trials are timed (or raises TimeoutError)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(Exception):  # The study may not exist yet.
            if accounts(storage)["timed"] >= at_least:
                return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {at_least} timed trials after {timeout}s")


def kill9(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)


@contextlib.contextmanager
def postgres_url(tmp: str) -> Iterator[str]:
    server = postgres_or_skip(tmp)
    try:
        yield server.get_uri()
    finally:
        server.cleanup()
