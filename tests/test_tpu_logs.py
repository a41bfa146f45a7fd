"""libtpu's own logs and a full disk: nothing pallas-tune starts may fill a disk, and a full
disk is one clear error that loses no finished trial."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from pallas_tune.measure import logs
from pallas_tune.measure.pool import Pool

HERE = os.path.dirname(os.path.abspath(__file__))


def _used(path):
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            total += st.st_blocks * 512
    return total


@pytest.fixture
def log_root(tmp_path, monkeypatch):
    root = tmp_path / "tpu-logs"
    monkeypatch.setenv(logs.ENV, str(root))
    return root


def test_off_writes_no_logs_at_all(monkeypatch):
    """Off: FATAL only, into a private scratch directory that close() removes."""
    import tempfile

    monkeypatch.setenv(logs.ENV, "off")
    run = logs.RunLogs()
    scratch = run.env["TPU_LOG_DIR"]
    assert run.env["TPU_MIN_LOG_LEVEL"] == "3" and os.path.isdir(scratch)
    assert os.path.dirname(scratch) == tempfile.gettempdir()
    assert oct(os.stat(scratch).st_mode & 0o777) == "0o700"
    assert run.path is None and run.note() == ""
    run.close()
    assert not os.path.exists(scratch)


@pytest.mark.libtpu
def test_off_leaves_no_glog_files_in_tmp_either(monkeypatch, tmp_path):
    """TPU_LOG_DIR=disabled alone does not stop libtpu's glog: a deviceless compile then wrote
    tpu_driver.*.log.INFO.<date>.<pid> to /tmp (and a profiler abort writes up to 1 GB each);
    with TPU_MIN_LOG_LEVEL=3 too, a profiler abort still left its four FATAL files there. A
    process given the 'off' environment writes none there, an aborting one neither, and what
    the abort wrote goes when the logs are closed."""
    import glob
    import subprocess
    import sys

    monkeypatch.setenv(logs.ENV, "off")
    run = logs.RunLogs()
    env = {**os.environ, **run.env, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    code = ("import os, jax, jax.numpy as jnp\n"
            "from pallas_tune.feasibility.compile import compile_deviceless\n"
            "s = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)\n"
            "r = compile_deviceless(lambda a, b: a @ b, [s, s], {}, chip='tpu_v6e')\n"
            "print(os.getpid(), r.ok, flush=True)\n"
            "import toy_kernels\n"  # A bf16 multiply by a constant: the profiler aborts.
            "x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)\n"
            "compile_deviceless(toy_kernels.scale.fn, [x], dict(factor=1.4427, br=64, bc=256,"
            " buffering=2), chip='tpu_v6e')\n")
    profile = f"--xla_jf_dump_static_llo_profile_to={tmp_path / 'sp'}"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**env, "LIBTPU_INIT_ARGS": profile,
                                            "PYTHONPATH": os.path.dirname(__file__)})
    pid, ok = done.stdout.split()[-2:]
    assert ok == "True" and done.returncode != 0, done.stderr[-2000:]  # Compiled, then aborted.
    assert not glob.glob(f"/tmp/tpu_driver*.{pid}"), "libtpu wrote glog files to /tmp"
    assert glob.glob(os.path.join(run.env["TPU_LOG_DIR"], "*FATAL*")), "no abort seen"
    run.close()
    assert not os.path.exists(run.env["TPU_LOG_DIR"])


def test_a_run_directory_under_the_root_and_a_note_naming_it(log_root):
    run = logs.RunLogs()
    assert run.path.startswith(str(log_root)) and run.env["TPU_LOG_DIR"] == run.path
    assert os.path.isfile(os.path.join(run.path, logs.MARKER))  # Made by us, marked as ours.
    assert run.path in run.note() and "64 MiB" in run.note()
    assert logs.RunLogs().path != run.path
    assert oct(os.stat(log_root).st_mode & 0o777) == "0o700"


def test_a_root_that_is_a_link_or_a_file_gets_no_logs(tmp_path, monkeypatch):
    """Someone else's link planted where the logs would go: libtpu writes none rather than
    follow it (and says so: tests/test_log_ownership.py)."""
    from pallas_tune.errors import PallasTuneWarning

    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    monkeypatch.setenv(logs.ENV, str(tmp_path / "link"))
    with pytest.warns(PallasTuneWarning, match="is a link"):
        run = logs.RunLogs()  # As off: FATAL only, into a scratch directory of ours.
    assert run.path is None and run.env["TPU_MIN_LOG_LEVEL"] == "3"
    assert not run.env["TPU_LOG_DIR"].startswith(str(tmp_path)) and not list(target.iterdir())
    run.close()
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv(logs.ENV, str(tmp_path / "file"))
    with pytest.warns(PallasTuneWarning, match="not a directory"):
        run = logs.RunLogs()
    assert run.path is None
    run.close()


def test_bad_bound_is_a_clear_error(monkeypatch):
    from pallas_tune.errors import PallasTuneError

    monkeypatch.setenv(logs.MB_ENV, "lots")
    with pytest.raises(PallasTuneError, match="PALLAS_TUNE_TPU_LOG_MB"):
        logs.RunLogs()


def test_shrink_cuts_big_files_to_their_head_and_an_appending_writer_goes_on(tmp_path):
    big = tmp_path / "tpu_driver.ERROR.1"
    with open(big, "ab") as f:  # O_APPEND, as glog opens its files.
        f.write(b"head\n" + b"x" * 3_000_000)
        f.flush()
        assert logs.shrink(str(tmp_path), 1_000_000) <= 1_000_000
        f.write(b"after\n")
    data = big.read_bytes()
    assert data.startswith(b"head\n") and data.endswith(b"after\n")
    assert len(data) == 1_000_000 // 8 + len(b"after\n")  # No hole where the rest was.


def test_shrink_removes_the_oldest_files_when_cutting_is_not_enough(tmp_path):
    for i in range(40):
        p = tmp_path / f"log.{i}"
        p.write_bytes(b"y" * 100_000)
        os.utime(p, (1000 + i, 1000 + i))
    assert logs.shrink(str(tmp_path), 1_000_000) <= 1_000_000
    left = sorted(os.listdir(tmp_path), key=lambda n: int(n.split(".")[1]))
    assert left and left[-1] == "log.39" and "log.0" not in left


def _run_dir(root, name):
    """A run directory as pallas-tune makes it (with its marker), renamed to ``name``."""
    path, problem = logs._make_run(str(root))
    assert problem is None, problem
    os.rename(path, root / name)
    return root / name


def test_dead_runs_are_pruned_past_four_bounds_live_ones_kept(log_root, monkeypatch):
    monkeypatch.setenv(logs.MB_ENV, "1")
    log_root.mkdir(mode=0o700)
    dead = [_run_dir(log_root, f"20200101-00000{i}-999999999-1") for i in range(6)]
    live = _run_dir(log_root, f"20200101-000000-{os.getpid()}-99")
    for i, d in enumerate([*dead, live]):
        (d / "INFO").write_bytes(b"z" * 2**20)
        os.utime(d, (1000 + i, 1000 + i))
    logs.RunLogs()
    left = set(os.listdir(log_root))
    assert live.name in left and dead[-1].name in left and dead[0].name not in left
    assert _used(log_root) <= 5 * 2**20


def test_cut_output_keeps_what_comes_next(tmp_path):
    f = open(tmp_path / "out", "ab+")  # noqa: SIM115
    f.write(b"a" * 5000)
    f.flush()
    logs.cut_output(f.fileno(), 4096)
    f.write(b"the tail\n")
    f.flush()
    f.seek(0)
    assert f.read() == b"[pallas-tune: earlier worker output dropped]\nthe tail\n"
    f.close()


def test_a_flooding_worker_stays_within_the_bound_and_its_crash_names_the_logs(
        log_root, monkeypatch, tmp_path):
    """A worker writing 40 MB of libtpu-style logs and 40 MB to stderr before it aborts (as
    libtpu's profiler does, per candidate): the pool keeps both within their bounds while it
    runs, and the crash says where the logs are."""
    monkeypatch.setenv(logs.MB_ENV, "4")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # Where the worker's captured output goes.
    with Pool("toy_kernels:ToySession", ("f",), limits={"compile": 120}) as pool:
        pool.start()
        reply = pool.call("flood", 40, 4.0, phase="compile")
        assert reply.kind == "crashed"
        assert f"libtpu's logs: {pool.logs.path}" in reply.message
        assert "LLO_CHECK failure (the last line)" in reply.message
        assert _used(pool.logs.path) <= 4 * 2**20 + 2**20
        assert _used(tmp_path) - _used(log_root) < 3 * 8 * 2**20


@pytest.mark.libtpu
@pytest.mark.slow
def test_a_tpu_estimate_tune_of_a_kernel_that_trips_the_profiler_bounds_its_logs(
        log_root, monkeypatch, cache_dir):
    """The real thing: a bf16 multiply by a constant makes libtpu 0.0.50's static profiler
    abort on v6e (LLO_CHECK ... Expected vector-bf16packed, got vector-int32), writing ~10 MB
    of logs per candidate. Every candidate fails; the logs stay in our directory, within the
    bound, and the failure says where they are."""
    pytest.importorskip("libtpu")
    import jax.numpy as jnp
    import toy_kernels

    from pallas_tune.errors import PallasTuneError

    monkeypatch.setenv(logs.MB_ENV, "2")
    x = jnp.ones((256, 256), jnp.bfloat16)
    with pytest.raises(PallasTuneError) as err:
        toy_kernels.scale.tune(x, factor=1.4427, timer="tpu-estimate", chip="v6e", trials=4,
                               write=False, transfer=False, workers=1)
    assert "libtpu's logs: " + str(log_root) in str(err.value), str(err.value)[:3000]
    runs = os.listdir(log_root)
    assert runs and _used(log_root) <= 2 * 2**20 + 2**20
    assert any(f.startswith("tpu_driver") for r in runs for f in os.listdir(log_root / r))


def test_a_worker_imports_a_module_the_parent_took_from_a_path_dir(tmp_path):
    """`--path DIR` is never put on sys.path (it must not shadow dependencies); the workers
    still find a kernel module the parent imported from DIR, and only those modules."""
    import importlib.util

    (tmp_path / "offpath_session.py").write_text(
        "import os\nclass S:\n    def __init__(self):\n        pass\n"
        "    def info(self, channel=None):\n        return {'pid': os.getpid()}\n")
    (tmp_path / "json.py").write_text("raise SystemExit('shadowed')\n")
    spec = importlib.util.spec_from_file_location("offpath_session",
                                                  tmp_path / "offpath_session.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["offpath_session"] = module
    try:
        spec.loader.exec_module(module)
        with Pool("offpath_session:S", ()) as pool:
            assert pool.start()["pid"] != os.getpid()
    finally:
        del sys.modules["offpath_session"]
