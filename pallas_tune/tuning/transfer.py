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

__all__ = ["PRIOR_TASKS", "prior_for"]

# At most this many other (chip, key) runs inform one search, nearest keys first.
PRIOR_TASKS = 8


def prior_for(kernel: Any, chip: str, key: str, names: Sequence[str], *, kind: str,
              defaults: Mapping[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """A :class:`~pallas_tune.search.prior.Prior` over the parameters ``names`` from the
    kernel's ledgers (None where nothing was measured elsewhere), and its provenance record:
    ``{"tasks": ["chip:key", ...], "trials": n}``. ``defaults``: values for parameters a
    trial does not name (declared since it ran: it ran as their default, as a restamp says)."""
    from pallas_tune import keys
    from pallas_tune.cache import ledger
    from pallas_tune.chips import normalize_chip
    from pallas_tune.search.prior import Prior

    here = normalize_chip(chip)
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for root in reversed(kernel.cache.roots()):  # The user's runs replace the shipped ones.
        for other_chip in _chips(root):
            path = kernel.cache.ledger_path(other_chip, kernel.name, kind=kind, root=root)
            try:
                records, _ = ledger.read(path)
            except OSError:
                continue
            for record in records:  # Later runs of a (chip, key) replace earlier ones.
                k, trials = record.get("key"), record.get("trials")
                if isinstance(k, str) and isinstance(trials, list) and (other_chip, k) != (
                        here, key):
                    runs[(other_chip, k)] = trials
    ranked = sorted(runs, key=lambda ck: (ck[0] != here, keys.key_distance(key, ck[1]), ck))
    tasks, labels = [], []
    for other_chip, k in ranked:
        task = [({**(defaults or {}), **t["config"]}, float(t["median_ms"]))
                for t in runs[(other_chip, k)]
                if isinstance(t, dict) and t.get("outcome") == "ok"
                and isinstance(t.get("config"), dict) and _finite(t.get("median_ms"))]
        if len(task) >= 3:
            tasks.append(task)
            labels.append(f"{other_chip}:{k}")
        if len(tasks) >= PRIOR_TASKS:
            break
    prior = Prior(names, tasks, labels)
    if not prior:
        return None, {}
    return prior, {"tasks": prior.names, "trials": prior.trials}


def _chips(root: str) -> list[str]:
    try:
        return sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))
                      and not d.startswith("."))
    except OSError:
        return []


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0
