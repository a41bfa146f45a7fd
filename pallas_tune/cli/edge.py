"""The edge: a command's parsed arguments, turned once into a validated, frozen request.

``main`` parses the command line and calls :func:`convert` before any work starts: every
flag's value and every conflict between flags is checked here, with the message that names
it (a usage error makes, opens and imports nothing), and a sweep's
:class:`~pallas_tune.TuneOptions` is built here, once (:func:`pallas_tune.cli.options.tune_options`).
Below this module no function sees the ``argparse.Namespace``: each command takes its request,
and a shape's variation of the options is a ``dataclasses.replace`` of the one object
(``tests/test_cli_edge.py`` checks both).

What a request holds is what the flags say, checked; what files say (a ``--space`` file's
kernel and shapes, a record's lines, a cache's entries) is read by the command itself.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from pallas_tune.cli.shapes import CLIUsageError, check_specs, read_shapes

if TYPE_CHECKING:
    from pallas_tune.chips import ChipSpec
    from pallas_tune.tuning.options import TuneOptions

__all__ = ["NO_KERNEL", "NO_SHAPES", "CheckRequest", "FeasibilityRequest", "MergeRequest",
           "RecheckRequest", "ReportRequest", "ShowRequest", "SweepRequest", "convert"]

NO_KERNEL: Final = ("name the kernel (MODULE:NAME), a --space file that names one, or "
                    "--from-record FILE")
NO_SHAPES: Final = "give at least one --shapes (or a --space file with [[shapes]])"


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepRequest:
    """``pallas-tune sweep``, checked.

    ``shapes``: the ``--shapes`` specs, each ``@FILE`` read, their syntax checked (a
    ``--space`` file's or a record's shapes are read by the sweep). ``storage``: the study
    storage's URL (None: ``--no-storage``); ``default_storage``: it is the embedded default,
    whose directory the sweep makes before opening it. ``options``: the tuning options, built
    once; ``options.chip`` None means this host's, settled when the sweep starts (after
    ``interpret`` is applied). ``paths`` and ``imports``: ``--path`` and ``--import``.
    """

    kernel: str | None
    shapes: tuple[str, ...]
    space: str | None
    program: str | None
    from_record: str | None
    storage: str | None
    default_storage: bool
    force: bool
    fresh_study: bool
    interpret: str | None
    verbose: bool
    quiet: bool
    paths: tuple[str, ...]
    imports: tuple[str, ...]
    options: TuneOptions


@dataclass(frozen=True, slots=True, kw_only=True)
class FeasibilityRequest:
    """``pallas-tune feasibility``: ``chip`` is the chip's spec; ``shapes`` as for sweep."""

    kernel: str
    chip: ChipSpec
    shapes: tuple[str, ...]
    compile: bool
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShowRequest:
    """``pallas-tune show``: ``chip`` normalized (None: every chip)."""

    kernel: str | None
    chip: str | None
    key: str | None
    format: str
    trials: bool
    imports: tuple[str, ...]
    paths: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckRequest:
    """``pallas-tune check``: ``roots`` the PATHs given (none: the user cache), ``spaces`` the
    ``--space`` names (each needs ``chip``), ``paths`` and ``imports`` as for sweep."""

    roots: tuple[str, ...]
    paths: tuple[str, ...]
    imports: tuple[str, ...]
    no_kernels: bool
    fail_stale: bool
    spaces: tuple[str, ...]
    chip: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class MergeRequest:
    """``pallas-tune merge``: ``into`` the cache root (None: the user cache); ``into_file``: the
    winners file ``--into`` named, when it named one (only entries that belong in it are
    merged, into ``into``, the root it lies in)."""

    inputs: tuple[str, ...]
    into: str | None
    into_file: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportRequest:
    """``pallas-tune report``: ``chip`` normalized (None: every chip); ``shipped``: the
    entries shipped with installed libraries too, not only the user's; ``png``: PNGs too."""

    kernel: str
    chip: str | None
    key: str | None
    out: str
    reference: str | None
    paths: tuple[str, ...]
    shipped: bool = False  # Also the entries shipped with installed libraries.
    png: bool = False  # Also a PNG of each figure (matplotlib).


@dataclass(frozen=True, slots=True, kw_only=True)
class RecheckRequest:
    """``pallas-tune recheck-xla``: ``chip`` is the chip's spec, ``keys`` the ``--key`` values
    (none: every key), ``shipped``: also the entries of read-only roots (shipped with
    pallas-tune or a library), their rechecks written to the user cache, ``memory_limit_bytes``
    the compile worker's cap (None: none)."""

    kernel: str
    chip: ChipSpec
    keys: tuple[str, ...]
    dry_run: bool
    again: bool
    shipped: bool
    memory_limit_bytes: int | None
    paths: tuple[str, ...]


# A compile worker's address-space cap, in GiB: below 1 a worker cannot load JAX and libtpu
# (0.001 died with MemoryError at import); past 64 TiB no host has it, and RLIMIT_AS overflows
# near 2**33 GiB (1e20 raised OverflowError in the worker).
MEMORY_GB: Final = (1.0, 65536.0)


def memory_gb(value: float | None, flag: str, *, none_is_zero: bool = False) -> float | None:
    """A ``--*-memory-gb`` value, checked: finite and within :data:`MEMORY_GB` (0: no cap,
    where ``none_is_zero``). Returns it, or None for no cap."""
    if value is None or (none_is_zero and value == 0):
        return None
    low, high = MEMORY_GB
    if not math.isfinite(value) or not low <= value <= high:
        zero = " (0: no cap)" if none_is_zero else ""
        raise CLIUsageError(
            f"{flag} {value}: give a worker's memory cap in GiB from {low:g} to {high:g}{zero}, "
            "e.g. 12: the address space a compile worker may map")
    return value


def _check_refs(refs: Any, what: str) -> None:
    """Each MODULE:NAME given is of that form (a path or a relative name refused); imports
    nothing."""
    from pallas_tune.cli.registry import check_ref

    for ref in refs:
        if ref is not None:
            check_ref(ref, what)


def _modules(modules: Any) -> tuple[str, ...]:
    """The ``--import`` modules, each a dotted name (a path refused); imports nothing."""
    from pallas_tune.cli.registry import check_module

    for module in modules or ():
        check_module(module, f"--import {module}")
    return _many(modules)


def _many(values: Any) -> tuple[str, ...]:
    """A repeatable flag's values (None when never given) as a tuple."""
    return tuple(values or ())


def _spec(chip: str) -> ChipSpec:
    from pallas_tune import chips

    try:
        return chips.chip_spec(chip)
    except ValueError as e:
        raise CLIUsageError(str(e)) from None


def _storage(no_storage: bool, url: str | None) -> tuple[str | None, bool]:
    """(the storage URL, whether it is the default), checked (an SQLite file given must be a
    database); nothing created."""
    from pallas_tune.tuning.storage import check_url, default_storage_url

    if no_storage:
        if url:
            raise CLIUsageError("give --storage or --no-storage, not both")
        return None, False
    if url:
        check_url(url, files=True)
        return url, False
    return default_storage_url(create=False), True


def _sweep_shapes(args: argparse.Namespace) -> tuple[str, ...]:
    """The ``--shapes`` specs, with what the flags beside them allow checked."""
    shapes = tuple(read_shapes(args.shapes))
    if args.program:
        if args.kernel or args.space or args.from_record:
            raise CLIUsageError("--program tunes a whole program: give it without a kernel, "
                                "--space or --from-record")
        if not shapes:
            raise CLIUsageError("--program needs --shapes with the program's arguments, e.g. "
                                "--shapes 'x=2048x4096:bfloat16,w=4096x4096:bfloat16'")
    elif args.from_record:
        if shapes or args.space:
            raise CLIUsageError("--from-record names the shapes: give no --shapes or --space")
    elif not args.space:  # Else the --space file may name the kernel and the shapes.
        if not args.kernel:
            raise CLIUsageError(NO_KERNEL)
        if not shapes:
            raise CLIUsageError(NO_SHAPES)
    check_specs(shapes)
    return shapes


def sweep_request(args: argparse.Namespace) -> SweepRequest:
    from pallas_tune import chips
    from pallas_tune.cli.options import tune_options

    _check_refs((args.kernel,), "kernel")
    _check_refs((args.program,), "--program")
    shapes = _sweep_shapes(args)
    memory_gb(args.worker_memory_gb, "--worker-memory-gb")
    imports = _modules(args.imports)
    chip = chips.normalize_chip(args.chip) if args.chip else None
    storage, default = _storage(args.no_storage, args.storage)
    options = tune_options(args, chip, storage=storage)  # Bad values fail here, before any work.
    return SweepRequest(
        kernel=args.kernel, shapes=shapes, space=args.space, program=args.program,
        from_record=args.from_record, storage=storage, default_storage=default,
        force=args.force, fresh_study=args.fresh_study, interpret=args.interpret,
        verbose=args.verbose, quiet=args.quiet, paths=_many(args.path),
        imports=imports, options=options)


def feasibility_request(args: argparse.Namespace) -> FeasibilityRequest:
    from pallas_tune.feasibility import compile as _compile

    _check_refs((args.kernel,), "kernel")
    chip = _spec(args.chip)
    if args.compile and not _compile.libtpu_available():
        raise CLIUsageError("--compile needs libtpu: pip install 'pallas-tune[tpu]'")
    shapes = tuple(read_shapes(args.shapes))
    if not shapes:
        raise CLIUsageError("give at least one --shapes")
    check_specs(shapes)
    return FeasibilityRequest(kernel=args.kernel, chip=chip, shapes=shapes,
                              compile=args.compile, paths=_many(args.path))


def show_request(args: argparse.Namespace) -> ShowRequest:
    from pallas_tune import chips

    return ShowRequest(kernel=args.kernel,
                       chip=chips.normalize_chip(args.chip) if args.chip else None,
                       key=args.key, format=args.format, trials=args.trials,
                       imports=_modules(args.imports), paths=_many(args.path))


def check_request(args: argparse.Namespace) -> CheckRequest:
    from pallas_tune import chips

    if args.space and not args.chip:
        raise CLIUsageError("--space needs --chip: the chip whose entries to look for")
    if args.chip and not chips.recognized(args.chip):
        raise CLIUsageError(f"--chip {args.chip}: no such chip; known chips: "
                            f"{', '.join(chips.known_chips())} (a short name, e.g. v6e, or a "
                            "device kind, e.g. 'TPU v6 lite', also works)")
    return CheckRequest(roots=_many(args.paths), paths=_many(args.path),
                        imports=_modules(args.imports), no_kernels=args.no_kernels,
                        fail_stale=args.fail_stale, spaces=_many(args.space), chip=args.chip)


def merge_request(args: argparse.Namespace) -> MergeRequest:
    from pallas_tune import chips

    into = args.into
    if into is None or os.path.isdir(into):
        return MergeRequest(inputs=_many(args.inputs), into=into)
    if os.path.lexists(into) and not os.path.isfile(into):
        raise CLIUsageError(f"--into {into}: neither a directory nor a regular file; give a "
                            "cache root (the directory whose <chip>/<kernel>.json files the "
                            "entries go to; made if missing)")
    if not os.path.isfile(into) and not into.endswith(".json"):  # A cache root to make.
        return MergeRequest(inputs=_many(args.inputs), into=into)
    into_file = os.path.abspath(into)  # A winners file: ROOT/<chip>/<kernel>.json.
    chip_dir = os.path.basename(os.path.dirname(into_file))
    if not chips.recognized(chip_dir) or chips.normalize_chip(chip_dir) != chip_dir:
        raise CLIUsageError(
            f"--into {into}: not a winners file of a cache (ROOT/<chip>/<kernel>.json: its "
            f"directory, {chip_dir!r}, is no chip's). --into takes a cache root, the directory "
            "whose <chip>/<kernel>.json files the entries go to (made if missing), e.g. "
            "--into merged/, or one winners file in a cache root")
    return MergeRequest(inputs=_many(args.inputs),
                        into=os.path.dirname(os.path.dirname(into_file)), into_file=into_file)


def report_request(args: argparse.Namespace) -> ReportRequest:
    from pallas_tune import chips

    _check_refs((args.reference,), "--reference")
    return ReportRequest(kernel=args.kernel,
                         chip=chips.normalize_chip(args.chip) if args.chip else None,
                         key=args.key, out=args.out, reference=args.reference,
                         paths=_many(args.path), shipped=args.shipped, png=args.png)


def recheck_request(args: argparse.Namespace) -> RecheckRequest:
    _check_refs((args.kernel,), "kernel")
    gb = memory_gb(args.memory_gb, "--memory-gb", none_is_zero=True)
    cap = None if gb is None else int(gb * (1 << 30))
    return RecheckRequest(kernel=args.kernel, chip=_spec(args.chip), keys=_many(args.key),
                          dry_run=args.dry_run, again=args.again, shipped=args.shipped,
                          memory_limit_bytes=cap, paths=_many(args.path))


_CONVERTERS: Final[dict[str, Callable[[argparse.Namespace], Any]]] = {
    "sweep": sweep_request, "feasibility": feasibility_request, "show": show_request,
    "check": check_request, "merge": merge_request, "report": report_request,
    "recheck-xla": recheck_request,
}


def convert(args: argparse.Namespace) -> Any:
    """The parsed command line as its command's request: the one place flags are read.

    Raises:
      CLIUsageError, TuneOptionError: a flag's value, or flags given together, refused.
    """
    return _CONVERTERS[args.command](args)
