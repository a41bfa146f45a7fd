"""``pallas-tune sweep``: tune a kernel for a list of shapes, in any number of processes.

Every sweep keeps its studies in an Optuna storage: ``--storage URL`` (PostgreSQL for many
hosts), else the embedded default (SQLite in the user cache directory), or none with
``--no-storage``. The same command run again resumes; run on several hosts at once it shares
the work (see :mod:`pallas_tune.tuning.storage`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
import time
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.edge import NO_KERNEL, NO_SHAPES
from pallas_tune.cli.registry import KernelRegistry, import_path, load_kernel
from pallas_tune.cli.shapes import (
    CLIUsageError,
    build_call,
    check_specs,
    read_text,
    spec_items,
)
from pallas_tune.measure.records import describe_tally

if TYPE_CHECKING:
    from pallas_tune.cli.edge import SweepRequest

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


def _jobs(request: SweepRequest) -> tuple[list[tuple[str, list[str]]], int]:
    """(kernel ref, shape specs) to tune, and how many recorded kernels were skipped."""
    from pallas_tune.space import load_space

    specs = list(request.shapes)
    if request.from_record:
        jobs = read_record(request.from_record)
        if request.kernel:  # Named by the user: imported like any MODULE:NAME argument.
            jobs = {r: s for r, s in jobs.items() if r == request.kernel}
            if not jobs:
                raise CLIUsageError(f"--from-record {request.from_record} has no record of "
                                    f"{request.kernel}")
            return list(jobs.items()), 0
        return _allowed_records(request, jobs)
    kernel_ref = request.kernel
    if request.space:
        loaded = load_space(request.space)
        kernel_ref = kernel_ref or loaded["kernel"]
        if not specs:
            specs = [spec_items(s) for s in loaded["shapes"]]
    if not kernel_ref:
        raise CLIUsageError(NO_KERNEL)
    if not specs:
        raise CLIUsageError(NO_SHAPES)
    return [(kernel_ref, specs)], 0


def _allowed_records(request: SweepRequest, jobs: dict[str, list[str]]
                     ) -> tuple[list[tuple[str, list[str]]], int]:
    """The records whose kernel the user allowed to import (:mod:`pallas_tune.cli.registry`);
    the others are skipped with a line naming the flag that allows them."""
    registry = KernelRegistry(request.imports, request.paths)
    allowed = []
    for ref, specs in jobs.items():
        why = registry.ref_problem(ref)
        if why is None:
            allowed.append((ref, specs))
        else:
            print(f"pallas-tune sweep: skipped the {len(specs)} recorded shape(s) of {ref}: "
                  f"{why}", file=sys.stderr, flush=True)
    return allowed, len(jobs) - len(allowed)


def _on_chip(request: SweepRequest) -> SweepRequest:
    """The request with its options' chip settled: this host's where none was given."""
    from pallas_tune import chips

    if request.options.chip is not None:
        return request
    options = dataclasses.replace(request.options, chip=chips.current_chip())
    return dataclasses.replace(request, options=options)


def _prepare(request: SweepRequest) -> None:
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
    default = request.default_storage
    if request.storage and not default:
        open_storage(request.storage)  # Unreachable or driverless: say so before any work.
    dirs = ([root] if request.options.write else []) + ([storage_dir()] if default else [])
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
        open_storage(request.storage)


def cmd_sweep(request: SweepRequest) -> int:
    """Runs a sweep the edge (:func:`pallas_tune.cli.edge.sweep_request`) checked."""
    if request.program:
        return _sweep_program(request)
    jobs, skipped = _jobs(request)
    if not jobs:  # Every recorded kernel was skipped (each said why): nothing to set up.
        print(f"pallas-tune sweep: nothing tuned: all {skipped} recorded kernel(s) were "
              "skipped", file=sys.stderr)
        return 1
    for _, specs in jobs:
        check_specs(specs)
    if request.interpret is not None:  # Before the chip is settled: it decides this host's.
        os.environ["PALLAS_TUNE_INTERPRET"] = request.interpret
        from pallas_tune import _settings

        _settings.reload()
    request = _on_chip(request)
    loaded = []
    for kernel_ref, specs in jobs:  # Every kernel and spec checked before anything is made.
        kernel = load_kernel(kernel_ref, request.paths)
        loaded.append((kernel, [(spec, *build_call(kernel, spec)) for spec in specs]))
    _prepare(request)
    failures = 0
    for kernel, calls in loaded:
        failures += _sweep_kernel(request, kernel, request.options.chip, calls)
    return 1 if failures or skipped else 0


def _sweep_program(request: SweepRequest) -> int:
    """``--program MODULE:FN``: every tunable call of a whole program (see cli.program)."""
    from pallas_tune.cli.program import cmd_program

    request = _on_chip(request)
    _prepare(request)
    return cmd_program(request)


def _say(request: SweepRequest, text: str) -> None:
    if not request.quiet:
        print(text, flush=True)


def _sweep_kernel(request: SweepRequest, kernel: Any, chip: str,
                  calls: list[tuple[str, list[Any], dict[str, Any]]]) -> int:
    """Tunes every shape of one kernel; the number of failures. ``chip`` is
    ``request.options.chip`` (settled), named for the line that starts the kernel."""
    options = request.options
    if options.grad:
        _check_grad(kernel)
    where = request.storage or "no storage (--no-storage: not resumable)"
    backward = f", then its backward ({_backward_label(kernel)})" if options.grad else ""
    _say(request, f"pallas-tune sweep: {kernel.name} on {chip} ({len(calls)} shape(s), "
                  f"{options.trials} trials each, space of {kernel.space.size}, timer "
                  f"{options.timer}; studies in {where}){backward}")
    failures = 0
    for i, (_, call_args, call_kwargs) in enumerate(calls):
        label = f"[{i + 1}/{len(calls)}]"
        failures += _sweep_shape(request, kernel, label, call_args, call_kwargs)
        if options.grad and kernel.backward_backend == "pallas":
            # The backward, for the backward arguments of this shape (its own key and entry).
            from pallas_tune.tuning.grad import backward_call

            bwd_args, bwd_kwargs = backward_call(kernel, call_args, call_kwargs,
                                                 options.seed or 0)
            failures += _sweep_shape(request, kernel.backward, f"{label} backward",
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


def _sweep_shape(request: SweepRequest, kernel: Any, label: str, call_args: list[Any],
                 call_kwargs: dict[str, Any]) -> int:
    """Tunes one shape of one kernel unless cached; the number of failures (0 or 1)."""
    from pallas_tune.errors import DiskFullError, PallasTuneError

    options = request.options
    chip = options.chip
    kind = "estimate" if options.timer == "tpu-estimate" else "measured"
    key = kernel.cache_key(*call_args, **call_kwargs)
    user_file = kernel.cache.path(chip, kernel.name, kind=kind)
    found = kernel.cache.lookup(chip, kernel.name, key)
    if not request.force and found is not None and found[1] == user_file:
        stale = _stale(kernel, found[0])
        if stale is None:
            _say(request, f"  {key}: cached, skipped (--force re-tunes)")
            return 0
        _say(request, f"  {key}: {stale}; re-tuning")
    if request.fresh_study and request.storage:
        from pallas_tune.tuning.study import study_name

        _delete_study(request.storage, options.study_name or study_name(kernel, chip, key))
    progress = _progress(request, kernel, f"{label} {key}")
    t0 = time.perf_counter()
    try:  # grad=False: a sweep tunes the backward as a shape of its own (skipped if cached).
        result = kernel.tune(*call_args, options=dataclasses.replace(
            options, callbacks=(progress.callback,) if progress else (), grad=False),
            **call_kwargs)
    except KeyboardInterrupt:
        if progress:
            progress.close()
        _interrupted(request.storage, key)
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
    if result.within_noise:  # The final re-ranking could not rank: say so, claim nothing.
        label += f"; WITHIN NOISE: {result.provenance['ranking_noise']['note']}"
    elif math.isfinite(result.speedup):  # Both from the final re-ranking: like with like.
        label += f", default {result.default_ms:.4g} ms ({result.speedup:.2f}x)"
    if result.implementation == "xla":  # What calls will run, not only what Pallas can do.
        label += (f"; XLA {result.xla_ms:.4g} ms is faster: calls run XLA (the kernel's "
                  "reference), not this config")
    _say(request, f"  {key}: best {result.best} {result.best_ms:.4g} ms re-timed{label} "
                  f"({describe_tally(result.tally)}; {time.perf_counter() - t0:.1f}s) -> "
                  f"{result.cache_path or 'not written (--no-write)'}")
    return 0


def _stale(kernel: Any, entry: dict[str, Any]) -> str | None:
    """Why a cached entry is not done though present: tuned on other code of the kernel (an
    entry recording no fingerprint, or a malformed one, counts as done, as before)."""
    from pallas_tune import _kernel_hash

    recorded, _ = _kernel_hash.recorded(entry.get("provenance"))
    if _kernel_hash.kernel_state(recorded, kernel) != "stale":
        return None
    return f"stale: tuned on kernel {recorded}, now {kernel.fingerprint}"


def _delete_study(storage: str, name: str) -> None:
    import optuna

    from pallas_tune.tuning.storage import open_storage

    try:
        optuna.delete_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        pass  # None yet.


def _progress(request: SweepRequest, kernel: Any, label: str) -> Any:
    if request.quiet:
        return None
    from pallas_tune.cli.progress import SweepProgress

    default = getattr(kernel.space, "default", None)
    if default is None:
        default = next(iter(kernel.space.ordered_candidates()), None)
    return SweepProgress(label=label, total=min(request.options.trials, kernel.space.size),
                         default=dict(default) if default is not None else None,
                         verbose=request.verbose)


def _interrupted(storage: str | None, key: str) -> None:
    # Without --fresh-study: with it, the same command would start this shape's study over
    # instead of resuming it.
    argv = [a for a in sys.argv[1:] if a != "--fresh-study"]
    command = "pallas-tune " + shlex.join(argv) if argv else "the same command"
    if storage:
        print(f"pallas-tune sweep: interrupted at {key}; finished trials are saved in "
              f"{storage}; to resume, run again: {command}", file=sys.stderr, flush=True)
    else:
        print(f"pallas-tune sweep: interrupted at {key}; nothing to resume from "
              f"(--no-storage); run again without it to make sweeps resumable: {command}",
              file=sys.stderr, flush=True)
