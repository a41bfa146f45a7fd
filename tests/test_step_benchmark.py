"""benchmarks/steps' pure parts on made-up rows: the upstream figure composed with calls replaced
(megablox for a grouped matmul), the grouped matmul's MXU floor, the all-XLA cell that falls back
to that floor (a lower bound, marked so); and the Mixtral-8x7B TP8 layer traced under jax.grad."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")
GMM = "pallas_tune.kernels.grouped_matmul.grouped_matmul"
KEY = "lhs=8192x1792:bfloat16,rhs=8x1792x4096:bfloat16,group_sizes=8:int32"


@pytest.fixture(scope="module")
def steps():
    sys.path.insert(0, BENCHMARKS)
    try:
        yield (importlib.import_module("steps.upstream"), importlib.import_module("steps.render"),
               importlib.import_module("steps.layers"))
    finally:
        sys.path.remove(BENCHMARKS)


def _row(xla_calls, glue=1.0):
    calls = [{"kernel": "pallas_tune.kernels.flash_attention.flash_attention", "key": "a"},
             {"kernel": GMM, "key": KEY}, {"kernel": GMM + "_bwd", "key": KEY + ",d"},
             {"kernel": "pallas_tune.kernels.matmul.matmul", "key": "m"}]
    return {"layer": "mixtral_fwd_bwd", "step_detail": {
        "glue": {"ms": glue}, "calls": calls, "xla": {"calls": xla_calls}}}


def test_compose_replaces_calls_and_skips_what_they_absorbed(steps):
    upstream, _, _ = steps
    row = _row([{"ms": 9.0, "live": 1}, {"error": "CompileTimeHbmOom", "live": 2},
                {"absorbed": True}, {"ms": 0.5, "live": 3}])
    # Without a figure for the grouped matmul there is no upstream figure, and the reason says so.
    ms, why = upstream.compose(row, 2.0)
    assert ms is None and "call 1" in why and "CompileTimeHbmOom" in why
    # Splash for attention (call 0), megablox for call 1 (twice), XLA's dot thrice, the glue.
    ms, why = upstream.compose(row, 2.0, {1: 0.25})
    assert why == "" and ms == pytest.approx(1.0 + 2.0 + 2 * 0.25 + 3 * 0.5)
    # splash_ms None keeps XLA's attention: the all-XLA layer with the grouped matmuls replaced.
    ms, _ = upstream.compose(row, None, {1: 0.25})
    assert ms == pytest.approx(1.0 + 9.0 + 2 * 0.25 + 3 * 0.5)


def test_the_mxu_floor_counts_the_gradients_two_matmuls(steps):
    upstream, _, _ = steps
    flops = 2 * 8192 * 1792 * 4096
    assert upstream.mxu_floor_ms(KEY, False, 1e12) == pytest.approx(flops / 1e12 * 1e3)
    assert upstream.mxu_floor_ms(KEY, True, 1e12) == pytest.approx(3 * flops / 1e12 * 1e3)


def test_the_all_xla_cell_falls_back_to_the_floor_as_a_lower_bound(steps):
    _, render, _ = steps
    detail = {"xla": {"calls": [{"error": "RESOURCE_EXHAUSTED: CompileTimeHbmOom"}]}}
    cell, v = render._xla_cell({"xla": None}, detail, {"xla_floor": {"ms": 3.5}})
    assert v == 3.5 and cell.startswith(">= 3.500") and "CompileTimeHbmOom" in cell
    # A real all-XLA figure is never replaced by the floor.
    cell, v = render._xla_cell({"xla": 4.0}, {"xla": {"calls": []}}, {"xla_floor": {"ms": 3.5}})
    assert v == 4.0 and not cell.startswith(">=")
    assert render._xla_cell({"xla": None}, detail, {})[1] is None


def test_the_mixtral_tp8_layer_differentiates_with_its_shards_shapes(steps):
    import jax

    from pallas_tune.kernels import (flash_attention, flash_attention_bwd, grouped_matmul,
                                     grouped_matmul_bwd, matmul, matmul_bwd, rms_norm,
                                     rms_norm_bwd)

    _, _, layers = steps
    args = layers.mixtral_tp8_args(256)
    kernels = [getattr(m, m.__name__.rsplit(".", 1)[1]) for m in (
        flash_attention, flash_attention_bwd, grouped_matmul, grouped_matmul_bwd, matmul,
        matmul_bwd, rms_norm, rms_norm_bwd)]
    warned = [set(k._warned) for k in kernels]
    try:  # Its misses warn once per kernel; other tests expect those warnings: left as found.
        grads = jax.eval_shape(layers.train(layers.mixtral_tp8), *args)
    finally:
        for k, before in zip(kernels, warned, strict=True):
            k._memo.clear()
            k._warned.clear()
            k._warned.update(before)
    assert [g.shape for g in grads] == [a.shape for a in args]
    assert args[6].shape == (8, 4096, 2 * 1792) and args[7].shape == (8, 1792, 4096)


def test_the_upstream_rows_refuse_before_tuning_where_no_all_xla_figures_exist(steps,
                                                                               monkeypatch):
    """A run of --settings tuned with --upstream has no all-XLA per-call figures to put splash
    beside: refused at once, before tuning splash (half an hour at 32768 tokens)."""
    upstream, _, _ = steps

    def never(*a, **k):
        raise AssertionError("splash tuned with nothing to compose it with")

    monkeypatch.setattr(upstream, "tune_splash", never)
    row = _row([])
    del row["step_detail"]["xla"]
    row["layer"] = "llama_fwd_bwd"
    out = upstream.rows("llama_fwd_bwd", row, 512, 4, 6.0)
    assert {k: v["ms"] for k, v in out.items()} == {"maxtext": None, "tuned": None}
    assert "--settings xla" in out["tuned"]["detail"]["error"]


def test_a_failing_upstream_part_keeps_the_layers_own_figures(steps, monkeypatch):
    """Seen at 32768 tokens: splash's backward had no estimable config, tune raised after an
    hour of the layer's compiles, and the run ended without writing the tuned figure. The row
    is saved before the upstream part, and the failure is recorded in it."""
    import types

    import pallas_tune as pt

    sys.path.insert(0, BENCHMARKS)
    try:
        st = importlib.import_module("steps.step_tuning")
    finally:
        sys.path.remove(BENCHMARKS)
    upstream, _, _ = steps
    result = types.SimpleNamespace(calls=[])
    monkeypatch.setattr(st.pt, "autotune", lambda *a, **k: result)
    monkeypatch.setattr(st.step, "composed", lambda *a, **k: ({"tuned": 7.5}, "t", {"glue": {}}))

    def no_config(*a, **k):
        raise pt.NoFeasibleConfigError("none of 100 candidates succeeded")

    monkeypatch.setattr(st.upstream, "rows", no_config)
    monkeypatch.setattr(st, "LAYERS", {"llama_fwd_bwd": ("t", lambda: None, lambda: ())})
    saved = []
    row = st.run("llama_fwd_bwd", 1, ["tuned"], 1.0, "composed", 4, save=saved.append)
    assert saved and saved[0]["step_ms"] == {"tuned": 7.5}
    assert row["step_ms"] == {"tuned": 7.5}
    assert "none of 100 candidates" in row["upstream"]["tuned"]["detail"]["error"]
