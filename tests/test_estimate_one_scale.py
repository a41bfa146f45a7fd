"""Issue 55, items 1 and 4: every figure a tpu-estimate run ranks is on one scale (a model's
figure for a candidate libtpu gave none is calibrated on the configs with both, or ranked apart
and kept out of the pick; with the fitted model every candidate is ranked by the larger of
libtpu's figure and the calibrated model's; where libtpu figured fewer than MIN_PAIRS, by the
model alone), every trial and the entry name the figure they have, and the entry keeps the
estimate's shortlist, which ``confirm_top`` then measures without estimating again. Fake
evaluators: no libtpu, no device."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import pytest

import pallas_tune as pt
from pallas_tune.measure.evaluate import Evaluator
from pallas_tune.measure.records import (DEFAULT_SHORTLIST_K, Measurement, Outcome,
                                         TrialRecord)
from pallas_tune.measure.scale import MIN_PAIRS, one_scale, scale_figures


def _libtpu(a):  # libtpu's figure: big a is fast.
    return 10.0 - a


def _model(a):  # The model's: the same order, on half the scale.
    return 0.5 * (10.0 - a)


class FakeEstimate(Evaluator):
    """libtpu's figure for most configs; the fitted model's (raw) for those in ``modelled``
    (as a profiler abort with --estimate-fallback model leaves them)."""

    kind = "estimate"

    def __init__(self, modelled, model=_model, bound=False):
        super().__init__()
        self.modelled, self.model, self.bound = set(modelled), model, bound

    def start(self):
        self.device = {"chip": "v6e", "platform": "tpu", "device_kind": "TPU v6 lite",
                       "interpret": False}
        return self.device

    def _evaluate(self, candidates):
        out = []
        for number, config in candidates:
            a = config["a"]
            by_model = a in self.modelled
            rec = TrialRecord(
                number=number, config=dict(config), outcome=Outcome.OK,
                fingerprint=f"p{a}", detail="fitted model (libtpu's static profile aborted: "
                "FIFO: ...)" if by_model else "",
                measurement=Measurement(times_ms=(self.model(a) if by_model else _libtpu(a),),
                                        compile_ms=0.0,
                                        timer="fitted-model" if by_model else "tpu-estimate"))
            self._note(rec)
            out.append(rec)
        return out

    def one_scale(self, records):
        return one_scale(list(records), lambda configs: [self.model(c["a"]) for c in configs],
                         timer="fitted-model", bound=self.bound)

    def roofline(self, configs, chip):
        return [None for _ in configs]


@pytest.fixture
def kern(cache_dir):
    @pt.tunable(a=list(range(8)), name="one_scale_toy")
    def kern(x, *, a):
        return x

    return kern, jnp.ones((64, 128))


def _estimate(kern, x, modelled, model=_model, bound=False, **options):
    from pallas_tune.tuning import TuneOptions, run

    opts = TuneOptions(timer="tpu-estimate", chip="v6e", trials=8, retime_top=0, seed=0,
                       warm_start=0, transfer=False, **{"write": False, **options})
    return run(kern, (x,), {}, opts, evaluator=FakeEstimate(modelled, model, bound))


def test_a_model_figure_never_decides_the_pick_raw(kern):
    """a=6 has only the model's figure, 2.0 ms raw: below libtpu's best (a=7, 3.0 ms), but
    on libtpu's scale (x2, from the 7 configs with both) 4.0 ms. Ranked raw, it won."""
    kern, x = kern
    res = _estimate(kern, x, modelled={6})
    assert res.best == {"a": 7} and res.best_ms == 3.0
    six = next(r for r in res.records if r.config == {"a": 6})
    assert six.median_ms == pytest.approx(4.0)
    assert six.measurement.timer == "fitted-model calibrated"
    assert six.detail.startswith("fitted-model figure 2 ms calibrated on 7 configs with both")
    assert res.provenance["timer"] == "tpu-estimate+fitted-model calibrated"
    assert res.provenance["calibration"] == {"pairs": 7, "ratio": 2.0}
    assert all(r.measurement.timer == "tpu-estimate" for r in res.records if r.config != {"a": 6})


def test_too_few_libtpu_figures_rank_every_candidate_by_the_model_alone(kern):
    """libtpu figured a=0 and a=1 only (fewer than MIN_PAIRS: nothing to calibrate on, too few
    to pick from, as fp8 on 7x where its profiler aborts on most): every candidate is ranked
    by the model's own figure, libtpu's kept in the detail; the model's best (a=7) wins."""
    kern, x = kern
    res = _estimate(kern, x, modelled=set(range(2, 8)))
    assert MIN_PAIRS > 2 and res.best == {"a": 7} and res.best_ms == pytest.approx(1.5)
    assert all(r.measurement.timer == "fitted-model" for r in res.records)
    one = next(r for r in res.records if r.config == {"a": 1})
    assert one.median_ms == pytest.approx(_model(1)) and "(its own 9 ms)" in one.detail
    assert res.provenance["timer"] == "fitted-model"
    assert "libtpu figured 2 of the run's candidates" in res.provenance["timing_note"]


def test_model_figures_that_cannot_be_calibrated_are_ranked_apart(kern):
    """libtpu figured six candidates but the model traces none of them: nothing to calibrate
    on, so the two model-figured ones stay out of the pick (a=7, 1.5 ms raw, would win)."""
    kern, x = kern
    res = _estimate(kern, x, modelled={6, 7},
                    model=lambda a: _model(a) if a >= 6 else None)
    assert res.best == {"a": 5}
    apart = [r for r in res.records if r.config["a"] >= 6]
    assert all(not r.outcome.timed and r.error.startswith("not ranked: fitted-model figure")
               for r in apart)
    assert res.provenance["timer"] == "tpu-estimate"
    assert "ranked apart, not in the pick" in res.provenance["timing_note"]


def test_the_fitted_model_bounds_libtpu_figures_from_below(kern):
    """With the fitted model (``bound``), a candidate libtpu rates fast but the model,
    calibrated on libtpu's best, rates slow is ranked by the model's figure: libtpu leaves out
    costs the chip pays. Model: a=7 three times as slow as libtpu says, the rest on half
    libtpu's scale (calibration x2 from the median)."""
    kern, x = kern
    res = _estimate(kern, x, modelled=set(),
                    model=lambda a: 4.5 if a == 7 else _model(a), bound=True)
    assert res.best == {"a": 6} and res.best_ms == 4.0
    seven = next(r for r in res.records if r.config == {"a": 7})
    assert seven.median_ms == pytest.approx(9.0)
    assert seven.measurement.timer == "fitted-model calibrated"
    assert seven.detail.startswith("libtpu's figure 3 ms; the fitted-model figure 4.5 ms "
                                   "calibrated on 8 configs with both (x2) is larger")
    assert res.provenance["timer"] == "max(tpu-estimate, fitted-model calibrated)"
    assert "(1 of 8 libtpu-figured by the model's)" in res.provenance["timing_note"]


def test_the_rule_on_plain_figures():
    """scale_figures, as a benchmark scores it: each case of the rule."""
    lib = {"a": 1.0, "b": 2.0, "c": 3.0}
    model = {"a": 0.5, "b": 1.0, "c": 3.0, "d": 1.0}  # x2 calibration (median of 2, 2, 1).
    s = scale_figures(lib, model, bound=True)
    assert (s.how, s.pairs, s.ratio) == ("calibrated", 3, 2.0)
    assert s.figures == {"a": (1.0, "libtpu"), "b": (2.0, "libtpu"), "c": (6.0, "bound"),
                         "d": (2.0, "calibrated")}
    assert scale_figures(lib, model, bound=False).figures["c"] == (3.0, "libtpu")
    assert scale_figures(lib, {}, bound=False).how == "libtpu"
    few = scale_figures({"a": 1.0}, {"a": 0.5, "d": 0.2}, bound=True)
    assert few.how == "model" and few.figures == {"a": (0.5, "model"), "d": (0.2, "model")}
    assert scale_figures({}, {"d": 0.2}, bound=True).figures == {"d": (0.2, "model")}
    apart = scale_figures(lib, {"d": 1.0}, bound=True)
    assert apart.how == "apart" and "d" not in apart.figures


def test_when_every_candidate_has_a_model_figure_the_entry_names_the_model(kern):
    kern, x = kern
    res = _estimate(kern, x, modelled=set(range(8)))
    assert res.best == {"a": 7} and res.provenance["timer"] == "fitted-model"
    assert "tpu-estimate+" not in res.provenance["timer"]
    assert "by a MODEL" in res.provenance["timing_note"]


class OnTheChip(Evaluator):
    """A measuring fake on a v6e: what the chip says (a=5 beats a=7)."""

    kind = "fake"

    def __init__(self):
        super().__init__()
        self.evaluated = []

    def start(self):
        self.device = {"chip": "v6e", "platform": "tpu", "device_kind": "TPU v6 lite"}
        return self.device

    def _evaluate(self, candidates):
        out = []
        for number, config in candidates:
            self.evaluated.append(dict(config))
            rec = TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                              fingerprint=f"p{config['a']}", measurement=Measurement(
                                  times_ms=(1.0 + abs(config["a"] - 5),), compile_ms=0.0))
            self._note(rec)
            out.append(rec)
        return out

    def roofline(self, configs, chip):
        return [None for _ in configs]


def test_the_entry_keeps_its_shortlist_and_confirm_top_measures_exactly_it(kern):
    from pallas_tune.tuning import TuneOptions, run

    kern, x = kern
    key = kern.cache_key(x)
    res = _estimate(kern, x, modelled=set(), write=True)
    entry, path = kern.cache.lookup("v6e", kern.name, key)
    kept = entry["shortlist"]
    assert kept["k"] == DEFAULT_SHORTLIST_K == 15 and "not measured" in kept["k_from"]
    assert kept["configs"] == [{"a": a} for a in range(7, -1, -1)]
    assert kept["figures_ms"] == [_libtpu(a) for a in range(7, -1, -1)]
    assert "shortlist" not in entry["provenance"] and res.cache_path
    # The ledger's trials are gone: confirm_top reads the entry's shortlist, estimates nothing.
    os.remove(kern.cache.ledger_path("v6e", kern.name, kind="estimate"))
    chip = OnTheChip()
    confirmed = run(kern, (x,), {}, TuneOptions(confirm_top=4, write=False, retime_top=0,
                                                seed=0), evaluator=chip)
    assert chip.evaluated == [{"a": 7}, {"a": 6}, {"a": 5}, {"a": 4}]
    assert confirmed.best == {"a": 5}
    source = confirmed.provenance["confirmed"]["from"]
    assert source.startswith(f"tpu_v6e:{key} (estimate entry's shortlist of 15")


@pt.tunable(br=[8, 16, 32], bc=[128, 256], f32=[False, True])
def half_aborting(x, *, factor=1.4427, br, bc, f32):
    """x * factor: in bf16 libtpu 0.0.50's profiler aborts on it (a bf16 vector times a packed
    bf16 constant: tests/test_profiler_abort.py); through f32 it estimates."""
    from jax.experimental import pallas as pl

    def body(x_ref, o_ref):
        v = x_ref[...]
        o_ref[...] = ((v.astype(jnp.float32) * factor).astype(v.dtype) if f32
                      else v * factor)

    r, c = x.shape
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(r // br, c // bc),
                          in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
                          out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
                          name="half_aborting")(x)


@pytest.mark.libtpu
@pytest.mark.slow
def test_a_real_run_half_aborted_ranks_the_model_calibrated(cache_dir, monkeypatch):
    """Deviceless libtpu: the bf16 configs abort the profiler, the f32 ones estimate; with
    the model fallback the aborted ones get the fitted model's figure calibrated on the f32
    configs, never the raw one, and the entry names both figures."""
    monkeypatch.setenv("PALLAS_TUNE_TPU_LOGS", "off")
    x = jnp.ones((256, 512), jnp.bfloat16)
    res = half_aborting.tune(x, timer="tpu-estimate", chip="v6e", trials=12, write=False,
                             transfer=False, workers=2, warm_start=0, estimate_fallback="model")
    timed = [r for r in res.records if r.outcome.timed]
    libtpu = [r for r in timed if r.config["f32"]]
    modelled = [r for r in timed if not r.config["f32"]]
    assert libtpu and modelled and len(libtpu) + len(modelled) == len(timed)
    assert all(r.measurement.timer == "fitted-model calibrated" and
               " calibrated on " in r.detail and "aborted" in r.detail for r in modelled)
    # libtpu's own figure, or the calibrated model's where it is larger (and says so).
    assert all(r.measurement.timer == "tpu-estimate" or r.detail.startswith("libtpu's figure")
               for r in libtpu)
    assert res.provenance["timer"] == "max(tpu-estimate, fitted-model calibrated)"
    assert res.provenance["calibration"]["pairs"] >= 3
