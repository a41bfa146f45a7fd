"""Transfer: the trials a kernel already measured at other shapes and chips, as a prior.

Every tuning run leaves its trials in the ledger beside the winners file (``*.trials.jsonl``,
in the user cache and the shipped one, per chip). A new shape's search starts from them: each
other (chip, key) whose latest run timed at least 3 configs is one prior task (the same chip's
nearest keys first, then other chips'), and :class:`pallas_tune.search.prior.Prior` turns them
into a score per candidate that the GP sampler uses as its mean. Estimates inform estimates and
measurements inform measurements (the kinds are never mixed). The provenance of the result
names the tasks (``prior``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PRIOR_TASKS", "entry_shortlist", "estimate_top", "prior_for"]

# At most this many other (chip, key) runs inform one search, nearest keys first.
PRIOR_TASKS = 8
# What a prior reads of one ledger: its newest bytes (records are appended; a ledger of 10^6
# rows would otherwise cost a tune minutes and gigabytes), the trials of one run, the chip
# folders of one root, a key's length.
LEDGER_BYTES = 16 * 2**20
TASK_TRIALS = 2000
ROOT_CHIPS = 64
KEY_CHARS = 4096
RUNS_KEPT = 4  # Runs of one (chip, key) kept to fall back on when the newest is unusable.
_VALUE_ITEMS = 64  # A config value may be a short list (a tuple parameter), not a document.

_WARNED: set[str] = set()  # Ledgers warned about in this process (once each).


def prior_for(kernel: Any, chip: str, key: str, names: Sequence[str], *, kind: str,
              defaults: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """A :class:`~pallas_tune.search.prior.Prior` over the parameters ``names`` from the
    kernel's ledgers (None where nothing was measured elsewhere), and its provenance record:
    ``{"tasks": ["chip:key", ...], "trials": n}``, with ``"truncated": [ledger, ...]`` where
    only a ledger's newest ``LEDGER_BYTES`` were read. ``defaults``: values for parameters a
    trial does not name (declared since it ran: it ran as their default, as a restamp says).

    A prior is advice: a record that is not a well-formed run (whoever wrote it) is skipped,
    with one warning per ledger naming it, and nothing here stops the tune."""
    from pallas_tune.chips import normalize_chip
    from pallas_tune.search.prior import Prior

    here = normalize_chip(chip)
    runs = _Runs()
    runs.read(kernel, here, key, kind)
    if kind == "measured":  # Across fidelities: the compiler's estimates for this chip.
        runs.read(kernel, here, key, "estimate", chips=(here,), own=True)
    ranked = sorted(runs.raw, key=lambda r: (r[0] != here, _distance(key, r[1]), r[2] != kind,
                                             r))
    tasks, labels = [], []
    for other_chip, k, run_kind in ranked:  # Only the runs used are checked, newest first.
        task = [({**(defaults or {}), **config}, ms)
                for config, ms in runs.latest((other_chip, k, run_kind))]
        if len(task) >= 3:
            tasks.append(task)
            labels.append(f"{other_chip}:{k}" + (" (estimate)" if run_kind != kind else ""))
        if len(tasks) >= PRIOR_TASKS:
            break
    runs.warn()
    prior = Prior(names, tasks, labels)
    if not prior:
        return None, {}
    record: dict[str, Any] = {"tasks": prior.names, "trials": prior.trials}
    if runs.truncated:
        record["truncated"] = runs.truncated
    return prior, record


def estimate_top(kernel: Any, chip: str, key: str, k: int, space: Any,
                 defaults: Mapping[str, Any] | None = None
                 ) -> tuple[list[dict[str, Any]], list[float], str]:
    """The compiler estimate's ``k`` fastest configs of ``space`` for (chip, key), from the
    latest estimate run there (its ledger), with their estimates, and that run's label;
    empty where no estimate run is recorded."""
    from pallas_tune.chips import normalize_chip

    here = normalize_chip(chip)
    runs = _Runs()
    runs.read(kernel, here, key, "estimate", chips=(here,), own=True, only=key)
    trials = runs.latest((here, key, "estimate"))
    runs.warn()
    out: list[tuple[float, dict[str, Any]]] = []
    for config, ms in sorted(trials, key=lambda t: t[1]):
        full = {**(defaults or {}), **config}
        if set(full) == set(space.names) and full in space and all(full != c for _, c in out):
            out.append((ms, full))
        if len(out) >= k:
            break
    return [c for _, c in out], [ms for ms, _ in out], f"{here}:{key} (estimate)"


def entry_shortlist(kernel: Any, chip: str, key: str, k: int, space: Any,
                    defaults: Mapping[str, Any] | None = None
                    ) -> tuple[list[dict[str, Any]], list[float], str] | None:
    """The shortlist the estimate's cache entry for (chip, key) keeps (its best K, see
    measure.records.shortlist), its first ``k`` in the space, their figures and its label:
    what ``--confirm-top`` measures, no estimate run again; None where no such entry is."""
    from pallas_tune.chips import normalize_chip

    here = normalize_chip(chip)
    for hit in kernel.cache.lookup_all(here, kernel.name, key):
        kept = (hit.entry or {}).get("shortlist")
        if hit.kind != "estimate" or not isinstance(kept, dict):
            continue
        configs, figures = [], []
        for config, ms in zip(kept.get("configs") or [], kept.get("figures_ms") or [],
                              strict=False):
            full = {**(defaults or {}), **config} if isinstance(config, dict) else None
            if full is not None and set(full) == set(space.names) and full in space:
                configs.append(full)
                figures.append(ms)
        if configs:
            return (configs[:k], figures[:k],
                    f"{here}:{key} (estimate entry's shortlist of {kept.get('k')}, {hit.path})")
    return None


class _Runs:
    """The runs read from a kernel's ledgers, per (chip, key, kind): their raw trial lists
    (the newest ``RUNS_KEPT``, newest last), checked only when used (:meth:`latest`); what was
    skipped, per ledger; the ledgers read only in part."""

    def __init__(self) -> None:
        self.raw: dict[tuple[str, str, str], list[tuple[str, Any]]] = {}
        self.skipped: dict[str, _Skipped] = {}
        self.truncated: list[str] = []
        self._cut: set[str] = set()

    def read(self, kernel: Any, here: str, key: str, kind: str, *,
             chips: Sequence[str] | None = None, own: bool = False,
             only: str | None = None) -> None:
        """Adds the runs of ``kind`` (not (``here``, ``key``)'s own unless ``own``; only
        ``only``'s if given) from every root, the user's last (they replace the shipped)."""
        from pallas_tune.cache import ledger

        for root in reversed(kernel.cache.roots()):
            for other_chip in chips if chips is not None else _chips(root):
                path = kernel.cache.ledger_path(other_chip, kernel.name, kind=kind, root=root)
                try:
                    records, bad, cut = ledger.read_newest(path, LEDGER_BYTES, key=only)
                except OSError:
                    continue
                skipped = self.skipped.setdefault(path, _Skipped())
                if bad:
                    skipped.add("a line that is not a JSON record", bad)
                for record in records:
                    k = record.get("key")
                    problem = _key_problem(k)
                    if problem:
                        skipped.add(problem)
                    elif own or (other_chip, k) != (here, key):
                        runs = self.raw.setdefault((other_chip, k, kind), [])
                        runs.append((path, record.get("trials")))
                        del runs[:-RUNS_KEPT]
                if cut:
                    self.truncated.append(path)
                    self._cut.add(path)

    def latest(self, run: tuple[str, str, str]) -> list[tuple[dict[str, Any], float]]:
        """The ok trials of the newest run of ``run`` with a usable trial (or none failing)."""
        for path, raw in reversed(self.raw.get(run, [])):
            trials, why = _trials(raw)
            if why:
                self.skipped[path].add(why)
            if trials or not why:  # A run none of whose trials is usable replaces none.
                return trials
        return []

    def warn(self) -> None:
        for path, skipped in self.skipped.items():
            _warn(path, skipped, path in self._cut)
        for path in self._cut - set(self.skipped):
            _warn(path, _Skipped(), True)


def _trials(trials: Any) -> tuple[list[tuple[dict[str, Any], float]], str]:
    """A run's ok trials as (config, ms), at most ``TASK_TRIALS``; and why some were not
    usable ("" if all were)."""
    out, why = [], ""
    for t in trials[:TASK_TRIALS] if isinstance(trials, list) else ():
        if not isinstance(t, dict):
            why = why or "a trial that is not an object"
            continue
        if t.get("outcome") != "ok":
            continue
        config, ms = t.get("config"), _ms(t.get("median_ms"))
        problem = ("median_ms is not a positive finite number" if ms is None
                   else _config_problem(config))
        if problem:
            why = why or problem
            continue
        out.append((config, ms))
    return out, why


def _key_problem(k: Any) -> str:
    """Why ``k`` is not a cache key ("" if it may be one): a string of at most ``KEY_CHARS``
    whose array dims are sizes an array can have."""
    from pallas_tune import keys

    if not isinstance(k, str):
        return "a key that is not a string"
    if len(k) > KEY_CHARS:
        return f"a key over {KEY_CHARS} characters"
    if any(len(d) > 18 for d in keys.DIM_RE.findall(k)):
        return "a key with a dimension over 10^18"
    return ""


def _ms(v: Any) -> float | None:
    if not isinstance(v, int | float) or isinstance(v, bool):
        return None
    try:
        v = float(v)  # An int of 400 digits is no time (OverflowError).
    except OverflowError:
        return None
    return v if math.isfinite(v) and v > 0 else None


def _config_problem(config: Any) -> str:
    """Why ``config`` cannot be a config ("" if it can): names to plain values (numbers,
    strings, booleans, None, or short lists of those, as TOML and JSON spell tuples)."""
    if not isinstance(config, dict):
        return "a config that is not an object"
    for name, value in config.items():
        if not name or not isinstance(name, str) or not name.isidentifier():
            return f"a config name that is not a parameter name ({name!r:.40})"
        items = value if isinstance(value, list) else [value]
        if len(items) > _VALUE_ITEMS or not all(_plain(v) for v in items):
            return f"config value of {name!r:.40} is not a number, string, boolean or short list"
    return ""


def _plain(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    return v is None or isinstance(v, bool | int | str) and len(str(v)) <= 256


def _distance(a: str, b: str) -> float:
    from pallas_tune import keys

    try:
        return keys.key_distance(a, b)
    except (ValueError, OverflowError, RecursionError, TypeError):
        return math.inf


class _Skipped:
    """How many records of a ledger were skipped, and the first reason."""

    def __init__(self) -> None:
        self.count, self.first = 0, ""

    def add(self, why: str, count: int = 1) -> None:
        self.count += count
        self.first = self.first or why


def _warn(path: str, skipped: _Skipped, cut: bool) -> None:
    """One warning per ledger and process: what was skipped or left unread."""
    if (not skipped.count and not cut) or path in _WARNED:
        return
    _WARNED.add(path)
    from pallas_tune.errors import warn

    parts = []
    if skipped.count:
        parts.append(f"{skipped.count} record(s) were skipped, in whole or in part "
                     f"(first: {skipped.first})")
    if cut:
        parts.append(f"only its newest {LEDGER_BYTES / 2**20:g} MiB were read")
    warn(f"pallas-tune: the trial ledger {path} was read as a prior for tuning: "
         f"{'; '.join(parts)}. The tune goes on without them; `pallas-tune check` "
         "lists what is wrong with the file.")


def _chips(root: str) -> list[str]:
    """The chip folders of a cache root (at most ``ROOT_CHIPS``, by name)."""
    try:
        with os.scandir(root) as it:
            found = []
            for entry in it:
                if not entry.name.startswith(".") and entry.is_dir():
                    found.append(entry.name)
                if len(found) >= 4 * ROOT_CHIPS:
                    break
    except OSError:
        return []
    return sorted(found)[:ROOT_CHIPS]
