"""``pallas-tune recheck-xla``: XLA beside the estimate entries tuned before it was a candidate
(``--again``: every estimate entry, decided again under the current footing).

An entry tuned on compiler estimates before XLA was a candidate (issue 28) has no ``xla_ms``:
its call runs the Pallas config even where the kernel's reference (XLA) is faster, and nothing
says so. This command estimates the reference at each such entry's shapes (its whole program,
deviceless, never on a stand-in: as tuning does now) and rewrites the entry with ``xla_ms``,
``margin_over_xla`` and, where XLA's figure is lower and not partial, ``implementation:
"xla"`` (the call then runs XLA). The provenance says the XLA figure was added afterwards, by
this command, on which date. The Pallas winner's own figure is not re-estimated: both figures
come from the same static profile of the same libtpu version (checked: an entry estimated on
another libtpu is skipped, with a note).

Before any estimate it says which entries are the user's and which lie in read-only roots
(shipped with pallas-tune or a library, or on ``PALLAS_TUNE_CACHE_PATH``). Only the user's are
rechecked unless ``--shipped`` is given; then the read-only ones are too, and it says first
that each recheck goes to the user cache, where it serves instead of the read-only entry. Each
entry is written as soon as it is rechecked (the cache's atomic merge), so a stop loses only
the entry in progress, and the same command (without ``--again``) goes on with the rest.

    pallas-tune recheck-xla pallas_tune.kernels.matmul:matmul --chip v6e [--dry-run] [--again]
        [--shipped]
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.edge import MEMORY_GB
from pallas_tune.cli.registry import load_kernel
from pallas_tune.cli.shapes import CLIUsageError, build_call

if TYPE_CHECKING:
    from pallas_tune.cli.edge import RecheckRequest

__all__ = ["add_parser"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("recheck-xla", help="estimate XLA beside estimate entries tuned without "
                                           "it; dispatch to XLA where it is faster")
    r.add_argument("kernel", help="MODULE:NAME of a @tunable kernel with a reference")
    r.add_argument("--chip", default="v6e", help="the TPU whose estimate entries to recheck")
    r.add_argument("--key", action="append", help="only these cache keys (repeatable)")
    r.add_argument("--dry-run", action="store_true", help="print, write nothing")
    r.add_argument("--again", action="store_true",
                   help="also entries that have an XLA figure: estimate XLA again and decide "
                        "under the current footing (pallas_tune.tuning.footing)")
    r.add_argument("--shipped", action="store_true",
                   help="also recheck the entries shipped with pallas-tune or a library (or "
                        "on PALLAS_TUNE_CACHE_PATH), which are read-only: each recheck is "
                        "written to your cache, where it then serves instead of the shipped "
                        "entry (without it they are listed and left alone)")
    r.add_argument("--memory-gb", type=float, default=0,
                   help=f"address-space cap of the compile worker in GiB, {MEMORY_GB[0]:g} to "
                        f"{MEMORY_GB[1]:g} (0: none)")
    r.add_argument("--path", action="append", metavar="DIR",
                   help="also import kernels from DIR (repeatable)")
    r.set_defaults(func=cmd_recheck_xla)


def cmd_recheck_xla(request: RecheckRequest) -> int:
    from pallas_tune.measure.estimate import Estimator

    kernel = load_kernel(request.kernel, request.paths)
    if kernel.reference is None:
        raise CLIUsageError(f"{kernel.name} has no reference=: there is no XLA to compare")
    spec = request.chip
    found = [(key, entry, path) for key, entry, path in kernel.cache.entries(spec.name,
                                                                             kernel.name)
             if (request.again or "xla_ms" not in entry) and _estimated(entry)
             and (not request.keys or key in request.keys)]
    todo = _announce(request, kernel, found)
    if not todo:
        return 0
    here = _libtpu_version()
    written = 0
    plain = Estimator(1, memory_limit_bytes=request.memory_limit_bytes, profile=False)
    where = kernel.cache.path(spec.name, kernel.name, kind="estimate")
    with Estimator(1, memory_limit_bytes=request.memory_limit_bytes) as est, plain, \
            _on_stop(lambda: written, where):
        for key, entry in todo:
            was = entry.get("provenance", {}).get("versions", {}).get("libtpu")
            if was and here and was != here:
                print(f"  {key}: skipped (estimated on libtpu {was}, this is {here}: the two "
                      "figures would not compare)")
                continue
            rewritten = _recheck_one(kernel, spec, key, entry, est, plain)
            if rewritten is None or request.dry_run:
                continue
            # Written at once (the cache's atomic merge): a stop loses the entry in progress only.
            path = kernel.cache.write(spec.name, kernel.name, key, rewritten, kind="estimate")
            written += 1
            print(f"    written to {path}", flush=True)
    if written:
        print(f"{written} entries rewritten in {where}")
    return 0


@contextlib.contextmanager
def _on_stop(written: Callable[[], int], where: str) -> Iterator[None]:
    """On Ctrl-C or SIGTERM: says how many rechecked entries are kept, and where."""
    try:
        yield
    except KeyboardInterrupt:
        print(f"stopped: the {written()} entries rechecked before are kept in {where} (the "
              "entry in progress is not)", flush=True)
        raise


def _announce(request: RecheckRequest, kernel: Any, found: list[tuple[str, dict[str, Any], str]]
              ) -> list[tuple[str, dict[str, Any]]]:
    """Says, before any estimate, which entries are the user's and which are read-only
    (shipped with pallas-tune or a library); returns (key, entry) of those to recheck: the
    user's, and the read-only ones only with ``--shipped`` (each recheck then written to the
    user cache, where it shadows the read-only entry)."""
    name = kernel.name
    chip = request.chip.name
    what = "" if request.again else " without an XLA figure"
    if not found:
        print(f"{name} on {chip}: no estimate entry{what}")
        return []
    user_root = os.path.abspath(kernel.cache.user_root)
    mine = [(k, e) for k, e, p in found if _under(p, user_root)]
    others: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for k, e, p in found:
        if not _under(p, user_root):
            others.setdefault(p, []).append((k, e))
    user_file = kernel.cache.path(chip, name, kind="estimate")
    print(f"{name} on {chip}: {len(found)} estimate entries{what}: {len(mine)} in your cache "
          f"({user_file})"
          + "".join(f", {len(v)} {_origin(p)} ({p}, read-only)" for p, v in others.items()))
    if not others:
        return mine
    shadowed = sum(len(v) for v in others.values())
    if request.shipped:
        print(f"--shipped: the {shadowed} read-only entries are rechecked too; "
              + ("nothing is written (--dry-run)" if request.dry_run else
                 f"each recheck is written to {user_file}, where it serves instead of the "
                 "read-only entry (delete it there to go back)"))
        return mine + [item for v in others.values() for item in v]
    print(f"the {shadowed} read-only entries are left alone: --shipped rechecks them too, "
          f"writing each recheck to {user_file}, where it then serves instead")
    return mine


def _under(path: str, root: str) -> bool:
    return os.path.abspath(path).startswith(root + os.sep)


def _origin(path: str) -> str:
    """Where a read-only entry comes from, in words."""
    from importlib import resources

    shipped = str(resources.files("pallas_tune.caches"))
    if _under(path, os.path.abspath(shipped)):
        return "shipped with pallas-tune"
    return "from a library or PALLAS_TUNE_CACHE_PATH"


def _recheck_one(kernel: Any, spec: Any, key: str, entry: dict[str, Any], est: Any, plain: Any
                 ) -> dict[str, Any] | None:
    """XLA's estimate at the entry's shapes, printed with the decision; the entry rewritten
    with it, or None where XLA gave no figure."""
    from pallas_tune.tuning.footing import data_floor_ms, xla_decision, xla_row

    call_args, call_kwargs = build_call(kernel, key)
    r = est.map(kernel.reference, call_args, call_kwargs, [{}], spec.name, standin=False)[0]
    if r.kind == "worker_crashed":  # Died profiled (seen: XLA's ragged_dot): the footing
        # takes XLA's cost model from a compile without the profiling flag.
        r = dataclasses.replace(r, model_cycles=plain.map(
            kernel.reference, call_args, call_kwargs, [{}], spec.name,
            standin=False)[0].model_cycles)
    row = xla_row(r, spec.clock_hz)
    row["floor_ms"] = data_floor_ms(kernel, call_args, call_kwargs, spec.name)
    xla_ms, impl, note = xla_decision(row, float(entry["median_ms"]))
    print(f"  {key}: tuned {float(entry['median_ms']):.4g} ms, XLA "
          f"{xla_ms:.4g} ms (ESTIMATES) -> runs {impl}" + (f"; {note}" if note else ""),
          flush=True)
    if math.isnan(xla_ms):
        return None
    return _with_xla(entry, xla_ms, impl, note, row)


def _estimated(entry: dict[str, Any]) -> bool:
    return entry.get("provenance", {}).get("kind") == "estimate"


def _with_xla(entry: dict[str, Any], xla_ms: float, impl: str, note: str,
              row: dict[str, Any]) -> dict[str, Any]:
    from pallas_tune.tuning.result import xla_fields

    earlier = ("implementation", "xla_ms", "margin_over_xla", "xla_partial")  # --again.
    out = {**{k: v for k, v in entry.items() if k not in earlier},
           **xla_fields(xla_ms, float(entry["median_ms"]), row.get("partial", 0), impl)}
    prov = dict(out.get("provenance", {}))
    prov["xla"] = {"timer": "tpu-estimate", "partial": row.get("partial", 0),
                   **{k: row[k] for k in ("model_ms", "floor_ms") if k in row},
                   "note": ("XLA's figure (the reference's whole program, a compiler ESTIMATE) "
                            "added after tuning by pallas-tune recheck-xla on "
                            f"{datetime.date.today().isoformat()}; the Pallas figure is the "
                            "tuning run's" + (f"; {note}" if note else ""))}
    out["provenance"] = prov
    return out


def _libtpu_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        return None
