"""``pallas-tune sweep``: tune a kernel for a list of shapes, in any number of processes.

Every sweep keeps its studies in an Optuna storage: ``--storage URL`` (PostgreSQL for many
hosts), else the embedded default (SQLite in the user cache directory), or none with
``--no-storage``. The same command run again resumes; run on several hosts at once it shares
the work (see :mod:`pallas_tune.tuning.storage`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from pallas_tune.cli.options import tune_options
from pallas_tune.cli.shapes import CLIUsageError, build_call, check_specs, read_shapes, spec_items

__all__ = ["cmd_sweep", "import_path", "load_kernel", "read_record"]


@contextlib.contextmanager
def import_path(paths: Sequence[str] = ()) -> Iterator[None]:
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


def load_kernel(ref: str, paths: Sequence[str] = ()) -> Any:
    from pallas_tune import _refs
    from pallas_tune.tunable import TunableKernel

    for p in paths:
        if not os.path.isdir(p):
            raise CLIUsageError(f"--path {p}: not a directory")
    with import_path(paths):
        try:
            obj = _refs.load(ref)
        except (ValueError, ImportError, AttributeError) as e:
            hint = ("" if paths else " (the current directory is not searched: pass --path . "
                                     "to import kernels from files here)")
            raise CLIUsageError(f"cannot load kernel {ref!r}: {e}{hint}") from None
    if not isinstance(obj, TunableKernel):
        raise CLIUsageError(f"{ref} is not a @pallas_tune.tunable kernel (got {type(obj).__name__})")
    return obj


def read_record(path: str) -> dict[str, list[str]]:
    """``PALLAS_TUNE_RECORD`` lines -> {kernel ref: [shape specs]} (each once, in order).
    Lines that are not records are skipped with a warning (the file is production's)."""
    jobs: dict[str, list[str]] = {}
    bad = 0
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise CLIUsageError(f"--from-record {path}: cannot read it ({e})") from None
    for line in lines:
        try:
            rec = json.loads(line)
            ref, spec = rec["ref"], rec["shapes"]
            if not isinstance(ref, str) or not isinstance(spec, str):
                raise TypeError
        except (ValueError, KeyError, TypeError):
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


def _jobs(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    from pallas_tune.space import load_space

    specs = read_shapes(args)
    if args.from_record:
        if specs or args.space:
            raise CLIUsageError("--from-record names the shapes: give no --shapes or --space")
        jobs = read_record(args.from_record)
        if args.kernel:
            jobs = {r: s for r, s in jobs.items() if r == args.kernel}
            if not jobs:
                raise CLIUsageError(f"--from-record {args.from_record} has no record of "
                                    f"{args.kernel}")
        return list(jobs.items())
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
    return [(kernel_ref, specs)]


def _storage(args: argparse.Namespace) -> str | None:
    if args.no_storage:
        if args.storage:
            raise CLIUsageError("give --storage or --no-storage, not both")
        return None
    if args.storage:
        return args.storage
    from pallas_tune.tuning.storage import default_storage_url

    return default_storage_url()


def cmd_sweep(args: argparse.Namespace) -> int:
    jobs = _jobs(args)
    for _, specs in jobs:
        check_specs(specs)
    from pallas_tune import chips

    if args.interpret is not None:
        os.environ["PALLAS_TUNE_INTERPRET"] = args.interpret
        from pallas_tune import _settings

        _settings.reload()
    chip = chips.normalize_chip(args.chip) if args.chip else chips.current_chip()
    args.storage = _storage(args)
    if args.storage:
        from pallas_tune.tuning.storage import open_storage

        open_storage(args.storage)  # Unreachable or driverless: say so before any work.
    tune_options(args, chip)  # Bad values fail here, before any shape is tuned.
    failures = 0
    for kernel_ref, specs in jobs:
        kernel = load_kernel(kernel_ref, args.path or ())
        calls = [(spec, *build_call(kernel, spec)) for spec in specs]  # All checked first.
        failures += _sweep_kernel(args, kernel, chip, calls)
    return 1 if failures else 0


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
    from pallas_tune.errors import PallasTuneError

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
    except (PallasTuneError, ValueError) as e:
        print(f"pallas-tune sweep: {key}: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        if progress:
            progress.close()
    counts = result.trials["outcome"].value_counts().to_dict()
    label = " (compiler estimate)" if kind == "estimate" else ""
    _say(args, f"  {key}: best {result.best} {result.best_ms:.4g} ms{label} "
               f"({', '.join(f'{v} {k}' for k, v in counts.items())}; "
               f"{time.perf_counter() - t0:.1f}s) -> {result.cache_path}")
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
