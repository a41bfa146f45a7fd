"""Parse once at the edge (issue 42, item 2): the CLI turns its arguments into one validated,
frozen request before any work starts (:mod:`pallas_tune.cli.edge`), and nothing below that edge
reads the ``argparse.Namespace``; a sweep builds its ``TuneOptions`` from the flags once."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys

import pytest

import pallas_tune.cli
from pallas_tune.cli import build_parser, edge
from pallas_tune.cli.shapes import CLIUsageError

CLI_DIR = pathlib.Path(pallas_tune.cli.__file__).parent

# The edge: the only functions that read the parsed command line, (module, function).
CONVERTERS = frozenset({
    ("edge.py", "convert"), ("edge.py", "sweep_request"), ("edge.py", "_sweep_shapes"),
    ("edge.py", "feasibility_request"), ("edge.py", "show_request"),
    ("edge.py", "check_request"), ("edge.py", "merge_request"), ("edge.py", "report_request"),
    ("edge.py", "recheck_request"), ("options.py", "tune_options"),
})
# main picks the command and its handler (what argparse's subcommand set) and hands the
# namespace to edge.convert; it reads nothing else.
DISPATCH = {("__init__.py", "main"): {"command", "func"}}


def _namespace_names(fn: ast.FunctionDef) -> set[str]:
    """The names in ``fn`` that hold a parsed namespace: parameters annotated as one, any
    parameter or local called ``args`` (the CLI's name for it), and ``parse_args`` results."""
    params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    names = {a.arg for a in params
             if a.annotation is not None and "Namespace" in ast.unparse(a.annotation)}
    names |= {a.arg for a in params if a.arg == "args"}
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id == "args":
            names.add("args")
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and node.value.func.attr == "parse_args"):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _reads(fn: ast.FunctionDef, names: set[str]) -> set[str]:
    """Attributes ``fn`` reads off those names (``getattr(args, "x")`` and ``vars(args)``
    included: ``*`` where the attribute is not spelled)."""
    out = set()
    for node in ast.walk(fn):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in names):
            out.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "vars") and node.args
              and isinstance(node.args[0], ast.Name) and node.args[0].id in names):
            arg = node.args[1] if len(node.args) > 1 else None
            out.add(arg.value if isinstance(arg, ast.Constant) else "*")
    return out


def _functions() -> dict[tuple[str, str], ast.FunctionDef]:
    out = {}
    for path in sorted(CLI_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                out.setdefault((path.name, node.name), node)
    return out


def test_only_the_edge_reads_the_parsed_namespace():
    functions = _functions()
    missing = sorted(CONVERTERS - set(functions))
    assert not missing, f"converters renamed or gone (update CONVERTERS): {missing}"
    bad = []
    for where, fn in functions.items():
        if where in CONVERTERS:
            continue
        params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        typed = [a.arg for a in params
                 if a.annotation is not None and "Namespace" in ast.unparse(a.annotation)]
        if typed:
            bad.append(f"{where[0]}:{fn.name} takes the namespace ({', '.join(typed)}); take "
                       "the command's request from pallas_tune.cli.edge instead")
        read = _reads(fn, _namespace_names(fn)) - DISPATCH.get(where, set())
        if read:
            bad.append(f"{where[0]}:{fn.name} reads {sorted(read)} off the parsed arguments; "
                       "only the edge converters may (pallas_tune.cli.edge)")
    assert not bad, "\n".join(bad)
    # Not vacuous: each converter does read the command line.
    for where in CONVERTERS:
        assert _reads(functions[where], _namespace_names(functions[where])), where


def test_every_command_has_a_converter_and_requests_are_frozen():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    assert set(commands) == set(edge._CONVERTERS), (
        "a command without a converter in pallas_tune.cli.edge")
    argv = {"sweep": ["sweep", "k:f", "--shapes", "x=8x128:float32", "--no-storage"],
            "feasibility": ["feasibility", "k:f", "--shapes", "x=8x128:float32"],
            "show": ["show"], "check": ["check"], "merge": ["merge", "a.json"],
            "report": ["report", "--kernel", "k"], "recheck-xla": ["recheck-xla", "k:f"]}
    for command, words in argv.items():
        request = edge.convert(parser.parse_args(words))
        assert dataclasses.is_dataclass(request), command
        field = dataclasses.fields(request)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(request, field, None)


@pytest.mark.parametrize("argv,message", [
    (["sweep", "k:f", "--shapes", "x=8x8:float32", "--storage", "sqlite:///s.db",
      "--no-storage"], "give --storage or --no-storage, not both"),
    (["sweep", "k:f", "--program", "m:f", "--shapes", "x=8x8:float32"],
     "--program tunes a whole program"),
    (["sweep", "--program", "m:f"], "--program needs --shapes"),
    (["sweep", "--from-record", "r.jsonl", "--shapes", "x=8x8:float32"],
     "--from-record names the shapes"),
    (["sweep", "--shapes", "x=8x8:float32"], "name the kernel"),
    (["sweep", "k:f"], "give at least one --shapes"),
    (["sweep", "k:f", "--shapes", "x=8x8"], "no dtype"),
    (["check", "--space", "matmul"], "--space needs --chip"),
    (["recheck-xla", "k:f", "--chip", "nochip"], "unknown chip"),
    (["recheck-xla", "k:f", "--memory-gb", "nan"], "--memory-gb nan: give a worker's memory"),
    (["recheck-xla", "k:f", "--memory-gb", "0.001"], "from 1 to 65536"),
    (["sweep", "k:f", "--shapes", "x=8x8:float32", "--no-storage", "--worker-memory-gb",
      "1e20"], "--worker-memory-gb 1e+20"),
    (["recheck-xla", "../../etc/passwd:x"], "is not a module's dotted name"),
    (["sweep", "--program", "./k.py:f", "--shapes", "x=8x8:float32"], "--path DIR"),
    (["show", "--import", "../k"], "--import ../k"),
    (["check", "--space", "matmul", "--chip", "garbage"], "no such chip"),
    (["merge", "a.json", "--into", "/no/chip/dir/k.json"], "not a winners file of a cache"),
])
def test_flags_are_refused_at_the_edge_before_any_import(argv, message):
    """The edge alone refuses them: the kernel ``k:f`` is never looked for."""
    with pytest.raises(CLIUsageError, match=re.escape(message)):
        edge.convert(build_parser().parse_args(argv))
    assert "k" not in sys.modules


def test_a_sweep_builds_its_options_from_the_flags_once(cache_dir, capsys, monkeypatch):
    """Two shapes, one kernel: ``tune_options`` runs once, at the edge, and each shape's
    ``kernel.tune`` gets that object with only its chip, callbacks and grad replaced."""
    import toy_kernels

    from pallas_tune.cli import options as cli_options

    original = cli_options.tune_options
    built, tuned = [], []

    def counting(*a, **k):
        built.append(original(*a, **k))
        return built[-1]

    for name, module in list(sys.modules.items()):  # However a module imported it.
        if name.startswith("pallas_tune.cli"):
            for attr in ("tune_options", "_tune_options"):
                if getattr(module, attr, None) is original:
                    monkeypatch.setattr(module, attr, counting)
    tune = type(toy_kernels.scale).tune

    def recording(self, *a, options=None, **k):
        tuned.append(options)
        return tune(self, *a, options=options, **k)

    monkeypatch.setattr(type(toy_kernels.scale), "tune", recording)
    rc = pallas_tune.cli.main(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32",
                               "--shapes", "x=32x128:float32", "--trials", "2", "--repeats",
                               "1", "-q", "--no-storage"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert len(built) == 1, f"tune_options ran {len(built)} times in one sweep"
    assert len(tuned) == 2
    same = {"chip", "callbacks", "grad"}
    for options in tuned:
        assert options.chip == "cpu" and options.grad is False
        assert {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                if f.name not in same} == {f.name: getattr(built[0], f.name)
                                           for f in dataclasses.fields(built[0])
                                           if f.name not in same}
