import json
import subprocess
import sys

import pytest

from conftest import subprocess_env


def _cli(args, cache_dir, **env):
    return subprocess.run([sys.executable, "-m", "pallas_tune.cli", *args], capture_output=True,
                          text=True, timeout=600,
                          env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir, **env))


def test_sweep_then_show_then_skip(cache_dir):
    r = _cli(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32",
              "--shapes", "x=128x256:bfloat16,factor=3.0", "--trials", "4", "--repeats", "1"],
             cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("best {") == 2
    data = json.loads((cache_dir / "cpu" / "toy_kernels.scale.json").read_text())
    assert set(data["entries"]) == {"x=64x256:float32,factor=2.0", "x=128x256:bfloat16,factor=3.0"}
    show = _cli(["show"], cache_dir)
    assert show.returncode == 0
    assert "toy_kernels.scale" in show.stdout and "x=128x256:bfloat16,factor=3.0" in show.stdout
    again = _cli(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32", "--trials", "4"],
                 cache_dir)
    assert "cached, skipped" in again.stdout


@pytest.mark.parametrize("args,message", [
    (["sweep", "toy_kernels:nope", "--shapes", "x=8x128:float32"], "no attribute 'nope'"),
    (["sweep", "toy_kernels:plain_add", "--shapes", "x=8x128:float32"], "not a @pallas_tune"),
    (["sweep", "toy_kernels:scale", "--shapes", "x=8x128:floaty"], "unknown dtype"),
    (["sweep", "toy_kernels:scale", "--shapes", "z=8x128:float32"], "does not fit"),
    (["sweep", "toy_kernels:scale", "--shapes", "x8x128"], "name=DIMS:DTYPE"),
])
def test_bad_input_is_a_clear_error(cache_dir, args, message):
    r = _cli(args, cache_dir)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
