"""A cache or record file may name a kernel; only the user decides to import its module (issue 25,
item 1). ``check`` and ``show`` import the shipped kernels, the modules named with ``--import``,
modules found under ``--path`` and entry points a package declares, nothing else; ``sweep
--from-record`` skips records of other kernels. A file naming a module never runs it.
"""

from __future__ import annotations

import json
import sys

import pytest

import pallas_tune as pt

_EVIL = '''\
import pathlib
pathlib.Path({marker!r}).write_text("imported")
'''


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """An installed-looking module whose import leaves a marker file: what a file must not run."""
    mods = tmp_path / "site"
    mods.mkdir()
    marker = tmp_path / "ran"
    (mods / "evil_mod.py").write_text(_EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(mods))
    yield marker
    sys.modules.pop("evil_mod", None)


def _winners(path, kernel, entries, *, chip="cpu", kind="measured"):
    head = json.dumps({"schema": 2, "kernel": kernel, "chip": chip, "kind": kind})
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head[:-1] + ', "entries": {\n' + ",\n".join(lines) + "\n}}\n")


def _main(capsys, *args):
    from pallas_tune.cli import main

    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


_FP = {"config": {"b": 8}, "median_ms": 1.0,
       "provenance": {"kernel_fingerprint": "0123456789abcdef"}}


def test_check_does_not_import_a_module_a_file_names_and_fails(cache_dir, tmp_path, evil,
                                                               capsys):
    root = tmp_path / "caches"
    _winners(root / "cpu" / "evil_mod.k.json", "evil_mod.k", {"x=8:float32": _FP})
    rc, out, err = _main(capsys, "check", str(root))
    assert not evil.exists() and "evil_mod" not in sys.modules
    assert rc == 1, out + err  # A file it could not check is never OK.
    assert "evil_mod.k" in out and "--import evil_mod" in out, out
    # --no-kernels asks for the file format only: checked as asked, no import either.
    rc, out, err = _main(capsys, "check", str(root), "--no-kernels")
    assert rc == 0 and not evil.exists(), out + err


def test_show_does_not_import_a_module_a_file_names(cache_dir, evil, capsys):
    _winners(cache_dir / "cpu" / "evil_mod.k.json", "evil_mod.k", {"x=8:float32": _FP})
    rc, out, err = _main(capsys, "show", "--kernel", "evil_mod")
    assert rc == 0, err
    assert not evil.exists() and "evil_mod" not in sys.modules
    assert "x=8:float32" in out and "--import evil_mod" in out, out


def test_import_flag_and_path_let_check_import_what_the_user_names(cache_dir, tmp_path,
                                                                  capsys):
    """--import MODULE (any installed module) and --path DIR (modules found there) are the
    user's decision; the kernel is then checked against its space."""
    root = tmp_path / "caches"
    good = {"x=64x256:float32,factor=2.0": {"config": {"br": 8, "bc": 128, "buffering": 1},
                                            "median_ms": 1.0}}
    _winners(root / "cpu" / "toy_kernels.scale.json", "toy_kernels.scale", good)
    rc, out, _ = _main(capsys, "check", str(root))
    assert rc == 1 and "--import toy_kernels" in out, out
    rc, out, _ = _main(capsys, "check", str(root), "--import", "toy_kernels")
    assert rc == 0 and ": OK" in out, out
    from conftest import TESTS_DIR

    rc, out, _ = _main(capsys, "check", str(root), "--path", TESTS_DIR)
    assert rc == 0 and ": OK" in out, out
    rc, _, err = _main(capsys, "check", str(root), "--import", "no_such_module_here")
    assert rc == 2 and "--import no_such_module_here" in err, err


def test_shipped_kernels_need_no_flag(cache_dir, capsys):
    from pallas_tune.cli.registry import KernelRegistry

    registry = KernelRegistry()
    kernel, why = registry.find("pallas_tune.kernels.rms_norm.rms_norm")
    assert why is None and isinstance(kernel, pt.TunableKernel)
    kernel, why = registry.find("jax.ops.gpu.softmax")  # An adapter's registered name.
    assert why is None and kernel.name == "jax.ops.gpu.softmax"
    kernel, why = registry.find("pallas_tune.kernels.__main__.x")
    assert kernel is None and "--import" in why


def test_sweep_from_record_skips_kernels_it_may_not_import(cache_dir, tmp_path, evil, capsys):
    record = tmp_path / "misses.jsonl"
    record.write_text(
        json.dumps({"ref": "evil_mod:k", "shapes": "x=8x128:float32"}) + "\n"
        + json.dumps({"ref": "toy_kernels:scale", "shapes": "x=64x256:float32"}) + "\n")
    rc, out, err = _main(capsys, "sweep", "--from-record", str(record), "--import",
                         "toy_kernels", "--trials", "2", "--repeats", "1", "-q",
                         "--no-storage")
    assert not evil.exists() and "evil_mod" not in sys.modules
    assert "evil_mod:k" in err and "--import evil_mod" in err, err
    assert rc == 1, out + err  # Not everything recorded was tuned.
    from pallas_tune.cache import read_file

    tuned = read_file(str(cache_dir / "cpu" / "toy_kernels.scale.json"))["entries"]
    assert set(tuned) == {"x=64x256:float32,factor=2.0"}


def test_entry_points_declare_kernels(cache_dir, tmp_path, monkeypatch, capsys):
    """A package may declare its kernels (group ``pallas_tune.kernels``, name: the kernel's
    name); check then imports that one entry point, nothing else."""
    site = tmp_path / "site"
    dist = site / "ep_pkg-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pallas_tune.kernels]\nep.scale = ep_mod:scale\n")
    (site / "ep_mod.py").write_text(
        "import pallas_tune as pt\nfrom toy_kernels import scale as _s\n"
        "scale = pt.tunable(br=[8, 16], bc=[128], buffering=[1], name='ep.scale')(_s.fn)\n")
    root = tmp_path / "caches"
    _winners(root / "cpu" / "ep.scale.json", "ep.scale",
             {"x=64x256:float32,factor=2.0": {"config": {"br": 64, "bc": 128, "buffering": 1}}})
    rc, out, _ = _main(capsys, "check", str(root))
    assert rc == 1 and "--import" in out and "ep_mod" not in sys.modules, out
    monkeypatch.syspath_prepend(str(site))
    try:
        rc, out, _ = _main(capsys, "check", str(root))
        assert "ep_mod" in sys.modules
        assert rc == 1 and "br=64" in out and "--import" not in out, out  # Checked: outside.
    finally:
        sys.modules.pop("ep_mod", None)
