"""Replay search strategies on exhaustively measured landscapes (Kernel Tuner cache files).

``run(path, strategy="default", budget=50, seed=0)`` loads a Kernel Tuner cache file (the format
of ``../shared/landscapes`` and of ``benchmarks/landscapes``; gzip or plain JSON), runs the named
strategy as if each lookup were a measurement, and returns the times in evaluation order. An
evaluation draws one of the config's recorded repeats at random (so it is noisy, as a real
measurement); a failed config costs an evaluation and returns ``inf``; a config is never
evaluated twice (a re-proposal is answered from what was measured, at no cost). The space is the
file's ``tune_params`` restricted to the configurations the file holds, and strategies only
propose from it. ``trace(...)`` is the same run with the configs and the strategy's own wall
time, to score what a user would get: the *mean* time of the config that measured best.

Strategies (``STRATEGIES``): ``"default"`` (pallas-tune's, as the tuner searches:
:class:`pallas_tune.search.gp.CandidateBO`), ``"tpe"`` (Optuna's TPESampler as it comes: in
Optuna 5 multivariate, 10 startup trials), ``"tpe-mv"`` (multivariate, grouped TPE, 5 startup
trials), ``"cmaes"`` (Optuna's CmaEsSampler over the parameters' value ranks), ``"optuna-gp"``
(Optuna's GPSampler; needs PyTorch), ``"random"`` (without replacement) and ``"grid"`` (file
order). Optuna samplers
see every parameter categorical (as the tuner encodes a space) except ``cmaes``; a proposal
outside the constrained space is told ``inf`` and not counted. ``strategy`` may also be any
callable ``(landscape, budget, seed, evaluate, measured) -> None``: check your own.

``warm_start``: configs (dicts or tuples in the file's key order) measured first, in order, as
the tuner measures its warm starts (the declared default, the nearest tuned shapes' winners, a
roofline model's picks) before it searches; strategies then learn from them.

``find_landscapes()`` lists the landscape files under ``$PALLAS_TUNE_LANDSCAPES`` or, in a
checkout, ``../shared/landscapes`` beside the repository.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune.config import _freeze

__all__ = ["Landscape", "STRATEGIES", "Trace", "find_landscapes", "load", "make_prior", "run",
           "trace"]

# Where find_landscapes() looks when no folder is given: this variable, else ../shared/landscapes.
LANDSCAPES_ENV = "PALLAS_TUNE_LANDSCAPES"


class Landscape:
    """A measured space: configs (tuples in ``keys`` order) → list of repeat times or None."""

    def __init__(self, keys: Sequence[str], params: dict[str, list[Any]],
                 times: dict[tuple[Any, ...], list[float] | None], name: str = ""):
        if not times:
            raise ValueError(f"landscape {name!r} holds no configs: give a file whose 'cache' "
                             "has at least one record")
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

    @functools.cached_property
    def means(self) -> dict[tuple[Any, ...], float]:
        """Each config's mean recorded time (``inf`` for a failed config)."""
        return {c: sum(t) / len(t) if t else math.inf for c, t in self.times.items()}

    @property
    def optimum(self) -> float:
        return min(self.means.values())


def load(path: str) -> Landscape:
    """Reads a Kernel Tuner cache file; records without the file's keys are skipped."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    try:
        keys, cache = data["tune_params_keys"], data["cache"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a Kernel Tuner cache file (no {e}): give one with "
                         "'tune_params_keys' and 'cache'") from None
    times: dict[tuple[Any, ...], list[float] | None] = {}
    for rec in cache.values():
        if not isinstance(rec, dict) or any(k not in rec for k in keys):
            continue
        config = tuple(_freeze(rec[k]) for k in keys)
        t = rec.get("time")
        if isinstance(t, int | float) and math.isfinite(t) and t > 0:
            reps = [float(x) for x in rec.get("times") or [t]
                    if isinstance(x, int | float) and math.isfinite(x) and x > 0]
            times[config] = reps or [float(t)]
        else:
            times[config] = None
    params = data.get("tune_params") or {}
    return Landscape(keys, params, times, name=data.get("kernel_name", path))


def find_landscapes(root: str | None = None) -> list[str]:
    """Landscape files (``*.json.gz``, ``*.json``) under ``root``, else under
    ``$PALLAS_TUNE_LANDSCAPES``, else under ``../shared/landscapes`` beside this checkout;
    sorted, empty if the folder is absent."""
    if root is None:
        root = os.environ.get(LANDSCAPES_ENV) or os.path.join(
            os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "landscapes")
    files = glob.glob(os.path.join(root, "**", "*.json.gz"), recursive=True)
    files += glob.glob(os.path.join(root, "**", "*.json"), recursive=True)
    return sorted(os.path.normpath(f) for f in files)


Evaluate = Callable[[tuple[Any, ...]], float]
PriorArg = Any  # A Prior, or a list of landscape files, Landscapes or (config, time) lists.
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


def _default(land: Landscape, budget: int, seed: int, evaluate, measured, **settings) -> None:
    """pallas-tune's default sampler (``settings`` override its defaults, for studies)."""
    from pallas_tune.search.gp import CandidateBO

    bo = CandidateBO(land.configs, land.choices, seed=seed, budget=budget, **settings)
    while len(measured) < budget:
        c = bo.propose(measured)
        if c is None:
            break
        evaluate(c)


def default_with(**settings: Any) -> Strategy:
    """The default strategy with some of :class:`~pallas_tune.search.gp.CandidateBO`'s settings
    changed (for replay studies of those settings)."""
    return functools.partial(_default, **settings)


def _optuna(land: Landscape, budget: int, seed: int, evaluate, measured, *,
            sampler: Any, ordinal: bool = False) -> None:
    """An Optuna sampler over the landscape's values: categorical, as the tuner encodes a space,
    or (``ordinal``) each parameter as the integer rank of its value."""
    import optuna

    optuna.logging.disable_default_handler()
    valid = set(land.configs)
    names = [k for k, ch in zip(land.keys, land.choices, strict=True) if len(ch) > 1]
    pos = {k: i for i, k in enumerate(land.keys)}
    study = optuna.create_study(direction="minimize", sampler=sampler)
    rng = random.Random(seed)

    def suggest(trial: Any) -> tuple[Any, ...]:
        c = [ch[0] for ch in land.choices]
        for k in names:
            ch = land.choices[pos[k]]
            i = (trial.suggest_int(k, 0, len(ch) - 1) if ordinal else
                 trial.suggest_categorical(k, list(range(len(ch)))))
            c[pos[k]] = ch[i]
        return tuple(c)

    def encode(c: tuple[Any, ...]) -> dict[str, int]:
        return {k: land.choices[pos[k]].index(c[pos[k]]) for k in names}

    def tell(trial: Any, value: float) -> None:
        # Failed and invalid configs are told +inf, not FAIL: TPE ignores failed trials, so it
        # would keep proposing the same region; an infinite value puts it in the "bad" group.
        study.tell(trial, value if math.isfinite(value) else math.inf)

    def measure_given(c: tuple[Any, ...], value: float | None = None) -> None:
        study.enqueue_trial(encode(c))
        trial = study.ask()
        suggest(trial)
        tell(trial, evaluate(c) if value is None else value)

    for c, value in list(measured.items()):  # Warm starts: learned, not measured again.
        measure_given(c, value)
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
            measure_given(rng.choice([x for x in land.configs if x not in measured]))
            misses = 0


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, v) if isinstance(v, int | float) and not isinstance(v, bool) else (1, str(v))


def _tpe(land, budget, seed, evaluate, measured):
    """Optuna's TPESampler with its defaults (Optuna 5: multivariate, constant liar, 10 startup
    trials), every parameter categorical."""
    import optuna

    _optuna(land, budget, seed, evaluate, measured,
            sampler=optuna.samplers.TPESampler(seed=seed))


def _tpe_mv(land, budget, seed, evaluate, measured):
    """Multivariate, grouped TPE over categorical parameters with 5 random startup trials (the
    tuner's TPE): failed and invalid proposals told +inf, invalid ones not counted."""
    import optuna

    _optuna(land, budget, seed, evaluate, measured, sampler=optuna.samplers.TPESampler(
        seed=seed, multivariate=True, group=True, n_startup_trials=min(5, max(1, budget // 5))))


def _cmaes(land, budget, seed, evaluate, measured):
    """Optuna's CmaEsSampler over the value ranks (CMA-ES needs numbers; categorical parameters
    would fall back to random), 5 random startup trials."""
    import optuna

    _optuna(land, budget, seed, evaluate, measured, ordinal=True,
            sampler=optuna.samplers.CmaEsSampler(seed=seed, n_startup_trials=5,
                                                 warn_independent_sampling=False))


def _optuna_gp(land, budget, seed, evaluate, measured):
    """Optuna's GPSampler as it comes (needs PyTorch), over the categorical encoding."""
    import optuna

    _optuna(land, budget, seed, evaluate, measured,
            sampler=optuna.samplers.GPSampler(seed=seed, n_startup_trials=5))


STRATEGIES: dict[str, Strategy] = {
    "default": _default, "tpe": _tpe, "tpe-mv": _tpe_mv, "cmaes": _cmaes,
    "optuna-gp": _optuna_gp, "random": _random, "grid": _grid,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trace:
    """A replayed search: ``configs`` measured in order, the ``values`` measured (a drawn repeat,
    ``inf`` for a failure), and ``seconds`` the strategy spent (proposals, not lookups)."""

    configs: list[tuple[Any, ...]]
    values: list[float]
    seconds: float


def trace(path: str | Landscape, strategy: str | Strategy = "default", budget: int = 50,
          seed: int = 0, *, warm_start: Sequence[Mapping[str, Any] | Sequence[Any]] = (),
          prior: PriorArg = None) -> Trace:
    """Replays ``strategy`` (a name in ``STRATEGIES`` or a callable) on a landscape; see
    :func:`run`."""
    land = path if isinstance(path, Landscape) else load(path)
    if isinstance(strategy, str):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy={strategy!r} must be one of {sorted(STRATEGIES)}")
        strategy = STRATEGIES[strategy]
    if prior is not None:
        strategy = _with_prior(strategy, land, prior)
    rng = random.Random(seed * 7919 + 1)
    configs: list[tuple[Any, ...]] = []
    out: list[float] = []
    seen: dict[tuple[Any, ...], float] = {}
    lookup = [0.0]

    def evaluate(c: tuple[Any, ...]) -> float:
        if c in seen:
            return seen[c]
        if len(out) >= budget:
            return seen.get(c, math.inf)
        t0 = time.perf_counter()
        reps = land.times.get(c)
        if c not in land.times:
            raise ValueError(f"the strategy proposed {c!r}, which is not in the landscape: "
                             "propose only configs from landscape.configs")
        value = rng.choice(reps) if reps else math.inf
        seen[c] = value
        configs.append(c)
        out.append(value)
        lookup[0] += time.perf_counter() - t0
        return value

    for w in warm_start:
        c = _as_tuple(land, w)
        if c in land.times and len(out) < budget:
            evaluate(c)
    t0 = time.perf_counter()
    strategy(land, min(budget, len(land.configs)), seed, evaluate, seen)
    return Trace(configs=configs, values=out,
                 seconds=max(0.0, time.perf_counter() - t0 - lookup[0]))


def run(path: str | Landscape, strategy: str | Strategy = "default", budget: int = 50,
        seed: int = 0, *, warm_start: Sequence[Mapping[str, Any] | Sequence[Any]] = (),
        prior: PriorArg = None) -> list[float]:
    """Replays ``strategy`` on a landscape; returns measured times in evaluation order (inf for
    failed configs). Deterministic for a given seed. ``warm_start`` configs (dicts by parameter
    name, or tuples in the file's key order; those not in the file are skipped) are measured
    first. ``prior``: what other tasks of the same kernel measured, for the default strategy to
    learn from (transfer, :mod:`pallas_tune.search.prior`): a list whose items are landscape
    files or :class:`Landscape` objects (other devices or shapes; each config's mean time) or
    lists of (config, time) pairs (a dict by parameter name or a tuple in the file's key order),
    or a ready :class:`~pallas_tune.search.prior.Prior`."""
    return trace(path, strategy, budget, seed, warm_start=warm_start, prior=prior).values


def make_prior(land: Landscape, prior: PriorArg) -> Any:
    """A :class:`~pallas_tune.search.prior.Prior` over ``land``'s parameters from ``prior``
    (see :func:`run`)."""
    from pallas_tune.search.prior import Prior

    if isinstance(prior, Prior):
        return prior
    if isinstance(prior, str | os.PathLike | Landscape):
        raise TypeError("prior= takes a list of landscapes or (config, time) lists, not one "
                        "landscape: wrap it in a list")
    tasks, names = [], []
    for i, item in enumerate(prior or ()):
        if isinstance(item, str | os.PathLike):
            item = load(os.fspath(item))
        if isinstance(item, Landscape):
            tasks.append([(dict(zip(item.keys, c, strict=True)), m)
                          for c, m in item.means.items()])
            names.append(item.name)
        else:
            tasks.append([(dict(zip(land.keys, _as_tuple(land, c), strict=True)), t)
                          for c, t in item])
            names.append(f"prior {i}")
    return Prior(land.keys, tasks, names)


def _with_prior(strategy: Strategy, land: Landscape, prior: PriorArg) -> Strategy:
    func = strategy.func if isinstance(strategy, functools.partial) else strategy
    if func is not _default:
        raise ValueError("prior= is for the default strategy (and default_with(...)); the "
                         "other strategies do not learn from other tasks: leave prior out")
    scores = make_prior(land, prior).scores(land.configs, land.choices)
    return strategy if scores is None else functools.partial(strategy, prior=scores)


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
