import contextlib
import importlib
import os
import sys

# Keep JAX on the CPU in tests even where jax[tpu] is installed: without a TPU, libtpu's
# backend init only prints errors. Deviceless TPU compiles (libtpu tests) don't need it.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Deviceless TPU compiles load libtpu in this process; under pytest-xdist two test processes may
# load it at once (the library sets this too, before its own loads).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
# JAX's persistent compilation cache, shared by xdist's workers and the tests' subprocesses
# (which compile many of the same programs: references, kernels in interpret mode), in a
# temporary directory of this run's own, removed when it ends. Many users run JAX with it on,
# so the suite runs that way too. A JAX_COMPILATION_CACHE_DIR of your own is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _JAX_CACHE = tempfile.mkdtemp(prefix="pallas-tune-test-jax-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    atexit.register(shutil.rmtree, _JAX_CACHE, True)
# libtpu's logs of the tests' workers and commands: under a temporary directory of this test
# run's own, removed when it ends (a fixed one had kept 52 run directories, 1.9 MB, after a full
# run), not the user's log directory (pallas_tune.measure.logs; bounded either way). xdist's
# workers and the tests' subprocesses inherit it. Set PALLAS_TUNE_TPU_LOGS to keep them.
if "PALLAS_TUNE_TPU_LOGS" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _LOG_ROOT = tempfile.mkdtemp(prefix="pallas-tune-test-logs-")
    os.environ["PALLAS_TUNE_TPU_LOGS"] = _LOG_ROOT
    atexit.register(shutil.rmtree, _LOG_ROOT, True)
# And the test process's own libtpu (deviceless compiles in-process), as the CLI's: a run
# directory there, not libtpu's default /tmp/tpu_logs (170 KB a full run had left there).
if "TPU_LOG_DIR" not in os.environ:
    import atexit

    from pallas_tune.measure.logs import RunLogs

    _OWN_LOGS = RunLogs()
    os.environ.update(_OWN_LOGS.env)
    atexit.register(_OWN_LOGS.close)

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings

# Hypothesis profiles of the property tests (HYPOTHESIS_PROFILE picks one; `ci` by default):
# `ci` draws few examples, derandomized, so CI checks the same cases each run; `long` draws many
# random ones for local runs (HYPOTHESIS_MAX_EXAMPLES sets how many per test).
_SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]
settings.register_profile("ci", max_examples=5, deadline=None, derandomize=True, database=None,
                          suppress_health_check=_SLOW, print_blob=True)
settings.register_profile("long", deadline=None, suppress_health_check=_SLOW, print_blob=True,
                          max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "150")))
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty user cache directory for the test (shipped caches still behind it)."""
    from pallas_tune import _settings, cache

    d = tmp_path / "cache"
    monkeypatch.setenv("PALLAS_TUNE_CACHE_DIR", str(d))
    monkeypatch.delenv("PALLAS_TUNE_MODE", raising=False)
    cache.reset_default_cache()
    _settings.reload()
    yield d
    cache.reset_default_cache()
    _settings.reload()


@pytest.fixture
def fresh():
    """Forget per-process memo and warnings of the toy kernels."""
    import toy_kernels

    for k in (toy_kernels.scale, toy_kernels.scale_checked, toy_kernels.add):
        k._memo.clear()
        k._warned.clear()
    yield toy_kernels
    for k in (toy_kernels.scale, toy_kernels.scale_checked, toy_kernels.add):
        k._memo.clear()
        k._warned.clear()


@contextlib.contextmanager
def estimate_modules(*names):
    """benchmarks/estimates modules imported by name; afterwards they, the modules they import
    from there (``also``: name prefixes) and the stub ``tpu_inference`` modules their import
    installs are taken out of ``sys.modules`` again."""
    folder = os.path.join(os.path.dirname(TESTS_DIR), "benchmarks", "estimates")
    before = set(sys.modules)
    sys.path.insert(0, folder)
    try:
        yield tuple(importlib.import_module(n) for n in names)
    finally:
        sys.path.remove(folder)
        for k in set(sys.modules) - before:
            if (k == "tpu_inference" or k.startswith("tpu_inference.")
                    or os.path.dirname(getattr(sys.modules[k], "__file__", "") or "") == folder):
                del sys.modules[k]


def subprocess_env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def pytest_collection_modifyitems(config, items):
    from pallas_tune.feasibility.compile import libtpu_available

    if libtpu_available():
        return
    skip = pytest.mark.skip(reason="needs libtpu for deviceless TPU compiles: "
                                   "pip install 'pallas-tune[tpu]' (CI installs it)")
    for item in items:
        if "libtpu" in item.keywords:
            item.add_marker(skip)
