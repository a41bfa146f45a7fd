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
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping
from typing import Any, Final

from pallas_tune.cache.files import dumps, sanitize

__all__ = ["entry_problem", "split_entry"]

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


def _number_or_null(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def entry_problem(entry: Any) -> str | None:
    """Why ``entry`` cannot be served whatever the kernel (None: its structure is fine).

    The kernel-specific checks (parameter names, types, the declared space, validity for the
    call's shapes) are the dispatcher's, in :mod:`pallas_tune.runtime.dispatch`.
    """
    if not isinstance(entry, dict):
        return f"the entry is a {_type(entry)}, not an object"
    config = entry.get("config")
    if not isinstance(config, dict):
        return ("the entry has no `config`" if config is None
                else f"`config` is a {_type(config)}, not an object")
    if not config:
        return "`config` is empty"
    for k, v in config.items():
        if not _plain(v):
            return (f"config value {k}={_short(v)} is not a finite number, string, boolean, "
                    "null or short list of those")
    for field in ("median_ms", "spread_ms"):
        if not _number_or_null(entry.get(field)):
            return f"`{field}` is a {_type(entry[field])}, not a number"
    for field, kinds, what in (("provenance", dict, "an object"),
                               ("outside_space", bool, "true or false"),
                               ("trials", list, "a list")):
        if field in entry and entry[field] is not None and not isinstance(entry[field], kinds):
            return f"`{field}` is a {_type(entry[field])}, not {what}"
    count = entry.get("trial_count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 0):
        return f"`trial_count` is {_short(count)}, not a count"
    return None


def _type(v: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", int: "number",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def split_entry(key: str, entry: Mapping[str, Any], *, kind: str
                ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(winner entry, ledger record or None): the trials and the bulky provenance fields go to
    the ledger record; both are strict JSON. Raises ValueError if the entry has no config."""
    winner = sanitize(dict(entry))
    if not isinstance(winner.get("config"), dict) or not winner["config"]:
        raise ValueError(f"cache entry for {key!r} has no config: {entry!r:.200}")
    trials = winner.pop("trials", None)
    winner.pop("key", None)  # The key is the entry's name in the file.
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
