"""Failure isolation: bad candidates are recorded, the study completes, a good one wins."""

import numpy as np
import pytest

pytestmark = pytest.mark.slow


def test_four_bad_kernels_tuned_with_good_ones(cache_dir, fresh):
    import toy_kernels

    x = toy_kernels.ones((64, 256))
    res = toy_kernels.misbehaving.tune(x, trials=16, timeout_s=8, repeats=2)
    df = res.trials
    by_mode = {m: set(df[df["mode"] == m].outcome) for m in df["mode"].unique()}
    assert by_mode["good"] == {"ok"}
    assert by_mode["raise"] == {"runtime_error"}
    assert by_mode["hang"] == {"timeout"}
    assert by_mode["abort"] == {"runtime_error"}
    assert by_mode["wrong"] == {"mismatch"}
    assert df[df["mode"] == "abort"].error.str.contains("SIGABRT").all()
    assert res.best["mode"] == "good"
    assert res.provenance["isolated"] is True
    np.testing.assert_allclose(toy_kernels.misbehaving(x), 2 * x)  # Served from the cache.
