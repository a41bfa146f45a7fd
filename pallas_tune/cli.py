"""``pallas-tune``: offline sweeps and cache inspection. The only module that prints.

    pallas-tune sweep MODULE:KERNEL --shapes "x=1024x1024:bfloat16,y=1024x1024:bfloat16" --trials 32
    pallas-tune sweep --space matmul            # kernel and shape sets from search_spaces/matmul.toml
    pallas-tune show [--kernel matmul] [--chip cpu]
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


class CLIUsageError(Exception):
    """Bad command-line input; printed without a traceback."""


def _load_kernel(ref: str) -> Any:
    from pallas_tune import _refs
    from pallas_tune.tunable import TunableKernel

    sys.path.insert(0, os.getcwd())
    try:
        obj = _refs.load(ref)
    except (ValueError, ImportError, AttributeError) as e:
        raise CLIUsageError(f"cannot load kernel {ref!r}: {e}") from None
    finally:
        sys.path.pop(0)
    if not isinstance(obj, TunableKernel):
        raise CLIUsageError(f"{ref} is not a @pallas_tune.tunable kernel (got {type(obj).__name__})")
    return obj


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
    kernel = _load_kernel(kernel_ref)
    from pallas_tune import chips

    if args.interpret is not None:
        os.environ["PALLAS_TUNE_INTERPRET"] = args.interpret
        from pallas_tune import _settings

        _settings.reload()
    chip = chips.normalize_chip(args.chip) if args.chip else chips.current_chip()
    options = _tune_options(args, chip)  # Bad values fail here, before any shape is tuned.
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
            result = kernel.tune(*call_args, options=_tune_options(args, chip), **call_kwargs)
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


# How `pallas-tune sweep` reads each TuneOptions field (its help is the field's documentation).
_OPTION_TYPES: dict[str, Any] = {
    **dict.fromkeys(("trials", "seed", "warm_start", "patience", "max_attempts", "warmup",
                     "repeats", "retime_top", "workers", "compile_workers"), int),
    **dict.fromkeys(("min_time_s", "max_time_s", "slow_factor", "vreg_limit"), float),
    **dict.fromkeys(("sampler", "storage", "study_name", "timer", "chip", "feasibility",
                     "estimate_fallback"), str),
    **dict.fromkeys(("isolate", "standin", "write"), bool),
    "timeout_s": "limits",
}
_OPTION_CHOICES = {"sampler": ("gp", "tpe"), "timer": ("auto", "wallclock", "profiler", "tpu-estimate"),
                   "feasibility": ("auto", "off", "model", "compile"),
                   "estimate_fallback": ("roofline",)}
_CLI_ONLY = ("callbacks",)  # Functions: from the API only.


def _add_tune_options(parser: argparse.ArgumentParser) -> None:
    from pallas_tune.tuning.options import TuneOptions

    group = parser.add_argument_group("tuning options (pallas_tune.TuneOptions)")
    for name, text in TuneOptions.help().items():
        if name in _CLI_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _OPTION_TYPES[name]
        text = text.replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        elif kind == "limits":
            group.add_argument(flag, type=_limits_arg, default=None, metavar="S|PHASE=S,...",
                               help=text)
        else:
            group.add_argument(flag, type=kind, default=None, choices=_OPTION_CHOICES.get(name),
                               help=text)


def _limits_arg(text: str) -> float | dict[str, float]:
    try:
        if "=" not in text:
            return float(text)
        return {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give seconds (e.g. 60) or phase=seconds pairs (e.g. trace=60,run=300)"
        ) from None


def _tune_options(args: argparse.Namespace, chip: str) -> Any:
    from pallas_tune.tuning.options import TuneOptions

    given = {n: getattr(args, n) for n in TuneOptions.names()
             if n not in _CLI_ONLY and getattr(args, n, None) is not None}
    given.setdefault("seed", 0)  # Sweeps are reproducible unless told otherwise.
    given["chip"] = chip
    if args.verbose:
        given["callbacks"] = (_print_trial,)
    return TuneOptions.build(**given)


def _print_trial(record: Any, progress: Any) -> None:
    del progress  # Unused.
    if record.duplicate_of is not None:
        what = f"same program as trial {record.duplicate_of}"
    elif record.outcome.timed:
        what = f"{record.outcome.value} {record.median_ms:.4g} ms"
    else:
        what = f"{record.outcome.value} ({record.error.splitlines()[0][:120] if record.error else ''})"
    print(f"  [{record.number:3d}] {_fmt_config(record.config)} -> {what}", flush=True)


def cmd_show(args: argparse.Namespace) -> int:
    from pallas_tune.cache import default_cache

    rows = []
    for _path, root, data in default_cache().scan():
        where = "shipped" if root != default_cache().user_root else "user"
        if "error" in data:
            rows.append(("?", "?", "?", f"UNREADABLE: {data['error']}", "", "", where))
            continue
        if args.kernel and args.kernel not in data.get("kernel", ""):
            continue
        if args.chip and data.get("chip") != args.chip:
            continue
        kind = data.get("kind", "measured")
        for key, entry in data["entries"].items():
            prov = entry.get("provenance", {})
            ms = entry.get("median_ms")
            label = prov.get("timer", "?") + (" (interpret)" if prov.get("interpret") else "")
            if kind != "measured":
                label = f"ESTIMATE: {label}"
            rows.append((data.get("kernel", "?"), data.get("chip", "?"), key,
                         _fmt_config(entry.get("config", {})),
                         "inf" if ms is None or math.isinf(ms) else f"{ms:.4g}", label, where))
    if not rows:
        print(f"no cache entries (looked in {default_cache().roots()})")
        return 0
    header = ("kernel", "chip", "key", "best config", "median_ms", "how", "cache")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    widths = [min(w, 70) for w in widths]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(str(c)[:w].ljust(w) for c, w in zip(r, widths, strict=True)))
    return 0


def cmd_feasibility(args: argparse.Namespace) -> int:
    from pallas_tune.feasibility import compile as _compile
    from pallas_tune.feasibility import inspect as _inspect
    from pallas_tune.feasibility import model as feasibility
    from pallas_tune.chips import chip_spec

    kernel = _load_kernel(args.kernel)
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
            except Exception as e:  # noqa: BLE001
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


def _fmt_config(config: dict[str, Any]) -> str:
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in config.items())


def _fmt_value(v: Any) -> str:
    if isinstance(v, list | tuple):
        return "(" + ",".join(str(x) for x in v) + ")"
    return str(v)


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
    _add_tune_options(s)
    s.set_defaults(func=cmd_sweep)
    f = sub.add_parser("feasibility", help="VMEM model (and compiler) verdict per candidate")
    f.add_argument("kernel", help="MODULE:NAME of a @tunable kernel")
    f.add_argument("--chip", default="v6e", help="v4, v5e, v5p, v6e, 7x or a device_kind")
    f.add_argument("--shapes", action="append", help="as for sweep")
    f.add_argument("--compile", action="store_true",
                   help="also compile each candidate deviceless (needs libtpu)")
    f.set_defaults(func=cmd_feasibility)
    sh = sub.add_parser("show", help="list what the caches hold")
    sh.add_argument("--kernel", help="only kernels whose name contains this")
    sh.add_argument("--chip", help="only this chip (e.g. cpu, tpu_v6e)")
    sh.set_defaults(func=cmd_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pallas_tune.errors import PallasTuneError

    try:
        return int(args.func(args) or 0)
    except (CLIUsageError, PallasTuneError) as e:
        print(f"pallas-tune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
