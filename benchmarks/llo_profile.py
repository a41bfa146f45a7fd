"""Shared by the kernel profile benchmarks (flash_profile.py, hstu_profile.py): libtpu's static
profile and final VLIW bundles dumped for every deviceless compile, a kernel's source as of a
git revision, and the op mix of a compiled kernel program.

Import this module before JAX: it sets the environment libtpu reads when it loads.
"""

from __future__ import annotations

import collections
import glob
import importlib.util
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

DUMP = tempfile.mkdtemp(prefix="llo-profile-")
os.environ["LIBTPU_INIT_ARGS"] = (f"--xla_jf_dump_static_llo_profile_to={DUMP}/sp "
                                  f"--xla_jf_dump_to={DUMP}/jf "
                                  "--xla_jf_dump_llo_pass_label_regex=final_bundles")
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kernel_at(rev: str, name: str) -> Callable[..., Any]:
    """The undecorated function ``name`` of ``kernels/{name}.py`` as of git revision ``rev``
    (its ``pt.tunable`` registration cut off, so that it does not register twice)."""
    text = subprocess.run(["git", "-C", _ROOT, "show", f"{rev}:kernels/{name}.py"],
                          check=True, capture_output=True, text=True).stdout
    text = re.sub(r"\n@pt\.tunable\(.*?\)\n", "\n", text, flags=re.DOTALL)
    text = re.sub(rf"\n{name} = pt\.tunable\(.*", "\n", text, flags=re.DOTALL)
    path = os.path.join(DUMP, f"{name}_{rev}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"{name}_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def op_counts(program: str, kinds: Sequence[str], *, keep: str | None = None,
              show_all: bool = False) -> tuple[int, collections.Counter]:
    """(bundles, instructions per kind prefix) of the last compiled program named ``program``
    (static counts: a loop body once). Clears the dump, so that the next compile of the same
    name is not mistaken for this one. ``keep``: copy the bundles file there first."""
    files = sorted(glob.glob(f"{DUMP}/jf/*{program}.1-01-final_bundles.txt"),
                   key=os.path.getmtime)
    if not files:
        return 0, collections.Counter()
    with open(files[-1], encoding="utf-8") as f:
        text = f.read()
    if keep:
        import shutil

        shutil.copy(files[-1], keep)
    for old in glob.glob(f"{DUMP}/jf/*"):
        os.remove(old)
    ops = collections.Counter(re.findall(r"= ([a-z][a-z0-9_.]*)", text))
    if show_all:
        print("   ", dict(ops.most_common(40)))
    bundles = len(re.findall(r"^\s*0x[0-9a-f]+", text, flags=re.MULTILINE))
    return bundles, collections.Counter({k: sum(n for op, n in ops.items() if op.startswith(k))
                                         for k in kinds})


def profile_row(fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
                program: str, kinds: Sequence[str], floor_us: float, clock: float,
                env: str) -> str:
    """One table row's figures for ``fn(*args, **kwargs)`` compiled deviceless for v6e: cycles,
    microseconds, fraction of the ``floor_us`` roofline, bundles and op counts of ``program``;
    or why there is no estimate. ``{env}_KEEP`` / ``{env}_ALL_OPS`` as in :func:`op_counts`."""
    from pallas_tune.feasibility import compile as _compile

    r = _compile.compile_deviceless(fn, list(args), kwargs, chip="tpu_v6e")
    if not r.ok or not r.estimated_cycles:
        return f"no estimate ({r.kind}: {r.message[:200]})"
    cycles = sum(r.estimated_cycles)
    us = cycles / clock * 1e6
    bundles, ops = op_counts(program, kinds, keep=os.environ.get(f"{env}_KEEP"),
                             show_all=bool(os.environ.get(f"{env}_ALL_OPS")))
    return (f"{cycles:9d} {us:7.1f} {floor_us / us:8.1%} {bundles:7d} "
            + " ".join(f"{ops[k]:12d}" for k in kinds))
