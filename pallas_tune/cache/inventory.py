"""What the caches hold, as data: every winners and side file, every entry, and the trial
history of an entry. ``pallas-tune show`` prints it; other commands and reports reuse it.

Nothing here raises on file content: an unreadable file is a :class:`FileReport` with an
``error``, a damaged entry an :class:`EntryReport` with a ``problem``, a mistyped field ``None``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

from pallas_tune import _kernel_hash
from pallas_tune.cache import files, ledger, names, reader
from pallas_tune.cache.entries import entry_problem
from pallas_tune.errors import CacheFormatError

__all__ = ["EntryReport", "FileReport", "inventory", "trial_history"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EntryReport:
    """One entry of a winners file, as far as it could be read."""

    key: str
    config: dict[str, Any] | None
    median_ms: float | None  # None: absent, not a number, or not finite.
    spread_ms: float | None
    timer: str | None
    interpret: bool | None
    trial_count: int | None
    outside_space: bool
    problem: str | None  # Why a reader would skip it; None if it serves.
    kernel_fingerprint: str | None = None  # The kernel code it was tuned on; None: unknown.
    fingerprint_problem: str | None = None  # A malformed recorded fingerprint (then unknown).
    effective: dict[str, Any] | None = None  # What the config runs as (clamped), if recorded.
    implementation: str = "pallas"  # "xla" where the reference won and calls run it.
    default_ms: float | None = None  # The default's time in the same final ranking.
    xla_ms: float | None = None  # The reference's (XLA) time in the same final ranking.
    caveat: str | None = None  # What an estimate could not follow (provenance.estimate_caveat).


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class FileReport:
    """One winners (or recovered side) file under a cache root."""

    path: str
    root: str
    shipped: bool
    role: str  # "winners" or "recovered"
    kind: str  # "measured" or "estimate"
    chip: str  # The chip directory's name.
    kernel: str | None  # From the header; None if unreadable.
    schema: int | None
    error: str | None  # No call serves from the file (then ``entries`` is empty): why.
    damage: tuple[str, ...]  # Damage that left the other entries readable.
    entries: tuple[EntryReport, ...]
    ledger: str | None  # The trial ledger's path (schema 2), if it exists.
    refused: bool = False  # ``error`` is not a read failure: the file is not what its name says.


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    try:
        v = float(v)
    except OverflowError:  # An integer beyond any float (a hostile file's 1e400 digits).
        return None
    return v if math.isfinite(v) else None


def _entry_report(key: str, value: Any, problem: str | None) -> EntryReport:
    problem = problem or entry_problem(value)
    entry = value if isinstance(value, dict) else {}
    prov = entry.get("provenance")
    prov = prov if isinstance(prov, dict) else {}
    config = entry.get("config")
    trials = entry.get("trials")
    count = entry.get("trial_count")
    if isinstance(trials, list):
        count = len(trials)
    fingerprint, fingerprint_problem = _kernel_hash.recorded(prov)
    return EntryReport(
        key=key, config=config if isinstance(config, dict) else None,
        median_ms=_number(entry.get("median_ms")), spread_ms=_number(entry.get("spread_ms")),
        timer=prov.get("timer") if isinstance(prov.get("timer"), str) else None,
        interpret=prov.get("interpret") if isinstance(prov.get("interpret"), bool) else None,
        trial_count=count if isinstance(count, int) and not isinstance(count, bool) else None,
        outside_space=entry.get("outside_space") is True, problem=problem,
        kernel_fingerprint=fingerprint, fingerprint_problem=fingerprint_problem,
        effective=entry.get("effective") if isinstance(entry.get("effective"), dict) else None,
        implementation="xla" if entry.get("implementation") == "xla" else "pallas",
        default_ms=_number(entry.get("default_ms")), xla_ms=_number(entry.get("xla_ms")),
        caveat=_caveat(prov))


def _caveat(prov: dict[str, Any]) -> str | None:
    """The entry's ``estimate_caveat``; a long one is kept in the trial ledger (``in_ledger``)."""
    if isinstance(prov.get("estimate_caveat"), str):
        return prov["estimate_caveat"]
    moved = prov.get("in_ledger")
    if isinstance(moved, list) and "estimate_caveat" in moved:
        return "in the trial ledger beside the file (its last record for this key)"
    return None


def _file_report(path: str, root: str, shipped: bool, chip: str, role: str, kind: str
                 ) -> FileReport:
    base = {"path": path, "root": root, "shipped": shipped, "role": role, "kind": kind,
            "chip": chip}
    try:
        wf = reader.read(path)
    except (OSError, CacheFormatError) as e:
        return FileReport(**base, kernel=None, schema=None, error=str(e), damage=(),
                          entries=(), ledger=None)
    kernel = wf.header.get("kernel")
    refused = reader.named_problem(wf, path)  # As a call of its kernel would refuse it.
    if refused is not None:
        return FileReport(**base, kernel=kernel if isinstance(kernel, str) else None,
                          schema=wf.schema, error=refused, damage=(), entries=(), ledger=None,
                          refused=True)
    entries = tuple(_entry_report(k, v, p) for k, v, p in wf.items())
    ledger_path = None
    name = wf.header.get("ledger")
    if isinstance(name, str) and os.path.basename(name) == name and name.endswith(".jsonl"):
        candidate = os.path.join(os.path.dirname(path), name)
        ledger_path = candidate if os.path.exists(candidate) else None
    return FileReport(**base, kernel=kernel if isinstance(kernel, str) else None,
                      schema=wf.schema, error=None, damage=wf.damage, entries=entries,
                      ledger=ledger_path)


def inventory(cache: Any, *, kernel: str | None = None, chip: str | None = None
              ) -> list[FileReport]:
    """Every winners and side file under the cache's roots, user root first.

    Args:
      cache: a :class:`~pallas_tune.cache.TuningCache`.
      kernel: keep only files whose kernel name (or file name) contains this.
      chip: keep only this chip's directory (a normalised chip name, e.g. ``tpu_v6e``).
    """
    out = []
    user = cache.user_root
    for root in cache.roots():
        try:
            chip_dirs = sorted(os.listdir(root))
        except OSError:
            continue
        for chip_dir in chip_dirs:
            d = os.path.join(root, chip_dir)
            if (chip and chip_dir != chip) or chip_dir.startswith((".", "_")) \
                    or not os.path.isdir(d):
                continue
            try:
                entries = sorted(os.listdir(d))
            except OSError:
                continue
            for name in entries:
                role_kind = names.classify(name)
                if role_kind is None or role_kind[0] == "ledger":
                    continue
                report = _file_report(os.path.join(d, name), root, root != user, chip_dir,
                                      *role_kind)
                if kernel and kernel not in (report.kernel or "") and kernel not in name:
                    continue
                out.append(report)
    return out


def trial_history(report: FileReport, key: str) -> tuple[list[dict[str, Any]], int]:
    """The tuning runs recorded for ``key`` of a file (oldest first: each a dict with
    ``trials``, ``provenance``, ``written`` ...), and how many ledger lines were unreadable.
    Schema 1 files carried the trials in the entry itself."""
    if report.schema == 1:
        try:
            raw, st = files.read_raw(report.path)
            value, problem = files.parse_winners(raw, report.path, st).raw(key)
        except (OSError, CacheFormatError, KeyError):
            return [], 0
        trials = value.get("trials") if isinstance(value, dict) else None
        if problem is not None or not isinstance(trials, list):
            return [], 0
        return [{"key": key, "trials": trials, "provenance": value.get("provenance"),
                 "written": None}], 0
    if report.ledger is None:
        return [], 0
    try:
        return ledger.read(report.ledger, key=key)
    except OSError:
        return [], 0
