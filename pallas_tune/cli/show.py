"""``pallas-tune show``: what the caches hold, as a table, JSON or CSV, with no key cut."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.cli.options import _fmt_config

__all__ = ["backward_lines", "cmd_show", "code_state", "current_fingerprints", "show_problems",
           "show_rows"]

_HEADER = ("kernel", "chip", "key", "best config", "median_ms", "how", "code", "cache")


def _esc(value: Any, width: int | None = None) -> str:
    """Text safe for a terminal: control and format characters (escape sequences, bidi
    overrides) shown as Python escapes, never sent raw."""
    text = value if isinstance(value, str) else str(value)
    if not text.isprintable():
        text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                       for c in text)
    return text if width is None else text[:width]


def code_state(entry: Any, current: str | None) -> str:
    """Whether an entry was tuned on the kernel's current code: ``current``, ``stale``,
    ``unknown`` (none recorded, or malformed) or ``unchecked`` (recorded, but the kernel's
    own fingerprint is unknown here: not importable, or its source unreadable)."""
    if entry.kernel_fingerprint is None:
        return "unknown"
    if current is None:
        return "unchecked"
    return "current" if entry.kernel_fingerprint == current else "stale"


def current_fingerprints(reports: Sequence[Any], paths: Sequence[str] = ()
                         ) -> dict[str, str | None]:
    """Kernel name -> its code fingerprint now, for the kernels of files whose entries record
    one (only those kernels are imported; None where one cannot be)."""
    from pallas_tune.cli.check import kernel_by_name

    out: dict[str, str | None] = {}
    memo: dict[str, Any] = {}
    for r in reports:
        if r.kernel is None or r.kernel in out or not any(e.kernel_fingerprint
                                                         for e in r.entries):
            continue
        try:
            kernel = kernel_by_name(r.kernel, paths, memo)
        except Exception:  # noqa: BLE001 - a kernel module that fails to import: unchecked.
            kernel = None
        out[r.kernel] = kernel.fingerprint if kernel is not None else None
    return out


def show_rows(reports: Sequence[Any], current: Mapping[str, str | None] | None = None
              ) -> list[tuple[str, ...]]:
    """Table rows (kernel, chip, key, best config, median_ms, how, code, cache) for ``show``;
    ``code`` is :func:`code_state` against ``current`` (kernel name -> fingerprint)."""
    current = current or {}
    rows = []
    for r in reports:
        where = ("shipped" if r.shipped else "user") + (" (recovered)" if r.role == "recovered"
                                                         else "")
        kernel = r.kernel or os.path.basename(r.path)
        if r.error is not None:
            rows.append((kernel, r.chip, "?", f"UNREADABLE: {r.error}", "", "", "", where))
            continue
        for damage in r.damage:
            rows.append((kernel, r.chip, "?", f"DAMAGED: {damage}", "", "", "", where))
        for e in r.entries:
            if e.problem is not None:
                rows.append((kernel, r.chip, e.key, f"SKIPPED: {e.problem}", "", "", "",
                             where))
                continue
            how = (e.timer or "?") + (" (interpret)" if e.interpret else "")
            if r.kind != "measured":
                how = f"ESTIMATE: {how}"
            if e.outside_space:
                how += " (outside space)"
            ms = "-" if e.median_ms is None else f"{e.median_ms:.4g}"
            code = code_state(e, current.get(r.kernel or ""))
            rows.append((kernel, r.chip, e.key, _fmt_config(e.config or {}), ms, how, code,
                         where))
    return rows


def backward_lines(reports: Sequence[Any]) -> dict[str, str]:
    """Kernel name -> how its gradient is computed, for the importable kernels of these files
    that declare a backward: a Pallas kernel of its own (with its own entries), or XLA's
    ``jax.vjp`` of the reference (declared ``backward="xla"``: no kernel, nothing tuned)."""
    from pallas_tune.cli.check import kernel_by_name

    memo: dict[str, Any] = {}
    out: dict[str, str] = {}
    for r in reports:
        if r.kernel is None or r.kernel in out:
            continue
        try:
            kernel = kernel_by_name(r.kernel, (), memo)
        except Exception:  # noqa: BLE001 - not importable: nothing known of its gradient.
            continue
        backend = getattr(kernel, "backward_backend", None)
        if backend == "pallas":
            out[r.kernel] = f"pallas: kernel {kernel.backward.name} (its own entries)"
        elif backend == "xla":
            out[r.kernel] = "xla: jax.vjp of the reference (not a kernel; nothing tuned)"
    return out


def show_problems(reports: Sequence[Any]) -> list[str]:
    """One line per unreadable file, damaged line or skipped entry, in full."""
    out = []
    for r in reports:
        if r.error is not None:
            out.append(f"{r.path}: {r.error}")
        out += [f"{r.path}: {d}" for d in r.damage]
        out += [f"{r.path}, key {e.key!r}: {e.problem}" for e in r.entries if e.problem]
        out += [f"{r.path}, key {e.key!r}: {e.fingerprint_problem} (it still serves)"
                for e in r.entries if e.problem is None and e.fingerprint_problem]
    return out


def cmd_show(args: argparse.Namespace) -> int:
    from pallas_tune import chips
    from pallas_tune.cache import default_cache
    from pallas_tune.cache.inventory import inventory

    cache = default_cache()
    chip = chips.normalize_chip(args.chip) if args.chip else None
    reports = inventory(cache, kernel=args.kernel, chip=chip)
    rows = show_rows(reports, current_fingerprints(reports))
    if args.key:
        rows = [r for r in rows if args.key in r[2]]
    fmt = args.format
    if fmt == "json":
        out = [dict(zip(_HEADER, r, strict=True)) for r in rows]
        if args.trials:
            for item in out:
                item["runs"] = _runs_of(reports, item["kernel"], item["chip"], item["key"])
        json.dump({"roots": cache.roots(), "entries": out, "backward": backward_lines(reports),
                   "problems": show_problems(reports)}, sys.stdout, indent=1, default=str)
        print()
        return 0
    if fmt == "csv":
        w = csv.writer(sys.stdout)
        w.writerow(_HEADER)
        w.writerows(rows)
        return 0
    if not rows:
        print(_esc(f"no cache entries (looked in {cache.roots()})"))
        return 0
    rows = [tuple(_esc(c) for c in r) for r in rows]
    # Config, how and cache columns wrap at 70; the key and kernel are never cut.
    widths = [max(len(r[i]) for r in [*rows, _HEADER]) for i in range(len(_HEADER))]
    print("  ".join(h.ljust(w) for h, w in zip(_HEADER, widths, strict=True)).rstrip())
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    gradients = backward_lines(reports)
    if gradients:
        print("\ngradients (jax.grad through these kernels):")
        for name, how in gradients.items():
            print(_esc(f"  {name}: backward {how}"))
    problems = show_problems(reports)
    if problems:
        print("\nproblems (entries not served, or served with a warning; files are left as "
              "they are):")
        for line in problems:
            print(_esc(f"  {line}"))
    if args.trials:
        _print_trials(reports, args.key)
    return 0


def _runs_of(reports: Sequence[Any], kernel: str, chip: str, key: str) -> list[Any]:
    from pallas_tune.cache.inventory import trial_history

    for r in reports:
        if (r.kernel or os.path.basename(r.path)) == kernel and r.chip == chip and any(
                e.key == key for e in r.entries):
            return trial_history(r, key)[0]
    return []


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


