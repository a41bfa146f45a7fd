"""What other tasks' measurements say about a new task's candidates: transfer for the search.

A *task* is one kernel at one shape on one chip (or one landscape on one device). When a kernel
is tuned for a new task, the trials already measured on its other tasks (the trial ledger, a
storage's studies, other devices' landscapes in replay) rank the new task's space before it has
measured anything: on the 15 GPU landscapes the configs fast on one device are, by Spearman
correlation 0.6 to 0.95, fast on the others of the same kernel.

:class:`Prior` turns each task's observations into standardized log times (the slow half capped
at the median, failures at the worst: what is slow only tells "bad"), predicts them on configs
the task did not measure with a Gaussian process fitted on its points (a task that measured a
candidate gives its own value), and averages the tasks. :class:`~pallas_tune.search.gp.CandidateBO`
uses the result as the mean of its GP (``prior=``): the residual model learns where the new task
differs, and how far to trust the prior (a scale fitted on the new task's own points, shrunk
towards the prior at first). This is the "prior-mean" family of transfer-learning Bayesian
optimization (e.g. Feurer et al., RGPE; Kernel Tuner's and BaCO's use of earlier runs), kept
simple so that a misleading prior costs a few evaluations, not the search.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from pallas_tune.config import _freeze
from pallas_tune.search.model import GP, encode_features

__all__ = ["Prior", "Task"]

# At most this many points of one task fit its GP (the best half and a random half).
TASK_POINTS = 200

Task = Sequence[tuple[Mapping[str, Any] | Sequence[Any], float]]


def standardized(times: Sequence[float], cap_quantile: float = 0.5) -> np.ndarray:
    """Log times standardized, failures (inf, nan, <= 0) at the worst, the slow part capped at
    ``cap_quantile`` (from 8 points on)."""
    finite = [math.log(t) for t in times if math.isfinite(t) and t > 0]
    if not finite:
        return np.zeros(len(times))
    worst = max(finite)
    y = np.array([math.log(t) if math.isfinite(t) and t > 0 else worst for t in times])
    if len(y) >= 8:
        y = np.minimum(y, np.quantile(y, cap_quantile))
    return (y - y.mean()) / (y.std() or 1.0)


class Prior:
    """Observations of other tasks of one kernel, as a score per candidate of a new task.

    ``tasks``: per task, (config, time) pairs, a config being a dict by parameter name or a
    tuple in ``keys`` order; ``inf`` marks a failed config. ``names``: a label per task (the
    provenance of a search says which tasks informed it). Tasks with fewer than 3 finite times
    are dropped (they rank nothing)."""

    def __init__(self, keys: Sequence[str], tasks: Sequence[Task],
                 names: Sequence[str] | None = None):
        self.keys = list(keys)
        names = list(names) if names is not None else [f"task {i}" for i in range(len(tasks))]
        self.tasks: list[dict[tuple[Any, ...], float]] = []
        self.names: list[str] = []
        self._memo: dict[Any, np.ndarray] = {}
        for name, task in zip(names, tasks, strict=True):
            obs: dict[tuple[Any, ...], float] = {}
            for config, t in task:
                c = self._tuple(config)
                if c is None:
                    continue
                t = float(t) if isinstance(t, int | float) else math.inf
                obs[c] = min(obs.get(c, math.inf), t if math.isfinite(t) and t > 0 else math.inf)
            if sum(1 for v in obs.values() if math.isfinite(v)) >= 3:
                self.tasks.append(obs)
                self.names.append(str(name))

    def _tuple(self, config: Mapping[str, Any] | Sequence[Any]) -> tuple[Any, ...] | None:
        if isinstance(config, Mapping):
            if any(k not in config for k in self.keys):
                return None
            return tuple(_freeze(config[k]) for k in self.keys)
        config = tuple(_freeze(v) for v in config)
        return config if len(config) == len(self.keys) else None

    @property
    def trials(self) -> int:
        return sum(len(t) for t in self.tasks)

    def __bool__(self) -> bool:
        return bool(self.tasks)

    def scores(self, candidates: Sequence[tuple[Hashable, ...]],
               choices: Sequence[Sequence[Hashable]], *, seed: int = 0) -> np.ndarray | None:
        """Per task and candidate, the task's standardized log time (measured, or predicted
        where it did not measure the candidate): a (tasks, candidates) array, lower is faster;
        None without tasks. ``choices``: per parameter, its values (features as the search
        builds them); a task's configs outside them are left out of its fit."""
        if not self.tasks:
            return None
        memo = (len(candidates), candidates[0], candidates[-1],
                tuple(tuple(ch) for ch in choices), seed)
        if memo not in self._memo:  # Replays reuse one prior over many seeds.
            self._memo[memo] = self._scores(candidates, choices, seed)
        return self._memo[memo]

    def _scores(self, candidates: Sequence[tuple[Hashable, ...]],
                choices: Sequence[Sequence[Hashable]], seed: int) -> np.ndarray:
        tables = encode_features(choices)
        pos = [{v: j for j, v in enumerate(ch)} for ch in choices]

        def features(rows: Sequence[tuple[Any, ...]]) -> np.ndarray:
            cols = [tables[p][[pos[p][r[p]] for r in rows]] for p in range(len(choices))]
            return np.concatenate(cols, axis=1) if cols else np.zeros((len(rows), 0))

        x_all = features(candidates)
        rows = []
        rng = np.random.default_rng(seed)
        for obs in self.tasks:
            known = [(c, t) for c, t in obs.items()
                     if all(c[p] in pos[p] for p in range(len(choices)))]
            if len(known) < 3:
                continue
            y = standardized([t for _, t in known])
            index = {c: i for i, (c, _) in enumerate(known)}
            own = np.array([index.get(c, -1) for c in candidates])
            missing = np.flatnonzero(own < 0)
            pred = np.zeros(len(candidates))
            if missing.size:  # Only what the task did not measure is predicted.
                pred[missing] = self._predict(features([c for c, _ in known]), y,
                                              x_all[missing], rng)
            row = np.where(own >= 0, y[np.maximum(own, 0)], pred)
            rows.append((row - row.mean()) / (row.std() or 1.0))
        return np.array(rows).reshape(len(rows), len(candidates))

    @staticmethod
    def _predict(x: np.ndarray, y: np.ndarray, x_all: np.ndarray,
                 rng: np.random.Generator) -> np.ndarray:
        if x.shape[1] == 0:
            return np.zeros(len(x_all))
        if len(x) > TASK_POINTS:
            order = np.argsort(y)
            rest = rng.choice(order[TASK_POINTS // 2:], TASK_POINTS - TASK_POINTS // 2,
                              replace=False)
            keep = np.concatenate([order[:TASK_POINTS // 2], rest])
            x, y = x[keep], y[keep]
        gp = GP(x.shape[1], rng)
        gp.fit(x, y, optimize=True)
        out = np.empty(len(x_all))
        for lo in range(0, len(x_all), 4096):  # Bounded memory on spaces of 10^5 configs.
            out[lo:lo + 4096] = gp.predict(x_all[lo:lo + 4096])[0]
        return out
