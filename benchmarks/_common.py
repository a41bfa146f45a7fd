"""The plumbing the benchmark scripts share: where things are, the command line that made a
result, the receipts a result carries (date, host, versions, git), Markdown tables, writing a
result, running a child process for its JSON, and libtpu: whether it is there, and its static
profile dumped for deviceless compiles.

A script in ``benchmarks/<group>/`` imports it with benchmarks/ put on its path first:

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _common as bench  # noqa: E402

This module imports only the standard library (no JAX), so a script may import it before it
sets what libtpu reads when it loads (:func:`static_profile_env`).

Smoke mode (``PALLAS_TUNE_BENCH_SMOKE=1``, what ``tests/test_benchmarks_smoke.py`` sets): every
script runs its whole path at the smallest size that still exercises it (:func:`smoke` picks a
figure's tiny value), prints its table, and writes nothing under the repository:
:func:`write` and :func:`output` send a path under ``results/``, ``landscapes/`` or ``caches/``
to the same place under :data:`SMOKE_DIR`, a temporary folder.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TextIO

BENCHMARKS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCHMARKS)
RESULTS = os.path.join(BENCHMARKS, "results")  # What the scripts write; docs and tests link it.
LANDSCAPES = os.path.join(BENCHMARKS, "landscapes")
CACHES = os.path.join(REPO, "caches")
TESTS = os.path.join(REPO, "tests")

SMOKE_ENV = "PALLAS_TUNE_BENCH_SMOKE"
SMOKE = os.environ.get(SMOKE_ENV, "").strip() not in ("", "0")
# Where smoke runs write what would go under the repository (a fresh temporary folder unless
# PALLAS_TUNE_BENCH_SMOKE_DIR names one; the smoke tests give each script its tmp_path).
SMOKE_DIR = ""  # Set below, once scratch() is defined.


def scratch(prefix: str) -> str:
    """A fresh temporary folder, removed when the process that made it exits (a pool worker
    too: multiprocessing runs its finalizers then; a forked child does not inherit them)."""
    import multiprocessing.util
    import shutil

    path = tempfile.mkdtemp(prefix=prefix)
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(path,),
                                  kwargs={"ignore_errors": True}, exitpriority=0)
    return path


if SMOKE:  # Each script's child processes write there too.
    SMOKE_DIR = os.environ.get(f"{SMOKE_ENV}_DIR") or scratch("pt-bench-smoke-")
    os.makedirs(SMOKE_DIR, exist_ok=True)
    os.environ[f"{SMOKE_ENV}_DIR"] = SMOKE_DIR


def smoke(full: Any, tiny: Any) -> Any:
    """``tiny`` in smoke mode (:data:`SMOKE`), else ``full``: a script's default size."""
    return tiny if SMOKE else full


def output(path: str) -> str:
    """Where to write ``path``: itself, except in smoke mode, where a path inside the repository
    (a committed result, landscape or cache) becomes the same path under :data:`SMOKE_DIR`, so
    that a smoke run never overwrites what is committed."""
    if not SMOKE or not path:
        return path
    full = os.path.abspath(path)
    if os.path.commonpath([full, REPO]) != REPO:
        return path
    return os.path.join(SMOKE_DIR, os.path.relpath(full, REPO))


def result(*parts: str) -> str:
    """A path under ``benchmarks/results/``."""
    return os.path.join(RESULTS, *parts)


def script(file: str) -> str:
    """``file``'s path from the repository root, with ``/``: how commands name a script
    (``benchmarks/<group>/<name>.py``)."""
    return os.path.relpath(os.path.abspath(file), REPO).replace(os.sep, "/")


def command(file: str, args: Sequence[str] | None = None, env: str = "") -> str:
    """The command line that runs the script ``file`` with ``args`` (default: this process's
    arguments), as a result records it: ``[ENV ]python benchmarks/<group>/<name>.py ARGS``."""
    words = [env, "python", script(file), *(sys.argv[1:] if args is None else args)]
    return " ".join(w for w in words if w)


def today() -> str:
    return datetime.date.today().isoformat()


def version(dist: str, missing: str = "not installed") -> str:
    """The installed version of the distribution ``dist``, or ``missing``."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return missing


def versions(*dists: str) -> str:
    """``"jax 0.7.2, libtpu 0.0.50"``: those of ``dists`` that are installed."""
    return ", ".join(f"{d} {v}" for d in dists if (v := version(d, "")))


def host() -> str:
    """This machine, as a result's header names it: its name, architecture and CPU count."""
    return f"{platform.node() or 'unknown'} ({platform.machine()}, {os.cpu_count()} CPU cores)"


def git(*args: str, check: bool = True) -> str:
    """``git ARGS`` in this checkout: its output, stripped."""
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True,
                          check=check).stdout.strip()


def git_show(rev: str, path: str) -> str:
    """The text of ``path`` (from the repository root) at the git revision ``rev``."""
    return subprocess.run(["git", "-C", REPO, "show", f"{rev}:{path}"], capture_output=True,
                          text=True, check=True).stdout


def table(columns: Sequence[str], rows: Iterable[Any],
          cells: Callable[[Any], Iterable[Any]] = lambda r: r) -> list[str]:
    """A Markdown table's lines: the header of ``columns``, then ``cells(row)`` for each row."""
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(str(c) for c in cells(r)) + " |" for r in rows])


def write(path: str | None, text: str, *, echo: bool = True) -> None:
    """Writes ``text`` to ``path`` (:func:`output`'s, in smoke mode) as it is (its folder made;
    nowhere where ``path`` is empty) and, with ``echo``, prints it."""
    path = output(path) if path else path
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if echo:
        print(text.rstrip("\n"))


def run_json(cmd: Sequence[str], *, env: Mapping[str, str] | None = None,
             cwd: str | None = None, input: str | None = None,
             timeout: float | None = None) -> Any:
    """Runs ``cmd`` with ``env`` added to this process's environment, and returns the JSON its
    last line of output holds; a non-zero exit raises, with the end of its stderr."""
    r = subprocess.run(list(cmd), capture_output=True, text=True, cwd=cwd, input=input,
                       timeout=timeout, env={**os.environ, **(env or {})}, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def have_libtpu(to: str = "estimate", *, stream: TextIO | None = None) -> bool:
    """Whether libtpu is installed (deviceless TPU compiles); if not, says so: nothing to
    ``to``."""
    from pallas_tune.feasibility import compile as _compile

    if _compile.libtpu_available():
        return True
    print(f"libtpu is not installed (pip install 'pallas-tune[tpu]'): nothing to {to}.",
          file=stream or sys.stdout)
    return False


STATIC_PROFILE = "--xla_jf_dump_static_llo_profile_to"


def static_profile_env(prefix: str, *, bundles: bool = False) -> str:
    """Call before JAX loads: JAX on the CPU, libtpu loadable beside another process's, and
    libtpu's static LLO profile of every compile (what its cycle estimate reads) dumped to a
    fresh folder (removed when this process exits), returned; with ``bundles``, to its ``sp/``, and the final VLIW bundles of every
    program to its ``jf/``. libtpu's own logs of this process go to a run directory of
    pallas-tune's (``PALLAS_TUNE_TPU_LOGS``), as the CLI's do, not to ``/tmp/tpu_logs``."""
    import atexit

    from pallas_tune.measure.logs import RunLogs

    own = RunLogs()
    os.environ.update(own.env)
    atexit.register(own.close)
    dump = scratch(prefix)
    os.environ["LIBTPU_INIT_ARGS"] = (
        f"{STATIC_PROFILE}={dump}/sp --xla_jf_dump_to={dump}/jf "
        "--xla_jf_dump_llo_pass_label_regex=final_bundles" if bundles
        else f"{STATIC_PROFILE}={dump}")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    return dump


def winner_rank(figures: Mapping[Any, float], winner: Any) -> int:
    """The real winner's rank under a figure (1 = best; smaller figures are better), ties
    broken against it: 1 + how many other configs the figure puts level with it or ahead. A
    figure that cannot tell configs apart (a roofline's memory-bound configs, a model with no
    per-step cost) gives them one value; a tune picks one of them, not the winner by right, so
    a tie is no evidence for it (were ties shared, a figure that ranks everything alike would
    put every winner first)."""
    w = figures[winner]
    return 1 + sum(1 for c, v in figures.items() if c != winner and v <= w)


def k95(ranks: Sequence[float]) -> float:
    """The least K with a real winner inside a figure's top K on at least 95% of keys (inf: on
    more than 5% of keys the winner has no figure; nan: no key): the estimate pages' K95."""
    if not ranks:
        return math.nan
    k = sorted(ranks)[math.ceil(0.95 * len(ranks)) - 1]
    return k if k == math.inf else math.ceil(k - 1e-9)
