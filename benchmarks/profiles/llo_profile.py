"""Shared by the kernel profile benchmarks (flash_profile.py, hstu_profile.py, mamba2_profile.py,
flash_numerics.py): libtpu's static profile and final VLIW bundles dumped for every deviceless
compile, a kernel's source as of a git revision, and the op mix of a compiled kernel program.

Import this module before JAX: it sets the environment libtpu reads when it loads.
"""

from __future__ import annotations

import collections
import glob
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

DUMP = bench.static_profile_env("llo-profile-", bundles=True)


def kernel_at(rev: str, name: str) -> Callable[..., Any]:
    """The undecorated function ``name`` of ``kernels/{name}.py`` as of git revision ``rev``
    (its ``pt.tunable`` registration cut off, so that it does not register twice)."""
    text = bench.git_show(rev, f"kernels/{name}.py")
    text = re.sub(r"\n@pt\.tunable\(.*?\)\n", "\n", text, flags=re.DOTALL)
    text = re.sub(rf"\n{name} = pt\.tunable\(.*", "\n", text, flags=re.DOTALL)
    path = os.path.join(DUMP, f"{name}_{rev}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(f"{name}_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def versions(name: str, fn: Callable[..., Any], rev: str | None
             ) -> list[tuple[str, Callable[..., Any]]]:
    """(label, function) of each version of the kernel ``name`` to compare: ``kernel_at(rev)``
    where ``rev`` is given, then the working tree's ``fn``."""
    return ([(rev, kernel_at(rev, name))] if rev else []) + [("working tree", fn)]


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


def columns(kinds: Sequence[str]) -> str:
    """The header of :func:`profile_row`'s figures."""
    return (f"{'cycles':>9s} {'us':>7s} {'roofline':>8s} {'bundles':>7s} "
            + " ".join(f"{k:>12s}" for k in kinds))
