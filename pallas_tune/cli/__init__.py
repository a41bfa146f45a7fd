"""``pallas-tune``: offline sweeps and cache inspection. The only module that prints.

    pallas-tune sweep MODULE:KERNEL --shapes "x=1024x1024:bfloat16,y=1024x1024:bfloat16" --trials 32
    pallas-tune sweep --space matmul            # kernel and shape sets from search_spaces/matmul.toml
    pallas-tune show [--kernel matmul] [--chip cpu] [--trials [--key KEY]]

Kernels are imported from the installed packages and from ``--path DIR`` only: the current
directory is not searched (a ``jax.py`` lying there must not run). A ``--space`` file names a
module to import, like any config that names code; it is validated whole before that import.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["main"]

from pallas_tune.cli.options import _fmt_config, add_tune_options, tune_options  # noqa: E402

_tune_options = tune_options  # The name tests and older callers use.


class CLIUsageError(Exception):
    """Bad command-line input; printed without a traceback."""


@contextlib.contextmanager
def _import_path(paths: Sequence[str] = ()) -> Iterator[None]:
    """sys.path for importing kernels: the ``--path`` directories first, and without the current
    directory that ``python -m`` and ``-c`` put first (restored afterwards)."""
    saved = list(sys.path)
    here = os.path.realpath(os.getcwd())
    if sys.path and (sys.path[0] == "" or os.path.realpath(sys.path[0]) == here):
        del sys.path[0]
    sys.path[:0] = [os.path.abspath(p) for p in paths]
    try:
        yield
    finally:
        sys.path[:] = saved


def _load_kernel(ref: str, paths: Sequence[str] = ()) -> Any:
    from pallas_tune import _refs
    from pallas_tune.tunable import TunableKernel

    for p in paths:
        if not os.path.isdir(p):
            raise CLIUsageError(f"--path {p}: not a directory")
    with _import_path(paths):
        try:
            obj = _refs.load(ref)
        except (ValueError, ImportError, AttributeError) as e:
            hint = ("" if paths else " (the current directory is not searched: pass --path . "
                                     "to import kernels from files here)")
            raise CLIUsageError(f"cannot load kernel {ref!r}: {e}{hint}") from None
    if not isinstance(obj, TunableKernel):
        raise CLIUsageError(f"{ref} is not a @pallas_tune.tunable kernel (got {type(obj).__name__})")
    return obj


def _check_specs(specs: Sequence[str]) -> None:
    """Validates --shapes / [[shapes]] syntax before any kernel module is imported."""
    from pallas_tune import keys

    for spec in specs:
        try:
            keys.parse_key(spec)
        except ValueError as e:
            raise CLIUsageError(str(e)) from None


def _spec_items(spec: Any) -> str:
    """A shapes entry from a TOML file (a table) → the --shapes string form."""
    if isinstance(spec, str):
        return spec
    parts = []
    for k, v in spec.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        parts.append(f"{k}={v}")
    return ",".join(parts)


def build_call(kernel: Any, spec: str) -> tuple[list[Any], dict[str, Any]]:
    """Turns ``"x=1024x1024:bfloat16,causal=true"`` into (args, kwargs) of ShapeDtypeStructs."""
    import jax
    import jax.numpy as jnp

    from pallas_tune import keys

    try:
        parsed = keys.parse_key(spec)
    except ValueError as e:
        raise CLIUsageError(str(e)) from None

    def materialize(p: Any) -> Any:
        if p[0] == "array":
            try:
                dtype = jnp.dtype(p[2])
            except TypeError:
                raise CLIUsageError(f"unknown dtype {p[2]!r} in {spec!r}") from None
            return jax.ShapeDtypeStruct(p[1], dtype)
        if p[0] == "arrays":
            return tuple(materialize(x) for x in p[1])
        return p[1]

    values = {name: materialize(p) for name, p in parsed.items()}
    sig = inspect.signature(kernel.fn)
    try:
        bound = sig.bind_partial(**values)
    except TypeError as e:
        raise CLIUsageError(f"--shapes {spec!r} does not fit {kernel.name}{sig}: {e}") from None
    return list(bound.args), dict(bound.kwargs)


def _read_shapes(args: argparse.Namespace) -> list[str]:
    specs: list[str] = []
    for s in args.shapes or []:
        if s.startswith("@") or (os.path.isfile(s) and not "=" in s):
            path = s.lstrip("@")
            try:
                with open(path, encoding="utf-8") as f:
                    specs += [ln.strip() for ln in f if ln.strip() and not ln.startswith("#")]
            except OSError as e:
                raise CLIUsageError(f"cannot read shapes file {path}: {e}") from None
        else:
            specs.append(s)
    return specs


def cmd_sweep(args: argparse.Namespace) -> int:
    from pallas_tune.errors import PallasTuneError
    from pallas_tune.space import load_space

    kernel_ref = args.kernel
    specs = _read_shapes(args)
    if args.space:
        loaded = load_space(args.space)
        kernel_ref = kernel_ref or loaded["kernel"]
        if not specs:
            specs = [_spec_items(s) for s in loaded["shapes"]]
    if not kernel_ref:
        raise CLIUsageError("name the kernel (MODULE:NAME) or a --space file that names one")
    if not specs:
        raise CLIUsageError("give at least one --shapes (or a --space file with [[shapes]])")
    _check_specs(specs)
    kernel = _load_kernel(kernel_ref, args.path or ())
    from pallas_tune import chips

    if args.interpret is not None:
        os.environ["PALLAS_TUNE_INTERPRET"] = args.interpret
        from pallas_tune import _settings

        _settings.reload()
    chip = chips.normalize_chip(args.chip) if args.chip else chips.current_chip()
    options = tune_options(args, chip)  # Bad values fail here, before any shape is tuned.
    kind = "estimate" if options.timer == "tpu-estimate" else "measured"
    print(f"pallas-tune sweep: {kernel.name} on {chip} ({len(specs)} shape(s), "
          f"{options.trials} trials each, space of {kernel.space.size}, timer {options.timer})")
    failures = 0
    for spec in specs:
        call_args, call_kwargs = build_call(kernel, spec)
        key = kernel.cache_key(*call_args, **call_kwargs)
        user_file = kernel.cache.path(chip, kernel.name, kind=kind)
        found = kernel.cache.lookup(chip, kernel.name, key)
        if not args.force and found is not None and found[1] == user_file:
            print(f"  {key}: cached, skipped (--force re-tunes)")
            continue
        t0 = time.perf_counter()
        try:
            result = kernel.tune(*call_args, options=tune_options(args, chip), **call_kwargs)
        except (PallasTuneError, ValueError) as e:
            failures += 1
            print(f"  {key}: FAILED: {e}")
            continue
        counts = result.trials["outcome"].value_counts().to_dict()
        label = " (compiler estimate)" if kind == "estimate" else ""
        print(f"  {key}: best {result.best} {result.best_ms:.4g} ms{label} "
              f"({', '.join(f'{v} {k}' for k, v in counts.items())}; "
              f"{time.perf_counter() - t0:.1f}s) -> {result.cache_path}")
    return 1 if failures else 0


def _esc(value: Any, width: int | None = None) -> str:
    """Text safe for a terminal: control and format characters (escape sequences, bidi
    overrides) shown as Python escapes, never sent raw."""
    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                       for c in text)
    return text if width is None else text[:width]


def show_rows(reports: Sequence[Any]) -> list[tuple[str, ...]]:
    """Table rows (kernel, chip, key, best config, median_ms, how, cache) for ``show``."""
    rows = []
    for r in reports:
        where = ("shipped" if r.shipped else "user") + (" (recovered)" if r.role == "recovered"
                                                         else "")
        kernel = r.kernel or os.path.basename(r.path)
        if r.error is not None:
            rows.append((kernel, r.chip, "?", f"UNREADABLE: {r.error}", "", "", where))
            continue
        for damage in r.damage:
            rows.append((kernel, r.chip, "?", f"DAMAGED: {damage}", "", "", where))
        for e in r.entries:
            if e.problem is not None:
                rows.append((kernel, r.chip, e.key, f"SKIPPED: {e.problem}", "", "", where))
                continue
            how = (e.timer or "?") + (" (interpret)" if e.interpret else "")
            if r.kind != "measured":
                how = f"ESTIMATE: {how}"
            if e.outside_space:
                how += " (outside space)"
            ms = "-" if e.median_ms is None else f"{e.median_ms:.4g}"
            rows.append((kernel, r.chip, e.key, _fmt_config(e.config or {}), ms, how, where))
    return rows


def show_problems(reports: Sequence[Any]) -> list[str]:
    """One line per unreadable file, damaged line or skipped entry, in full."""
    out = []
    for r in reports:
        if r.error is not None:
            out.append(f"{r.path}: {r.error}")
        out += [f"{r.path}: {d}" for d in r.damage]
        out += [f"{r.path}, key {e.key!r}: {e.problem}" for e in r.entries if e.problem]
    return out


def cmd_show(args: argparse.Namespace) -> int:
    from pallas_tune import chips
    from pallas_tune.cache import default_cache
    from pallas_tune.cache.inventory import inventory

    cache = default_cache()
    chip = chips.normalize_chip(args.chip) if args.chip else None
    reports = inventory(cache, kernel=args.kernel, chip=chip)
    rows = show_rows(reports)
    if args.key:
        rows = [r for r in rows if args.key in r[2]]
    if not rows:
        print(_esc(f"no cache entries (looked in {cache.roots()})"))
        return 0
    header = ("kernel", "chip", "key", "best config", "median_ms", "how", "cache")
    rows = [tuple(_esc(c) for c in r) for r in rows]
    widths = [min(max(len(r[i]) for r in rows + [header]), 70) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c[:w].ljust(w) for c, w in zip(r, widths, strict=True)))
    problems = show_problems(reports)
    if problems:
        print("\nnot served (files are left as they are):")
        for line in problems:
            print(_esc(f"  {line}"))
    if args.trials:
        _print_trials(reports, args.key)
    return 0


def _print_trials(reports: Sequence[Any], key_filter: str | None) -> None:
    from pallas_tune.cache.inventory import trial_history

    for r in reports:
        for e in r.entries:
            if key_filter and key_filter not in e.key:
                continue
            runs, bad = trial_history(r, e.key)
            where = r.ledger or r.path
            print()
            print(_esc(f"{r.kernel or '?'} on {r.chip}, {e.key}: {len(runs)} tuning run(s) "
                       f"in {where}" + (f" ({bad} unreadable ledger lines skipped)" if bad
                                        else "")))
            for run in runs:
                written = run.get("written") or "?"
                trials = run.get("trials") if isinstance(run.get("trials"), list) else []
                print(_esc(f"  run written {written}: {len(trials)} trials"))
                for t in trials:
                    if not isinstance(t, dict):
                        print(_esc(f"    (not a trial record: {t!r:.60})"))
                        continue
                    ms = t.get("median_ms")
                    ms_text = f"{ms:.4g}" if isinstance(ms, int | float) and not isinstance(
                        ms, bool) and math.isfinite(ms) else "-"
                    config = t.get("config") if isinstance(t.get("config"), dict) else {}
                    error = f"  {t['error']}" if isinstance(t.get("error"), str) else ""
                    print(_esc(f"    #{t.get('number', '?')!s:>4} "
                               f"{t.get('outcome', '?')!s:14} {ms_text:>10}  "
                               f"{_fmt_config(config)}{error}", 200))


def cmd_feasibility(args: argparse.Namespace) -> int:
    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model as feasibility

    kernel = _load_kernel(args.kernel, args.path or ())
    try:
        spec = chip_spec(args.chip)
    except ValueError as e:
        raise CLIUsageError(str(e)) from None
    if args.compile and not _compile.libtpu_available():
        raise CLIUsageError("--compile needs libtpu: pip install 'pallas-tune[tpu]'")
    specs = _read_shapes(args)
    if not specs:
        raise CLIUsageError("give at least one --shapes")
    for shape in specs:
        call_args, call_kwargs = build_call(kernel, shape)
        print(f"{kernel.name} on {spec.name} for {shape} (scoped VMEM default "
              f"{spec.scoped_vmem_default_bytes / 2**20:.0f} MiB)")
        header = f"  {'config':60s} {'model':11s} {'est MiB':>8s} {'limit':>6s} {'vreg':>5s}"
        print(header + ("  compiler" if args.compile else ""))
        counts: dict[str, int] = {}
        for config in kernel.space:
            try:
                calls = _inspect.find_pallas_calls(kernel.fn, call_args, {**call_kwargs, **config})
            except Exception as e:
                print(f"  {_fmt_config(config):60s} trace error: {str(e)[:80]}")
                continue
            v = feasibility.model_verdict(calls, spec)
            line = (f"  {_fmt_config(config)[:60]:60s} {v.status:11s} "
                    f"{v.vmem_bytes / 2**20:8.2f} {v.limit_bytes / 2**20:6.0f} "
                    f"{v.vreg_pressure:5.1f}")
            key = f"model {v.status}"
            if args.compile:
                r = _compile.compile_deviceless(kernel.fn, call_args, {**call_kwargs, **config},
                                                chip=spec.name)
                used = f" {r.scoped_vmem_bytes / 2**20:.2f} MiB" if r.scoped_vmem_bytes else ""
                line += f"  {r.kind}{used} ({r.compile_s:.1f}s)"
                key += f" / compiler {r.kind}"
            counts[key] = counts.get(key, 0) + 1
            print(line)
        print("  summary: " + ", ".join(f"{k}: {n}" for k, n in sorted(counts.items())))
    return 0




def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pallas-tune", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sweep", help="tune a kernel for a list of argument shapes")
    s.add_argument("kernel", nargs="?", help="MODULE:NAME of a @tunable kernel")
    s.add_argument("--shapes", action="append",
                   help='e.g. "x=1024x1024:bfloat16,y=1024x1024:bfloat16" (repeatable), or '
                        "@FILE with one such line per shape")
    s.add_argument("--space", help="a search_spaces/ file name or path; supplies the kernel and "
                                   "shape sets when not given")
    s.add_argument("--force", action="store_true", help="re-tune keys already in the user cache")
    s.add_argument("--interpret", choices=("auto", "1", "0"), default=None)
    s.add_argument("-v", "--verbose", action="store_true", help="print every trial")
    add_tune_options(s)
    s.add_argument("--path", action="append", metavar="DIR",
                   help="also import kernels from DIR (repeatable; e.g. --path . for a kernel in "
                        "a file here: the current directory is not searched otherwise)")
    s.set_defaults(func=cmd_sweep)
    f = sub.add_parser("feasibility", help="VMEM model (and compiler) verdict per candidate")
    f.add_argument("kernel", help="MODULE:NAME of a @tunable kernel")
    f.add_argument("--chip", default="v6e", help="v4, v5e, v5p, v6e, 7x or a device_kind")
    f.add_argument("--shapes", action="append", help="as for sweep")
    f.add_argument("--compile", action="store_true",
                   help="also compile each candidate deviceless (needs libtpu)")
    f.add_argument("--path", action="append", metavar="DIR",
                   help="also import kernels from DIR (repeatable)")
    f.set_defaults(func=cmd_feasibility)
    sh = sub.add_parser("show", help="list what the caches hold")
    sh.add_argument("--kernel", help="only kernels whose name contains this")
    sh.add_argument("--chip", help="only this chip (e.g. cpu, tpu_v6e, v6e)")
    sh.add_argument("--key", help="only keys containing this")
    sh.add_argument("--trials", action="store_true",
                    help="also print the trial history of each entry shown (from the ledger)")
    sh.set_defaults(func=cmd_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pallas_tune.errors import PallasTuneError

    try:
        with _import_path():
            return int(args.func(args) or 0)
    except (CLIUsageError, PallasTuneError) as e:
        print(_esc(f"pallas-tune {args.command}: error: {e}").replace("\\n", "\n"),
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
