"""Paths the command line is given are as hostile-proof as the cache (issue 38).

1. ``--space NAME``: a bare name is a shipped space only, never a file of that name in the
   current directory (whose ``kernel=`` would be imported); a file is given as a path.
2. ``--path DIR``: a module there never replaces the standard library, a dependency or an
   installed package (warned, naming the file), and a kernel module raising ``SystemExit`` at
   import is a kernel that could not be loaded (a problem), not the command's exit.
3. A FIFO nobody writes to, given to ``--shapes @FILE``, ``--from-record`` or ``--space``, is
   refused after a bounded wait instead of blocking forever; pipes with a writer still work.
4. ``check DIR`` looks at the cache layout only (``DIR/*.json``, ``DIR/<chip>/*.json``) and stops
   after a bounded number of directory entries: ``check /`` does not walk the disk.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from unittest import mock

import pytest
from conftest import TESTS_DIR, subprocess_env

from pallas_tune import _bounded

_ZEN = "Beautiful is better than ugly"


def _cli(args, cache_dir, *, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pallas_tune", *args], capture_output=True,
                          check=False,
                          text=True, timeout=timeout, cwd=cwd,
                          env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir))


def _main(capsys, *args):
    from pallas_tune.cli import main

    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _winners(path, kernel, entries, *, chip="cpu"):
    head = json.dumps({"schema": 2, "kernel": kernel, "chip": chip})
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head[:-1] + ', "entries": {\n' + ",\n".join(lines) + "\n}}\n")


class _Tuned:
    """Stands in for tuning a kernel in ``sweep``: records which kernel got that far."""

    def __init__(self):
        self.kernels = []

    def __call__(self, args, kernel, chip, calls):
        self.kernels.append(kernel.name)
        return 0


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """An importable module ``space_marker_mod`` whose import leaves a marker file."""
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "imported"
    (site / "space_marker_mod.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nk = None\n")
    monkeypatch.syspath_prepend(str(site))
    yield marker
    sys.modules.pop("space_marker_mod", None)


# ---- 1. --space NAME is a shipped space, never a file here ------------------------------------

def test_check_space_name_never_reads_a_file_of_that_name_here(tmp_path, cache_dir):
    """The issue's case: CI runs `check caches --space llama3_matmul` where a file of that name
    lies; its kernel= (the Zen of Python's module) must not be imported: the shipped set is
    checked."""
    (tmp_path / "llama3_matmul").write_text('kernel = "this:x"\n[params]\nbm = [8]\n'
                                            '[[shapes]]\nx = "8x128:float32"\n')
    (tmp_path / "caches").mkdir()
    r = _cli(["check", "caches", "--space", "llama3_matmul", "--chip", "v6e"], cache_dir,
             cwd=tmp_path)
    assert _ZEN not in r.stdout + r.stderr
    assert "coverage: llama3_matmul (pallas_tune.kernels.matmul.matmul)" in r.stdout, (
        r.stdout[-2000:] + r.stderr[-2000:])
    assert r.returncode == 1  # The empty cache has no entry for the set's shapes.


def test_sweep_space_name_never_reads_a_file_of_that_name_here(tmp_path, cache_dir, capsys,
                                                               monkeypatch, marker_module):
    (tmp_path / "matmul").write_text('kernel = "space_marker_mod:k"\n[params]\nbm = [8]\n'
                                     '[[shapes]]\nx = "8x128:float32"\n')
    monkeypatch.chdir(tmp_path)
    with mock.patch("pallas_tune.cli.sweep._sweep_kernel", _Tuned()) as tuned:
        rc, _, err = _main(capsys, "sweep", "--space", "matmul", "--no-storage")
    assert not marker_module.exists()
    assert rc == 0 and tuned.kernels == ["pallas_tune.kernels.matmul.matmul"], err


def test_an_unknown_space_name_lists_the_known_ones_and_how_to_give_a_file(
        tmp_path, cache_dir, capsys, monkeypatch, marker_module):
    (tmp_path / "mine").write_text('kernel = "space_marker_mod:k"\n[params]\nbm = [8]\n'
                                   '[[shapes]]\nx = "8x128:float32"\n')
    monkeypatch.chdir(tmp_path)
    cache_dir.mkdir()
    for argv in (["check", str(cache_dir), "--space", "mine", "--chip", "v6e"],
                 ["sweep", "--space", "mine", "--no-storage"]):
        rc, out, err = _main(capsys, *argv)
        assert rc == 2, out + err
        assert "llama3_matmul" in err and "matmul" in err  # The known names.
        assert "./mine" in err, err  # How to use the file lying here.
        assert not marker_module.exists()


@pytest.mark.parametrize("form", ["./myspace", "myspace.toml", "sub/myspace.toml", "abs"])
def test_a_space_given_as_a_path_is_read(tmp_path, cache_dir, capsys, monkeypatch, form):
    text = ('kernel = "toy_kernels:scale"\n[params]\nbr = [8]\nbc = [128]\nbuffering = [1]\n'
            '[[shapes]]\nx = "64x256:float32"\n')
    name = str(tmp_path / "abs.toml") if form == "abs" else form
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    monkeypatch.chdir(tmp_path)
    with mock.patch("pallas_tune.cli.sweep._sweep_kernel", _Tuned()) as tuned:
        rc, _, err = _main(capsys, "sweep", "--space", name, "--no-storage")
    assert rc == 0 and tuned.kernels == ["toy_kernels.scale"], err


def test_load_space_bare_names_are_shipped_spaces_only(tmp_path, monkeypatch):
    """The one place that decides (``@tunable(space="matmul")`` included): a bare name is
    never a file in the current directory."""
    from pallas_tune.errors import SearchSpaceError
    from pallas_tune.space import _spaces_dir, load_space

    (tmp_path / "matmul").write_text('kernel = "this:x"\n[params]\nbm = [1]\n')
    (tmp_path / "matmul.toml").write_text('[params]\nbm = [1]\n')
    monkeypatch.chdir(tmp_path)
    shipped = load_space("matmul")
    assert shipped["path"] == os.path.join(_spaces_dir(), "matmul.toml")
    assert shipped["kernel"] == "pallas_tune.kernels.matmul:matmul"
    assert load_space("./matmul")["kernel"] == "this:x"  # A path: the user's own file.
    assert load_space("matmul.toml")["space"].names == ("bm",)
    with pytest.raises(SearchSpaceError, match=r"\./nosuch"):
        load_space("nosuch")
    with pytest.raises(SearchSpaceError, match="no search-space file"):
        load_space("./nosuch")


# ---- 2. --path DIR never shadows a dependency; a module's SystemExit is its failure ----------

_KERNEL_MOD = ("import pallas_tune as pt\n"
               "@pt.tunable(b=[1, 2], name={name!r})\n"
               "def k(x, *, b):\n    return x\n")


def test_path_dir_modules_never_replace_dependencies(tmp_path, cache_dir):
    d = tmp_path / "dir"
    d.mkdir()
    for mod in ("jax", "numpy", "optuna", "json"):
        (d / f"{mod}.py").write_text(f"open({str(tmp_path / ('ran_' + mod))!r}, 'w').write('x')"
                                     "\nraise SystemExit(0)\n")
    (d / "mykern.py").write_text(_KERNEL_MOD.format(name="mykern.k"))
    root = tmp_path / "root"
    _winners(root / "cpu" / "mykern.k.json", "mykern.k",
             {"x=8:float32": {"config": {"b": 3}, "median_ms": 1.0}})
    r = _cli(["check", str(root), "--path", str(d)], cache_dir, cwd=tmp_path)
    assert not list(tmp_path.glob("ran_*")), r.stderr[-2000:]
    assert r.returncode == 1 and "b=3 is not one of the declared choices" in r.stdout, (
        r.stdout[-2000:] + r.stderr[-2000:])
    assert str(d / "jax.py") in r.stderr and str(d / "numpy.py") in r.stderr, r.stderr[-2000:]
    # show reads the shipped caches too, whose adapters are named jax.ops.gpu.*.
    r = _cli(["show", "--path", str(d)], root, cwd=tmp_path)
    assert not list(tmp_path.glob("ran_*")), r.stderr[-2000:]
    assert r.returncode == 0 and "mykern.k" in r.stdout and "jax.ops.gpu.softmax" in r.stdout, (
        r.stdout[-2000:] + r.stderr[-2000:])


def test_a_kernel_module_exiting_at_import_is_a_problem(tmp_path, cache_dir, capsys):
    d = tmp_path / "dir"
    d.mkdir()
    (d / "exits_mod.py").write_text("raise SystemExit(0)\n")
    (d / "odd_mod.py").write_text("class Odd(BaseException):\n    pass\nraise Odd('odd')\n")
    root = tmp_path / "root"
    for name in ("exits_mod.k", "odd_mod.k"):
        _winners(root / "cpu" / f"{name}.json", name,
                 {"x=8:float32": {"config": {"b": 1}, "median_ms": 1.0}})
    rc, out, err = _main(capsys, "check", root, "--path", d)
    assert rc == 1, out + err  # Files it could not check against their kernel.
    assert "exits_mod.k" in out and "SystemExit" in out, out
    assert "odd_mod.k" in out and "Odd" in out, out
    rc, out, err = _main(capsys, "check", root, "--path", d, "--import", "exits_mod")
    assert rc == 2 and "--import exits_mod" in err and "SystemExit" in err, out + err
    rc, out, err = _main(capsys, "sweep", "exits_mod:k", "--path", d, "--shapes", "x=8:float32",
                         "--no-storage")
    assert rc == 2 and "SystemExit" in err, out + err
    rc, out, err = _main(capsys, "show", "--path", d)
    assert rc == 0 and "SystemExit" not in err  # Nothing in the user cache names it.


# ---- 3. a FIFO with no writer does not block forever -----------------------------------------

@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
@pytest.mark.parametrize("flag", ["--shapes", "--from-record", "--space"])
def test_a_fifo_with_no_writer_is_refused_after_a_bounded_wait(tmp_path, cache_dir, flag):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    args = {"--shapes": ["sweep", "toy_kernels:scale", "--shapes", f"@{fifo}"],
            "--from-record": ["sweep", "--from-record", str(fifo)],
            "--space": ["sweep", "--space", str(fifo)]}[flag]
    t0 = time.monotonic()
    r = _cli([*args, "--no-storage"], cache_dir, timeout=90)  # Hung: TimeoutExpired, a failure.
    assert time.monotonic() - t0 < 60
    assert r.returncode == 2, r.stderr[-2000:]
    assert str(fifo) in r.stderr and "FIFO with no writer" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_pipe_with_a_writer_is_read(tmp_path):
    """Process substitution (``<(cmd)``: /dev/fd/N) and a named FIFO whose writer comes, late
    or slow, are read whole."""
    r, w = os.pipe()
    os.write(w, b"x=8:float32\n")
    os.close(w)
    try:
        assert _bounded.read_path(f"/dev/fd/{r}", 1 << 20, what="shapes file") == b"x=8:float32\n"
    finally:
        os.close(r)
    if not hasattr(os, "mkfifo"):
        return
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)

    def write(delay_open, delay_write):
        time.sleep(delay_open)
        with open(fifo, "wb") as f:
            time.sleep(delay_write)
            f.write(b"late\n")

    for delays in ((0.5, 0.0), (0.0, 0.5)):  # A writer that opens late, one that writes late.
        t = threading.Thread(target=write, args=delays, daemon=True)
        t.start()
        assert _bounded.read_path(str(fifo), 1 << 20, what="shapes file") == b"late\n"
        t.join(10)


# ---- 4. check DIR looks at the cache layout only, and not forever -----------------------------

_GOOD = {"x=64x256:float32,factor=2.0": {"config": {"br": 8, "bc": 128, "buffering": 1},
                                         "median_ms": 1.0}}


def test_check_looks_at_the_cache_layout_only(tmp_path, cache_dir, capsys):
    root = tmp_path / "root"
    _winners(root / "cpu" / "toy_kernels.scale.json", "toy_kernels.scale", _GOOD)
    # Deeper than a cache root's chip directory: not a cache file, not looked at.
    _winners(root / "cpu" / "a" / "b" / "toy_kernels.scale.json", "toy_kernels.scale",
             {"k": {"config": 1}})
    deep = root / "x"
    for i in range(60):
        deep = deep / f"d{i}"
    _winners(deep / "cpu" / "toy_kernels.scale.json", "toy_kernels.scale", {"k": {"config": 1}})
    os.symlink(root, root / "loop")  # A directory link back to the root.
    os.symlink(root / "cpu", root / "cpu" / "loop")
    t0 = time.monotonic()
    rc, out, err = _main(capsys, "check", root, "--import", "toy_kernels")
    assert time.monotonic() - t0 < 60
    assert rc == 0 and "1 file(s), 1 entries" in out and ": OK" in out, out + err
    rc, out, err = _main(capsys, "check", root / "x", "--no-kernels")
    assert rc == 1 and "no cache files" in err and "<chip>" in err, out + err


def test_check_stops_after_a_bounded_number_of_entries(tmp_path, cache_dir, capsys):
    from pallas_tune.cli.check import MAX_ENTRIES

    root = tmp_path / "root"
    _winners(root / "cpu" / "toy_kernels.scale.json", "toy_kernels.scale", _GOOD)
    big = root / "notes"
    big.mkdir()
    for i in range(MAX_ENTRIES + 1):
        (big / f"n{i}").touch()
    rc, out, err = _main(capsys, "check", root, "--no-kernels")
    assert rc == 2 and f"{MAX_ENTRIES:,}" in err and str(root) in err, out + err
    assert "problem" not in out  # Stopped before checking anything, saying why.


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a whole file system")
def test_check_of_the_root_directory_ends_soon(tmp_path, cache_dir):
    t0 = time.monotonic()
    r = _cli(["check", "/", "--no-kernels"], cache_dir, cwd=TESTS_DIR, timeout=120)
    assert time.monotonic() - t0 < 90
    assert r.returncode in (1, 2) and "Traceback" not in r.stderr, r.stderr[-2000:]
    # Only / and its directories are looked in (/*.json, /<chip>/*.json), nothing deeper.
    checked = re.findall(r"^(?:problem|note): (/[^:]*):", r.stdout, re.MULTILINE)
    assert all(p.count("/") <= 2 for p in checked), [p for p in checked if p.count("/") > 2][:5]
    assert "file(s)" in r.stdout or "no cache files under /" in r.stderr or (
        "entries" in r.stderr), r.stdout[-2000:] + r.stderr[-2000:]
