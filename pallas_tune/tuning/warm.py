"""Warm starts: configs worth evaluating before the sampler proposes its own."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["own_configs", "queue", "warm_start_configs"]

# Rank at most this many configs with the roofline model (each is one trace).
ROOFLINE_MAX_SPACE = 4096

Ranker = Callable[[Sequence[Mapping[str, Any]], str], list[float | None]]


def warm_start_configs(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any], chip: str,
                       key: str, *, limit: int = 6, rank: Ranker | None = None,
                       space: Any = None, held: Mapping[str, Any] | None = None
                       ) -> list[dict[str, Any]]:
    """Configs worth measuring first: the declared default, the winners of the nearest tuned
    shapes (same kernel and chip, by key distance; only those valid here; the key's own entry
    first, so that a re-tune measures the config it may replace), then for TPU chips
    the roofline model's best picks. Deduplicated, at most ``limit``; the winners and the
    picks only where the kernel's declared constraints hold for the call (a rule between
    parameters would make the model's ties, one program under several names, fail as trials).

    ``rank(configs, chip)`` gives each config's roofline time, None where it is invalid here
    (the tuner passes its evaluator's, which traces inside the isolation boundary; default:
    in this process). ``held``: parameters not searched here, at their one value (a winner
    of another shape runs here with it)."""
    from pallas_tune import keys
    from pallas_tune.chips import chip_spec
    from pallas_tune.space import _freeze

    from pallas_tune import effective

    rank = rank or _rank_here(kernel, args, kwargs)
    space = space if space is not None else kernel.space
    dims = effective.clamp_dims(space, effective.call_env(kernel.signature, args, kwargs))
    out: list[dict[str, Any]] = []

    declared = getattr(kernel, "declared_problems", None)

    def admitted(c: Mapping[str, Any]) -> bool:  # The kernel's declared constraints hold.
        return declared is None or not declared(c, args, kwargs)

    def add(config: Mapping[str, Any], check: bool = True) -> None:
        # A winner of another shape, as the point of this call's space that runs like it.
        c = effective.representative({k: config[k] for k in space.names} | dict(held or {}),
                                     space, dims)
        if c not in out and c in space and len(out) < limit and (not check or admitted(c)):
            out.append(c)

    add(next(space.ordered_candidates()), check=False)  # The baseline, whatever it is.
    near = []
    if kernel.key_fn is None:
        for other, entry, _ in kernel.cache.entries(chip, kernel.name):
            d = keys.key_distance(key, other)
            if math.isfinite(d):  # The key's own entry too (a re-tune): distance 0, first.
                near.append((d, other, entry))
    winners = []
    for _, _, entry in sorted(near, key=lambda t: (t[0], t[1]))[:limit]:
        config = {k: _freeze(v) for k, v in entry.get("config", {}).items()}
        if set(config) == set(space.names):
            config |= dict(held or {})
            config = effective.representative(config, space, dims)
        if set(config) == set(space.names) and config in space and config not in winners:
            winners.append(config)
    for config, t in zip(winners, rank(winners, chip) if winners else [], strict=True):
        if t is not None:
            add(config)
    try:
        tpu = chip_spec(chip).platform == "tpu"
    except ValueError:
        tpu = False
    if tpu and len(out) < limit and space.size <= ROOFLINE_MAX_SPACE:
        configs = [c for c in space if admitted(c)]
        times = rank(configs, chip)
        ranked = sorted((t, i) for i, t in enumerate(times) if t is not None)
        for _, i in ranked:
            if len(out) >= limit:
                break
            add(configs[i])
    return out


def _rank_here(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Ranker:
    from pallas_tune.measure.candidate import KernelParts, roofline_time

    parts = KernelParts.of(kernel)

    def rank(configs: Sequence[Mapping[str, Any]], chip: str) -> list[float | None]:
        return [roofline_time(parts, args, kwargs, c, chip) for c in configs]

    return rank


def own_configs(kernel: Any, space: Any, configs: Sequence[Mapping[str, Any]],
                held: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """``TuneOptions.warm_configs`` as points of this call's space, deduplicated (``held``:
    parameters not searched here, at their one value: a given value of one of them is
    replaced); a config that is not one raises :class:`~pallas_tune.errors.TuneOptionError`
    naming what is wrong with it and the values the space has."""
    from pallas_tune.errors import TuneOptionError
    from pallas_tune.space import _freeze

    out: list[dict[str, Any]] = []
    for i, given in enumerate(configs):
        config = {k: _freeze(v) for k, v in given.items()}
        config |= {k: v for k, v in (held or {}).items() if k in config}
        problems = space.config_problems(config)  # Constraints are checked as any trial's.
        if problems:
            raise TuneOptionError(
                f"warm_configs[{i}]={dict(given)!r} is not a point of {kernel.name}'s space at "
                f"this call: {'; '.join(problems)}. Its parameters: "
                + "; ".join(f"{p.name} in {list(p.choices)}" for p in space.params) + ".")
        if config not in out:
            out.append(config)
    return out


def queue(kernel: Any, space: Any, given: Sequence[Mapping[str, Any]],
          found: Sequence[Mapping[str, Any]], trials: int) -> list[dict[str, Any]]:
    """The order of the first candidates: the baseline (the declared default, else the
    space's first point: what every speed-up is stated against and the first figure the slow
    cut-off compares with), then the caller's ``warm_configs``, then the ``found`` warm
    starts; each once. Where the baseline and the caller's configs are more than ``trials``,
    the caller's last ones are not evaluated: a warning names them and the ``trials`` that
    would."""
    baseline = next(space.ordered_candidates())
    out = [dict(baseline)]
    for config in [*given, *found]:
        if config not in out:
            out.append(dict(config))
    mine = [c for c in given if c != baseline]
    left = mine[max(0, trials - 1):]
    if left:
        from pallas_tune import errors

        errors.warn(
            f"{kernel.name}: warm_configs has {len(given)} configs and trials={trials}; the "
            f"declared default is evaluated first (the baseline of every speed-up), so "
            f"the last {len(left)} of yours ({', '.join(map(_text, left))}) may not be "
            f"(trials counts timed programs); give trials={len(mine) + 1} to evaluate them "
            "all.")
    return out


def _text(config: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in config.items()) + "}"
