"""Kernel fingerprints: a cache entry records the version of the kernel's code it was tuned on;
dispatch warns (once) when it serves an entry tuned on other code, a sweep re-tunes such
entries in a study of their own, ``show``/``check`` say current, stale or unknown, and a
malformed recorded value is hostile input (a warning, never a crash, never a changed file)."""

from __future__ import annotations

import importlib
import json
import re
import sys
import textwrap
import warnings

import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune import _kernel_hash

SHAPES = "x=64x256:float32"
KEY = "x=64x256:float32,factor=2.0"
OTHER = "0123456789abcdef"  # A well-formed fingerprint of no code here.

_MODULE = '''
"""Module docstring, version {doc}."""
import pallas_tune as pt

# {comment}


def _kernel(x, *, b):
    """Helper docstring {doc}."""
    return x * {factor}  # {comment}


@pt.tunable(b=[1, 2]{extra})
def kern(x, *, b):
    """Kernel docstring {doc}."""
    {body}
'''


def _load(tmp_path, monkeypatch, name, *, doc="one", comment="c", factor=2, extra="",
          body="return _kernel(x, b=b)"):
    (tmp_path / f"{name}.py").write_text(_MODULE.format(doc=doc, comment=comment, factor=factor,
                                                        extra=extra, body=body))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name).kern


def _warnings(record, pattern):
    return [str(w.message) for w in record if issubclass(w.category, pt.PallasTuneWarning)
            and re.search(pattern, str(w.message))]


# ---- the fingerprint -----------------------------------------------------------------------

def test_comments_docstrings_and_layout_do_not_count_code_does(tmp_path, monkeypatch):
    base = _load(tmp_path, monkeypatch, "fp_base")
    reworded = _load(tmp_path, monkeypatch, "fp_reworded", doc="two, longer\n\n  and more",
                     comment="another comment entirely",
                     body="return _kernel(\n        x,\n        b=b,\n    )")
    helper = _load(tmp_path, monkeypatch, "fp_helper", factor=3)  # _kernel's code changed.
    space = _load(tmp_path, monkeypatch, "fp_space", extra=", default={'b': 1}")
    assert re.fullmatch(r"[0-9a-f]{16}", base.fingerprint)
    assert reworded.fingerprint == base.fingerprint
    assert helper.fingerprint != base.fingerprint
    assert space.fingerprint not in (base.fingerprint, helper.fingerprint)
    with open(tmp_path / "fp_base.py", encoding="utf-8") as f:
        assert base.fingerprint == _kernel_hash.source_fingerprint(f.read())


_STANDIN = '''
import pallas_tune as pt
from m_estimate import shrink


def _cut(n):
    return max(1, n // {cut})


def _standin(args, kwargs, config):
    return [shrink(args[0], _cut(args[0].shape[0]))], kwargs, {scale}


def _shared(x):
    return x * {shared}


@pt.tunable(b=[1], standin=_standin)
def kern(x, *, b):
    return _shared(x) + {body}
'''


def test_the_standin_is_not_part_of_the_fingerprint_what_the_kernel_runs_is():
    """A stand-in decides how an estimate is made (each entry records it), not the program:
    editing it, or the helpers only it reaches, or its imports, stales nothing; the kernel's
    own code, and a helper the kernel also calls, still count (scheme 2). Scheme 1, which
    entries recorded before, counted the stand-in."""
    def fp(scheme=2, **kw):
        src = _STANDIN.format(**{"cut": 2, "scale": 2.0, "shared": 1, "body": 0, **kw})
        return _kernel_hash.source_fingerprint(src, scheme)

    base = fp()
    assert fp(cut=4, scale=4.0) == base
    assert fp(body=1) != base and fp(shared=2) != base
    plain = _STANDIN.format(cut=2, scale=2.0, shared=1, body=0)
    plain = plain.replace(", standin=_standin", "").replace("from m_estimate import shrink\n", "")
    plain = plain[:plain.index("def _cut")] + plain[plain.index("def _shared"):]
    assert _kernel_hash.source_fingerprint(plain) == base  # Adding a stand-in: no change.
    assert fp(1, cut=4) != fp(1)  # The earlier scheme saw the stand-in.


def test_entries_recorded_under_the_earlier_scheme_stay_current(tmp_path, monkeypatch):
    """Every cache written before scheme 2 recorded scheme 1's fingerprint: an entry whose
    recorded value is scheme 1's of the code as it is now is current, not stale; scheme 1 of
    other code is stale; ``version=`` kernels have no earlier scheme."""
    standin = ", standin=lambda args, kwargs, config: (args, kwargs, 1.0)"
    kern = _load(tmp_path, monkeypatch, "fp_scheme", extra=standin)
    with open(tmp_path / "fp_scheme.py", encoding="utf-8") as f:
        source = f.read()
    old = _kernel_hash.source_fingerprint(source, 1)
    assert old != kern.fingerprint  # The schemes differ, so the earlier one is not the same.
    assert _kernel_hash.kernel_state(old, kern) == "current"
    assert _kernel_hash.kernel_state(kern.fingerprint, kern) == "current"
    other = _kernel_hash.source_fingerprint(source.replace("x * 2", "x * 3"), 1)
    assert _kernel_hash.kernel_state(other, kern) == "stale"
    assert _kernel_hash.kernel_state(None, kern) == "unknown"
    versioned = _load(tmp_path, monkeypatch, "fp_scheme_v", extra=standin + ', version="1"')
    assert _kernel_hash.kernel_state(old, versioned) == "stale"


def test_version_overrides_the_code_and_is_validated(tmp_path, monkeypatch):
    a = _load(tmp_path, monkeypatch, "fp_va", extra=', version="2"')
    b = _load(tmp_path, monkeypatch, "fp_vb", extra=', version="2"', factor=5)
    c = _load(tmp_path, monkeypatch, "fp_vc", extra=', version="3"')
    code = _load(tmp_path, monkeypatch, "fp_vcode")
    assert a.fingerprint == b.fingerprint == _kernel_hash.version_fingerprint("2")
    assert c.fingerprint != a.fingerprint and code.fingerprint != a.fingerprint
    for bad in ("", "  ", 2):
        with pytest.raises(pt.SearchSpaceError, match="version="):
            pt.tunable(lambda x, *, b: x, b=[1], name="k", version=bad)


def test_unreadable_source_is_unknown(tmp_path, monkeypatch):
    namespace: dict = {"__name__": "toy_kernels"}  # A real module's name, not its code.
    exec(textwrap.dedent("""
        import pallas_tune as pt

        @pt.tunable(b=[1, 2], name="fp.execd")
        def execd(x, *, b):
            return x
    """), namespace)
    assert namespace["execd"].fingerprint is None
    import toy_kernels

    assert toy_kernels.scale.fingerprint is not None  # The module itself is readable.


# ---- dispatch ------------------------------------------------------------------------------

@pytest.fixture
def dk():
    import dispatch_kernels

    k = dispatch_kernels.rowsum
    k._memo.clear()
    k._warned.clear()
    yield dispatch_kernels
    k._memo.clear()
    k._warned.clear()


def _entry(fingerprint):
    prov = {"kind": "measured", "chip": "cpu", "timer": "wallclock"}
    if fingerprint is not _MISSING:
        prov["kernel_fingerprint"] = fingerprint
    return {"config": {"br": 16, "bc": 128}, "median_ms": 1.0, "provenance": prov}


_MISSING = object()


def _resolve(dk, x):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        config = dk.rowsum.config_for(x)
        out = np.asarray(dk.rowsum(x))
    np.testing.assert_allclose(out, np.asarray(dk.rowsum_reference(x)))
    return config, record


def test_a_stale_entry_serves_with_one_warning(cache_dir, dk):
    x = dk.data((16, 384))
    key = dk.rowsum.cache_key(x)
    dk.rowsum.cache.write("cpu", dk.rowsum.name, key, _entry(OTHER))
    config, record = _resolve(dk, x)
    assert config.source == "cache" and dict(config) == {"br": 16, "bc": 128}
    [message] = _warnings(record, "other code of the kernel")
    current = dk.rowsum.fingerprint
    for part in (dk.rowsum.name, key, OTHER, current, "pallas-tune sweep"):
        assert part in message, (part, message)
    dk.rowsum._memo.clear()  # Resolved again (a new process would warn again): not here.
    config, record = _resolve(dk, x)
    assert config.source == "cache" and not _warnings(record, "other code")


@pytest.mark.parametrize("recorded", ["current", None, _MISSING])
def test_current_and_unknown_entries_serve_silently(cache_dir, dk, recorded):
    x = dk.data((16, 384))
    key = dk.rowsum.cache_key(x)
    fp = dk.rowsum.fingerprint if recorded == "current" else recorded
    dk.rowsum._fingerprint = _UNSET()  # Forget it: is it computed only when needed?
    dk.rowsum.cache.write("cpu", dk.rowsum.name, key, _entry(fp))
    config, record = _resolve(dk, x)
    assert config.source == "cache" and not _warnings(record, ".")
    # An entry recording no fingerprint costs no fingerprint (nothing is parsed).
    assert (dk.rowsum._fingerprint is _UNSET()) == (recorded != "current")


def _UNSET():
    return importlib.import_module("pallas_tune.runtime.tunable")._UNSET


@pytest.mark.parametrize("bad", [12345, "xyz", OTHER.upper(), OTHER + "0", ["a"], {"a": 1}])
def test_a_malformed_fingerprint_warns_serves_and_leaves_the_file(cache_dir, dk, bad, capsys):
    x = dk.data((16, 384))
    key = dk.rowsum.cache_key(x)
    path = dk.rowsum.cache.write("cpu", dk.rowsum.name, key, _entry(bad))
    with open(path, "rb") as f:
        before = f.read()
    assert b"kernel_fingerprint" in before
    config, record = _resolve(dk, x)
    assert config.source == "cache"
    [message] = _warnings(record, "kernel_fingerprint")
    assert path in message and key in message and "unknown" in message
    with open(path, "rb") as f:
        assert f.read() == before
    from pallas_tune.cli import main

    assert main(["show", "--format", "json", "--kernel", "tests.rowsum"]) == 0
    shown = json.loads(capsys.readouterr().out)
    [row] = [e for e in shown["entries"] if e["key"] == key]
    assert row["code"] == "unknown"
    assert any("kernel_fingerprint" in p and key in p for p in shown["problems"])
    assert main(["check", str(cache_dir), "--no-kernels"]) == 1  # A damaged file: a problem.
    assert "is not 16 lowercase hex digits" in capsys.readouterr().out
    with open(path, "rb") as f:
        assert f.read() == before


# ---- tuner, sweep, show, check -------------------------------------------------------------

def _sweep(capsys, *extra):
    from pallas_tune.cli import main

    rc = main(["sweep", "toy_kernels:scale", "--shapes", SHAPES, "--trials", "2", "--repeats",
               "1", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    return out.out


def _recorded(cache_dir):
    from pallas_tune.cache import read_file

    return read_file(str(cache_dir / "cpu" / "toy_kernels.scale.json"))["entries"][KEY]


def _study_trials(cache_dir, name):
    import optuna

    storage = f"sqlite:///{cache_dir / '.studies' / 'studies.db'}"
    study = optuna.load_study(study_name=name, storage=storage)
    return [t for t in study.trials if "worker" in t.user_attrs]


def test_sweep_records_skips_current_and_retunes_stale_in_a_new_study(cache_dir, fresh, capsys,
                                                                     monkeypatch):
    from pallas_tune.cli import main
    from pallas_tune.tuning.study import study_name

    kernel = fresh.scale
    current = kernel.fingerprint
    _sweep(capsys)
    entry = _recorded(cache_dir)
    assert entry["provenance"]["kernel_fingerprint"] == current  # In the slim winner...
    ledger = cache_dir / "cpu" / "toy_kernels.scale.trials.jsonl"
    records = [json.loads(line) for line in ledger.read_text().splitlines()]
    assert records[-1]["provenance"]["kernel_fingerprint"] == current  # ...and the ledger.
    assert f"|kernel={current}" in study_name(kernel, "cpu", KEY)
    assert len(_study_trials(cache_dir, study_name(kernel, "cpu", KEY))) == 2

    assert "cached, skipped" in _sweep(capsys)  # Current: done.
    assert main(["show", "--format", "json", "--kernel", "toy_kernels.scale",
                 "--import", "toy_kernels"]) == 0
    [row] = [e for e in json.loads(capsys.readouterr().out)["entries"] if e["key"] == KEY]
    assert row["code"] == "current"

    # The kernel's code changes (as if toy_kernels.py were edited): the entry is stale. (The
    # file itself stays as it is: its on-disk check is test_an_edit_during_tuning_writes_nothing.)
    changed = "fedcba9876543210"
    monkeypatch.setattr(kernel, "_fingerprint", changed)  # Changed under every scheme:
    monkeypatch.setattr(_kernel_hash, "earlier_fingerprints", lambda fn: frozenset())
    monkeypatch.setattr("pallas_tune.tuning.finish.source_changed", lambda fn, fp: None)
    assert main(["show", "--format", "json", "--kernel", "toy_kernels.scale",
                 "--import", "toy_kernels"]) == 0
    [row] = [e for e in json.loads(capsys.readouterr().out)["entries"] if e["key"] == KEY]
    assert row["code"] == "stale"
    assert main(["check", str(cache_dir), "--import", "toy_kernels"]) == 0
    out = capsys.readouterr().out
    assert f"stale: tuned on kernel {current}, now {changed}" in out and "(kernel code: 1 stale)" in out
    assert main(["check", str(cache_dir), "--import", "toy_kernels", "--fail-stale"]) == 1
    capsys.readouterr()

    out = _sweep(capsys)
    assert f"{KEY}: stale: tuned on kernel {current}, now {changed}; re-tuning" in out
    assert "cached, skipped" not in out
    assert _recorded(cache_dir)["provenance"]["kernel_fingerprint"] == changed
    # Measured anew in a study of its own, not told the old code's values again.
    assert len(_study_trials(cache_dir, study_name(kernel, "cpu", KEY))) == 2
    assert len(_study_trials(cache_dir, f"toy_kernels.scale|cpu|{KEY}|kernel={current}")) == 2
    assert "cached, skipped" in _sweep(capsys)  # Current again.


def test_sweep_keeps_entries_of_unknown_code_as_done(cache_dir, fresh, capsys):
    from pallas_tune.cli import main

    fresh.scale.cache.write("cpu", fresh.scale.name, KEY, {
        "config": {"br": 8, "bc": 128, "buffering": 1}, "median_ms": 1.0,
        "provenance": {"kind": "measured", "chip": "cpu"}})  # Written before fingerprints.
    assert "cached, skipped" in _sweep(capsys, "--no-storage")
    assert main(["show", "--format", "json", "--kernel", "toy_kernels.scale",
                 "--import", "toy_kernels"]) == 0
    [row] = [e for e in json.loads(capsys.readouterr().out)["entries"] if e["key"] == KEY]
    assert row["code"] == "unknown"
    assert main(["check", str(cache_dir), "--import", "toy_kernels"]) == 0
    assert "(kernel code: 1 unknown)" in capsys.readouterr().out


def test_an_edit_during_tuning_writes_nothing(tmp_path, monkeypatch, cache_dir, capsys):
    """Workers import the kernel's module afresh: a file saved while a shape is being tuned
    splits its trials between two versions, so that shape fails and no entry is written."""
    from pallas_tune.cli import main

    kern = _load(tmp_path, monkeypatch, "fp_edited")
    before = kern.fingerprint  # The code the sweep starts on...
    (tmp_path / "fp_edited.py").write_text(_MODULE.format(  # ...then the file is saved anew.
        doc="one", comment="c", factor=3, extra="", body="return _kernel(x, b=b)"))
    assert _kernel_hash.source_changed(kern.fn, before) == str(tmp_path / "fp_edited.py")
    rc = main(["sweep", "fp_edited:kern", "--path", str(tmp_path), "--shapes", SHAPES,
               "--trials", "2", "--repeats", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and "fp_edited.py changed while" in err and "Nothing was written" in err
    assert not list(cache_dir.rglob("fp_edited*.json"))
    # A comment-only save is no change of code: nothing to refuse.
    (tmp_path / "fp_edited.py").write_text(_MODULE.format(
        doc="two", comment="other", factor=2, extra="", body="return _kernel(x, b=b)"))
    assert _kernel_hash.source_changed(kern.fn, before) is None

