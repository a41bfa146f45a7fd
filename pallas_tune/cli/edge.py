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
    """``pallas-tune merge``: ``into`` None is the user cache."""

    inputs: tuple[str, ...]
    into: str | None


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
    (none: every key), ``memory_limit_bytes`` the compile worker's cap (None: none)."""

    kernel: str
    chip: ChipSpec
    keys: tuple[str, ...]
    dry_run: bool
    again: bool
    memory_limit_bytes: int | None
    paths: tuple[str, ...]


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

    shapes = _sweep_shapes(args)
    chip = chips.normalize_chip(args.chip) if args.chip else None
    storage, default = _storage(args.no_storage, args.storage)
    options = tune_options(args, chip, storage=storage)  # Bad values fail here, before any work.
    return SweepRequest(
        kernel=args.kernel, shapes=shapes, space=args.space, program=args.program,
        from_record=args.from_record, storage=storage, default_storage=default,
        force=args.force, fresh_study=args.fresh_study, interpret=args.interpret,
        verbose=args.verbose, quiet=args.quiet, paths=_many(args.path),
        imports=_many(args.imports), options=options)


def feasibility_request(args: argparse.Namespace) -> FeasibilityRequest:
    from pallas_tune.feasibility import compile as _compile

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
                       imports=_many(args.imports), paths=_many(args.path))


def check_request(args: argparse.Namespace) -> CheckRequest:
    if args.space and not args.chip:
        raise CLIUsageError("--space needs --chip: the chip whose entries to look for")
    return CheckRequest(roots=_many(args.paths), paths=_many(args.path),
                        imports=_many(args.imports), no_kernels=args.no_kernels,
                        fail_stale=args.fail_stale, spaces=_many(args.space), chip=args.chip)


def merge_request(args: argparse.Namespace) -> MergeRequest:
    return MergeRequest(inputs=_many(args.inputs), into=args.into)


def report_request(args: argparse.Namespace) -> ReportRequest:
    from pallas_tune import chips

    return ReportRequest(kernel=args.kernel,
                         chip=chips.normalize_chip(args.chip) if args.chip else None,
                         key=args.key, out=args.out, reference=args.reference,
                         paths=_many(args.path), shipped=args.shipped, png=args.png)


def recheck_request(args: argparse.Namespace) -> RecheckRequest:
    cap = int(args.memory_gb * (1 << 30)) if args.memory_gb else None
    return RecheckRequest(kernel=args.kernel, chip=_spec(args.chip), keys=_many(args.key),
                          dry_run=args.dry_run, again=args.again, memory_limit_bytes=cap,
                          paths=_many(args.path))


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
