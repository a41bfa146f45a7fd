"""``pallas-tune show``: what the caches hold, as a table (no real key cut; cells over 1,000
characters are), JSON or CSV (whole)."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.options import _fmt_config
from pallas_tune.cli.registry import KernelRegistry

if TYPE_CHECKING:
    from pallas_tune.cli.edge import ShowRequest

__all__ = ["backward_lines", "cmd_show", "code_state", "judge_entries", "kernels_of",
           "show_problems", "show_rows"]

_HEADER = ("kernel", "chip", "key", "best config", "median_ms", "how", "code", "cache")
_PAD = 160  # Columns are padded to at most this many characters.
_MAX_CELL = 1000  # Longer cells are cut in the table (no real key comes near it).


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


def kernels_of(reports: Sequence[Any], registry: Any) -> dict[str, tuple[Any, str | None]]:
    """Kernel name -> (its tunable, None), or (None, why it was not imported and how to allow
    it), for the kernel of every file read; only those the user allowed are imported
    (:class:`~pallas_tune.cli.registry.KernelRegistry`)."""
    out: dict[str, tuple[Any, str | None]] = {}
    for r in reports:
        if r.kernel is None or r.kernel in out or r.error is not None:
            continue
        try:
            out[r.kernel] = registry.find(r.kernel)
        except Exception as e:  # noqa: BLE001 - a shipped module that fails to import.
            out[r.kernel] = None, f"importing it failed ({type(e).__name__}: {e})"
    return out


def judge_entries(reports: Sequence[Any], kernels: Mapping[str, tuple[Any, str | None]]
                  ) -> list[Any]:
    """The reports with every entry their kernel refuses (parameter names, value types, the
    declared space: what a call refuses before any trace) marked with the kernel's reason, as
    the runtime skips it. Kernels not in ``kernels`` leave their entries as read."""
    out = []
    for r in reports:
        kernel = kernels.get(r.kernel or "", (None, None))[0]
        if kernel is None or not r.entries:
            out.append(r)
            continue
        entries = []
        for e in r.entries:
            if e.problem is None and e.config is not None:
                found = kernel.entry_problems({"config": e.config,
                                               "outside_space": e.outside_space})
                e = dataclasses.replace(e, problem="; ".join(found) or None)
            entries.append(e)
        out.append(dataclasses.replace(r, entries=tuple(entries)))
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
            what = "REFUSED" if r.refused else "UNREADABLE"
            rows.append((kernel, r.chip, "?", f"{what}: {r.error}", "", "", "", where))
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
                how = f"ESTIMATE: {how}" + (" (caveat: see --format json)" if e.caveat else "")
            if e.outside_space:
                how += " (outside space)"
            ms = "-" if e.median_ms is None else f"{e.median_ms:.4g}"
            code = code_state(e, current.get(r.kernel or ""))
            rows.append((kernel, r.chip, e.key, best_text(e), ms, how, code, where))
    return rows


def best_text(e: Any) -> str:
    """The config a call runs: the effective one where the entry records it (the values that
    run, clamped to the shapes), and XLA where the reference won."""
    text = _fmt_config(e.effective or e.config or {})
    if e.implementation == "xla":
        xla = f" {e.xla_ms:.4g} ms" if e.xla_ms is not None else ""
        text = f"XLA{xla} (beat {text})"
    return text


def json_entries(reports: Sequence[Any], rows: Sequence[tuple[str, ...]]) -> list[dict[str, Any]]:
    """``show --format json``: the table's rows with numbers as numbers, and each served
    entry's config, effective config, implementation, default/XLA times and what an estimate
    could not follow (``estimate_caveat``, None where nothing)."""
    served = {(r.kernel or os.path.basename(r.path), r.chip, e.key, r.path): e
              for r in reports if r.error is None for e in r.entries if e.problem is None}
    by_row = {(k, c, key): e for (k, c, key, _), e in served.items()}
    out = []
    for row in rows:
        item: dict[str, Any] = dict(zip(_HEADER, row, strict=True))
        e = by_row.get((row[0], row[1], row[2]))
        if e is not None and not row[3].startswith(("SKIPPED", "DAMAGED")):
            item.update(median_ms=e.median_ms, config=e.config, effective=e.effective,
                        implementation=e.implementation, default_ms=e.default_ms,
                        xla_ms=e.xla_ms, estimate_caveat=e.caveat)
        else:
            item["median_ms"] = None
        out.append(item)
    return out


def backward_lines(kernels: Mapping[str, tuple[Any, str | None]]) -> dict[str, str]:
    """Kernel name -> how its gradient is computed, for the kernels this command could import
    that declare a backward: a Pallas kernel of its own (with its own entries), or XLA's
    ``jax.vjp`` of the reference (declared ``backward="xla"``: no kernel, nothing tuned)."""
    out: dict[str, str] = {}
    for name, (kernel, _) in sorted(kernels.items()):
        backend = getattr(kernel, "backward_backend", None)
        if backend == "pallas":
            out[name] = f"pallas: kernel {kernel.backward.name} (its own entries)"
        elif backend == "xla":
            out[name] = "xla: jax.vjp of the reference (not a kernel; nothing tuned)"
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


def cmd_show(request: ShowRequest) -> int:
    from pallas_tune import chips
    from pallas_tune.cache import default_cache
    from pallas_tune.cache.inventory import inventory
    from pallas_tune.cli import check

    cache = default_cache()
    chip = request.chip
    registry = KernelRegistry(request.imports, request.paths)
    reports = inventory(cache, kernel=request.kernel, chip=chip)
    kernels = kernels_of(reports, registry)
    reports = judge_entries(reports, kernels)
    current = {name: k.fingerprint if k is not None else None for name, (k, _) in kernels.items()}
    rows = show_rows(reports, current)
    unchecked = [f"kernel {name!r}: its entries were checked against the file format only, "
                 f"not its space: {why}" for name, (k, why) in sorted(kernels.items()) if k is None]
    if request.key:
        rows = [r for r in rows if request.key in r[2]]
    if chip is not None and not reports:
        _no_such_chip(cache, request)  # An unknown name: a usage error (exit 2).
    fmt = request.format
    if fmt == "json":
        out = json_entries(reports, rows)
        if request.trials:
            for item in out:
                item["runs"] = _runs_of(reports, item["kernel"], item["chip"], item["key"])
        json.dump({"roots": cache.roots(), "entries": out, "backward": backward_lines(kernels),
                   "problems": show_problems(reports) + unchecked}, sys.stdout, indent=1,
                  default=str)
        print()
        return 0
    if fmt == "csv":  # Whole cells, control characters escaped as in the table.
        w = csv.writer(sys.stdout)
        w.writerow(_HEADER)
        w.writerows(tuple(_esc(c) for c in r) for r in rows)
        return 0
    if not rows:
        print(_esc(f"no cache entries{_filters(request)} (looked in {cache.roots()})"))
        return 0
    if request.kernel or request.chip or request.key:
        _print_table(rows)
    else:  # Bare show: the user's entries in full, the library's shipped ones counted.
        _print_overview(rows)
    here = chips.current_chip()
    others = sorted({r[1] for r in rows} - {here})
    if others and chip is None:
        print()
        print(_esc(f"(this host is {here}; the entries for {', '.join(others)} are listed "
                   "too: --chip CHIP shows one chip's)"))
    gradients = backward_lines(kernels)
    if gradients:
        print("\ngradients (jax.grad through these kernels):")
        for name, how in gradients.items():
            print(_esc(f"  {name}: backward {how}"))
    problems = show_problems(reports) + unchecked
    root = check.root_problem(cache.user_root)
    problems = problems + [root] if root else problems
    if problems:
        print("\nproblems (entries not served, or served with a warning; files are left as "
              "they are):")
        for line in problems:
            text = _esc(f"  {line}")
            print(text if len(text) <= 2 * _MAX_CELL else text[:2 * _MAX_CELL - 1] + "…")
    if request.trials:
        _print_trials(reports, request.key)
    return 0


def _filters(request: ShowRequest) -> str:
    said = [f"{flag} {value}" for flag, value in (("--kernel", request.kernel),
                                                  ("--chip", request.chip),
                                                  ("--key", request.key)) if value]
    return f" for {', '.join(said)}" if said else ""


def _no_such_chip(cache: Any, request: ShowRequest) -> None:
    """Raises CLIUsageError where ``--chip`` names no chip pallas-tune knows and no cache
    holds (a chip it knows, or one a cache holds, with no entry is no error), naming both."""
    from pallas_tune import chips
    from pallas_tune.cache.inventory import inventory
    from pallas_tune.cli.shapes import CLIUsageError

    if request.chip is None or chips.recognized(request.chip):
        return
    held = sorted({r.chip for r in inventory(cache, kernel=request.kernel)})
    raise CLIUsageError(
        f"--chip {request.chip}: no such chip; known chips: {', '.join(chips.known_chips())} "
        "(a short name, e.g. v6e, or a device kind, e.g. 'TPU v6 lite', also works); chips "
        f"with entries in the caches: {', '.join(held) or 'none'}")


def _print_overview(rows: Sequence[tuple[str, ...]]) -> None:
    """Bare ``show``: every user-cache row, then one line per shipped (kernel, chip) with its
    number of entries (the full table of them runs to hundreds of characters a row)."""
    user = [r for r in rows if not r[7].startswith("shipped")]
    if user:
        _print_table(user)
    counts: dict[tuple[str, str], int] = {}
    for r in rows:
        if r[7].startswith("shipped"):
            counts[r[0], r[1]] = counts.get((r[0], r[1]), 0) + 1
    if not counts:
        return
    print(("\n" if user else "") + f"shipped with installed libraries: {sum(counts.values())} "
          f"entries of {len({k for k, _ in counts})} kernels (pallas-tune show --kernel NAME "
          "or --chip CHIP lists them; --format json or csv, all rows)")
    width = max(len(k) for k, _ in counts)
    for (kernel, chip), n in sorted(counts.items()):
        print(_esc(f"  {kernel.ljust(width)}  {chip:<12} {n:>3} entries"))


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    """The rows as columns padded to at most ``_PAD`` characters (a longer cell overflows its
    own row only), no cell over ``_MAX_CELL`` (cut with an ellipsis: the JSON and CSV formats
    hold them whole)."""
    cut = 0
    shown = []
    for r in rows:
        cells = [_esc(c) for c in r]
        cut += sum(len(c) > _MAX_CELL for c in cells)
        shown.append([c if len(c) <= _MAX_CELL else c[:_MAX_CELL - 1] + "…" for c in cells])
    widths = [min(_PAD, max(len(r[i]) for r in [*shown, _HEADER])) for i in range(len(_HEADER))]
    print("  ".join(h.ljust(w) for h, w in zip(_HEADER, widths, strict=True)).rstrip())
    for r in shown:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if cut:
        print(f"({cut} cell(s) cut at {_MAX_CELL} characters; --format json or csv shows them "
              "whole)")


def _runs_of(reports: Sequence[Any], kernel: str, chip: str, key: str) -> list[Any]:
    from pallas_tune.cache.inventory import trial_history
    from pallas_tune.measure.records import describe_tally, tally

    for r in reports:
        if (r.kernel or os.path.basename(r.path)) == kernel and r.chip == chip and any(
                e.key == key for e in r.entries):
            return trial_history(r, key)[0]
    return []


def _print_trials(reports: Sequence[Any], key_filter: str | None) -> None:
    from pallas_tune.cache.inventory import trial_history
    from pallas_tune.measure.records import describe_tally, tally

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
                counted = describe_tally(tally(
                    (str(t.get("outcome")), t.get("duplicate_of") is not None)
                    for t in trials if isinstance(t, dict)))
                print(_esc(f"  run written {written}: {counted}"))
                for t in trials:
                    if not isinstance(t, dict):
                        print(_esc(f"    (not a trial record: {t!r:.60})"))
                        continue
                    ms = t.get("median_ms")
                    ms_text = f"{ms:.4g}" if isinstance(ms, int | float) and not isinstance(
                        ms, bool) and math.isfinite(ms) else "-"
                    config = t.get("config") if isinstance(t.get("config"), dict) else {}
                    error = f"  {t['error']}" if isinstance(t.get("error"), str) else ""
                    outcome = t.get("outcome", "?")
                    if t.get("duplicate_of") is not None:  # Its original's figure, no run.
                        outcome, error = "duplicate", f"  same program as #{t['duplicate_of']}"
                    print(_esc(f"    #{t.get('number', '?')!s:>4} "
                               f"{outcome!s:14} {ms_text:>10}  "
                               f"{_fmt_config(config)}{error}", 200))


