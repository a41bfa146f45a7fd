"""Fuzz (hypothesis) the command line with hostile arguments and files (issue 25).

Whatever ``sweep``, ``show``, ``check`` and ``merge`` are given, they end with exit status 0
(only for valid input), 1 (a problem found) or 2 (a usage error), never an exception or a
traceback, and they create or change no file but those they are for (none at all unless they
succeed). The CLI runs in this process; a sweep that gets past every check calls a stand-in
for the tuning, which checks that only well-formed shapes got that far.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import tempfile
import warnings
from unittest import mock

from hypothesis import example, given
from hypothesis import strategies as st

from pallas_tune.cli import main

KERNEL = "toy_kernels:scale"
VALID_SPECS = ["x=8x128:float32", "x=16x256:bfloat16,factor=3.0", "x=8x128:float32,factor=1"]
HOSTILE_SPECS = [
    "x=99999999999x99999999999:float32", "x=axb:float32", "x=-1x128:float32", "x=0x128:float32",
    "x=8x128", "x=8x128:floaty", "z=8x128:float32", "x=(8x128:float32;0x1:int8)", "x8x128",
    "x=8x128:float32,br=8", "x=\x1b[2J:float32", "", ",", "=", "x=",
    "x=8x99999999999999999999:f32",
    "x=" + "8x" * 3000 + "8:float32", "@\x00", "@/dev/null/x", "@/",
]
# (value, is it a usage error) for the flags the sweep checks before any work.
TRIALS = [(None, False), ("1", False), ("0", True), ("-1", True), ("1e12", True), ("abc", True),
          ("99999999999", True)]
WORKERS = [(None, False), ("1", False), ("1000000000", True), ("0", True)]
CHIPS = [(None, False), ("cpu", False), ("v6e", False), ("bogus", True), ("\x1b[2J", True)]
KERNELS = [(KERNEL, False), ("toy_kernels:nope", True), ("no_such_module:k", True), (":", True),
           ("toy_kernels:plain_add", True), ("../../etc/passwd:x", True),
           (".toy_kernels:scale", True), ("toy_kernels.py:scale", True),
           ("toy_kernels:scale()", True)]
# (flags, is it a usage error) beside a valid sweep (issue 53.9, 56.7).
SWEEP_FLAGS = [([], False), (["--worker-memory-gb", "12"], False),
               (["--worker-memory-gb", "1e20"], True), (["--worker-memory-gb", "0.001"], True),
               (["--worker-memory-gb", "nan"], True), (["--worker-memory-gb=-1"], True),
               (["--warm-configs", "[" * 10_000 + "]" * 10_000], True),
               (["--warm-configs", '{"br": ' * 2000 + "8" + "}" * 2000], True),
               (["--warm-configs", '[{"br": 8, "bc": 128}]'], False),
               (["--import", "../x"], True), (["--import", ".x"], True), (["--chp", "v6e"], True),
               (["--trails", "3"], True), (["--timer", "wallclok"], True)]
# (argv, is it a usage error) of recheck-xla; the compile workers are stood in for.
RECHECK = [(["--memory-gb", m], m not in ("0", "1", "12", "65536"))
           for m in ("nan", "inf", "1e400", "0.001", "0", "1", "12", "65536", "65537", "1e20")] + [
    (["--memory-gb=-1"], True), (["--memory-gb=-inf"], True), (["--chip", "garbage"], True),
    (["--chp", "v6e"], True)]

_spec_text = st.text(alphabet="x0123456789:,=-();@\"abfloat32 \x1b\x00é", max_size=40)
_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                         st.text(max_size=8))
_json = st.recursive(_json_scalar, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)


@st.composite
def _specs(draw):
    return draw(st.one_of(st.sampled_from(VALID_SPECS), st.sampled_from(HOSTILE_SPECS),
                          _spec_text))


@st.composite
def _record_file(draw):
    """A PALLAS_TUNE_RECORD file: random bytes, or lines of records and junk."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=300))
    lines = []
    for _ in range(draw(st.integers(0, 5))):
        kind = draw(st.integers(0, 3))
        if kind == 0:
            rec = {"ref": draw(st.sampled_from([KERNEL, "toy_kernels:nope", 5, None])),
                   "shapes": draw(st.one_of(_specs(), _json))}
            line = json.dumps(rec)
        elif kind == 1:
            line = json.dumps(draw(_json))
        elif kind == 2:
            line = "[" * draw(st.integers(1, 3000))
        else:
            line = draw(st.text(max_size=40))
        lines.append(line)
    return "\n".join(lines).encode("utf-8", "surrogatepass")


@st.composite
def _winners_file(draw):
    """A winners file: random bytes, or the canonical layout with hostile entries."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.binary(max_size=300))
    kernel = draw(st.sampled_from(["toy_kernels.scale", "no.such.kernel", 5, None]))
    head = {"schema": draw(st.sampled_from([2, 2, 1, 3, "2"])), "kernel": kernel,
            "chip": draw(st.sampled_from(["cpu", "tpu_v6e", 7])), "kind": "measured"}
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        value = draw(st.one_of(
            st.fixed_dictionaries({"config": st.fixed_dictionaries(
                {"br": st.sampled_from([8, 16, "8", -8]), "bc": st.sampled_from([128, 0])}),
                "median_ms": st.one_of(st.floats(0.001, 10), _json)}),
            _json))
        entries.append(f"{json.dumps(draw(_specs()))}: {json.dumps(value)}")
    text = json.dumps(head)[:-1] + ', "entries": {\n' + ",\n".join(entries) + "\n}}\n"
    if draw(st.booleans()):
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=10)) + text[cut:]
    return text.encode("utf-8", "surrogatepass")


# ---- running one command in a sandbox -------------------------------------------------------

_ENV = ("PALLAS_TUNE_CACHE_DIR", "PALLAS_TUNE_STORAGE_DIR", "PALLAS_TUNE_CACHE_PATH",
        "PALLAS_TUNE_MODE", "PALLAS_TUNE_MAX_FILE_MB", "PALLAS_TUNE_RECORD")


@contextlib.contextmanager
def _sandbox():
    """A fresh directory as the user cache (and nothing else set), restored afterwards."""
    from pallas_tune import _settings, cache

    saved = {k: os.environ.get(k) for k in _ENV}
    with tempfile.TemporaryDirectory(prefix="pt-fuzz-") as d:
        for k in _ENV:
            os.environ.pop(k, None)
        os.environ["PALLAS_TUNE_CACHE_DIR"] = os.path.join(d, "cache")
        cache.reset_default_cache()
        _settings.reload()
        try:
            yield d
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            cache.reset_default_cache()
            _settings.reload()


def _tree(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames:
            out[os.path.join(dirpath, name)] = None
        for name in filenames:
            p = os.path.join(dirpath, name)
            with open(p, "rb") as f:
                out[p] = f.read()
    return out


def _run(argv, root, allowed=()):
    """Runs ``pallas-tune ARGV``; checks the exit status and what changed under ``root``
    (only paths under ``allowed``, and only on success). Returns (status, stdout, stderr)."""
    before = _tree(root)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage errors (2), --help (0).
            rc = e.code
    err_text = err.getvalue()
    assert rc in (0, 1, 2), (argv, rc, err_text[-2000:])
    assert "Traceback" not in err_text, (argv, err_text[-2000:])
    after = _tree(root)
    changed = {p for p in set(before) | set(after) if before.get(p, 0) != after.get(p, 0)}
    if rc != 0:
        assert not changed, (argv, rc, sorted(changed), err_text[-2000:])
    else:
        stray = [p for p in changed if not any(p.startswith(a) for a in allowed)]
        assert not stray, (argv, sorted(stray))
    return rc, out.getvalue(), err_text


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


class _Tuned:
    """Stands in for tuning: records what got past every check, and checks it is well-formed."""

    def __init__(self):
        self.calls = []

    def __call__(self, args, kernel, chip, calls):
        import jax

        for spec, call_args, call_kwargs in calls:
            for a in [*call_args, *call_kwargs.values()]:
                if isinstance(a, jax.ShapeDtypeStruct):
                    assert all(1 <= d <= 2**31 - 1 for d in a.shape), spec
        self.calls.append((kernel.name, chip, [c[0] for c in calls]))
        return 0


# ---- the fuzz tests -------------------------------------------------------------------------

@given(kernel=st.sampled_from(KERNELS), specs=st.lists(_specs(), max_size=3),
       shapes_file=st.one_of(st.none(), st.binary(max_size=200),
                             st.lists(_specs(), max_size=3).map(
                                 lambda s: "\n".join(s).encode("utf-8", "surrogatepass"))),
       trials=st.sampled_from(TRIALS), workers=st.sampled_from(WORKERS),
       chip=st.sampled_from(CHIPS),
       storage=st.sampled_from(["none", "default", "bogus://", "notaurl", "sqlite:///{d}/s.db",
                                "sqlite:////no/such/dir/x.db", "sqlite:///{d}/text.txt",
                                "sqlite://", "sqlite:///\x00", "sqlite:///{d}"]))
def test_sweep_arguments(kernel, specs, shapes_file, trials, workers, chip, storage):
    with _sandbox() as d, mock.patch("pallas_tune.cli.sweep._sweep_kernel", _Tuned()) as tuned:
        _write(os.path.join(d, "text.txt"), b"my notes\n")
        argv = ["sweep"] + ([kernel[0]] if kernel[0] else [])
        for s in specs:
            argv += ["--shapes", s]
        if shapes_file is not None:
            _write(os.path.join(d, "shapes.txt"), shapes_file)
            argv += ["--shapes", "@" + os.path.join(d, "shapes.txt")]
        for flag, (value, _) in (("--trials", trials), ("--workers", workers),
                                 ("--chip", chip)):
            if value is not None:
                argv += [flag, value]
        if storage == "none":
            argv.append("--no-storage")
        elif storage != "default":
            argv += ["--storage", storage.format(d=d)]
        rc, _, err = _run(argv, d, allowed=(os.path.join(d, "cache"), os.path.join(d, "s.db")))
        usage = any(bad for _, bad in (kernel, trials, workers, chip)) or storage in (
            "bogus://", "notaurl", "sqlite:////no/such/dir/x.db", "sqlite:///{d}/text.txt",
            "sqlite:///\x00", "sqlite:///{d}")
        if usage or any(s in HOSTILE_SPECS for s in specs):
            assert rc == 2, (argv, rc, err[-2000:])
        if rc == 0:
            assert tuned.calls and all(c[0] == "toy_kernels.scale" for c in tuned.calls)
        else:
            assert not tuned.calls


_GOOD_RECORD = json.dumps({"ref": KERNEL, "shapes": VALID_SPECS[0]}).encode() + b"\n"


@given(record=_record_file(), kernel=st.sampled_from([None, KERNEL, "toy_kernels:nope"]),
       allow=st.booleans())
@example(record=_GOOD_RECORD + b"[" * 3000, kernel=None, allow=True)  # Nested too deep.
@example(record=b"\x80\xff" + _GOOD_RECORD, kernel=KERNEL, allow=False)
def test_sweep_from_record_files(record, kernel, allow):
    with _sandbox() as d, mock.patch("pallas_tune.cli.sweep._sweep_kernel", _Tuned()) as tuned:
        path = os.path.join(d, "misses.jsonl")
        _write(path, record)
        argv = ["sweep"] + ([kernel] if kernel else []) + ["--from-record", path,
                                                           "--no-storage"]
        if allow:  # Records may name only kernels the user allows to be imported.
            argv += ["--import", "toy_kernels"]
        rc, _, err = _run(argv, d, allowed=(os.path.join(d, "cache"),))
        if rc == 0:
            assert tuned.calls and all(c[0] == "toy_kernels.scale" for c in tuned.calls)
        if KERNEL not in record.decode("utf-8", "replace"):  # Nothing there to tune.
            assert rc != 0 and not tuned.calls, (record, err)


@given(files=st.lists(_winners_file(), min_size=1, max_size=3),
       command=st.sampled_from(["show", "check", "merge"]),
       extra=st.lists(st.sampled_from([
           ["--kernel", "toy"], ["--chip", "cpu"], ["--chip", "\x1b"], ["--key", "x=8"],
           ["--format", "json"], ["--format", "csv"], ["--format", "xml"], ["--trials"],
           ["--no-kernels"], ["--fail-stale"], ["--space", "matmul"], ["--space", "/dev/null"],
           ["--bogus-flag"], ["/no/such/path"], ["/dev/zero"], ["{d}"],
           ["--into", "{d}/into"]]), max_size=3))
@example(files=[b'{"schema": 2, "kernel": "toy_kernels.scale", "chip": "cpu", "entries": {\n'
                b'"x=\\u001b[2J:float32": {"config": {"br": 8}, "median_ms": 1.0}\n}}\n'],
         command="show", extra=[["--format", "csv"]])
@example(files=[b"\x00" * 100, b'{"schema": 2, "kernel": "toy_kernels.scale", "entries": {\n'
                               b'"k": {"config": 1}\n}}\n'], command="merge", extra=[])
@example(files=[b'{"schema": 2, "kernel": "toy_kernels.scale", "chip": "cpu", "entries": {\n'
                b'"": {"config": {"br": 8}, "median_ms": 1.0}\n}}\n'], command="merge", extra=[])
def test_show_check_merge_on_hostile_caches(files, command, extra):
    with _sandbox() as d:
        inputs = []
        for i, data in enumerate(files):
            path = os.path.join(d, "cache" if i == 0 else f"host{i}", "cpu",
                                "toy_kernels.scale.json")
            _write(path, data)
            inputs.append(path)
        argv = [command] + ([p for p in inputs] if command == "merge" else [])
        for e in extra:
            argv += [a.format(d=d) for a in e]
        if command == "merge" and "--into" not in argv:
            argv += ["--into", os.path.join(d, "into")]
        rc, out, err = _run(argv, d, allowed=(os.path.join(d, "into"),))
        if command == "show" and rc == 0:
            assert "\x1b" not in out and "\x00" not in out
        skipped = re.search(r"(\d+) skipped", out) if command == "merge" else None
        if skipped:  # Each skip says which file or entry, and why.
            assert err.count("merge: skipped ") == int(skipped.group(1)), (out, err)


@given(kernel=st.sampled_from(KERNELS), flags=st.sampled_from(SWEEP_FLAGS))
@example(kernel=KERNELS[0], flags=SWEEP_FLAGS[6])
@example(kernel=KERNELS[5], flags=SWEEP_FLAGS[0])
def test_sweep_flag_values_and_kernel_refs(kernel, flags):
    """Malformed numbers, nesting, module paths and misspelt flags: exit 2, one line."""
    with _sandbox() as d, mock.patch("pallas_tune.cli.sweep._sweep_kernel", _Tuned()) as tuned:
        argv = ["sweep", kernel[0], "--shapes", VALID_SPECS[0], "--no-storage", *flags[0]]
        rc, _, err = _run(argv, d, allowed=(os.path.join(d, "cache"),))
        if kernel[1] or flags[1]:
            assert rc == 2 and not tuned.calls, (argv, rc, err[-2000:])
        else:
            assert rc == 0 and tuned.calls, (argv, rc, err[-2000:])


class _NoEstimates:
    """Stands in for recheck-xla's compile workers: a run that gets this far had valid input."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@given(kernel=st.sampled_from(KERNELS + [("toy_kernels:poor_scale", False)]),
       extra=st.sampled_from(RECHECK))
@example(kernel=("../../etc/passwd:x", True), extra=([], False))
@example(kernel=("toy_kernels:poor_scale", False), extra=(["--memory-gb", "nan"], True))
def test_recheck_xla_arguments(kernel, extra):
    with _sandbox() as d, mock.patch("pallas_tune.measure.estimate.Estimator", _NoEstimates):
        argv = ["recheck-xla", kernel[0], *extra[0]]
        rc, _, err = _run(argv, d)
        if kernel[1] or extra[1]:
            assert rc == 2, (argv, rc, err[-2000:])
