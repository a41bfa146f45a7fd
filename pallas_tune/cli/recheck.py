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

    pallas-tune recheck-xla pallas_tune.kernels.matmul:matmul --chip v6e [--dry-run] [--again]
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import TYPE_CHECKING, Any

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
    r.add_argument("--memory-gb", type=float, default=0,
                   help="address-space cap of the compile worker (0: none)")
    r.add_argument("--path", action="append", metavar="DIR",
                   help="also import kernels from DIR (repeatable)")
    r.set_defaults(func=cmd_recheck_xla)


def cmd_recheck_xla(request: RecheckRequest) -> int:
    from pallas_tune.measure.estimate import Estimator
    from pallas_tune.tuning.footing import data_floor_ms, xla_decision, xla_row

    kernel = load_kernel(request.kernel, request.paths)
    if kernel.reference is None:
        raise CLIUsageError(f"{kernel.name} has no reference=: there is no XLA to compare")
    spec = request.chip
    todo = [(key, entry) for key, entry, _ in kernel.cache.entries(spec.name, kernel.name)
            if (request.again or "xla_ms" not in entry) and _estimated(entry)
            and (not request.keys or key in request.keys)]
    if not todo:
        print(f"{kernel.name} on {spec.name}: no estimate entry without an XLA figure")
        return 0
    here = _libtpu_version()
    rewritten: dict[str, dict[str, Any]] = {}
    plain = Estimator(1, memory_limit_bytes=request.memory_limit_bytes, profile=False)
    with Estimator(1, memory_limit_bytes=request.memory_limit_bytes) as est, plain:
        for key, entry in todo:
            was = entry.get("provenance", {}).get("versions", {}).get("libtpu")
            if was and here and was != here:
                print(f"  {key}: skipped (estimated on libtpu {was}, this is {here}: the two "
                      "figures would not compare)")
                continue
            call_args, call_kwargs = build_call(kernel, key)
            r = est.map(kernel.reference, call_args, call_kwargs, [{}], spec.name,
                        standin=False)[0]
            if r.kind == "worker_crashed":  # Died profiled (seen: XLA's ragged_dot): the
                # footing takes XLA's cost model from a compile without the profiling flag.
                r = dataclasses.replace(r, model_cycles=plain.map(
                    kernel.reference, call_args, call_kwargs, [{}], spec.name,
                    standin=False)[0].model_cycles)
            row = xla_row(r, spec.clock_hz)
            row["floor_ms"] = data_floor_ms(kernel, call_args, call_kwargs, spec.name)
            xla_ms, impl, note = xla_decision(row, float(entry["median_ms"]))
            print(f"  {key}: tuned {float(entry['median_ms']):.4g} ms, XLA "
                  f"{xla_ms:.4g} ms (ESTIMATES) -> runs {impl}" + (f"; {note}" if note else ""))
            if math.isnan(xla_ms):
                continue
            rewritten[key] = _with_xla(entry, xla_ms, impl, note, row)
    if rewritten and not request.dry_run:
        path = kernel.cache.write_many(spec.name, kernel.name, rewritten, kind="estimate")
        print(f"{len(rewritten)} entries rewritten in {path}")
    return 0


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
