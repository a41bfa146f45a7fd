"""Replay search strategies on exhaustively measured landscapes (Kernel Tuner cache files).

``run(path, strategy="default", budget=50, seed=0)`` loads a Kernel Tuner cache file (the format
of shared/landscapes and of benchmarks/landscapes; gzip or plain JSON), runs the named strategy
as if each lookup were a measurement, and returns the times in evaluation order. An evaluation
draws one of the config's recorded repeats at random (so it is noisy, as a real measurement);
a failed config costs an evaluation and returns ``inf``; a config is never evaluated twice (a
re-proposal is answered from what was measured, at no cost). The space is the file's
``tune_params`` restricted to the configurations the file holds, and strategies only propose
from it.

Strategies: ``"default"`` (pallas-tune's, as the tuner searches: Bayesian optimization with a
Gaussian process over the enumerated candidates, :mod:`pallas_tune.search`), ``"tpe"`` (Optuna's
TPE as it comes: independent, 10 startup trials), ``"tpe-mv"`` (the tuner's previous default:
multivariate TPE over categorical parameters, 5 startup trials), ``"optuna-gp"`` (Optuna's
GPSampler; needs PyTorch), ``"random"`` (without replacement) and ``"grid"`` (file order).

``warm_start``: configs (dicts or tuples in the file's key order) measured first, in order, as
the tuner measures its warm starts (the declared default, the nearest tuned shapes' winners, a
roofline model's picks) before it searches; strategies then learn from them.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import random
from collections.abc import Callable, Mapping, Sequence
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

    @functools.cached_property
    def choices(self) -> list[list[Any]]:
        """Per parameter, the values the file's configs take, sorted."""
        return [sorted({c[i] for c in self.configs}, key=_sort_key)
                for i in range(len(self.keys))]

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


Evaluate = Callable[[tuple[Any, ...]], float]
Strategy = Callable[[Landscape, int, int, Evaluate, dict[tuple[Any, ...], float]], None]


def _random(land: Landscape, budget: int, seed: int, evaluate, measured) -> None:
    order = list(land.configs)
    random.Random(seed).shuffle(order)
    for c in order:
        if len(measured) >= budget:
            break
        evaluate(c)


def _grid(land: Landscape, budget: int, seed: int, evaluate, measured) -> None:
    del seed  # Deterministic.
    for c in land.configs:
        if len(measured) >= budget:
            break
        evaluate(c)


def _gp(land: Landscape, budget: int, seed: int, evaluate, measured) -> None:
    from pallas_tune.search.gp import DEFAULT_STARTUP, CandidateBO

    bo = CandidateBO(land.configs, land.choices, seed=seed, n_startup=DEFAULT_STARTUP)
    while len(measured) < budget:
        c = bo.propose(measured)
        if c is None:
            break
        evaluate(c)


def _optuna(land: Landscape, budget: int, seed: int, evaluate, measured_so_far, *,
            multivariate: bool = False, startup: int = 10, sampler: Any = None) -> None:
    """An Optuna sampler (TPE unless given) over the landscape's values, encoded as the tuner
    encodes a space (categorical)."""
    import optuna

    from pallas_tune.space import SearchSpace, TrialEncoder

    optuna.logging.disable_default_handler()
    valid = set(land.configs)
    encoder = TrialEncoder(SearchSpace.from_choices(dict(zip(land.keys, land.choices,
                                                             strict=True))))
    if sampler is None:
        sampler = optuna.samplers.TPESampler(seed=seed, multivariate=multivariate,
                                             group=multivariate, n_startup_trials=startup)
    study = optuna.create_study(direction="minimize", sampler=sampler)
    rng = random.Random(seed)
    measured = measured_so_far

    def suggest(trial: Any) -> tuple[Any, ...]:
        config = encoder.suggest(trial)
        return tuple(config[k] for k in land.keys)

    def encode(c: tuple[Any, ...]) -> dict[str, int]:
        return encoder.encode(dict(zip(land.keys, c, strict=True)))

    def tell(trial: Any, value: float) -> None:
        # Failed and invalid configs are told +inf, not FAIL: TPE ignores failed trials, so it
        # would keep proposing the same region; an infinite value puts it in the "bad" group.
        study.tell(trial, value if math.isfinite(value) else math.inf)

    for c, value in list(measured.items()):  # Warm starts: learned, not measured again.
        study.enqueue_trial(encode(c))
        trial = study.ask()
        suggest(trial)
        tell(trial, value)
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
            tell(trial, evaluate(c))
            continue
        if misses >= 10:  # Stuck: measure an unmeasured valid config at random, and learn it.
            c = rng.choice([x for x in land.configs if x not in measured])
            study.enqueue_trial(encode(c))
            trial = study.ask()
            assert suggest(trial) == c
            tell(trial, evaluate(c))
            misses = 0


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, int | float) and not isinstance(v, bool) else (1, str(v))


def _tpe(land, budget, seed, evaluate, measured):
    """Optuna's TPE as it comes: every parameter categorical, independent, 10 startup trials."""
    _optuna(land, budget, seed, evaluate, measured, multivariate=False, startup=10)


def _tpe_mv(land, budget, seed, evaluate, measured):
    """The tuner's default before the GP: multivariate TPE over categorical parameters with 5
    random startup trials, failed and invalid proposals told +inf, invalid ones not counted."""
    _optuna(land, budget, seed, evaluate, measured, multivariate=True,
            startup=min(5, max(1, budget // 5)))


def _optuna_gp(land, budget, seed, evaluate, measured):
    """Optuna's GPSampler as it comes (needs PyTorch), over the categorical encoding."""
    import optuna

    _optuna(land, budget, seed, evaluate, measured,
            sampler=optuna.samplers.GPSampler(seed=seed, n_startup_trials=5))


STRATEGIES: dict[str, Strategy] = {
    "default": _gp, "tpe": _tpe, "tpe-mv": _tpe_mv, "random": _random, "grid": _grid,
    "optuna-gp": _optuna_gp,
}


def run(path: str | Landscape, strategy: str = "default", budget: int = 50, seed: int = 0, *,
        warm_start: Sequence[Mapping[str, Any] | Sequence[Any]] = ()) -> list[float]:
    """Replays ``strategy`` on a landscape; returns measured times in evaluation order (inf for
    failed configs). Deterministic for a given seed. ``warm_start`` configs (dicts by parameter
    name, or tuples in the file's key order; those not in the file are skipped) are measured
    first."""
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

    for w in warm_start:
        c = _as_tuple(land, w)
        if c in land.times and len(out) < budget:
            evaluate(c)
    STRATEGIES[strategy](land, min(budget, len(land.configs)), seed, evaluate, seen)
    return out


def _as_tuple(land: Landscape, config: Mapping[str, Any] | Sequence[Any]) -> tuple[Any, ...]:
    values = [config.get(k) for k in land.keys] if isinstance(config, Mapping) else list(config)
    choices = land.choices
    out = []
    for v, ch in zip(values, choices, strict=True):
        v = _freeze(v)
        if isinstance(v, tuple) and v not in ch:  # Kernel Tuner files join tuples by commas.
            v = ",".join(map(str, v))
        out.append(v)
    return tuple(out)
