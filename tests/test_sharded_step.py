"""benchmarks/steps/sharded_step.py's pure parts: the collectives read from a compiled
program's text (tuple all-reduces, async starts, reduce-scatters, replica groups) and their
bandwidth model; and the per-chip programs of its layouts, which must be step_tuning's
single-chip programs (70B under TP8, 8B under FSDP) for its composition to mean anything."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks")

_BUNDLE = '"bundle_analysis_data":{"estimated_cycles":"%s","flops":"0"}'
HLO = "\n".join([
    "ENTRY %main {",
    "  %fusion.1 = bf16[4096,4096]{1,0} fusion(%p), kind=kOutput, backend_config={"
    + _BUNDLE % 1750000 + "}",
    '  %mm_1.2 = bf16[256,256]{1,0} custom-call(%a, %b), custom_call_target="tpu_custom_call", '
    'backend_config={"flag_configs":[]}',
    "  %all-reduce.7 = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}) all-reduce(%x, %y), "
    "channel_id=1, replica_groups=mesh['x'=8] {'x'}, to_apply=%add, backend_config="
    '{"collective_algorithm_config":{"emitter":"RotatedPincerEmitter","strategy":'
    '"UniDirection1DRingStrategy"},' + _BUNDLE % 0 + "}",
    "  %all-gather-start = (bf16[128,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%w), "
    "replica_groups=[1,8]<=[8], dimensions={0}",
    "  %all-gather-done = bf16[1024,1024]{1,0} all-gather-done(%all-gather-start)",
    "  %reduce_scatter.3 = f32[128,1024]{1,0} reduce-scatter(%g), replica_groups={{0,1,2,3}}, "
    "dimensions={0}, backend_config={" + _BUNDLE % 0 + "}",
    "}"])


@pytest.fixture(scope="module")
def steps():
    sys.path.insert(0, BENCHMARKS)
    try:
        yield (importlib.import_module("steps.collectives"),
               importlib.import_module("steps.sharded_layers"),
               importlib.import_module("steps.layers"))
    finally:
        sys.path.remove(BENCHMARKS)


def test_collectives_read_from_the_compiled_text(steps):
    coll, _, _ = steps
    ops = {o["name"]: o for o in coll.ops(HLO)}
    assert ops["all-reduce.7"]["bytes"] == 2 * 1024 * 1024 * 2  # A tuple: both arrays.
    assert ops["all-reduce.7"]["group"] == 8
    assert ops["all-reduce.7"]["algorithm"] == "RotatedPincerEmitter/UniDirection1DRingStrategy"
    assert ops["all-gather-start"]["bytes"] == 1024 * 1024 * 2  # The gathered half only.
    assert "collective" not in ops["all-gather-done"]  # Not counted twice.
    assert ops["reduce_scatter.3"]["bytes"] == 4 * 128 * 1024 * 4  # The full input: 4 chips.
    assert ops["reduce_scatter.3"]["group"] == 4
    assert ops["mm_1.2"] == {"name": "mm_1.2", "opcode": "custom-call", "cycles": 0,
                             "kernel": "mm_1"}  # A kernel libtpu left unread: 0, named.


def test_collective_model_and_summary(steps):
    coll, _, _ = steps
    s = coll.summary(HLO, 1.75e9)
    assert s["compute_ms"] == pytest.approx(1.0)  # 1.75M cycles at 1.75 GHz.
    assert s["ops_without_estimate"] == 1 and s["kernels_without_estimate"] == ["mm_1"]
    assert s["collective_profile_cycles"] == 0
    ring = coll.RING_BYTES_PER_S
    assert ring == 200e9  # v6e: 800 GB/s over 4 ports, two ports one way each.
    expect = (2 * 7 / 8 * 4 * 2**20 + 7 / 8 * 2 * 2**20 + 3 / 4 * 2 * 2**20) / ring * 1e3
    assert s["collectives_model_ms"] == pytest.approx(expect)
    assert set(s["collectives"]) == {"all-reduce", "all-gather", "reduce-scatter"}


def test_per_chip_programs_are_step_tunings(steps):
    _, sl, layers = steps
    shapes = lambda args: [a.shape for a in args]  # noqa: E731
    assert shapes(sl.chip_args(sl.MODELS["70b"], "tp8", 4096)) == shapes(
        layers.llama70b_tp8_args(4096))
    assert shapes(sl.chip_args(sl.MODELS["8b"], "fsdp", 4096)) == shapes(
        layers.llama8b_args(4096))
    # The 8B under TP8: 4 of 32 query heads and 1 of 8 KV heads a chip.
    assert shapes(sl.chip_args(sl.MODELS["8b"], "tp8", 4096))[2] == (4096, 768)
    with pytest.raises(ValueError, match="choose tp8 or fsdp"):
        sl.specs(sl.MODELS["8b"], "dp")


def test_unprofiled_compiles_rendered_and_their_collectives_composed():
    """Whole programs compiled without the profile give the compiler's verdict and their own
    collectives: the composed figure takes those (not a scaled neighbour's), and a program
    that ran out of VMEM only under the profile is told apart from one that compiles."""
    sys.path.insert(0, BENCHMARKS)
    try:
        render = importlib.import_module("steps.sharded_render")
    finally:
        sys.path.remove(BENCHMARKS)
    base = {"model": "8b", "layout": "tp8"}
    rows = [
        {**base, "tokens": 4096, "setting": "xla", "program": "mesh", "compute_ms": 2.0,
         "collectives_model_ms": 1.0, "compile_s": 400.0},
        {**base, "tokens": 4096, "setting": "tuned", "program": "mesh",
         "error": "Ran out of memory in memory space vmem. Used 142.86M of 127.94M"},
        {**base, "tokens": 8192, "setting": "tuned", "program": "mesh-unprofiled",
         "compile_s": 42.0, "collectives_model_ms": 2.5,
         "receipts": [{"kernel": "pallas_tune.kernels.matmul.matmul", "key": "x=1x1",
                       "source": "cache", "implementation": "pallas", "config": {}}] * 3},
        {**base, "tokens": 8192, "setting": "xla", "program": "mesh-unprofiled",
         "error": "Ran out of memory in memory space vmem. Used 140M of 127.94M"},
    ]
    groups = render._groups(rows)
    assert render.collectives_for(groups, "8b", "tp8", 8192, "tuned") == (
        2.5, "its own, unprofiled")
    # Without its own compile, the 4096-token profiled one's, scaled by tokens.
    assert render.collectives_for(groups, "8b", "tp8", 8192, "xla") == (
        2.0, "Llama-3.1-8B 4096 tokens, x2")
    text = render.render(rows, ["cmd"], per_chip={"rows": [
        {"model": "8b", "layout": "tp8", "tokens": 8192, "xla": 4.0, "tuned": 2.0}]})
    section = text.split("## Every whole program, compiled without the profile")[1]
    assert "| compiled in 42 s | 2.500 | cache 3 |" in section
    assert "failed: Ran out of memory in memory space vmem. Used 140M of 127.94M" in section
    assert "| 2.500 (its own, unprofiled) | 4.500 |" in text


def test_a_reduce_scatter_fused_as_all_reduce_and_slice_is_a_reduce_scatter(steps):
    """XLA:TPU writes some reduce-scatters as a fusion of an all-reduce of the padded array and
    a dynamic-slice, run by its SingleInputAllReduceScatterFusion emitter: modelled as the
    reduce-scatter it is (its padded bytes once), not as an all-reduce (twice)."""
    coll, _, _ = steps
    text = "\n".join([
        "%all-reduce-scatter.2 (input.2: bf16[14336,4096]) -> bf16[1824,4096] {",
        "  %all-reduce.6 = bf16[14592,4096]{1,0} all-reduce(%pad.2), channel_id=5, "
        "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
        "  ROOT %dynamic-slice.7 = bf16[1824,4096]{1,0} dynamic-slice(%all-reduce.6, %m, %c)",
        "}",
        "",
        "ENTRY %main.1 (p: bf16[14336,4096]) -> bf16[1824,4096] {",
        "  %psum.1 = bf16[4096,4096]{1,0} all-reduce(%p), replica_groups={{0,1,2,3,4,5,6,7}}, "
        "to_apply=%add",
        "  ROOT %fusion = bf16[1824,4096]{1,0} fusion(%p), kind=kCustom, "
        "calls=%all-reduce-scatter.2, backend_config={\"collective_algorithm_config\":"
        "{\"emitter\":\"SingleInputAllReduceScatterFusion\",\"strategy\":\"StrategyRing\"}}",
        "}"])
    ops = {o["name"]: o for o in coll.ops(text)}
    scatter = ops["all-reduce.6"]
    assert scatter["collective"] == "reduce-scatter"
    assert scatter["bytes"] == 14592 * 4096 * 2  # The padded full array, not times the group.
    assert scatter["algorithm"] == "SingleInputAllReduceScatterFusion/StrategyRing"
    assert ops["psum.1"]["collective"] == "all-reduce"  # Outside such a fusion: an all-reduce.
    s = coll.summary(text, 1.75e9)
    assert s["collectives"]["reduce-scatter"]["model_ms"] == pytest.approx(
        7 / 8 * 14592 * 4096 * 2 / coll.RING_BYTES_PER_S * 1e3)


def test_a_profiled_row_takes_the_collectives_of_its_unprofiled_compile():
    sys.path.insert(0, BENCHMARKS)
    try:
        render = importlib.import_module("steps.sharded_render")
    finally:
        sys.path.remove(BENCHMARKS)
    base = {"model": "8b", "layout": "fsdp", "tokens": 512, "setting": "xla"}
    rows = [{**base, "program": "mesh", "compute_ms": 1.0, "collectives_model_ms": 4.4},
            {**base, "program": "mesh-unprofiled", "collectives_model_ms": 3.9,
             "collectives": {"reduce-scatter": {}}}]
    row = render._groups(rows)[("8b", "fsdp", 512)][("xla", "mesh")]
    assert row["collectives_model_ms"] == 3.9 and row["compute_ms"] == 1.0
    assert row["collectives_from"] == "its unprofiled compile"
    assert render.total(row) == pytest.approx(4.9)
