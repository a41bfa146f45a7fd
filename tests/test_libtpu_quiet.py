"""A user's program on a host without a TPU, libtpu installed: none of libtpu's start-up noise
and nothing left in libtpu's log directory (issue 56, item 1).

JAX's start-up loads libtpu wherever it is installed; with no TPU, libtpu printed "Failed to
find host bounds for accelerator type", "E0000 ... unexpected worker hostname" and a "Source
Location Trace" before anything of the program's, and left ~5 KB of logs in /tmp/tpu_logs per
process (``pallas-tune show`` an ERROR file). ``import pallas_tune`` sets defaults that silence
it there (only unset variables, only where no TPU may be); a TPU host gets none.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, subprocess_env
from pallas_tune import chips
from pallas_tune.measure import logs

LIBTPU_DIR = "/tmp/tpu_logs"  # libtpu's default log directory.
NOISE = ("host bounds", "unexpected worker hostname", "Source Location Trace", "E0000",
         "InitGoogle", "TPU worker hostnames")
OURS = ("TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE", "TPU_MIN_LOG_LEVEL")


def _user_env(**extra):
    """A user's shell: every backend starts (libtpu's too), no TPU variable set. With
    ALLOW_MULTIPLE_LIBTPU_LOAD=1 libtpu initialises in full even while another process (a
    parallel test) holds its lock; without it, whether it prints depends on who holds it."""
    env = subprocess_env(ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    for name in ("JAX_PLATFORMS", "TPU_LOG_DIR", *OURS):
        env.pop(name, None)
    return {**env, **{k: str(v) for k, v in extra.items()}}


def _libtpu_files_of(before, cwd):
    """New files in libtpu's default log directory written by a process run in ``cwd`` (glog
    names end in the pid; the INFO file's header names the working directory)."""
    new = set(glob.glob(os.path.join(LIBTPU_DIR, "*"))) - before
    pids = set()
    for path in new:
        if ".INFO." in path:
            try:
                with open(path, errors="replace") as f:
                    if f"Current working directory {cwd}" in f.read(20000):
                        pids.add(path.rsplit(".", 1)[-1])
            except OSError:
                continue
    return sorted(p for p in new if p.rsplit(".", 1)[-1] in pids)


@pytest.fixture
def no_tpu_host():
    from pallas_tune.feasibility.compile import libtpu_available

    if not libtpu_available():
        pytest.skip("libtpu is not installed: it prints nothing to silence")
    if chips.tpu_devices_here():
        pytest.skip("a TPU may be on this host: pallas-tune leaves libtpu's start-up to JAX")


@pytest.mark.libtpu
@pytest.mark.parametrize("command", [
    [os.path.join(REPO, "examples", "tune_matmul.py"), "--size", "256", "--trials", "4"],
    ["-c", "import pallas_tune, jax; print(jax.devices())"],
    ["-m", "pallas_tune", "show", "--chip", "v6e"],
], ids=["readme-example", "import-then-jax", "cli-show"])
def test_a_user_program_prints_no_libtpu_noise_and_leaves_no_libtpu_files(
        command, no_tpu_host, tmp_path):
    """The README's first command (at a tiny size), a program that imports pallas_tune then
    uses JAX, and ``pallas-tune show`` (which left an ERROR file): nothing of libtpu's on
    stderr or stdout, no file in /tmp/tpu_logs."""
    before = set(glob.glob(os.path.join(LIBTPU_DIR, "*")))
    r = subprocess.run([sys.executable, *command], capture_output=True, text=True, timeout=600,
                       cwd=tmp_path, env=_user_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    printed = [line for line in (r.stdout + r.stderr).splitlines()
               if any(n in line for n in NOISE)]
    assert not printed, "\n".join(printed)
    assert not _libtpu_files_of(before, tmp_path)


def _imported_env(**env):
    """What ``import pallas_tune`` leaves in os.environ (and whether it imported JAX)."""
    code = ("import json, os, sys\nimport pallas_tune\nfrom pallas_tune import chips\n"
            f"print(json.dumps([{{k: os.environ.get(k) for k in {[*OURS, 'JAX_PLATFORMS']!r}}},"
            " chips.LIBTPU_DEFAULTS, 'jax' in sys.modules]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=_user_env(**env))
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_import_sets_only_unset_defaults_and_stays_cheap(no_tpu_host):
    got, defaulted, jax_imported = _imported_env()
    assert got == {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v6e-1",
                   "TPU_MIN_LOG_LEVEL": "3", "JAX_PLATFORMS": None}
    assert defaulted == {k: v for k, v in got.items() if v} and not jax_imported
    # The user's own settings win: theirs kept, and ours not added beside them.
    got, defaulted, _ = _imported_env(TPU_ACCELERATOR_TYPE="v5litepod-4", TPU_MIN_LOG_LEVEL="1")
    assert got == {"TPU_WORKER_HOSTNAMES": None, "TPU_ACCELERATOR_TYPE": "v5litepod-4",
                   "TPU_MIN_LOG_LEVEL": "1", "JAX_PLATFORMS": None} and defaulted == {}
    # A log directory of the user's: libtpu's level is left to them.
    got, defaulted, _ = _imported_env(TPU_LOG_DIR="/nonexistent")
    assert got["TPU_MIN_LOG_LEVEL"] is None and "TPU_MIN_LOG_LEVEL" not in defaulted


def test_a_host_that_may_have_a_tpu_gets_nothing(monkeypatch, tmp_path):
    """TPU device nodes (/dev/accel*: v4, v5p; /dev/vfio/N: v5e, v6e) or a TPU's PCI id: no
    default is set (JAX's own start-up configures libtpu there; JAX_PLATFORMS never)."""
    real_glob, real_listdir = glob.glob, os.listdir
    pci = tmp_path / "0000:00:04.0"
    pci.mkdir()
    (pci / "vendor").write_text("0x1ae0\n")
    (pci / "device").write_text("0x0042\n")  # Google's, but a network card (gVNIC): no TPU.
    nodes = {"accel": [], "vfio": ["vfio"]}

    def fake_glob(pattern, *a, **k):
        if pattern == "/dev/accel*":
            return nodes["accel"]
        if pattern.startswith("/sys/bus/pci/devices/"):
            return [str(pci / "vendor")]
        return real_glob(pattern, *a, **k)

    def fake_listdir(path="."):
        return nodes["vfio"] if path == "/dev/vfio" else real_listdir(path)

    monkeypatch.setattr(glob, "glob", fake_glob)
    monkeypatch.setattr(os, "listdir", fake_listdir)
    for name in OURS:
        monkeypatch.delenv(name, raising=False)
    assert not chips.tpu_devices_here() and chips.quiet_tpu_probe_env()
    for accel, vfio, device in [(["/dev/accel0"], ["vfio"], "0x0042"),
                                ([], ["vfio", "0"], "0x0042"), ([], ["vfio"], "0x006f")]:
        nodes["accel"], nodes["vfio"] = accel, vfio
        (pci / "device").write_text(device + "\n")
        assert chips.tpu_devices_here() and chips.quiet_tpu_probe_env() == {}, (accel, vfio)


def test_our_run_directories_keep_libtpus_own_level(monkeypatch, tmp_path):
    """Where ``import pallas_tune`` lowered libtpu's level, a pallas-tune run directory (the
    CLI's, a worker pool's) sets it back: its logs, within their bound, are as they were; a
    level the user set is theirs."""
    monkeypatch.setenv(logs.ENV, str(tmp_path))
    monkeypatch.setitem(chips.LIBTPU_DEFAULTS, "TPU_MIN_LOG_LEVEL", "3")
    run = logs.RunLogs()
    assert run.env == {"TPU_LOG_DIR": run.path, "TPU_MIN_LOG_LEVEL": "0"}
    run.close()
    monkeypatch.delitem(chips.LIBTPU_DEFAULTS, "TPU_MIN_LOG_LEVEL")
    run = logs.RunLogs()
    assert run.env == {"TPU_LOG_DIR": run.path}
    run.close()
