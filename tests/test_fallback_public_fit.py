"""benchmarks/estimates/fallback_public_fit.py: fitting the fallback model's constants to
real-hardware winners, on made-up features (no tracing, no tpu-inference): the fit ranks the
winners a hidden set of constants chose, the winner's exact rank, and the keys a fit must never
see (every key a fidelity report scores)."""

from __future__ import annotations

import json
import math
import types

import pytest
from conftest import estimate_modules

from pallas_tune.chips import chip_spec
from pallas_tune.feasibility.fitted import V6E, Constants


@pytest.fixture(scope="module")
def mods():
    """(fit, report) modules, taken out of ``sys.modules`` afterwards with the stub
    ``tpu_inference`` modules their import installs."""
    with estimate_modules("fallback_public_fit", "fallback_public_report") as m:
        yield m


def _features(rep, steps, nbytes):
    """A config's features (a features file's entry), as feasibility.fitted.call_features
    would read them: grid steps and bytes refetched with one buffer (nothing overlaps them)."""
    return rep.Traced.of({"features": [{"steps": steps, "dots": [], "pipelined_bytes": 0.0,
                                        "serial_bytes": nbytes, "step_bytes": 0.0,
                                        "vec_elems": 0.0}], "roofline_s": 1.0})


def _keys(rep, truth, spec):
    """Keys trading grid steps against bytes; each one's winner is its best config under
    ``truth`` (the hidden chip)."""
    out = []
    for scale in (0.5, 1.0, 2.0, 4.0):
        feats = {(1, 1, 1): _features(rep, 200 * scale, 1e6),
                 (2, 2, 2): _features(rep, 10, 1e8 * scale),
                 (3, 3, 3): _features(rep, 60 * scale, 3e7 * scale)}
        times = rep.model_times(feats, spec, truth)
        out.append((min(times, key=times.get), feats))
    return out


def test_the_fit_ranks_the_winners_a_hidden_chip_chose(mods):
    fit, rep = mods
    spec = chip_spec("v6e")
    truth = Constants(mxu_eff=1.0, bw_eff=1.0, step_s=5e-6, vec_s=1e-12)
    keys = _keys(rep, truth, spec)
    before = [rep.exact(rep.model_times(f, spec, V6E), w)["rank"] for w, f in keys]
    assert before.count(1) < 4  # libtpu's fit misranks them.
    c, loss = fit.fit(keys, spec, 0.05)
    assert loss < fit.loss([math.log(getattr(V6E, p)) for p in fit.PARAMS], keys, spec, 0.05)
    assert [rep.exact(rep.model_times(f, spec, c), w)["rank"] for w, f in keys] == [1] * 4
    for p in fit.PARAMS:
        lo, hi = fit.BOUNDS[p]
        assert lo <= getattr(c, p) <= hi


def test_the_winners_exact_rank_and_ratio(mods):
    _, rep = mods
    figs = {(1, 1, 1): 2.0, (2, 2, 2): 1.0, (3, 3, 3): 2.5}
    assert rep.exact(figs, (1, 1, 1)) == {"rank": 2, "ratio": 2.0}
    assert rep.exact(figs, (9, 9, 9)) == {"rank": math.inf, "ratio": None}
    # A config level with the winner counts as ahead of it: a figure that cannot tell them
    # apart is no evidence for the winner.
    assert rep.exact({**figs, (4, 4, 4): 2.0}, (1, 1, 1)) == {"rank": 3, "ratio": 2.0}


def test_a_fit_never_sees_a_key_a_report_scores(mods, tmp_path):
    fit, _ = mods
    (tmp_path / "estimate_fidelity.json").write_text(json.dumps(
        {"runs": [{"key": [16, 2048, 1536], "winner": [16, 1024, 1536]}]}))
    (tmp_path / "estimate_fidelity_strata.json").write_text(json.dumps(
        {"runs": [{"chip": "7x", "key": [64, 1024, 1024]}]}))
    planned = [types.SimpleNamespace(chip="v6e", key=(8192, 4096, 2048))]
    never = fit.reported_keys(str(tmp_path), planned)
    assert never == {("v6e", (16, 2048, 1536)), ("7x", (64, 1024, 1024)),
                     ("v6e", (8192, 4096, 2048))}


def test_validation_keys_are_counted_per_n_batch_band(mods):
    """The validation table per n_batch band: each key in its own band, the winner's top-3
    and pick-within-2% counts of the public fit there (a key the fit ranks first, and one it
    ranks last, over made-up features)."""
    _, rep = mods
    spec = chip_spec("v6e")
    c = Constants(mxu_eff=1.0, bw_eff=1.0, step_s=5e-6, vec_s=1e-12)
    feats = {(1, 1, 1): _features(rep, 10, 1e6), (2, 2, 2): _features(rep, 20, 1e6),
             (3, 3, 3): _features(rep, 30, 1e6), (4, 4, 4): _features(rep, 40, 1e6)}
    fits = {"v6e": {"spec": spec, "constants": c,
                    "valid": [((1, 1, 1), feats), ((4, 4, 4), feats)],
                    "valid_keys": [(32, 1024, 1024), (16384, 1024, 1024)]}}
    lines = rep.band_rows(fits)
    head = lines[0].split(" | ")
    top3, within = head.index("public: top 3"), head.index("public: pick within 2%")
    rows = {r.split(" | ")[1]: r.split(" | ") for r in lines[2:]}
    assert set(rows) == {"up to 64", "8192 and up"}
    assert (rows["up to 64"][top3], rows["up to 64"][within]) == ("1/1", "1/1")
    assert (rows["8192 and up"][top3], rows["8192 and up"][within]) == ("0/1", "0/1")
