"""``pallas-tune``: offline sweeps, reports and cache tools. The only part that prints.

    pallas-tune sweep MODULE:KERNEL --shapes "x=1024x1024:bfloat16,y=1024x1024:bfloat16" --trials 32
    pallas-tune sweep --space matmul            # kernel and shape sets from search_spaces/matmul.toml
    pallas-tune sweep --from-record misses.jsonl   # the shapes production met (PALLAS_TUNE_RECORD)
    pallas-tune sweep --program mylib.train:step --path . --shapes "x=...,w=..."  # a whole step
    pallas-tune show [--kernel matmul] [--chip v6e] [--format table|json|csv] [--trials]
    pallas-tune check [PATH ...]                # non-zero exit on a problem (for a library's CI)
    pallas-tune check [PATH ...] --space NAME --chip v6e   # ... or on a shape without an entry
    pallas-tune merge FILE ... [--into ROOT]    # merge cache files other hosts wrote into yours
    pallas-tune report --kernel matmul [--key KEY] [--out DIR]
    pallas-tune recheck-xla MODULE:KERNEL --chip v6e   # XLA beside estimate entries tuned without it

Exit status: 0 success, 1 a failure (a shape that failed to tune, a cache problem found by
check), 2 a usage error (bad flags or specs), 130 interrupted (Ctrl-C; the sweep resumes), 143
terminated (SIGTERM, as a scheduler or a preempted host sends it: handled like Ctrl-C).
Errors go to stderr.

Kernels are imported from the installed packages and from ``--path DIR`` only: the current
directory is not searched (a ``jax.py`` lying there must not run), and a module in DIR never
replaces the standard library, a dependency or an installed package (such a file is skipped
with a warning; see :mod:`pallas_tune.cli.pathdirs`). A ``--space`` file names a
module to import, like any config that names code; it is validated whole before that import.
``--space NAME`` (a bare name) is a shipped space, never a file of that name here: a file is
given as a path (``./NAME``, ``DIR/NAME.toml``, ``NAME.toml``).
A cache file or a record is data, not config: the kernels they name are imported only when the
user allowed it (``--import MODULE``, ``--path DIR``, an entry point a package declares, or a
kernel shipped in pallas-tune; see :mod:`pallas_tune.cli.registry`).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

__all__ = ["main"]

from pallas_tune.cli import edge  # noqa: E402
from pallas_tune.cli.options import _fmt_config, add_tune_options, tune_options  # noqa: E402
from pallas_tune.cli.registry import add_import_option  # noqa: E402
from pallas_tune.cli.shapes import (  # noqa: E402
    CLIUsageError,
    build_call,
    read_shapes,
    spec_items,
)

if TYPE_CHECKING:
    from pallas_tune.cli.edge import FeasibilityRequest

_tune_options = tune_options  # The names tests and older callers use.
_spec_items = spec_items
_read_shapes = read_shapes


from pallas_tune.cli.show import _esc, cmd_show, show_problems, show_rows  # noqa: E402
from pallas_tune.cli.sweep import cmd_sweep  # noqa: E402
from pallas_tune.cli.sweep import import_path as _import_path  # noqa: E402
from pallas_tune.cli.sweep import load_kernel as _load_kernel  # noqa: E402


def cmd_feasibility(request: FeasibilityRequest) -> int:
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model as feasibility

    kernel = _load_kernel(request.kernel, request.paths)
    spec = request.chip
    for shape in request.shapes:
        call_args, call_kwargs = build_call(kernel, shape)
        print(f"{kernel.name} on {spec.name} for {shape} (scoped VMEM default "
              f"{spec.scoped_vmem_default_bytes / 2**20:.0f} MiB)")
        configs = list(kernel.space)
        texts, fixed = _varied_texts(configs)  # Whole, never cut: only what differs.
        if fixed:
            print(f"  same in every config: {fixed}")
        width = max(len("config"), *map(len, texts)) if texts else len("config")
        header = (f"  {'config':{width}s}  {'model':11s} {'est MiB':>8s} {'limit':>6s} "
                  f"{'vreg':>5s}")
        print(header + ("  compiler" if request.compile else ""))
        counts: dict[str, int] = {}
        for config, text in zip(configs, texts, strict=True):
            try:
                calls = _inspect.find_pallas_calls(kernel.fn, call_args, {**call_kwargs, **config})
            except Exception as e:
                print(f"  {text:{width}s}  trace error: {str(e)[:80]}")
                continue
            v = feasibility.model_verdict(calls, spec)
            line = (f"  {text:{width}s}  {v.status:11s} "
                    f"{v.vmem_bytes / 2**20:8.2f} {v.limit_bytes / 2**20:6.0f} "
                    f"{v.vreg_pressure:5.1f}")
            key = f"model {v.status}"
            if request.compile:
                r = _compile.compile_deviceless(kernel.fn, call_args, {**call_kwargs, **config},
                                                chip=spec.name)
                used = f" {r.scoped_vmem_bytes / 2**20:.2f} MiB" if r.scoped_vmem_bytes else ""
                line += f"  {r.kind}{used} ({r.compile_s:.1f}s)"
                key += f" / compiler {r.kind}"
            counts[key] = counts.get(key, 0) + 1
            print(line)
        print("  summary: " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())))
    return 0


def _varied_texts(configs: list[dict[str, Any]]) -> tuple[list[str], str]:
    """Each config as text with only the parameters whose value differs across ``configs``
    (so that no two rows read the same), and the parameters every config shares, as text."""
    names = list(dict.fromkeys(k for c in configs for k in c))
    same = [n for n in names if len({repr(c.get(n)) for c in configs}) == 1]
    texts = [_fmt_config({k: v for k, v in c.items() if k not in same}) or "(the one config)"
             for c in configs]
    return texts, _fmt_config({n: configs[0][n] for n in same if n in configs[0]})




def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("pallas-tune")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _sweep_parser(sub: Any) -> None:
    s = sub.add_parser("sweep", help="tune a kernel for a list of argument shapes (resumable; "
                                     "any number of workers may share one --storage)")
    s.add_argument("kernel", nargs="?", help="MODULE:NAME of a @tunable kernel")
    s.add_argument("--shapes", action="append",
                   help='e.g. "x=1024x1024:bfloat16,y=1024x1024:bfloat16" (repeatable), or '
                        "@FILE with one such line per shape")
    s.add_argument("--space", help="a shipped space's name (matmul: search_spaces/matmul.toml; "
                                   "never a file here), or a file given as a path (./NAME, "
                                   "DIR/NAME.toml, NAME.toml); supplies the kernel and shape "
                                   "sets when not given")
    s.add_argument("--program", metavar="MODULE:FN",
                   help="tune every tunable call of a whole program (a training or serving "
                        "step) at once; --shapes gives FN's own arguments")
    s.add_argument("--from-record", metavar="FILE",
                   help="tune exactly the shapes a program met and missed in the cache "
                        "(a file written with PALLAS_TUNE_RECORD=FILE)")
    s.add_argument("--no-storage", action="store_true",
                   help="keep studies in memory only (not resumable). Without --storage they "
                        "live in an SQLite file in the user cache directory")
    s.add_argument("--force", action="store_true",
                   help="re-tune keys already in the user cache (resuming their stored studies); "
                        "entries tuned on other code of the kernel are re-tuned without it")
    s.add_argument("--fresh-study", action="store_true",
                   help="delete each shape's stored study first and start over (run it on one "
                        "worker, then start the others; changed kernel code gets new studies "
                        "by itself, unless --study-name is given)")
    s.add_argument("--interpret", choices=("auto", "1", "0"), default=None)
    out = s.add_mutually_exclusive_group()
    out.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    out.add_argument("-q", "--quiet", action="store_true",
                     help="print nothing but errors (no progress display)")
    add_tune_options(s)
    s.add_argument("--path", action="append", metavar="DIR",
                   help="also import kernels from DIR (repeatable; e.g. --path . for a kernel in "
                        "a file here: the current directory is not searched otherwise)")
    add_import_option(s, "--from-record tunes only the shipped kernels and those of --import "
                         "modules, --path directories or declared entry points: a record "
                         "naming a module never gets it imported")
    s.set_defaults(func=cmd_sweep)


def _tool_parsers(sub: Any) -> None:
    from pallas_tune.cli import check as _check
    from pallas_tune.cli import recheck as _recheck
    from pallas_tune.cli import report as _report

    sh = sub.add_parser("show", help="list what the caches hold")
    sh.add_argument("--kernel", help="only kernels whose name contains this")
    sh.add_argument("--chip", help="only this chip (e.g. cpu, tpu_v6e, v6e, 'TPU v6 lite')")
    sh.add_argument("--key", help="only keys containing this")
    sh.add_argument("--format", choices=("table", "json", "csv"), default="table")
    sh.add_argument("--trials", action="store_true",
                    help="also print the trial history of each entry shown (from the ledger)")
    add_import_option(sh, "entries are checked against the shipped kernels and those of "
                          "--import modules, --path directories or declared entry points; a "
                          "file naming a module never gets it imported")
    sh.add_argument("--path", action="append", metavar="DIR",
                    help="also import the kernels that files name from DIR (repeatable)")
    sh.set_defaults(func=cmd_show)
    _check.add_parsers(sub)
    _report.add_parser(sub)
    _recheck.add_parser(sub)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pallas-tune", description=__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pallas-tune {_version()}")
    sub = p.add_subparsers(dest="command", required=True)  # Its parsers are _Parsers too.
    p.commands = sub.choices
    _sweep_parser(sub)
    f = sub.add_parser("feasibility", help="VMEM model (and compiler) verdict per candidate")
    f.add_argument("kernel", help="MODULE:NAME of a @tunable kernel")
    f.add_argument("--chip", default="v6e", help="v4, v5e, v5p, v6e, 7x or a device_kind")
    f.add_argument("--shapes", action="append", help="as for sweep")
    f.add_argument("--compile", action="store_true",
                   help="also compile each candidate deviceless (needs libtpu)")
    f.add_argument("--path", action="append", metavar="DIR",
                   help="also import kernels from DIR (repeatable)")
    f.set_defaults(func=cmd_feasibility)
    _tool_parsers(sub)
    return p


class _Parser(argparse.ArgumentParser):
    """argparse with a "did you mean" for a misspelt command, choice or option, and an
    option no subcommand knows reported under that subcommand's usage (argparse's own puts
    it under the top-level usage, which lists no option of the subcommand)."""

    commands: dict[str, argparse.ArgumentParser] | None = None

    def parse_args(self, args: Any = None, namespace: Any = None) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            sub = (self.commands or {}).get(getattr(parsed, "command", None) or "", self)
            sub.error(f"unrecognized arguments: {' '.join(extras)}"
                      + _suggestion(extras, _option_strings(sub)))
        return parsed

    def error(self, message: str) -> Any:  # type: ignore[override]
        import re

        m = re.search(r"invalid choice: (['\"]?)(.*?)\1 \(choose from", message)
        if m:
            for action in self._actions:
                if action.choices and f"argument {_action_name(action)}:" in message:
                    message += _suggestion([m.group(2)], [str(c) for c in action.choices])
        super().error(message)


def _action_name(action: argparse.Action) -> str:
    """The name argparse gives an argument in its messages."""
    if action.option_strings:
        return "/".join(action.option_strings)
    return str(action.metavar or action.dest)


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [o for a in parser._actions for o in a.option_strings]


def _suggestion(words: Sequence[str], known: Sequence[str]) -> str:
    """"; did you mean --chip?" for the first word close to a known one, else ""."""
    import difflib

    for word in words:
        close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


# The commands that may load libtpu in this process.
_COMPILING = frozenset({"sweep", "feasibility", "recheck-xla"})


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status (see the module docstring)."""
    args = build_parser().parse_args(argv)
    command, run = args.command, args.func  # Which command; the edge reads every other flag.
    from pallas_tune.errors import (DiskFullError, PallasTuneError, SearchSpaceError,
                                    TuneOptionError, is_disk_full)

    terminated: list[int] = []
    try:
        with _import_path(), _sigterm_as_interrupt(terminated):
            # Inside the guard: the probe imports jax, never the current directory's jax.py.
            from pallas_tune.chips import quiet_tpu_probe_env

            os.environ.update(quiet_tpu_probe_env())  # No TPU here: no libtpu probing noise.
            if command in _COMPILING:
                from pallas_tune.measure.logs import RunLogs

                # This process's own libtpu (deviceless compiles) logs in a run directory of
                # its own, set before libtpu loads; its workers' get theirs, within a bound.
                own = RunLogs()
                os.environ.update(own.env)
                atexit.register(own.close)
            request = edge.convert(args)  # Every flag checked, once, before any work.
            return int(run(request) or 0)
    except KeyboardInterrupt:
        print(f"pallas-tune {command}: interrupted", file=sys.stderr, flush=True)
        return 143 if terminated else 130
    except SystemExit as e:
        if e.code == 130:
            return 143 if terminated else 130
        raise
    except (CLIUsageError, TuneOptionError, SearchSpaceError) as e:  # Bad input given.
        _error(command, e)
        return 2
    except DiskFullError as e:  # Its message may speak to API users (the error's .result).
        _error(command, _disk_full_text(e))
        return 1
    except (PallasTuneError, OSError) as e:
        _error(command, e)
        return 1
    except Exception as e:  # A database's "disk is full" (SQLAlchemy, Optuna): one line too.
        if not is_disk_full(e):
            raise
        _error(command, f"the disk is full ({type(e).__name__}: "
                        f"{str(e).strip().splitlines()[0][:300]}); free space and run it "
                        "again (what finished is kept)")
        return 1


def _disk_full_text(e: BaseException) -> str:
    """A full disk in the words of a command-line user: where the tune's work is and what to
    do, for a tune that finished but whose entry could not be written (the API's error keeps
    that tune on its ``.result``, which a command line cannot reach)."""
    result = getattr(e, "result", None)
    if result is None:
        return str(e)
    cause = e.__cause__ or e.__context__
    lines = str(cause).strip().splitlines() if cause is not None else []
    why = f" ({type(cause).__name__}: {lines[0][:300]})" if lines else ""
    storage = getattr(result.options, "storage", None)
    if storage:
        import re

        shown = re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", storage)  # No password shown.
        kept = (f"its trials are kept in the study storage {shown}: free space and run the "
                "same command again, which resumes from them and writes the entry")
    else:
        kept = ("its trials were not kept (--no-storage): free space and run the command "
                "again (without --no-storage a sweep keeps its trials and resumes)")
    return (f"the disk is full{why}: the tune of {result.key} finished (best {result.best}, "
            f"{result.best_ms:.4g} ms) but its cache entry could not be written; {kept}. Or "
            "point PALLAS_TUNE_CACHE_DIR (and PALLAS_TUNE_TPU_LOGS, --storage) at a disk with "
            "room.")


@contextlib.contextmanager
def _sigterm_as_interrupt(terminated: list[int]):
    """SIGTERM raises KeyboardInterrupt in the main thread while a command runs, so a stop from
    a job scheduler or a host's preemption saves what finished and prints the resume line, as
    Ctrl-C does (``terminated`` records that it was SIGTERM: exit status 143)."""
    def handler(signum, frame):
        terminated.append(signum)
        raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # main() called from another thread: signals stay as they are.
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _error(command: str, e: BaseException) -> None:
    print(_esc(f"pallas-tune {command}: error: {e}").replace("\\n", "\n"), file=sys.stderr,
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
