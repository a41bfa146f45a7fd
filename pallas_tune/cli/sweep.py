"""``pallas-tune sweep``: tune a kernel for a list of shapes, in any number of processes.

Every sweep keeps its studies in an Optuna storage: ``--storage URL`` (PostgreSQL for many
hosts), else the embedded default (SQLite in the user cache directory), or none with
``--no-storage``. The same command run again resumes; run on several hosts at once it shares
the work (see :mod:`pallas_tune.tuning.storage`).
"""

from __future__ import annotations

import argparse
import json
import os
import math
import shlex
import sys
import time
from typing import Any

from pallas_tune.cli.options import tune_options
from pallas_tune.cli.registry import KernelRegistry, import_path, load_kernel
from pallas_tune.cli.shapes import (
    CLIUsageError,
    build_call,
    check_specs,
    read_shapes,
    read_text,
    spec_items,
)
from pallas_tune.measure.records import describe_tally

# import_path and load_kernel live in cli.registry (what may be imported); re-exported here.
__all__ = ["cmd_sweep", "import_path", "load_kernel", "read_record"]


def read_record(path: str) -> dict[str, list[str]]:
    """``PALLAS_TUNE_RECORD`` lines -> {kernel ref: [shape specs]} (each once, in order).
    Lines that are not records are skipped with a warning (the file is production's)."""
    jobs: dict[str, list[str]] = {}
    bad = 0
    for line in read_text(path, "--from-record", errors="replace").splitlines():
        try:
            rec = json.loads(line)
            ref, spec = rec["ref"], rec["shapes"]
            if not isinstance(ref, str) or not isinstance(spec, str):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            bad += line.strip() != ""
            continue
        specs = jobs.setdefault(ref, [])
        if spec not in specs:
            specs.append(spec)
    if bad:
        print(f"pallas-tune sweep: warning: {bad} line(s) of {path} are not records; skipped",
              file=sys.stderr)
    if not jobs:
        raise CLIUsageError(f"--from-record {path}: no records in it (set PALLAS_TUNE_RECORD="
                            f"{path} while the program runs to record its cache misses)")
    return jobs


def _jobs(args: argparse.Namespace) -> tuple[list[tuple[str, list[str]]], int]:
    """(kernel ref, shape specs) to tune, and how many recorded kernels were skipped."""
    from pallas_tune.space import load_space

    specs = read_shapes(args)
    if args.from_record:
        if specs or args.space:
            raise CLIUsageError("--from-record names the shapes: give no --shapes or --space")
        jobs = read_record(args.from_record)
        if args.kernel:  # Named by the user: imported like any MODULE:NAME argument.
            jobs = {r: s for r, s in jobs.items() if r == args.kernel}
            if not jobs:
                raise CLIUsageError(f"--from-record {args.from_record} has no record of "
                                    f"{args.kernel}")
            return list(jobs.items()), 0
        return _allowed_records(args, jobs)
    kernel_ref = args.kernel
    if args.space:
        loaded = load_space(args.space)
        kernel_ref = kernel_ref or loaded["kernel"]
        if not specs:
            specs = [spec_items(s) for s in loaded["shapes"]]
    if not kernel_ref:
        raise CLIUsageError("name the kernel (MODULE:NAME), a --space file that names one, or "
                            "--from-record FILE")
    if not specs:
        raise CLIUsageError("give at least one --shapes (or a --space file with [[shapes]])")
    return [(kernel_ref, specs)], 0


def _allowed_records(args: argparse.Namespace, jobs: dict[str, list[str]]
                     ) -> tuple[list[tuple[str, list[str]]], int]:
    """The records whose kernel the user allowed to import (:mod:`pallas_tune.cli.registry`);
    the others are skipped with a line naming the flag that allows them."""
    registry = KernelRegistry(args.imports or (), args.path or ())
    allowed = []
    for ref, specs in jobs.items():
        why = registry.ref_problem(ref)
        if why is None:
            allowed.append((ref, specs))
        else:
            print(f"pallas-tune sweep: skipped the {len(specs)} recorded shape(s) of {ref}: "
                  f"{why}", file=sys.stderr, flush=True)
    return allowed, len(jobs) - len(allowed)


def _storage(args: argparse.Namespace) -> str | None:
    """The storage URL, checked (an SQLite file given must be a database); nothing created."""
    from pallas_tune.tuning.storage import check_url, default_storage_url

    if args.no_storage:
        if args.storage:
            raise CLIUsageError("give --storage or --no-storage, not both")
        return None
    if args.storage:
        check_url(args.storage, files=True)
        return args.storage
    args.default_storage = True
    return default_storage_url(create=False)


def _prepare(args: argparse.Namespace, write: bool) -> None:
    """Creates what the sweep writes to, once every input is checked (a usage error creates
    nothing): the cache directory and the default storage's; then opens the storage."""
    from pallas_tune.cache import default_cache
    from pallas_tune.errors import PallasTuneError
    from pallas_tune.tuning.storage import open_storage, storage_dir

    root = default_cache().user_root
    fix = "set PALLAS_TUNE_CACHE_DIR to a writable directory"
    if os.path.lexists(root) and not os.path.isdir(root):
        raise PallasTuneError(f"the cache directory {root} is a file, not a directory (left as "
                              f"it is); {fix}")
    default = getattr(args, "default_storage", False)
    if args.storage and not default:
        open_storage(args.storage)  # Unreachable or driverless: say so before any work.
    dirs = ([root] if write else []) + ([storage_dir()] if default else [])
    for d in dirs:
        what, how = ("cache", fix) if d == root else (
            "study", f"{fix} (or PALLAS_TUNE_STORAGE_DIR), or pass --no-storage or --storage URL")
        try:
            os.makedirs(d, exist_ok=True)
        except OSError as e:
            raise PallasTuneError(f"cannot create the {what} directory {d} "
                                  f"({e.strerror or e}); {how}") from None
        if not os.access(d, os.W_OK):
            raise PallasTuneError(f"the {what} directory {d} is not writable; {how}")
    if default:
        open_storage(args.storage)


def cmd_sweep(args: argparse.Namespace) -> int:
    if getattr(args, "program", None):
        return _sweep_program(args)
    jobs, skipped = _jobs(args)
    if not jobs:  # Every recorded kernel was skipped (each said why): nothing to set up.
        print(f"pallas-tune sweep: nothing tuned: all {skipped} recorded kernel(s) were "
              "skipped", file=sys.stderr)
        return 1
    for _, specs in jobs:
        check_specs(specs)
    from pallas_tune import chips

    if args.interpret is not None:
        os.environ["PALLAS_TUNE_INTERPRET"] = args.interpret
        from pallas_tune import _settings

        _settings.reload()
    chip = chips.normalize_chip(args.chip) if args.chip else chips.current_chip()
    args.storage = _storage(args)
    options = tune_options(args, chip)  # Bad values fail here, before any shape is tuned.
    loaded = []
    for kernel_ref, specs in jobs:  # Every kernel and spec checked before anything is made.
        kernel = load_kernel(kernel_ref, args.path or ())
        loaded.append((kernel, [(spec, *build_call(kernel, spec)) for spec in specs]))
    _prepare(args, options.write)
    failures = 0
    for kernel, calls in loaded:
        failures += _sweep_kernel(args, kernel, chip, calls)
    return 1 if failures or skipped else 0


def _sweep_program(args: argparse.Namespace) -> int:
    """``--program MODULE:FN``: every tunable call of a whole program (see cli.program)."""
    from pallas_tune import chips
    from pallas_tune.cli.program import cmd_program

    if args.kernel or args.space or args.from_record:
        raise CLIUsageError("--program tunes a whole program: give it without a kernel, "
                            "--space or --from-record")
    specs = read_shapes(args)
    if not specs:
        raise CLIUsageError("--program needs --shapes with the program's arguments, e.g. "
                            "--shapes 'x=2048x4096:bfloat16,w=4096x4096:bfloat16'")
    check_specs(specs)
    chip = chips.normalize_chip(args.chip) if args.chip else chips.current_chip()
    args.storage = _storage(args)
    options = tune_options(args, chip)
    _prepare(args, options.write)
    return cmd_program(args, specs, options)


def _say(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        print(text, flush=True)


def _sweep_kernel(args: argparse.Namespace, kernel: Any, chip: str,
                  calls: list[tuple[str, list[Any], dict[str, Any]]]) -> int:
    options = tune_options(args, chip)
    if options.grad:
        _check_grad(kernel)
    where = args.storage or "no storage (--no-storage: not resumable)"
    backward = f", then its backward ({_backward_label(kernel)})" if options.grad else ""
    _say(args, f"pallas-tune sweep: {kernel.name} on {chip} ({len(calls)} shape(s), "
               f"{options.trials} trials each, space of {kernel.space.size}, timer "
               f"{options.timer}; studies in {where}){backward}")
    failures = 0
    for i, (_, call_args, call_kwargs) in enumerate(calls):
        label = f"[{i + 1}/{len(calls)}]"
        failures += _sweep_shape(args, kernel, chip, label, call_args, call_kwargs)
        if options.grad and kernel.backward_backend == "pallas":
            # The backward, for the backward arguments of this shape (its own key and entry).
            from pallas_tune.tuning.grad import backward_call

            bwd_args, bwd_kwargs = backward_call(kernel, call_args, call_kwargs,
                                                 options.seed or 0)
            failures += _sweep_shape(args, kernel.backward, chip, f"{label} backward",
                                     bwd_args, bwd_kwargs)
    return failures


def _check_grad(kernel: Any) -> None:
    from pallas_tune.errors import TuneOptionError
    from pallas_tune.tuning.grad import check_grad

    try:
        check_grad(kernel)
    except TuneOptionError as e:
        raise CLIUsageError(f"--grad: {e}") from None


def _backward_label(kernel: Any) -> str:
    if kernel.backward_backend == "xla":
        return "xla: jax.vjp of the reference, no kernel to tune"
    return f"Pallas kernel {kernel.backward.name}"


def _sweep_shape(args: argparse.Namespace, kernel: Any, chip: str, label: str,
                 call_args: list[Any], call_kwargs: dict[str, Any]) -> int:
    """Tunes one shape of one kernel unless cached; the number of failures (0 or 1)."""
    from pallas_tune.errors import DiskFullError, PallasTuneError

    options = tune_options(args, chip)
    kind = "estimate" if options.timer == "tpu-estimate" else "measured"
    key = kernel.cache_key(*call_args, **call_kwargs)
    user_file = kernel.cache.path(chip, kernel.name, kind=kind)
    found = kernel.cache.lookup(chip, kernel.name, key)
    if not args.force and found is not None and found[1] == user_file:
        stale = _stale(kernel, found[0])
        if stale is None:
            _say(args, f"  {key}: cached, skipped (--force re-tunes)")
            return 0
        _say(args, f"  {key}: {stale}; re-tuning")
    if args.fresh_study and args.storage:
        from pallas_tune.tuning.study import study_name

        _delete_study(args.storage, options.study_name or study_name(kernel, chip, key))
    progress = _progress(args, kernel, options, f"{label} {key}")
    t0 = time.perf_counter()
    try:  # grad=False: a sweep tunes the backward as a shape of its own (skipped if cached).
        result = kernel.tune(*call_args, options=tune_options(
            args, chip, callbacks=(progress.callback,) if progress else (), grad=False),
            **call_kwargs)
    except KeyboardInterrupt:
        if progress:
            progress.close()
        _interrupted(args, key)
        raise SystemExit(130) from None
    except DiskFullError:
        raise  # Every shape after would fail the same way: stop, with the one error.
    except (PallasTuneError, ValueError) as e:
        print(f"pallas-tune sweep: {key}: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if progress:
            progress.close()
    label = " (compiler estimate)" if kind == "estimate" else ""
    if math.isfinite(result.speedup):  # Both from the final re-ranking: like with like.
        label += f", default {result.default_ms:.4g} ms ({result.speedup:.2f}x)"
    if result.implementation == "xla":  # What calls will run, not only what Pallas can do.
        label += (f"; XLA {result.xla_ms:.4g} ms is faster: calls run XLA (the kernel's "
                  "reference), not this config")
    _say(args, f"  {key}: best {result.best} {result.best_ms:.4g} ms{label} "
               f"({describe_tally(result.tally)}; {time.perf_counter() - t0:.1f}s) -> "
               f"{result.cache_path or 'not written (--no-write)'}")
    return 0


def _stale(kernel: Any, entry: dict[str, Any]) -> str | None:
    """Why a cached entry is not done though present: tuned on other code of the kernel (an
    entry recording no fingerprint, or a malformed one, counts as done, as before)."""
    from pallas_tune import _kernel_hash

    recorded, _ = _kernel_hash.recorded(entry.get("provenance"))
    if _kernel_hash.state(recorded, kernel.fingerprint if recorded else None) != "stale":
        return None
    return f"stale: tuned on kernel {recorded}, now {kernel.fingerprint}"


def _delete_study(storage: str, name: str) -> None:
    import optuna

    from pallas_tune.tuning.storage import open_storage

    try:
        optuna.delete_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        pass  # None yet.


def _progress(args: argparse.Namespace, kernel: Any, options: Any, label: str) -> Any:
    if args.quiet:
        return None
    from pallas_tune.cli.progress import SweepProgress

    default = getattr(kernel.space, "default", None)
    if default is None:
        default = next(iter(kernel.space.ordered_candidates()), None)
    return SweepProgress(label=label, total=min(options.trials, kernel.space.size),
                         default=dict(default) if default is not None else None,
                         verbose=args.verbose)


def _interrupted(args: argparse.Namespace, key: str) -> None:
    # Without --fresh-study: with it, the same command would start this shape's study over
    # instead of resuming it.
    argv = [a for a in sys.argv[1:] if a != "--fresh-study"]
    command = "pallas-tune " + shlex.join(argv) if argv else "the same command"
    if args.storage:
        print(f"pallas-tune sweep: interrupted at {key}; finished trials are saved in "
              f"{args.storage}; to resume, run again: {command}", file=sys.stderr, flush=True)
    else:
        print(f"pallas-tune sweep: interrupted at {key}; nothing to resume from "
              f"(--no-storage); run again without it to make sweeps resumable: {command}",
              file=sys.stderr, flush=True)
