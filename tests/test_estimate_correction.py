"""The opt-in corrected estimate (measure.correction): its terms as documented, v6e only, off
by default, and a ``tpu-estimate`` tune asked for it ranks by it while keeping libtpu's figure."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_tune.chips import chip_spec
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.feasibility.fitted import V6E, CallFeatures, call_features
from pallas_tune.measure import correction


def _features(**kw):
    base = dict(steps=8, dots=(), pipelined_bytes=1e6, serial_bytes=0.0, step_bytes=2e5,
                vec_elems=0.0)
    return CallFeatures(**{**base, **kw})


def test_terms_are_the_documented_ones():
    spec = chip_spec("v6e")
    c = correction.V6E_CORRECTION
    assert c.exposed == pytest.approx(1 - 1 / V6E.bw_eff)  # Derived from bw_eff, not fitted.
    f = _features(steps=8, step_bytes=2e5, serial_bytes=3e5, pipelined_bytes=9e9)
    want = c.exposed * (2e5 + 3e5) / spec.hbm_bw_bytes_per_s + 8 * c.step_s
    assert correction.correction_s([f], spec, c) == pytest.approx(want)
    # Pipelined refetches are hidden behind compute: they add nothing.
    assert correction.correction_s([dataclasses.replace(f, pipelined_bytes=0.0)], spec, c) \
        == pytest.approx(want)
    # Several calls (a backward's passes) add up.
    assert correction.correction_s([f, f], spec, c) == pytest.approx(2 * want)


def test_more_steps_and_bigger_fills_cost_more():
    spec, c = chip_spec("v6e"), correction.V6E_CORRECTION
    small = correction.correction_s([_features(steps=4, step_bytes=1e5)], spec, c)
    assert correction.correction_s([_features(steps=64, step_bytes=1e5)], spec, c) > small
    assert correction.correction_s([_features(steps=4, step_bytes=1e7)], spec, c) > small


def _matmul_calls(bm, bk, bn, size=1024):
    from pallas_tune.kernels.matmul import matmul

    x = jax.ShapeDtypeStruct((size, size), jnp.bfloat16)
    return _inspect.find_pallas_calls(matmul.__wrapped__, [x, x],
                                      {"bm": bm, "bk": bk, "bn": bn, "buffering": 2,
                                       "semantics": ("parallel", "parallel", "arbitrary")})


def test_corrected_ms_only_on_v6e_and_says_so():
    calls = _matmul_calls(256, 256, 256)
    ms, said = correction.corrected_ms(0.05, calls, chip_spec("v6e"))
    f = [call_features(k) for k in calls]
    assert ms == pytest.approx(0.05 + correction.correction_s(f, chip_spec("v6e"),
                                                              correction.V6E_CORRECTION) * 1e3)
    assert ms > 0.05 and "corrected (v6e-" in said and "libtpu 0.05 ms" in said
    for chip in ("v5e", "v5p", "7x"):  # No correction measured there: libtpu's figure.
        assert correction.corrected_ms(0.05, calls, chip_spec(chip)) == (0.05, "")
    assert correction.corrected_ms(0.05, [], chip_spec("v6e")) == (0.05, "")
    assert "none" in correction.describe("tpu_v5e")
    assert "per grid step" in correction.describe("tpu_v6e")


def test_smaller_tiles_pay_more_per_step():
    """At equal libtpu figures, 64 steps of 256^3 tiles are corrected up more than 1 step of
    1024^3 tiles: the per-step term."""
    spec = chip_spec("v6e")
    small = correction.corrected_ms(0.05, _matmul_calls(256, 256, 256), spec)[0]
    large = correction.corrected_ms(0.05, _matmul_calls(1024, 1024, 1024), spec)[0]
    assert small > large


@pytest.mark.libtpu
def test_tune_ranks_by_the_corrected_figure_and_keeps_libtpu_s(tmp_path):
    from pallas_tune.kernels.matmul import matmul

    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    space = dict(trials=3, timer="tpu-estimate", chip="v6e", workers=1, write=False,
                 xla=False, seed=0, transfer=False)
    on = matmul.tune(x, x, **space, estimate_correction=True)
    off = matmul.tune(x, x, **space)  # Off by default: it did not help on held-out keys.
    assert "per grid step" in on.provenance["estimate_correction"]
    assert off.provenance["estimate_correction"].startswith("off")
    clock = chip_spec("v6e").clock_hz
    by_config = {tuple(sorted(r.config.items())): r for r in off.records if r.outcome.timed}
    checked = 0
    for r in on.records:
        if not r.outcome.timed:
            continue
        assert "corrected (v6e-" in r.detail
        libtpu_ms = r.cycles / clock * 1e3  # The trial keeps libtpu's own figure.
        assert r.median_ms > libtpu_ms
        twin = by_config.get(tuple(sorted(r.config.items())))
        if twin is not None:
            assert twin.median_ms == pytest.approx(libtpu_ms)
            checked += 1
    assert checked >= 1
