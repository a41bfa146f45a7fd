"""PALLAS_TUNE_RECORD and PALLAS_TUNE_RECEIPTS pointed at hostile paths (issue 38): recording
never blocks or breaks the program it watches, and a file that cannot be written is named in one
warning per process, not dropped in silence."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from conftest import subprocess_env

import pallas_tune as pt
from pallas_tune.runtime import record as _record
from pallas_tune.config import Config
from pallas_tune.errors import RecordWarning

# A traced call of a tunable kernel on an empty cache: a miss (a record line) and a receipt.
PROGRAM = """
import warnings
warnings.simplefilter("always")
import jax, numpy as np, toy_kernels as tk
x = tk.ones((64, 256))
out = jax.jit(lambda a: tk.scale(a))(x)
print("RIGHT" if np.allclose(out, 2 * np.asarray(x)) else "WRONG", flush=True)
"""


@pytest.fixture(autouse=True)
def _forget_drops():
    """Each test sees its own first warning (the once-per-process memory reset)."""
    _record._dropped.clear()
    yield
    _record._dropped.clear()


def _drop_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, RecordWarning)]


def test_a_fifo_nobody_reads_does_not_hang_the_program(tmp_path):
    """A FIFO with no reader: opening it for writing blocked the program at its first trace.
    Now the program finishes, right, and each variable's FIFO is named in a warning."""
    receipts, record = tmp_path / "receipts.fifo", tmp_path / "record.fifo"
    os.mkfifo(receipts)
    os.mkfifo(record)
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache", PALLAS_TUNE_RECEIPTS=receipts,
                         PALLAS_TUNE_RECORD=record)
    try:
        r = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                           env=env, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the program hung on a FIFO named by PALLAS_TUNE_RECEIPTS/RECORD")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["RIGHT"], r.stdout
    for env_name, path in (("PALLAS_TUNE_RECEIPTS", receipts), ("PALLAS_TUNE_RECORD", record)):
        assert f"{env_name}={path}: not written (a FIFO no process reads)" in r.stderr, \
            r.stderr[-3000:]


def test_a_fifo_with_a_reader_gets_the_line(tmp_path, monkeypatch, fresh):
    """A pipe someone reads (``/dev/stderr`` in CI, ``>(jq .)``) is a fine destination: the
    receipt arrives whole, and nothing is warned."""
    fifo = tmp_path / "r.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        monkeypatch.setenv("PALLAS_TUNE_RECEIPTS", str(fifo))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _record.receipt(fresh.scale, "cpu", "x=1", Config({"br": 8}, source="default"))
        line = os.read(reader, 65536)
    finally:
        os.close(reader)
    assert _drop_warnings(caught) == []
    got = json.loads(line)
    assert got["config"] == {"br": 8} and got["key"] == "x=1" and line.endswith(b"\n")


def _unwritable() -> list:
    """Paths that cannot be written, even by root (the tests run as root: chmod stops nobody)."""
    cases = [pytest.param("directory", "Is a directory", id="directory"),
             pytest.param("missing", "No such file or directory", id="under-a-missing-directory")]
    full = pytest.param("/dev/full", "No space left on device", id="dev-full")
    if not os.path.exists("/dev/full"):
        full = pytest.param("/dev/full", "", id="dev-full",
                            marks=pytest.mark.skip(reason="no /dev/full on this platform"))
    cases.append(full)
    ro = "/proc/sys/kernel/ostype"  # Read-only to root as well (EACCES).
    try:
        os.close(os.open(ro, os.O_WRONLY | os.O_NONBLOCK))
        skip = "writable here"
    except PermissionError:
        skip = ""
    except OSError as e:
        skip = f"not there: {e}"
    cases.append(pytest.param(ro, "Permission denied", id="read-only-file", marks=(
        [pytest.mark.skip(reason=f"{ro} {skip}")] if skip else [])))
    return cases


@pytest.mark.parametrize("var", ["PALLAS_TUNE_RECEIPTS", "PALLAS_TUNE_RECORD"])
@pytest.mark.parametrize(("where", "reason"), _unwritable())
def test_an_unwritable_path_is_warned_about_once(where, reason, var, tmp_path, monkeypatch,
                                                 cache_dir, fresh):
    path = {"directory": str(tmp_path), "missing": str(tmp_path / "no" / "such" / "r.jsonl")
            }.get(where, where)
    monkeypatch.setenv(var, path)
    x, y = fresh.ones((64, 256)), fresh.ones((32, 256))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [jax.jit(lambda a: fresh.scale(a))(v) for v in (x, y, x)]  # Two keys: 2 writes.
        fresh.add(x, x)  # Another kernel: a third.
    np.testing.assert_allclose(outs[0], 2 * x)
    np.testing.assert_allclose(outs[1], 2 * y)
    dropped = _drop_warnings(caught)
    assert dropped == [f"{var}={path}: not written ({reason}); "
                       f"{'receipts' if var.endswith('RECEIPTS') else 'misses'} of this process "
                       "are dropped"], dropped
    assert not os.path.exists(tmp_path / "no")  # Nothing created on the way.


def test_a_block_device_is_refused(tmp_path, monkeypatch, fresh):
    """Records are lines of text: a block device (a disk) is never written. (Faked: fstat
    reports a block device for a plain file; a test writing to a real disk on failure would
    be worse than the bug it checks.)"""
    import stat

    path = tmp_path / "disk"
    path.write_bytes(b"")
    real_fstat = os.fstat

    def fstat(fd):
        st = real_fstat(fd)
        mode = stat.S_IFBLK | stat.S_IMODE(st.st_mode)
        return os.stat_result((mode, *tuple(st)[1:]))

    monkeypatch.setattr(os, "fstat", fstat)
    monkeypatch.setenv("PALLAS_TUNE_RECEIPTS", str(path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _record.receipt(fresh.scale, "cpu", "x=1", Config({"br": 8}, source="default"))
    monkeypatch.undo()
    assert _drop_warnings(caught) == [
        f"PALLAS_TUNE_RECEIPTS={path}: not written (a block device, not a file); "
        "receipts of this process are dropped"]
    assert path.read_bytes() == b""
