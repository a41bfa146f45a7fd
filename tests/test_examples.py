"""Every example in examples/ runs as a user would run it (on this CPU host, in interpret
mode), in a fresh process with its own cache directory, in under a minute or two."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from conftest import subprocess_env

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
ARGS = {"tune_matmul.py": ["--size", "256", "--trials", "4"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    r = subprocess.run([sys.executable, str(path), *ARGS.get(path.name, [])],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr
