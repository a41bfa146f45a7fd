"""Estimate first, confirm on the chip: a measured run learns from the compiler's estimates
for its chip (the transfer prior across fidelities) and can measure only the estimate's best
few (``confirm_top``). With fake timers, on the CPU."""

from __future__ import annotations

import os

import jax.numpy as jnp
import pytest

import pallas_tune as pt
from pallas_tune.cache import ledger
from pallas_tune.errors import TuneOptionError


def _estimate(cfg):  # What the compiler's estimate says: prefers big a.
    return 1.0 + (7 - cfg["a"]) + 0.5 * abs(cfg["b"] - 1)


def _measured(cfg):  # What the chip says: agrees coarsely, a=6 beats a=7.
    return 1.0 + abs(cfg["a"] - 6) + 0.5 * abs(cfg["b"] - 1)


@pytest.fixture
def kern(cache_dir):
    @pt.tunable(a=list(range(8)), b=list(range(4)), name="confirm_toy")
    def kern(x, *, a, b):
        return x

    x = jnp.ones((64, 128))
    path = kern.cache.ledger_path("cpu", kern.name, kind="estimate")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    trials = [{"number": i, "config": {"a": a, "b": b}, "outcome": "ok",
               "median_ms": _estimate({"a": a, "b": b})}
              for i, (a, b) in enumerate((a, b) for a in range(8) for b in range(4))]
    ledger.append(path, [{"key": kern.cache_key(x), "kind": "estimate", "trials": trials}])
    return kern, x


def _run(kern, x, **options):
    from test_tuner import Landscape

    from pallas_tune.tuning import TuneOptions, run

    ev = Landscape(_measured)
    res = run(kern, (x,), {}, TuneOptions(write=False, retime_top=0, seed=0, **options),
              evaluator=ev)
    return res, ev


def test_confirm_top_measures_only_the_estimates_best_and_says_so(kern):
    kern, x = kern
    res, ev = _run(kern, x, confirm_top=3)
    top = [{"a": 7, "b": 1}, {"a": 7, "b": 0}, {"a": 7, "b": 2}]
    assert sorted(map(lambda c: tuple(sorted(c.items())), ev.evaluated)) == sorted(
        tuple(sorted(c.items())) for c in top)
    confirmed = res.provenance["confirmed"]
    assert confirmed["from"] == f"cpu:{kern.cache_key(x)} (estimate)"
    assert confirmed["configs"] == top and confirmed["estimate_ms"] == [1.0, 1.5, 1.5]
    assert res.best == {"a": 7, "b": 1} and len(res.records) == 3


def test_confirm_top_without_estimates_or_with_the_estimate_timer_is_a_clear_error(kern,
                                                                                   cache_dir):
    kern, x = kern
    with pytest.raises(TuneOptionError, match="no compiler estimates of .* run the same tune "
                                              "with --timer tpu-estimate"):
        _run(kern, jnp.ones((32, 128)), confirm_top=3)


def test_a_measured_run_learns_from_the_estimates_for_its_chip(kern):
    """The transfer prior across fidelities: the estimate run at this very key is a task of
    the measured run's prior (labelled as an estimate), so the GP starts where the estimate
    is good, and finds the chip's optimum (a=6, b=1) within 6 trials (a cold GP: not in 8)."""
    kern, x = kern
    res, ev = _run(kern, x, trials=8, warm_start=0, transfer=True)
    assert res.provenance["prior"]["tasks"][0] == f"cpu:{kern.cache_key(x)} (estimate)"
    first = next(i for i, c in enumerate(ev.evaluated) if c == {"a": 6, "b": 1})
    cold, ev_cold = _run(kern, x, trials=8, warm_start=0, transfer=False)
    later = next((i for i, c in enumerate(ev_cold.evaluated) if c == {"a": 6, "b": 1}), 99)
    assert first < 6 and first < later, (first, later)
