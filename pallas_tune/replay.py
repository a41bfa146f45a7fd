"""Replay search strategies on exhaustively measured landscapes (Kernel Tuner cache files).

``run(path, strategy="default", budget=50, seed=0)`` loads a Kernel Tuner cache file (the format
of shared/landscapes and of benchmarks/landscapes; gzip or plain JSON), runs the named strategy
as if each lookup were a measurement, and returns the times in evaluation order. An evaluation
draws one of the config's recorded repeats at random (so it is noisy, as a real measurement);
a failed config costs an evaluation and returns ``inf``; a config is never evaluated twice (a
re-proposal is answered from what was measured, at no cost). The space is the file's
``tune_params`` restricted to the configurations the file holds, and strategies only propose
from it.

Strategies: ``"random"`` (without replacement), ``"grid"`` (file order), ``"tpe"`` (Optuna's
TPE as it comes: independent, 10 startup trials), ``"default"`` (pallas-tune's, as the tuner
searches: multivariate TPE over categorical parameters, 5 startup trials).
"""

from __future__ import annotations

import gzip
import json
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Landscape", "STRATEGIES", "load", "run"]


class Landscape:
    """A measured space: configs (tuples in ``keys`` order) → list of repeat times or None."""

    def __init__(self, keys: Sequence[str], params: dict[str, list[Any]],
                 times: dict[tuple[Any, ...], list[float] | None], name: str = ""):
        self.keys = list(keys)
        self.params = params
        self.times = times
        self.configs = list(times)
        self.name = name

    @property
    def optimum(self) -> float:
        return min(statistics_mean(t) for t in self.times.values() if t)


def statistics_mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


def _freeze(v: Any) -> Any:
    return tuple(_freeze(x) for x in v) if isinstance(v, list) else v


def load(path: str) -> Landscape:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    keys = data["tune_params_keys"]
    times: dict[tuple[Any, ...], list[float] | None] = {}
    for rec in data["cache"].values():
        config = tuple(_freeze(rec[k]) for k in keys)
        t = rec.get("time")
        if isinstance(t, int | float) and math.isfinite(t):
            reps = [float(x) for x in rec.get("times") or [t] if isinstance(x, int | float)]
            times[config] = reps or [float(t)]
        else:
            times[config] = None
    return Landscape(keys, data["tune_params"], times, name=data.get("kernel_name", path))


Strategy = Callable[[Landscape, int, int, Callable[[tuple[Any, ...]], float]], None]


def _random(land: Landscape, budget: int, seed: int, evaluate) -> None:
    order = list(land.configs)
    random.Random(seed).shuffle(order)
    for c in order[:budget]:
        evaluate(c)


def _grid(land: Landscape, budget: int, seed: int, evaluate) -> None:
    del seed  # Deterministic.
    for c in land.configs[:budget]:
        evaluate(c)


def _optuna(land: Landscape, budget: int, seed: int, evaluate, *, multivariate: bool,
            startup: int) -> None:
    """TPE over the landscape's values, encoded as the tuner encodes a space (categorical)."""
    import optuna

    from pallas_tune.space import SearchSpace, TrialEncoder

    optuna.logging.disable_default_handler()
    valid = set(land.configs)
    encoder = TrialEncoder(SearchSpace.from_choices({
        k: sorted({c[i] for c in land.configs}, key=_sort_key) for i, k in enumerate(land.keys)}))
    sampler = optuna.samplers.TPESampler(seed=seed, multivariate=multivariate,
                                         group=multivariate, n_startup_trials=startup)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    rng = random.Random(seed)
    measured: dict[tuple[Any, ...], float] = {}

    def suggest(trial: Any) -> tuple[Any, ...]:
        config = encoder.suggest(trial)
        return tuple(config[k] for k in land.keys)

    def encode(c: tuple[Any, ...]) -> dict[str, int]:
        return encoder.encode(dict(zip(land.keys, c, strict=True)))

    def tell(trial: Any, value: float) -> None:
        # Failed and invalid configs are told +inf, not FAIL: TPE ignores failed trials, so it
        # would keep proposing the same region; an infinite value puts it in the "bad" group.
        study.tell(trial, value if math.isfinite(value) else math.inf)

    misses = 0
    while len(measured) < min(budget, len(valid)):
        trial = study.ask()
        c = suggest(trial)
        if c in measured:  # Answer from what was measured: no evaluation.
            tell(trial, measured[c])
            misses += 1
        elif c not in valid:  # Outside the constrained space: never evaluated, not counted.
            tell(trial, math.inf)
            misses += 1
        else:
            misses = 0
            measured[c] = evaluate(c)
            tell(trial, measured[c])
            continue
        if misses >= 10:  # Stuck: measure an unmeasured valid config at random, and learn it.
            c = rng.choice([x for x in land.configs if x not in measured])
            study.enqueue_trial(encode(c))
            trial = study.ask()
            assert suggest(trial) == c
            measured[c] = evaluate(c)
            tell(trial, measured[c])
            misses = 0


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, int | float) and not isinstance(v, bool) else (1, str(v))


def _tpe(land, budget, seed, evaluate):
    """Optuna's TPE as it comes: every parameter categorical, independent, 10 startup trials."""
    _optuna(land, budget, seed, evaluate, multivariate=False, startup=10)


DEFAULT_STARTUP = 5


def _default(land, budget, seed, evaluate):
    """pallas-tune's: multivariate TPE over categorical parameters with 5 random startup trials,
    failed and invalid proposals told +inf, invalid ones not counted; as it never measures a
    config twice, a space smaller than the budget is searched exhaustively in TPE's order.
    Chosen on the shared landscapes over 12 seeds @50 (conv 0.82, pnpoly 0.97, dedisp 1.00)
    against log2-ordinal encodings (0.76) and 8-10 startup trials."""
    _optuna(land, budget, seed, evaluate, multivariate=True,
            startup=min(DEFAULT_STARTUP, max(1, budget // 5)))


STRATEGIES: dict[str, Strategy] = {
    "default": _default, "tpe": _tpe, "random": _random, "grid": _grid,
}


def run(path: str | Landscape, strategy: str = "default", budget: int = 50, seed: int = 0
        ) -> list[float]:
    """Replays ``strategy`` on a landscape; returns measured times in evaluation order (inf for
    failed configs). Deterministic for a given seed."""
    land = path if isinstance(path, Landscape) else load(path)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {sorted(STRATEGIES)}")
    rng = random.Random(seed * 7919 + 1)
    out: list[float] = []
    seen: dict[tuple[Any, ...], float] = {}

    def evaluate(c: tuple[Any, ...]) -> float:
        if c in seen:
            return seen[c]
        if len(out) >= budget:
            return seen.get(c, math.inf)
        reps = land.times.get(c)
        value = rng.choice(reps) if reps else math.inf
        seen[c] = value
        out.append(value)
        return value

    STRATEGIES[strategy](land, budget, seed, evaluate)
    return out
