"""The wheel carries everything a user needs, and works from a fresh virtual environment.

This is the issue's end-to-end check: build the wheel, install it into a new venv, tune the shipped
matmul there with the console script (CPU, interpret mode), then resolve the cached config in a
second process that neither tunes nor imports Optuna, and check the result against the reference.
"""

import os
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of the sources: setuptools builds in the source tree (build/, egg-info),
    # which two builds at once (pytest-xdist workers) break, and which a test should not touch.
    src = tmp_path_factory.mktemp("src") / "pallas-tune"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".hypothesis"))
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation",
                        "--outdir", str(out), str(src)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (whl,) = out.glob("pallas_tune-*.whl")
    return whl


def test_wheel_contents(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("pallas_tune/__init__.py", "pallas_tune/cli/__init__.py",
                     "pallas_tune/kernels/matmul.py", "pallas_tune/search_spaces/matmul.toml",
                     "pallas_tune/caches/__init__.py"):
        assert required in names, required
    assert any(n.endswith("entry_points.txt") for n in names)


def test_fresh_venv_tune_then_resolve_without_optuna(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                        "--no-index", "-q", str(wheel)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    # Dependencies (jax, optuna, ...) come from this interpreter's site-packages, added last, so
    # the freshly installed pallas_tune shadows any development copy.
    fresh_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                                capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(fresh_site, "zz_deps.pth"), "w") as f:
        f.write("\n".join(p for p in site.getsitepackages() if "site-packages" in p) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PALLAS_TUNE_CACHE_DIR=str(tmp_path / "cache"), JAX_PLATFORMS="cpu")
    where = subprocess.run([str(py), "-c", "import pallas_tune; print(pallas_tune.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True)
    assert where.stdout.strip().startswith(str(venv)), where.stdout

    tune = subprocess.run(
        [str(venv / "bin" / "pallas-tune"), "sweep", "pallas_tune.kernels.matmul:matmul",
         "--shapes", "x=256x512:float32,y=512x256:float32", "--trials", "3", "--repeats", "1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert tune.returncode == 0, tune.stdout + tune.stderr[-3000:]
    assert "best {" in tune.stdout

    resolve = (
        "import sys, jax, jax.numpy as jnp, numpy as np\n"
        "from pallas_tune.kernels.matmul import matmul, matmul_reference\n"
        "x = jax.random.normal(jax.random.key(1), (256, 512), jnp.float32)\n"
        "y = jax.random.normal(jax.random.key(2), (512, 256), jnp.float32)\n"
        "cfg = matmul.config_for(x, y)\n"
        "assert cfg.source == 'cache', cfg\n"
        "out = jax.jit(matmul)(x, y)\n"
        "np.testing.assert_allclose(out, matmul_reference(x, y), rtol=1e-4, atol=1e-3)\n"
        "assert 'optuna' not in sys.modules and 'pallas_tune.tuning' not in sys.modules\n"
        "import importlib.resources as r\n"
        "assert (r.files('pallas_tune.search_spaces') / 'matmul.toml').is_file()\n"
        "assert (r.files('pallas_tune') / 'py.typed').is_file()\n"
        "assert (r.files('pallas_tune.caches') / 'nvidia_h100' / 'jax.ops.gpu.softmax.json')"
        ".is_file()\n"
        "import importlib.metadata as m\n"
        "assert any('LICENSE' in str(f) for f in m.files('pallas-tune'))\n"
        "print('RESOLVED', dict(cfg))\n"
    )
    r2 = subprocess.run([str(py), "-c", resolve], capture_output=True, text=True, env=env,
                        cwd=tmp_path, timeout=300)
    assert r2.returncode == 0 and "RESOLVED" in r2.stdout, r2.stderr[-3000:]
    r3 = subprocess.run([str(py), "-m", "pallas_tune", "show"], capture_output=True, text=True,
                        env=env, cwd=tmp_path, timeout=300)
    assert r3.returncode == 0 and "matmul" in r3.stdout, r3.stdout + r3.stderr[-3000:]
