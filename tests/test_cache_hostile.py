"""Cache files damaged the way disks, editors, crashed writers and other tools damage them.

Property tests (hypothesis): whatever bytes lie in a kernel's cache file, a call of the kernel
returns the right numbers, warns when it could not use an entry for its key, never raises, and
leaves the file byte-identical; a write never loses the new entry nor the file's old ones.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import warnings

import dispatch_kernels as dk
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import pallas_tune as pt
from pallas_tune.cache import TuningCache, read_file
from pallas_tune.cache.inventory import inventory, trial_history
from pallas_tune.cli import show_rows

KERNEL = dk.rowsum
KEY = "x=16x384:float32"
X = dk.data((16, 384))
REF = np.asarray(dk.rowsum_reference(X))
# Random files each run, as Hypothesis draws them by default (not the derandomized `ci` profile).
RANDOM = settings.get_profile("default")

_numbers = st.sampled_from([8, 16, 128, 256, 384, 0, -8, -128, 2**64, 8.0, 128.0, 1e308,
                            math.nan, math.inf, -math.inf, True, False])
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                     st.text(max_size=6), _numbers)
_json = st.recursive(_scalars, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=4), c, max_size=3), max_leaves=8)
_values = st.one_of(_numbers, st.sampled_from(["128", "", [128], [8, 16], {"v": 8}]), _json)
_in_space = st.fixed_dictionaries({"br": st.sampled_from([8, 16]),
                                   "bc": st.sampled_from([128, 256])})
_configs = st.one_of(
    _in_space, _in_space, _in_space,  # Well-typed, in the space: valid or not for the shape.
    st.fixed_dictionaries({"br": st.sampled_from([8, 16, 16.0, True, -16, "16", [16], 32]),
                           "bc": st.sampled_from([128, 256, 384, 128.0, 0, None])}),
    st.fixed_dictionaries({"br": _values, "bc": _values}),
    st.dictionaries(st.sampled_from(["br", "bc", "bz", "", "BR", "b\x1b[2J"]), _values,
                    max_size=3),
    _json,
)
_entry = st.fixed_dictionaries({"config": _configs}, optional={
    "median_ms": _values, "spread_ms": _values, "provenance": _json,
    "outside_space": st.sampled_from([True, False, True, "yes", None, 1]),
    "trial_count": _values, "trials": _json})
_entries = st.one_of(_entry, _entry, _entry, _json)
_other_keys = st.one_of(st.just("x=8x384:float32"), st.just("x=16x512:float32"),
                        st.text(max_size=12))


@st.composite
def _entry_tables(draw) -> object:
    if draw(st.integers(0, 9)) == 0:
        return draw(_json)
    table = {}
    if draw(st.integers(0, 4)) > 0:
        table[KEY] = draw(_entries)
    for k in draw(st.lists(_other_keys, max_size=3)):
        table[k] = draw(_entries)
    return table


_files = st.fixed_dictionaries({
    "schema": st.sampled_from([2] * 6 + [1, 1, 3, "2", None]),
    "kernel": st.sampled_from([KERNEL.name] * 8 + ["other", 5]),
    "chip": st.sampled_from(["cpu"] * 8 + ["tpu_v6e", None]),
    "kind": st.sampled_from(["measured"] * 8 + ["estimate", []]),
    "entries": _entry_tables(),
})


def _render(data: dict, layout: str) -> bytes:
    if layout == "canonical" and isinstance(data.get("entries"), dict):
        head = json.dumps({k: v for k, v in data.items() if k != "entries"})
        lines = [head[:-1] + ', "entries": {']
        body = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in data["entries"].items()]
        if body:
            lines.append(",\n".join(body))
        lines.append("}}\n")
        return "\n".join(lines).encode()
    return json.dumps(data, indent=1 if layout == "pretty" else None,
                      ensure_ascii=layout != "raw-utf8").encode()


@st.composite
def hostile_files(draw) -> bytes:
    source = draw(st.sampled_from(["json"] * 6 + ["bytes", "nested", "empty"]))
    if source == "bytes":
        return draw(st.binary(max_size=300))
    if source == "nested":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        return (b'{"schema": 2, "entries": {"' + KEY.encode() + b'": {"config": '
                + b"[" * depth + b"]" * depth + b"}}}")
    if source == "empty":
        return b""
    content = _render(draw(_files), draw(st.sampled_from(["canonical", "pretty", "compact",
                                                          "raw-utf8"])))
    damage = draw(st.sampled_from(["none"] * 5 + ["truncate", "flip", "insert", "append"]))
    if damage == "none" or not content:
        return content
    at = draw(st.integers(0, len(content) - 1))
    if damage == "truncate":
        return content[:at]
    if damage == "flip":
        return content[:at] + bytes([content[at] ^ draw(st.integers(1, 255))]) + content[at + 1:]
    junk = draw(st.sampled_from([b"\xff\xfe", b"\x00", b"\n", b"\x1b[31m", b'"}', b",\n"]))
    return content[:at] + junk + content[at:] if damage == "insert" else content + junk


def _oracle_entry(content: bytes):
    """The file's entry for KEY as an independent strict reader sees it (None if none)."""
    try:
        data = json.loads(content.decode("utf-8"))
        return data["entries"][KEY]
    except Exception:
        return None


def _truly_valid(config) -> bool:
    """Whether a served config computes the right thing for X (16x384), by hand."""
    br, bc = config["br"], config["bc"]
    return all(type(v) is int and v > 0 for v in (br, bc)) and 384 % bc == 0 and 16 % br == 0


@settings(RANDOM, max_examples=int(os.environ.get("PALLAS_TUNE_HOSTILE_EXAMPLES", "40")),
          deadline=None,
          database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(content=hostile_files())
def test_any_cache_file_content_the_call_is_right_and_the_file_untouched(content):
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "cpu", "tests.rowsum.json")
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(content)
        cache = TuningCache(root, use_shipped=False)
        KERNEL._cache, KERNEL._memo, KERNEL._warned = cache, {}, set()
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                config = KERNEL.config_for(X)
                out = np.asarray(KERNEL(X))
                list(cache.entries("cpu", KERNEL.name))
                list(cache.neighbours("cpu", KERNEL.name, KEY))
                reports = inventory(cache)
                show_rows(reports)
                for r in reports:
                    for e in r.entries:
                        trial_history(r, e.key)
        finally:
            KERNEL._cache, KERNEL._memo, KERNEL._warned = None, {}, set()
        messages = [str(w.message) for w in record if issubclass(w.category, pt.PallasTuneWarning)]
        np.testing.assert_array_equal(out, REF)
        assert _truly_valid(config), config
        if config.source == "cache":
            entry = _oracle_entry(content)
            assert entry is not None and entry["config"] == dict(config)
            assert all(type(entry["config"][k]) is type(v) for k, v in config.items())
        else:
            assert messages, "a call that could not use a cache entry must say so"
            if _oracle_entry(content) is not None:
                assert any(path in m for m in messages), messages  # Names the file.
        with open(path, "rb") as f:
            assert f.read() == content


@settings(RANDOM, max_examples=int(os.environ.get("PALLAS_TUNE_HOSTILE_EXAMPLES", "40")) // 2,
          database=None,
          deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(content=hostile_files())
# Found by this test: a measured write merged into a file whose header says "estimate".
@example(content=b'{"schema": 2, "kernel": "tests.rowsum", "chip": "cpu", "kind": "estimate", '
                 b'"entries": {\n}}\n')
def test_a_write_never_loses_the_new_entry_nor_the_old_ones(content):
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "cpu", "tests.rowsum.json")
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(content)
        try:
            before = read_file(path)
            ours = before.get("kernel", KERNEL.name) == KERNEL.name and before.get(
                "kind", "measured") == "measured"
        except Exception:
            before, ours = None, False
        cache = TuningCache(root, use_shipped=False)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            written = cache.write("cpu", KERNEL.name, "new-key",
                                  {"config": {"br": 8, "bc": 128}, "median_ms": 1.0,
                                   "trials": [{"number": 0, "outcome": "ok"}]})
            found = cache.lookup("cpu", KERNEL.name, "new-key")
        assert found is not None and found[0]["config"] == {"br": 8, "bc": 128}
        after = read_file(written)
        json.loads(open(written, "rb").read().decode(),
                    parse_constant=lambda c: pytest.fail(f"{c} in a written file"))
        if written == path:
            assert ours and set(before["entries"]) <= set(after["entries"])
        else:
            assert open(path, "rb").read() == content  # Left as it was.
        assert not [f for f in os.listdir(os.path.dirname(path)) if f.startswith(".tmp-")]
