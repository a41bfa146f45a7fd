"""``warm_configs``: the caller's own configs (the one they run today, another library's
defaults) evaluated first, so a tune is never worse than them by its own timer."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

import pallas_tune as pt
from pallas_tune.errors import TuneOptionError

MINE = {"br": 64, "bc": 256, "buffering": 2}


def test_the_callers_configs_are_evaluated_first(cache_dir, fresh):
    res = fresh.scale.tune(fresh.ones(), trials=3, seed=0, repeats=1, warm_start=0,
                           warm_configs=[MINE], write=False)
    trials = res.trials.sort_values("number")
    first, second = trials.iloc[0], trials.iloc[1]
    # The declared baseline first (every speed-up is stated against it), then the caller's,
    # then the sampler's picks (warm_start=0: no others).
    assert {k: first[k] for k in MINE} == next(fresh.scale.space.ordered_candidates())
    assert {k: second[k] for k in MINE} == MINE
    assert res.best_ms <= float(second["median_ms"])


def test_a_config_outside_the_space_is_refused_before_any_trial(cache_dir, fresh):
    with pytest.raises(TuneOptionError) as e:
        fresh.scale.tune(fresh.ones(), trials=3, warm_configs=[{**MINE, "br": 48}],
                         write=False)
    text = str(e.value)
    assert "warm_configs[0]" in text and "br" in text and "[8, 16, 32, 64]" in text
    with pytest.raises(TuneOptionError, match="lacks parameter"):
        fresh.scale.tune(fresh.ones(), trials=3, warm_configs=[{"br": 8}], write=False)


def test_the_option_takes_one_mapping_or_a_list_of_them():
    assert pt.TuneOptions(warm_configs=MINE).warm_configs == (MINE,)
    assert pt.TuneOptions(warm_configs=[MINE, MINE]).warm_configs == (MINE, MINE)
    for bad in ("br=8", [("br", 8)], [{}], 3):
        with pytest.raises(TuneOptionError, match="warm_configs"):
            pt.TuneOptions(warm_configs=bad)


def test_the_sweep_flag_reads_json():
    from pallas_tune.cli.options import _configs_arg

    assert _configs_arg('{"br": 8, "bc": 128, "buffering": 1}') == [
        {"br": 8, "bc": 128, "buffering": 1}]
    assert _configs_arg('[{"br": 8}, {"br": 16}]') == [{"br": 8}, {"br": 16}]
    with pytest.raises(argparse.ArgumentTypeError, match="not JSON"):
        _configs_arg("{br: 8}")


def test_the_default_is_evaluated_whatever_the_warm_configs_and_trials(cache_dir):
    """Issue 53.6: as many warm configs as trials left the declared default unevaluated, and
    a config 2.8x slower than it was cached. The default is the baseline: always evaluated,
    first; the caller's configs the budget cannot hold are named in a warning."""
    from test_tuner import Landscape

    from pallas_tune.tuning import TuneOptions, run

    @pt.tunable(a=list(range(8)), b=list(range(4)), default={"a": 0, "b": 0},
                name="warm_default_toy")
    def kern(x, *, a, b):
        return x

    def cost(cfg):  # The default is the fastest; every other config 2.8x slower or worse.
        return 1.0 if cfg == {"a": 0, "b": 0} else 2.8 + cfg["a"] + cfg["b"]

    mine = [{"a": a, "b": 1} for a in range(1, 4)]
    ev = Landscape(cost)
    with pytest.warns(pt.PallasTuneWarning, match=r"trials=3; the declared default is "
                      r"evaluated first .* the last 1 of yours \(\{a=3, b=1\}\) .* trials=4"):
        res = run(kern, (np.ones((8, 128), np.float32),), {},
                  TuneOptions(trials=3, warm_configs=mine, warm_start=0, write=False,
                              retime_top=0, seed=0), evaluator=ev)
    assert ev.evaluated[0] == {"a": 0, "b": 0}
    assert ev.evaluated[1:3] == mine[:2]
    assert res.best == {"a": 0, "b": 0} and res.best_ms == 1.0
    assert res.default_ms == 1.0
