"""Every directory pallas-tune prunes or removes is one it made (issue 53, items 1 and 8).

``PALLAS_TUNE_TPU_LOGS`` may name a directory that holds the user's own things (``~`` is allowed):
the pruner of libtpu's logs removed every subdirectory not named like a live run's once the
root passed four bounds (a user's ``important/`` went, 3 MB, with ``PALLAS_TUNE_TPU_LOG_MB=1``).
Only run directories pallas-tune made, marked when made, are pruned; never through a link,
never another user's, never a file in the root. A root that cannot hold run directories is
said once, and libtpu's logs stay within the bound (not in libtpu's own fallback in /tmp).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from conftest import subprocess_env
from pallas_tune.errors import PallasTuneWarning
from pallas_tune.measure import logs

OTHER_UID = 65534  # nobody


def _fill(directory, name, mib):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, name), "wb") as f:
        f.write(os.urandom(mib * 2**20))


def _tree(path):
    """{relative path: content} of the files under ``path``, links not followed."""
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, path)] = fh.read()
    return out


def _snapshot(root):
    """What each entry of ``root`` is: a link's target, a folder's files, a file's bytes."""
    out = {}
    for name in os.listdir(root):
        p = os.path.join(root, name)
        if os.path.islink(p):
            out[name] = ("link", os.readlink(p))
        elif os.path.isdir(p):
            out[name] = _tree(p)
        else:
            with open(p, "rb") as f:
                out[name] = f.read()
    return out


def _dead_runs(root, n, mib):
    """``n`` run directories made by pallas-tune in a process that has since exited, each as
    libtpu leaves it: ``mib`` MiB of logs (the child makes the directory itself, as libtpu does
    where pallas-tune leaves that to it)."""
    code = ("import os, sys\nfrom pallas_tune.measure.logs import RunLogs\n"
            f"for _ in range({n}):\n"
            "    r = RunLogs()\n"
            "    os.makedirs(r.path, exist_ok=True)\n"
            "    open(os.path.join(r.path, 'tpu_driver.INFO'), 'wb').write(b'z' * "
            f"{mib} * 2**20)\n"
            "    print(r.path)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=subprocess_env(PALLAS_TUNE_TPU_LOGS=root))
    assert done.returncode == 0, done.stderr[-2000:]
    paths = done.stdout.split()
    for i, p in enumerate(paths):  # Oldest first, all newer than the user's things.
        os.utime(p, (5000 + i, 5000 + i))
    return paths


def test_the_pruner_removes_only_its_own_dead_runs(tmp_path, monkeypatch):
    """The class test: a user folder, a folder named like a run directory without our marker,
    a file in the root, links (named like a run directory too) to a folder outside the root
    with content, and a folder of another user's (as root: chowned; else skipped in part), all
    in the log root, which passes four bounds. All survive with their contents; our own dead
    runs are pruned to the bound, the oldest first."""
    root = tmp_path / "home"
    root.mkdir()
    monkeypatch.setenv(logs.ENV, str(root))
    monkeypatch.setenv(logs.MB_ENV, "1")
    outside = tmp_path / "outside"
    _fill(outside, "precious", 2)
    _fill(root / "important", "data", 3)
    _fill(root / "20200101-000000-999999999-1", "mine", 2)  # Looks like ours, is the user's.
    _fill(root, "notes.bin", 2)
    os.symlink(outside, root / "20200101-000001-999999998-1")
    os.symlink(outside, root / "outside-link")
    others = root / "20200101-000002-999999997-1"
    _fill(others, "theirs", 2)
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if as_root:  # Another user's run directory, marker and all: not ours to remove.
        with open(others / logs.MARKER, "wb") as f:
            f.write(logs._MAGIC + b"\n")
        for p in (others, others / logs.MARKER, others / "theirs"):
            os.chown(p, OTHER_UID, OTHER_UID)
    for entry in root.iterdir():  # The user's things are the oldest in the root.
        os.utime(entry, (1000, 1000), follow_symlinks=False)
    before, before_outside = _snapshot(root), _tree(outside)

    ours = _dead_runs(str(root), 6, 1)
    logs.RunLogs().close()  # Prunes the root past 4 x 1 MiB.

    after = _snapshot(root)
    assert {name: after.get(name) for name in before} == before, sorted(set(before) - set(after))
    assert _tree(outside) == before_outside
    left = [p for p in ours if os.path.exists(p)]
    assert left == ours[-len(left):] and 1 <= len(left) <= 4, left  # Newest kept, in the bound.
    if not as_root:
        pytest.skip("another user's folder needs root to make (os.chown); the rest passed")


def test_a_run_that_wrote_nothing_leaves_nothing(tmp_path, monkeypatch):
    """A run directory is made (and marked) when its run starts; if libtpu wrote nothing in it,
    closing removes it, and a dead run's empty directory goes at the next start. The test suite
    itself left 52 run directories in the temp directory."""
    monkeypatch.setenv(logs.ENV, str(tmp_path))
    run = logs.RunLogs()
    assert os.listdir(run.path) == [logs.MARKER]
    run.close()
    assert os.listdir(tmp_path) == []
    (empty,) = _dead_runs(str(tmp_path), 1, 0)
    os.unlink(os.path.join(empty, "tpu_driver.INFO"))
    logs.RunLogs().close()
    assert os.listdir(tmp_path) == []


def test_shrink_leaves_the_marker_and_follows_no_link(tmp_path):
    """Cutting a run directory to its bound never removes its marker (it would no longer be
    ours) and never cuts a file through a link."""
    run = tmp_path / "20200101-000000-1-1"
    run.mkdir()
    (run / logs.MARKER).write_bytes(logs._MAGIC + b"\n")
    os.utime(run / logs.MARKER, (1, 1))  # The oldest file there.
    _fill(tmp_path, "victim", 1)
    os.symlink(tmp_path / "victim", run / "tpu_driver.INFO")
    for i in range(12):  # Cut to 128 KiB each, 1.5 MiB: the oldest files must go too.
        _fill(run, f"log.{i}", 1)
    assert logs.shrink(str(run), 2**20) <= 2**20
    assert (run / logs.MARKER).exists() and (tmp_path / "victim").stat().st_size == 2**20


@pytest.mark.parametrize("kind", ["file", "link", "other user", "read-only", "no mkdir"])
def test_a_root_that_cannot_hold_logs_is_said_once_and_the_bound_kept(kind, tmp_path,
                                                                      monkeypatch):
    """Item 8: a log root that is a file, a link or another user's directory dropped the logs
    silently; a read-only one sent them to libtpu's own fallback in /tmp, outside the bound.
    Each is said once, naming the problem and the fix, and libtpu is given a scratch directory
    of ours at FATAL only (removed on close), never the root."""
    root = tmp_path / "root"
    if kind == "file":
        root.write_text("x")
    elif kind == "link":
        (tmp_path / "dir").mkdir()
        os.symlink(tmp_path / "dir", root)
    elif kind == "other user":
        if not (hasattr(os, "geteuid") and os.geteuid() == 0):
            pytest.skip("another user's directory needs root to make (os.chown)")
        root.mkdir()
        os.chown(root, OTHER_UID, OTHER_UID)
    elif kind == "read-only":
        root.mkdir(mode=0o500)
        if os.geteuid() == 0:  # Root writes anywhere; a user gets EACCES: as that user sees it.
            real = os.access
            monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if os.fspath(p) == str(
                root) else real(p, m, *a, **k))
    else:  # The directory is fine, but a run directory cannot be made in it (a full disk).
        root.mkdir()
        real_mkdir = os.mkdir

        def mkdir(p, *a, **k):
            if os.path.dirname(os.fspath(p)) == str(root):
                raise OSError(28, "No space left on device")
            return real_mkdir(p, *a, **k)

        monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setenv(logs.ENV, str(root))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        runs = [logs.RunLogs(), logs.RunLogs()]
    said = [str(w.message) for w in seen if issubclass(w.category, PallasTuneWarning)]
    assert len(said) == 1, said
    expected = {"file": "not a directory", "link": "is a link", "other user": "another user",
                "read-only": "cannot write", "no mkdir": "No space left"}[kind]
    assert expected in said[0] and f"{logs.ENV}={root}" in said[0]
    assert f"{logs.ENV}=off" in said[0] and "a directory of yours" in said[0]
    for run in runs:
        scratch = run.env["TPU_LOG_DIR"]
        assert run.path is None and run.env["TPU_MIN_LOG_LEVEL"] == "3"
        assert not scratch.startswith(str(root)) and os.path.basename(scratch).startswith(
            "pallas-tune-nologs-") and os.stat(scratch).st_uid == os.getuid()
        run.close()
        assert not os.path.exists(scratch)
    if kind in ("read-only", "no mkdir"):
        assert os.listdir(root) == []
