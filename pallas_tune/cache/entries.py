"""Cache entries: what a served entry must look like, and how a tuner's entry is split into the
winner (read on every trace) and its trial history (the ledger, read by people and reports).

A winner entry (schema 2)::

    {"config": {"bm": 512, ...}, "median_ms": 0.41, "spread_ms": 0.003,
     "provenance": {"kind": "measured", "chip": "tpu_v6e", "timer": "wallclock",
                    "kernel_fingerprint": "3f0c9a1e5b7d2c44", ...},
     "trial_count": 32}

``kernel_fingerprint`` (16 hex digits, see :mod:`pallas_tune._kernel_hash`) names the version
of the kernel's code the entry was tuned on; entries written before it existed have none.

plus, optionally, ``"outside_space": true`` for a config deliberately outside the kernel's
declared space (served only if its values have the declared types and it is valid for the
call). Schema 1 entries also carried ``"key"`` and the full ``"trials"`` list.

Its figures are times in milliseconds, each finite and at most :data:`MAX_MS`, or null where
not measured: ``median_ms`` > 0 (a merge ranks entries by it: a 0, a negative or a NaN time
would beat every real one), ``spread_ms``, ``search_median_ms``, ``default_ms`` and ``xla_ms``
>= 0. :func:`entry_fault` is the rule every reader applies (an entry it refuses is skipped by
a call, a problem to ``check``, ``SKIPPED`` in ``show``), and merge and the writers too
(:mod:`pallas_tune.cache.declared`).
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import numbers
from collections.abc import Mapping
from typing import Any, Final

from pallas_tune.cache.files import dumps, sanitize

__all__ = ["MAX_MS", "Fault", "entry_fault", "entry_problem", "figure_fault", "split_entry"]

# Provenance fields that are history rather than receipt (the interleaved re-timing table), and
# any field longer than the limit (as JSON), go to the ledger with the trials: the winners file
# is read on every first trace of a shape, the ledger only by people and reports.
HISTORY_FIELDS: Final = frozenset({"retimed_interleaved"})
RECEIPT_FIELD_LIMIT: Final = 512
_MAX_CONFIG_DEPTH: Final = 4


def _plain(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple) and depth < _MAX_CONFIG_DEPTH and len(value) <= 64:
        return all(_plain(v, depth + 1) for v in value)
    return False


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    """Why no call serves an entry: ``reason``, short and the same for every entry with the
    fault (what ``merge`` counts: "median_ms <= 0"), ``detail`` (the entry's own values) and
    ``fix`` (what to write instead; may be empty)."""

    reason: str
    detail: str
    fix: str = ""

    def __str__(self) -> str:
        return self.detail


# The figures of an entry: times in milliseconds. ``median_ms`` (what a merge ranks entries by)
# must be > 0; the others (a spread, a default's or XLA's time, where a figure of 0 may be an
# estimate's) >= 0. Each is null where not measured; none is over MAX_MS (about 2.8 hours: no
# kernel call takes that long, and a larger figure is a unit mistake or a poisoned entry).
MAX_MS: Final = 1e7
POSITIVE_FIGURES: Final = ("median_ms",)
FIGURES: Final = ("median_ms", "spread_ms", "search_median_ms", "default_ms", "xla_ms")
_FIGURE_FIX: Final = ("A time is a finite number of milliseconds, {floor} and at most "
                      f"{MAX_MS:.0e}, or null where it was not measured.")


def figure_fault(field: str, value: Any) -> Fault | None:
    """Why ``value`` is not a valid figure ``field`` of an entry (None: it is). Accepts any
    real number type (numpy's too: what a writer is given), as the readers' JSON numbers."""
    if value is None:
        return None
    positive = field in POSITIVE_FIGURES
    fix = _FIGURE_FIX.format(floor="> 0" if positive else ">= 0")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Fault(f"{field} not a number", f"`{field}` is a {_type(value)}, not a number",
                     fix)
    try:
        ms = float(value)
    except OverflowError:  # An integer beyond any float: a finite number, far out of range.
        ms = MAX_MS * 2 if value > 0 else -1.0
    if not math.isfinite(ms):
        return Fault(f"{field} not finite", f"`{field}` is {ms!r}, not a finite number", fix)
    if ms <= 0 if positive else ms < 0:
        return Fault(f"{field} {'<= 0' if positive else '< 0'}",
                     f"`{field}` is {_short(value)}, not {'> 0' if positive else '>= 0'}", fix)
    if ms > MAX_MS:
        return Fault(f"{field} too large", f"`{field}` is {_short(value)}, over {MAX_MS:.0e} ms",
                     fix)
    return None


def figures_fault(entry: Mapping[str, Any]) -> Fault | None:
    """The first invalid figure of ``entry`` (see :func:`figure_fault`), or None."""
    for field in FIGURES:
        fault = figure_fault(field, entry.get(field))
        if fault is not None:
            return fault
    return None


def entry_problem(entry: Any) -> str | None:
    """Why ``entry`` cannot be served whatever the kernel (None: its structure is fine): see
    :func:`entry_fault`."""
    fault = entry_fault(entry)
    return None if fault is None else fault.detail


def entry_fault(entry: Any) -> Fault | None:
    """Why ``entry`` cannot be served whatever the kernel (None: its structure and figures are
    fine): the one rule every reader applies (a call's lookup, ``check``, ``show``), and
    ``merge`` and the writers too.

    The kernel-specific checks (parameter names, types, the declared space, validity for the
    call's shapes) are the dispatcher's, in :mod:`pallas_tune.runtime.dispatch`.
    """
    if not isinstance(entry, dict):
        return Fault("entry not an object", f"the entry is a {_type(entry)}, not an object",
                     _ENTRY_FIX)
    config = entry.get("config")
    if not isinstance(config, dict):
        return (Fault("config missing", "the entry has no `config`", _ENTRY_FIX)
                if config is None else
                Fault("config not an object", f"`config` is a {_type(config)}, not an object",
                      _ENTRY_FIX))
    if not config:
        return Fault("config empty", "`config` is empty", _ENTRY_FIX)
    for k, v in config.items():
        if not _plain(v):
            return Fault("config value not plain data",
                         f"config value {k}={_short(v)} is not a finite number, string, "
                         "boolean, null or short list of those", _ENTRY_FIX)
    fault = figures_fault(entry)
    if fault is not None:
        return fault
    for field, kinds, what in (("provenance", dict, "an object"),
                               ("outside_space", bool, "true or false"),
                               ("trials", list, "a list")):
        if field in entry and entry[field] is not None and not isinstance(entry[field], kinds):
            return Fault(f"{field} not {what}", f"`{field}` is a {_type(entry[field])}, not "
                         f"{what}", _ENTRY_FIX)
    count = entry.get("trial_count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        return Fault("trial_count not a count", f"`trial_count` is {_short(count)}, not a count",
                     _ENTRY_FIX)
    return None


_ENTRY_FIX: Final = ('An entry is {"config": {PARAMETER: VALUE, ...}, "median_ms": TIME, '
                     "...}, as the tuner writes it.")


def _type(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def split_entry(key: str, entry: Mapping[str, Any], *, kind: str
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(winner entry, ledger record or None): the trials and the bulky provenance fields go to
    the ledger record; both are strict JSON. Raises ValueError if the entry has no config.

    An entry that counts trials (``trial_count``) but carries none is a tuned winner rewritten
    with no run of its own (``pallas-tune recheck-xla`` adding XLA's figure, say): it is kept
    whole and no record is made, since the ledger's latest record of a key is read as that key's
    run. A record of no trials would hide the run's trials from reports and ``show --trials``,
    and set ``trial_count`` to 0."""
    winner = sanitize(dict(entry))
    if not isinstance(winner.get("config"), dict) or not winner["config"]:
        raise ValueError(f"cache entry for {key!r} has no config: {entry!r:.200}")
    trials = winner.pop("trials", None)
    winner.pop("key", None)  # The key is the entry's name in the file.
    count = winner.get("trial_count")
    if trials is None and isinstance(count, int) and not isinstance(count, bool) and count > 0:
        return winner, None
    provenance = winner.get("provenance")
    moved = []
    if isinstance(provenance, dict):
        slim = {}
        for name, value in provenance.items():
            if name in HISTORY_FIELDS or len(dumps(value)) > RECEIPT_FIELD_LIMIT:
                moved.append(name)
            else:
                slim[name] = value
        if moved:
            slim["in_ledger"] = moved
        winner["provenance"] = slim
    if trials is None and not moved:
        return winner, None
    trials = trials if isinstance(trials, list) else []
    winner["trial_count"] = len(trials)
    record = {"key": key, "kind": kind,
              "written": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "config": winner["config"], "median_ms": winner.get("median_ms"),
              "provenance": provenance, "trials": trials}
    return winner, record


def upgrade_schema1(key: str, entry: Any, *, kind: str
                    ) -> tuple[Any, dict[str, Any] | None]:
    """A schema 1 entry as a schema 2 winner and the ledger record of its trials; a damaged
    entry is kept as it is (a writer never drops what it does not understand)."""
    if entry_problem(entry) is not None:
        return sanitize(entry), None
    return split_entry(key, entry, kind=kind)
