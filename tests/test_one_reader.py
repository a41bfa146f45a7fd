"""One reader of winners files, for the runtime and the tools (issue 25, item 3): what ``check``
passes is what a call serves, and what a call refuses ``check`` fails and ``show`` marks.
"""

from __future__ import annotations

import json
import os
import warnings

import dispatch_kernels as dk
import pytest

import pallas_tune as pt
from pallas_tune.cache import TuningCache

KEY = "x=16x384:float32"
X = dk.data((16, 384))
GOOD = {"config": {"br": 8, "bc": 128}, "median_ms": 1.0}


def _text(entries, **header):
    head = json.dumps({"schema": 2, "kernel": dk.rowsum.name, "chip": "cpu",
                       "kind": "measured", **header})
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in entries]
    return head[:-1] + ', "entries": {\n' + ",\n".join(lines) + "\n}}\n"


def _file(root, text, name=None):
    path = root / "cpu" / (name or f"{dk.rowsum.name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _serve(root):
    """(config the call resolves to, the warnings it gave) with ``root`` as the only cache."""
    kernel = dk.rowsum
    kernel._cache, kernel._memo, kernel._warned = TuningCache(str(root), use_shipped=False), {}, set()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            config = kernel.config_for(X)
    finally:
        kernel._cache, kernel._memo, kernel._warned = None, {}, set()
    return config, [str(w.message) for w in record if issubclass(w.category, pt.PallasTuneWarning)]


def _check(capsys, root, *extra):
    from pallas_tune.cli import main

    rc = main(["check", str(root), "--import", "dispatch_kernels", *extra])
    return rc, capsys.readouterr().out


def _show(capsys, cache_dir):
    from pallas_tune.cli import main

    assert main(["show", "--format", "json", "--kernel", dk.rowsum.name, "--import",
                 "dispatch_kernels"]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_entry_after_the_closing_brace_is_ignored_by_the_call_and_the_tools(
        cache_dir, capsys):
    before = _text([(KEY, GOOD)])
    path = _file(cache_dir, before + f'{json.dumps(KEY)}: {json.dumps({"config": {"br": 16, "bc": 128}})}\n')
    config, messages = _serve(cache_dir)
    assert config.source == "cache" and dict(config) == GOOD["config"]  # Not the trailing one.
    assert any(str(path) in m and "follows the closing" in m for m in messages), messages
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and "follows the closing" in out, out
    shown = _show(capsys, cache_dir)
    assert [e["best config"] for e in shown["entries"] if e["key"] == KEY] == ["br=8 bc=128"]


def test_a_header_kind_other_than_the_name_is_refused_by_the_call_and_check(cache_dir, capsys):
    path = _file(cache_dir, _text([(KEY, GOOD)], kind="estimate"))  # Named as measured.
    config, messages = _serve(cache_dir)
    assert config.source != "cache"
    assert any(str(path) in m and "estimate" in m for m in messages), messages
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and "estimate" in out and "problem:" in out, out
    shown = _show(capsys, cache_dir)
    assert not [e for e in shown["entries"] if e["key"] == KEY], shown  # Not a served row.


def test_a_header_kernel_other_than_the_name_fails_check(cache_dir, capsys):
    """``other.json`` holding the rowsum's header is never read for the rowsum, nor served for
    ``other``: check says so, whatever its entries."""
    _file(cache_dir, _text([(KEY, GOOD)]), name="other.json")
    config, _ = _serve(cache_dir)
    assert config.source != "cache"
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and "other.json" in out and f"{dk.rowsum.name}.json" in out, out


@pytest.mark.parametrize("config,why", [
    ({"br": True, "bc": 128}, "br"),
    ({"br": 32, "bc": 128}, "br"),  # Well typed, outside the declared space.
    ({"br": "x", "bc": 128}, "br"),
])
def test_entries_the_call_refuses_check_fails_and_show_marks(cache_dir, capsys, config, why):
    _file(cache_dir, _text([(KEY, {"config": config, "median_ms": 0.5})]))
    served, messages = _serve(cache_dir)
    assert served.source != "cache" and any(KEY in m for m in messages), messages
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and f"entry {KEY!r}" in out, out
    [row] = [e for e in _show(capsys, cache_dir)["entries"] if e["key"] == KEY]
    assert row["best config"].startswith("SKIPPED:") and why in row["best config"], row
    assert row["median_ms"] is None, row  # Not served: no time (JSON numbers are numbers).


@pytest.mark.parametrize("figures,field", [
    ({"median_ms": 0.0}, "median_ms"), ({"median_ms": -1.0}, "median_ms"),
    ({"median_ms": float("nan")}, "median_ms"), ({"median_ms": float("inf")}, "median_ms"),
    ({"median_ms": 1e300}, "median_ms"), ({"median_ms": 10**400}, "median_ms"),
    ({"median_ms": 1.0, "spread_ms": -0.5}, "spread_ms"),
    ({"median_ms": 1.0, "default_ms": float("-inf")}, "default_ms"),
])
def test_entries_whose_figures_are_no_times_the_call_skips_check_fails_show_marks(
        cache_dir, capsys, figures, field):
    """Issue 53.2: `check` called a file holding ``"median_ms": 0`` (or NaN) OK, which a merge
    then ranked above every real time. One rule, in the one reader: no call serves it."""
    _file(cache_dir, _text([(KEY, {"config": GOOD["config"], **figures})]))
    served, messages = _serve(cache_dir)
    assert served.source != "cache" and any(KEY in m and field in m for m in messages), messages
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and f"entry {KEY!r}" in out and field in out, out
    [row] = [e for e in _show(capsys, cache_dir)["entries"] if e["key"] == KEY]
    assert row["best config"].startswith("SKIPPED:") and field in row["best config"], row


def test_a_dangling_symlink_is_unreadable_to_the_call_and_the_tools(cache_dir, tmp_path,
                                                                     capsys):
    path = cache_dir / "cpu" / f"{dk.rowsum.name}.json"
    path.parent.mkdir(parents=True)
    os.symlink(tmp_path / "gone.json", path)
    config, messages = _serve(cache_dir)
    assert config.source != "cache"
    assert any(str(path) in m and "symbolic link" in m for m in messages), messages
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and "symbolic link" in out, out
    rc, out = _check(capsys, path)  # Named directly, too.
    assert rc == 1 and "symbolic link" in out, out


def test_a_directory_named_like_a_winners_file_fails_check(cache_dir, capsys):
    (cache_dir / "cpu" / f"{dk.rowsum.name}.json").mkdir(parents=True)
    _, messages = _serve(cache_dir)
    assert any("not a regular file" in m for m in messages), messages
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and "not a regular file" in out, out


def _line(key, br):
    return f'{json.dumps(key)}: {json.dumps({"config": {"br": br, "bc": 128}})}'


@pytest.mark.parametrize("body", [
    ["A8", "}}", "A16"],  # An entry after the closing line.
    ["A8", "}}", "A16", "}}"],  # An early closing line: a damaged line, the rest serves.
    ["A8", "}}", "B16", "}}", "junk"],
    ["A8", "A16"],  # Truncated: no closing line.
    ["A8", "}}x", "A16", "}}"],
    ["A8,", "A16", "}}", "", "  "],  # Blank lines after the closing line are no damage.
])
def test_the_fast_lookup_and_the_index_agree_on_every_key(tmp_path, body):
    from pallas_tune.cache import files

    keys = {"A": "x=16x384:float32", "B": "x=8x384:float32"}
    lines = [_line(keys[b[0]], int(b[1:].rstrip(","))) + ("," if b.endswith(",") else "")
             if b[:1] in keys else b for b in body]
    head = json.dumps({"schema": 2, "kernel": dk.rowsum.name, "chip": "cpu", "kind": "measured"})
    raw = (head[:-1] + ', "entries": {\n' + "\n".join(lines) + "\n").encode()
    path = tmp_path / "f.json"
    path.write_bytes(raw)
    st = os.stat(path)
    for key in keys.values():
        fast = files.parse_winners(raw, str(path), st).find(key)  # The first lookup's way.
        indexed = files.parse_winners(raw, str(path), st)
        listed = key in indexed.keys()  # Every line looked at first: the tools' way.
        assert (fast is not None) == listed, (key, fast)
        assert fast == indexed.find(key), key
    damaged = files.parse_winners(raw, str(path), st)
    after = [i for i, b in enumerate(body) if b == "}}"]
    junk_after = bool(after) and any(b.strip() for b in body[after[-1] + 1:])
    assert bool(damaged.damage) == (not after or junk_after or body.count("}}") > 1
                                    or "}}x" in body), damaged.damage


def test_a_side_file_no_call_reads_fails_check_until_merged_back(cache_dir, capsys):
    """A ``.recovered-<id>.json`` side file is never read by a call: check says so and names
    the merge that brings its entries back; after that merge, the call serves them."""
    from pallas_tune.cli import main

    side = _file(cache_dir, _text([(KEY, GOOD)]), name=f"{dk.rowsum.name}.recovered-ab12.json")
    assert _serve(cache_dir)[0].source != "cache"
    rc, out = _check(capsys, cache_dir)
    assert rc == 1 and f"pallas-tune merge {side}" in out, out
    assert main(["merge", str(side), "--into", str(cache_dir)]) == 0, capsys.readouterr()
    side.unlink()
    config, _ = _serve(cache_dir)
    assert config.source == "cache" and dict(config) == GOOD["config"]
    rc, out = _check(capsys, cache_dir)
    assert rc == 0 and ": OK" in out, out
