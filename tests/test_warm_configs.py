"""``warm_configs``: the caller's own configs (the one they run today, another library's
defaults) evaluated first, so a tune is never worse than them by its own timer."""

from __future__ import annotations

import argparse

import pytest

import pallas_tune as pt
from pallas_tune.errors import TuneOptionError

MINE = {"br": 64, "bc": 256, "buffering": 2}


def test_the_callers_configs_are_evaluated_first(cache_dir, fresh):
    res = fresh.scale.tune(fresh.ones(), trials=3, seed=0, repeats=1, warm_start=0,
                           warm_configs=[MINE], write=False)
    trials = res.trials.sort_values("number")
    first, second = trials.iloc[0], trials.iloc[1]
    assert {k: first[k] for k in MINE} == MINE
    # Then the declared baseline (warm_start=0 keeps only it), then the sampler's picks.
    assert {k: second[k] for k in MINE} == next(fresh.scale.space.ordered_candidates())
    assert res.best_ms <= float(first["median_ms"])


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
