"""Commands pallas-tune prints must run as printed (issue 26.7): the miss warning's sweep
command for a kernel in the user's own directory names the --path it needs, and running it
tunes the shape, after which the same call is a cache hit."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap

from conftest import subprocess_env

KERNEL = textwrap.dedent('''
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    import pallas_tune as pt


    @pt.tunable(br=[8, 16], default={"br": 8})
    def scaled_add(x, y, *, alpha=2.0, br):
        def body(x_ref, y_ref, o_ref):
            o_ref[...] = x_ref[...] + alpha * y_ref[...]
        spec = pl.BlockSpec((br, x.shape[1]), lambda i: (i, 0))
        return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(pl.cdiv(x.shape[0], br),), in_specs=[spec, spec],
                              out_specs=spec)(x, y)
''')

SCRIPT = textwrap.dedent('''
    import warnings
    import jax.numpy as jnp
    from mykernels import scaled_add

    x = jnp.ones((32, 128), jnp.float32)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scaled_add(x, x, alpha=2)
    print("SOURCE", scaled_add.config_for(x, x, alpha=2.0).source)
    for w in seen:
        print("WARNING", w.message)
''')


def test_miss_warning_command_runs_as_printed(tmp_path):
    work = tmp_path / "proj"
    work.mkdir()
    (work / "mykernels.py").write_text(KERNEL)
    (work / "run.py").write_text(SCRIPT)
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join(p for p in env["PYTHONPATH"].split(os.pathsep)
                                        if os.path.abspath(p) != str(work))
    first = subprocess.run([sys.executable, "run.py"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "SOURCE default" in first.stdout, first.stdout
    m = re.search(r"(pallas-tune sweep \S+ --path \S+ --shapes '[^']+')", first.stdout)
    assert m, first.stdout
    command = m.group(1)
    assert f"--path {work}" in command and "alpha=2.0" in command
    # Run it as printed, from another directory, as a user would paste it.
    argv = shlex.split(command)
    argv[0:1] = [sys.executable, "-m", "pallas_tune"]
    argv += ["--trials", "2", "--repeats", "1", "--no-storage", "-q"]
    swept = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=600)
    assert swept.returncode == 0, swept.stdout[-2000:] + swept.stderr[-3000:]
    again = subprocess.run([sys.executable, "run.py"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0 and "SOURCE cache" in again.stdout, again.stdout
