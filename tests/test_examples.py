"""Every example in examples/ runs as a user would run it (on this CPU host, in interpret
mode), in a fresh process with its own cache directory, in under a minute or two."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
from conftest import REPO, subprocess_env

EXAMPLES = [p for p in sorted((pathlib.Path(__file__).parent.parent / "examples").glob("*.py"))
            if p.name not in ("train_step.py", "train_hstu.py",
                              "train_linear_attention.py")]  # Checked in detail below.
ARGS = {"tune_matmul.py": ["--size", "256", "--trials", "4"]}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    r = subprocess.run([sys.executable, str(path), *ARGS.get(path.name, [])],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "Traceback" not in r.stderr


def test_train_step_tunes_forward_and_backward_then_trains(tmp_path):
    """examples/train_step.py: every kernel call tuned with grad=True (backward kernels cached
    under their own names), the jitted step's gradient matches the references', loss falls."""
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache")
    run = subprocess.run([sys.executable, os.path.join(REPO, "examples", "train_step.py"),
                          "--steps", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert out.count("backward (pallas) matmul_bwd") == 2 and "backward (pallas) rms_norm_bwd" in out
    assert "source='cache'" in out and "all finite: True" in out
    err = float(re.search(r"max \|grad - reference grad\| = (\S+);", out).group(1))
    assert err < 1e-4
    losses = [float(v) for v in re.findall(r"step \d+: loss (\S+)", out)]
    final = float(re.search(r"after 2 steps: loss (\S+)", out).group(1))
    assert len(losses) == 2 and final < losses[0]
    cached = os.listdir(tmp_path / "cache" / "cpu")
    assert any("matmul_bwd" in f for f in cached) and any("rms_norm_bwd" in f for f in cached)


@pytest.mark.libtpu
def test_autotune_step_estimates_the_step_composed(tmp_path):
    """examples/autotune_step.py --estimate: tuned for v6e on compiler estimates, the step's
    estimate composed of its glue and each call, under the three settings."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", "autotune_step.py"),
                        "--estimate", "--trials", "2", "--tokens", "256"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "composed" in r.stdout and "ESTIMATES" in r.stdout
    figures = dict(re.findall(r"(default|tuned|xla) ([0-9.e-]+) ms", r.stdout))
    assert set(figures) == {"default", "tuned", "xla"}
    assert float(figures["tuned"]) <= float(figures["default"]) * 1.05  # Tuning's ranking.


@pytest.mark.parametrize("script,backward", [("train_hstu.py", "hstu_attention_bwd"),
                                             ("train_linear_attention.py",
                                              "linear_attention_bwd")])
def test_training_examples_tune_the_pallas_backward_and_train(tmp_path, script, backward):
    """examples/train_hstu.py and train_linear_attention.py: the backward tuned is the Pallas
    kernel, its entry written to the cache, the traced gradient matches XLA's autodiff of the
    forward's reference (the example asserts it), and SGD lowers the loss."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "examples", script)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "backward (pallas)" in r.stdout and "gradient matches" in r.stdout
    assert list((tmp_path / "cache").glob(f"*/*{backward}*.json"))
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", r.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0]
