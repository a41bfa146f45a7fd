"""A kernel defined in a script is named, and cached, as the module the script is when imported
(issue 56 item 6): `python tune.py` and `import tune` both name it `tune.scale`, not
`__main__.scale` once and `tune.scale` the other time."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from conftest import subprocess_env

SCRIPT = textwrap.dedent('''
    import warnings
    import jax.numpy as jnp
    import pallas_tune as pt

    @pt.tunable(bm=[8, 16])
    def scale(x, *, bm):
        return x * 2

    if __name__ == "__main__":
        print("NAME", scale.name)
''')


def _run(args, cwd):
    out = subprocess.run([sys.executable, *args], cwd=cwd, env=subprocess_env(),
                         capture_output=True, text=True, timeout=300, check=True)
    return [line.split()[1] for line in out.stdout.splitlines() if line.startswith("NAME ")]


def test_a_scripts_kernel_has_its_import_name(tmp_path):
    (tmp_path / "tune_me.py").write_text(SCRIPT)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text(SCRIPT)
    assert _run(["tune_me.py"], tmp_path) == ["tune_me.scale"]
    assert _run(["-c", "import tune_me; print('NAME', tune_me.scale.name)"],
                tmp_path) == ["tune_me.scale"]
    assert _run(["-m", "pkg.job"], tmp_path) == ["pkg.job.scale"]


def test_a_kernel_with_no_file_keeps_main_and_the_warning_says_name(tmp_path):
    code = SCRIPT.replace('if __name__ == "__main__":', "if True:") + textwrap.dedent('''
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            scale(jnp.ones((8, 128)))
        print("NAME", "give-name" if any("give @tunable(name=" in str(m.message) for m in w)
              else "silent")
    ''')
    assert _run(["-c", code], tmp_path) == ["__main__.scale", "give-name"]
