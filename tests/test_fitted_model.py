"""The fitted cost model (`pallas_tune.feasibility.fitted`): tracing only, no libtpu.

Its constants and their agreement with libtpu's estimates: benchmarks/estimates/model_fidelity.py.
"""

import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO

import pallas_tune as pt
from pallas_tune.chips import chip_spec
from pallas_tune.feasibility import fitted
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.kernels.matmul import matmul

SEM = ("parallel", "parallel", "arbitrary")
N = 2048
X = jax.ShapeDtypeStruct((N, N), jnp.bfloat16)
V6E = chip_spec("v6e")
LEDGERS = sorted(glob.glob(os.path.join(REPO, "caches", "tpu_v6e", "*.estimate.trials.jsonl")))


def _calls(bm, bn, bk, buffering=2):
    config = {"bm": bm, "bn": bn, "bk": bk, "buffering": buffering, "semantics": SEM}
    return _inspect.find_pallas_calls(matmul.fn, [X, X], config)


def _time(bm, bn, bk, buffering=2, spec=V6E):
    return fitted.fitted_calls(_calls(bm, bn, bk, buffering), spec)


def test_bigger_matmul_tiles_beat_128_tiles():
    small = _time(128, 128, 128)
    for t in (256, 512, 1024):
        assert _time(t, t, t) < small
    # A 128-wide N tile leaves half of v6e's 256x256 MXU empty (libtpu: 152k against 79k cycles).
    assert _time(1024, 128, 1024) > 1.5 * _time(1024, 256, 1024)


def test_single_buffering_is_slower():
    # libtpu's estimate at 2048^3, 1024 tiles: 0.0394 ms with Buffered(1), 0.0263 with two.
    (f,) = [fitted.call_features(c) for c in _calls(1024, 1024, 1024, buffering=1)]
    assert f.serial_bytes > 0
    assert _time(1024, 1024, 1024, buffering=1) > 1.2 * _time(1024, 1024, 1024)


@pytest.mark.parametrize("tiles", [(128, 128, 128), (256, 512, 256), (1024, 1024, 1024),
                                   (1024, 128, 1024), (512, 512, 2048)])
def test_time_is_above_the_flop_and_hbm_floors(tiles):
    t = _time(*tiles)
    flops = 2.0 * N**3
    unique_bytes = 3 * N * N * 2  # x and y read once, the result written once.
    assert t >= flops / V6E.bf16_flops
    assert t >= unique_bytes / (V6E.hbm_bw_bytes_per_s * fitted.constants_for(V6E).bw_eff)


def test_the_fallback_ranks_with_the_chips_fit_to_real_tpu_winners():
    """v6e and 7x have constants fitted to published real-TPU winners (fitted.PUBLIC); other
    chips get libtpu's v6e fit, scaled. The v6e fit charges a grid step more than libtpu's
    estimates do, so small tiles fall further behind under it."""
    assert fitted.constants_for(V6E) is fitted.PUBLIC["tpu_v6e"]
    assert fitted.constants_for(chip_spec("7x")) is fitted.PUBLIC["tpu_7x"]
    assert fitted.constants_for(chip_spec("v5e")) is fitted.V6E
    calls = _calls(128, 128, 128)
    assert fitted.fitted_calls(calls, V6E) == fitted.fitted_calls(
        calls, V6E, fitted.PUBLIC["tpu_v6e"]) != fitted.fitted_calls(calls, V6E, fitted.V6E)
    big = _calls(1024, 1024, 1024)

    def gap(c):
        return fitted.fitted_calls(calls, V6E, c) / fitted.fitted_calls(big, V6E, c)

    assert gap(fitted.PUBLIC["tpu_v6e"]) > 1.5 * gap(fitted.V6E)


def test_other_chips_scale_by_their_peaks():
    v5e = chip_spec("v5e")  # A quarter of v6e's bf16 peak, half its bandwidth, 128x128 MXUs.
    calls = _calls(512, 512, 512)  # Like for like: v6e with libtpu's fit, as v5e gets it.
    assert fitted.fitted_calls(calls, v5e) > 2 * fitted.fitted_calls(calls, V6E, fitted.V6E)


def _ledger_kernels():
    out = []
    for path in LEDGERS:
        name = os.path.basename(path).removesuffix(".estimate.trials.jsonl")
        with open(path) as f:
            key = json.loads(f.readline())["key"]
        out.append(pytest.param(name, key, id=name.rpartition(".")[2]))
    return out


@pytest.mark.parametrize("name,key", _ledger_kernels())
def test_finite_and_positive_on_every_shipped_kernel(name, key):
    """Each kernel with shipped v6e estimates, at its first tuned shape, default config."""
    from pallas_tune.cli.registry import KernelRegistry
    from pallas_tune.cli.shapes import build_call

    kernel, why = KernelRegistry().find(name)
    if kernel is None:
        pytest.skip(f"{name}: {why}")
    args, kwargs = build_call(kernel, key)
    config = next(iter(kernel.space))
    with pt.target("v6e"):
        calls = _inspect.find_pallas_calls(kernel.fn, args, {**kwargs, **config})
    assert calls
    t = fitted.fitted_calls(calls, V6E)
    assert math.isfinite(t) and t > 0
    steps = sum(f.steps for f in map(fitted.call_features, calls))
    assert t >= steps * fitted.constants_for(V6E).step_s
