"""The README's promises, re-read against the code (issue 26): its Python blocks run as
written, in order, in one fresh process (the block that lowers for a TPU where libtpu is
installed), and every `pallas-tune ...` command line it shows parses as that command takes it."""

from __future__ import annotations

import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from conftest import subprocess_env

README = pathlib.Path(__file__).parent.parent / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall(README.read_text()) if kind == lang]


def test_python_blocks_run_as_written(tmp_path):
    from pallas_tune.feasibility.compile import libtpu_available

    blocks = _blocks("python")
    assert len(blocks) >= 3, "the README lost its Python examples"
    script = []
    for i, body in enumerate(blocks):
        if "pt.target(" in body and not libtpu_available():
            continue  # Lowers for a TPU: needs libtpu (CI installs it).
        script.append(f"print('--- block {i}', flush=True)\n{body}")
    (tmp_path / "readme_blocks.py").write_text("\n".join(script))
    r = subprocess.run([sys.executable, "readme_blocks.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=900,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert f"--- block {len(blocks) - 1}" in r.stdout or "pt.target(" in blocks[-1]


def _commands() -> list[str]:
    out = []
    for body in _blocks("bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if "pallas-tune " in line and not line.startswith("#"):
                out.append(line[line.index("pallas-tune "):])
    return out


@pytest.mark.parametrize("line", _commands())
def test_cli_lines_parse(line):
    """Each command line shown parses with the CLI's own parser (placeholders such as
    `...` or `[--flag]` are dropped first); running them is the other tests' work."""
    from pallas_tune.cli import build_parser

    words = []
    for w in shlex.split(line)[1:]:
        if w == "...":  # A placeholder: a value after a flag, else nothing.
            if words and words[-1].startswith("--"):
                words.append("PLACEHOLDER")
            continue
        if not (w.startswith("[") or w.endswith("]")):
            words.append(w)
    try:
        build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"README command does not parse ({e.code}): pallas-tune {' '.join(words)}")
