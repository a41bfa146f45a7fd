"""The chip table and the VMEM/SMEM/VREG model (pure tracing: no libtpu needed here)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.feasibility import compile as _compile
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.feasibility.model import (BAND_OVER, BAND_UNDER, check_feasible, estimate_vmem,
                                           model_calls, model_verdict, need_band)
from pallas_tune.feasibility.rules import itemsize_bits, native_sublane_tiling
from pallas_tune import chips
from pallas_tune.chips import chip_spec
from pallas_tune.kernels.matmul import matmul

MiB = 2**20
SEM = ("parallel", "parallel", "arbitrary")
X = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)


def test_chip_names_and_facts():
    assert chip_spec("v6e") is chip_spec("TPU v6 lite") is chip_spec("tpu_v6e")
    v6e, v5e, v7 = chip_spec("v6e"), chip_spec("TPU v5 lite"), chip_spec("7x")
    assert v6e.scoped_vmem_default_bytes == 32 * MiB and v5e.scoped_vmem_default_bytes == 16 * MiB
    assert v6e.vmem_bytes == 128 * MiB and v6e.mxu_dim == 256 and v5e.mxu_dim == 128
    assert v6e.topology == "v6e:1x1" and chip_spec("v5p").tensorcores_per_chip == 2
    assert v6e.sublane_tiling(2) == 8 and v7.sublane_tiling(2) == 16 and v6e.sublane_tiling(1) == 32
    assert chip_spec("nvidia_h100").smem_per_block_bytes > 0
    with pytest.raises(ValueError, match="unknown chip 'v9z'"):
        chip_spec("v9z")


@pytest.mark.parametrize("buffering,expected_mib", [(2, 4.0), (1, 3.0)])
def test_estimate_counts_buffers(buffering, expected_mib):
    est = estimate_vmem(matmul.fn, X, X, chip="v6e", bm=512, bn=512, bk=512,
                        buffering=buffering, semantics=SEM)
    # Inputs 2 x 0.5 MiB x buffers, output 0.5 MiB x 2, f32 accumulator 1 MiB.
    assert est == int(expected_mib * MiB)


def test_whole_array_window_is_single_buffered():
    small = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    est = estimate_vmem(matmul.fn, small, small, chip="v6e", bm=512, bn=512, bk=512,
                        buffering=2, semantics=SEM)
    assert est == int(2.5 * MiB)  # 3 windows x 0.5 MiB x 1 buffer + 1 MiB accumulator.


def test_padding_to_native_tiles():
    def f(x):
        return pl.pallas_call(lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              grid=(4,), in_specs=[pl.BlockSpec((8, 100), lambda i: (i, 0))],
                              out_specs=pl.BlockSpec((8, 100), lambda i: (i, 0)))(x)

    est = estimate_vmem(f, jax.ShapeDtypeStruct((32, 100), jnp.float32), chip="v6e")
    assert est == 2 * 2 * 8 * 128 * 4  # Lanes padded from 100 to 128.


def test_verdicts_ok_uncertain_infeasible():
    ok = check_feasible(matmul, X, X, chip="v6e", bm=512, bn=512, bk=512, buffering=2,
                        semantics=SEM)
    assert ok.ok and ok.status == "ok" and ok.limit_bytes == 32 * MiB and ok.stage == "model"
    big = check_feasible(matmul, X, X, chip="v5e", bm=2048, bn=2048, bk=1024, buffering=2,
                         semantics=SEM)
    assert not big.ok and big.status == "infeasible" and big.detail == "vmem_scoped_oom"
    assert "scoped VMEM limit 16.00 MiB" in big.reason
    for v in (ok, big):
        assert v.status in ("ok", "uncertain", "infeasible")


def _window_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


def _windows(x, *, block, grid=None, buffers=None):
    """A copy kernel: one input and one output window of ``block`` (cdiv grid unless given)."""
    g = grid or tuple(pl.cdiv(a, b or 1) for a, b in zip(x.shape, block, strict=True))
    mode = {} if buffers is None else {"pipeline_mode": pl.Buffered(buffers)}
    return pl.pallas_call(_window_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=g, in_specs=[pl.BlockSpec(block, lambda *i: i, **mode)],
                          out_specs=pl.BlockSpec(block, lambda *i: i))(x)


def _calls(shape, dtype, block, **kw):
    return _inspect.find_pallas_calls(_windows, (jax.ShapeDtypeStruct(shape, dtype),),
                                      {"block": block, **kw})


def test_uncertain_band_is_the_measured_error_around_the_limit():
    spec, limit = chip_spec("v6e"), 32 * MiB
    lo, hi = need_band(10 * MiB)
    assert lo == int(10 * MiB * (1 - BAND_OVER)) and hi >= 10 * MiB * (1 + BAND_UNDER)
    assert 0 < BAND_OVER < 0.5 and 0 < BAND_UNDER < 0.5

    def verdict(rows):  # 2 f32 windows of (rows, 1024), double-buffered: 16 KiB per row.
        return model_verdict(_calls((4 * rows, 1024), jnp.float32, (rows, 1024)), spec)

    rows_ok = int(limit / (1 + BAND_UNDER) / (16 * 1024)) // 8 * 8
    rows_edge = limit // (16 * 1024)  # Estimate exactly at the limit.
    rows_over = (int(limit / (1 - BAND_OVER) / (16 * 1024)) // 8 + 2) * 8
    fits, edge, over = verdict(rows_ok), verdict(rows_edge), verdict(rows_over)
    assert fits.status == "ok" and fits.vmem_bytes == rows_ok * 16 * 1024
    assert edge.status == "uncertain" and edge.ok and edge.vmem_bytes == limit
    assert edge.band_bytes[0] <= limit < edge.band_bytes[1]
    assert "the compiler decides" in edge.reason
    assert over.status == "infeasible" and not over.ok and over.detail == "vmem_scoped_oom"
    assert edge.min_limit_bytes >= edge.band_bytes[1]


def _upcast_kernel(x_ref, o_ref):
    y = x_ref[...].astype(jnp.float32)  # A large live value: an f32 copy of the block.
    o_ref[...] = (y * jnp.max(jnp.abs(y), axis=1, keepdims=True)).astype(o_ref.dtype)


def _upcast(x, *, rows):
    return pl.pallas_call(_upcast_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(x.shape[0] // rows,),
                          in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)))(x)


def test_large_live_values_never_refuse_a_candidate_alone():
    """The f32 copy of a bf16 block counts towards the estimate, but the compiler may keep such
    values out of VMEM (tpu-inference's quantized matmul needed 30-54% less than estimates made
    of them, at real-TPU winners the model had refused): over the limit by them alone, the
    compiler decides; windows over the limit are still refused."""
    spec = chip_spec("v6e")  # Scoped limit 32 MiB.
    x = jax.ShapeDtypeStruct((448 * 32, 8192), jnp.bfloat16)
    # bf16 (448, 8192) windows, in and out, double-buffered: 28 MiB; its f32 copy: 14 MiB more.
    calls = _inspect.find_pallas_calls(_upcast, (x,), {"rows": 448})
    (m,) = model_calls(calls, spec)
    assert m.low_bytes == 28 * MiB and m.temp_bytes == 14 * MiB and m.dot_temp_bytes == 0
    v = model_verdict(calls, spec)
    assert need_band(m.estimate_bytes)[0] > v.limit_bytes  # Refused before: the low edge.
    assert v.status == "uncertain" and "large live values" in v.reason
    over = model_verdict(_inspect.find_pallas_calls(_upcast, (x,), {"rows": 1024}), spec)
    assert over.status == "infeasible" and over.detail == "vmem_scoped_oom"  # 64 MiB windows.


def test_kernel_vmem_limit_is_used():
    def f(x):
        return pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...]),
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
            in_specs=[pl.BlockSpec((4096, 1024), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((4096, 1024), lambda i: (i, 0)),
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=100 * MiB))(x)

    x = jax.ShapeDtypeStruct((8192, 1024), jnp.float32)
    v = check_feasible(f, x, chip="v6e")
    assert v.ok and v.limit_bytes == 100 * MiB and v.vmem_bytes == 64 * MiB
    v5p = check_feasible(f, x, chip="v5p")  # 64 MiB of windows > 63.94 MiB physical.
    assert not v5p.ok and v5p.detail == "vmem_physical_oom"


def test_smem_scratch_counts_against_smem():
    def f(x):
        def k(x_ref, o_ref, s_ref):
            o_ref[...] = x_ref[...]

        return pl.pallas_call(k, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              scratch_shapes=[pltpu.SMEM((512 * 1024,), jnp.int32)])(x)

    v = check_feasible(f, jax.ShapeDtypeStruct((8, 128), jnp.float32), chip="v6e")
    assert not v.ok and v.detail == "smem_oom"


def test_block_rule_and_vreg_constraint():
    ragged = jax.ShapeDtypeStruct((1000, 1000), jnp.float32)
    fine = check_feasible(matmul, ragged, ragged, chip="v6e", bm=128, bn=128, bk=128,
                          buffering=2, semantics=SEM)
    assert fine.ok and fine.status == "ok"  # Ragged: edge blocks are padded, not an error.
    bad = check_feasible(matmul, ragged, ragged, chip="v6e", bm=128, bn=128, bk=128,
                         buffering=3, semantics=SEM)
    assert not bad.ok and bad.detail == "block_rule" and "Buffered(3)" in bad.reason
    v = check_feasible(matmul, X, X, chip="v6e", bm=1024, bn=1024, bk=256, buffering=2,
                       semantics=SEM)
    assert v.vreg_pressure > 1  # A 1024x1024 f32 dot result is 16 vreg files.
    tight = check_feasible(matmul, X, X, chip="v6e", bm=1024, bn=1024, bk=256, buffering=2,
                           semantics=SEM, vreg_limit=4)
    assert not tight.ok and tight.detail == "vreg_pressure"


@pytest.mark.parametrize("shape,block", [
    ((1000, 1000), (128, 128)),  # No tile divides 1000: padded edge blocks.
    ((1000, 1000), (1000, 384)),  # Full dim x a multiple of 128.
    ((100, 1000), (128, 1024)),  # Blocks larger than the array dims.
    ((30, 4100), (8, 4100)),
    ((6, 1000, 1000), (None, 8, 128)),  # Squeezed leading dim.
    ((4000,), (1024,)), ((4000,), (2048,)), ((4000,), (4000,)),  # Rank 1.
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int8])
def test_ragged_shapes_are_accepted(shape, block, dtype):
    calls = _calls(shape, dtype, block)
    assert _inspect.block_rule_violations(calls) == []
    for chip in ("v5e", "v6e", "7x"):
        assert _inspect.block_rule_violations(calls, spec=chip) == []


@pytest.mark.parametrize("block,expected", [
    ((100, 128), "block dim 0 = 100 must be a multiple of 8 (sublanes) or equal the array dim "
                 "1000; use 104 or 1000"),
    ((8, 100), "block dim 1 = 100 must be a multiple of 128 (lanes) or equal the array dim "
               "1000; use 128 or 1000"),
    ((4, 1000), "block dim 0 = 4 must be a multiple of 8 (sublanes)"),
    ((None, 128), "block dim 0 is squeezed (None, size 1) but is one of the last two dims, "
                  "which must be a multiple of 8 (sublanes) or the array dim 1000"),
])
def test_non_multiple_blocks_are_rejected_naming_dim_value_and_multiple(block, expected):
    problems = _inspect.block_rule_violations(_calls((1000, 1000), jnp.float32, block),
                                              spec="v6e")
    assert len(problems) == 2  # The input and the output window.
    assert all(expected in p for p in problems)
    assert problems[0].startswith("pallas_call args[0]: ")


@pytest.mark.parametrize("chip,dtype,rows,native", [
    ("v6e", jnp.float32, 8, 8), ("v6e", jnp.bfloat16, 8, 8), ("7x", jnp.bfloat16, 8, 16),
    ("v5e", jnp.int8, 8, 32), ("7x", jnp.int8, 16, 32), ("v6e", jnp.int4, 32, 64),
    ("v6e", jnp.float8_e4m3fn, 16, 32),
])
def test_dtype_tiling_is_opt_in(chip, dtype, rows, native):
    spec = chip_spec(chip)
    assert native_sublane_tiling(spec, itemsize_bits(dtype)) == native
    calls = _calls((1000, 1024), dtype, (rows, 1024))
    # The compiler accepts 8-row multiples for every dtype (libtpu 0.0.50.1, see rules.py).
    assert _inspect.block_rule_violations(calls, spec=spec) == []
    strict = _inspect.block_rule_violations(calls, spec=spec, native_tiling=True)
    if rows % native == 0:
        assert strict == []
    else:
        assert strict and f"must be a multiple of {native} (the native" in strict[0]
        v = model_verdict(calls, spec, native_tiling=True)
        assert v.status == "infeasible" and v.detail == "block_rule"
    assert model_verdict(calls, spec).status == "ok"


@pytest.mark.parametrize("dtype,block,ok", [
    (jnp.float32, 128, True), (jnp.bfloat16, 128, False), (jnp.bfloat16, 256, True),
    (jnp.int8, 256, False), (jnp.int8, 512, True), (jnp.int4, 512, False),
    (jnp.bool_, 128, True),  # bool is a 32-bit memref.
    (jnp.float32, 100, False), (jnp.float32, 3072, True),
])
def test_rank1_rules_follow_the_bitwidth(dtype, block, ok):
    problems = _inspect.block_rule_violations(_calls((4096,), dtype, (block,)), spec="v6e")
    assert (problems == []) is ok
    if not ok:
        assert f"rank-1 block dim 0 = {block}" in problems[0] and "power of two" in problems[0]


def test_blocks_must_start_in_bounds_at_every_grid_step():
    over = _calls((1000, 1000), jnp.float32, (128, 128), grid=(9, 8))
    problems = _inspect.block_rule_violations(over)
    assert len(problems) == 2 and "starts at element 1024" in problems[0]
    assert "cdiv(1000, 128) = 8" in problems[0]
    assert over[0].blocks[0].max_start == (1024, 896)
    assert _calls((1000, 1000), jnp.float32, (128, 128))[0].blocks[0].max_start == (896, 896)


def test_other_rules_and_targets():
    assert _inspect.block_rule_violations(_calls((1000, 1000), jnp.float32, (128, 128),
                                                 buffers=1)) == []
    three = _inspect.block_rule_violations(_calls((1000, 1000), jnp.float32, (128, 128),
                                                  buffers=3))
    assert len(three) == 1 and "pl.Buffered(3)" in three[0] and "emit_pipeline" in three[0]
    bad = _calls((1000, 1000), jnp.float32, (100, 128))
    assert _inspect.block_rule_violations(bad, spec="nvidia_h100") == []  # No Mosaic rules.
    assert _inspect.block_rule_violations(bad, sublanes=4) == []  # Overrides still work.


def test_tpu_target_lowers_xla_ops_without_explicit_sharding_rules():
    """The target's abstract mesh is Auto (JAX 0.12 defaults to Explicit, under which ops with no
    sharding rule, such as lax.ragged_dot, a natural XLA reference for a grouped matmul, fail to
    trace), and it still tells Pallas the TPU generation (a kernel lowers for v6e)."""
    bf = jnp.bfloat16
    args = (jax.ShapeDtypeStruct((256, 128), bf), jax.ShapeDtypeStruct((2, 128, 128), bf),
            jax.ShapeDtypeStruct((2,), jnp.int32))
    with chips.target("v6e"):
        text = jax.jit(jax.lax.ragged_dot).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
        x = jax.ShapeDtypeStruct((256, 256), bf)
        kernel = jax.jit(lambda a, b: matmul.fn(a, b, **matmul.space.default)).trace(x, x).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "ragged_dot" in text
    assert "tpu_custom_call" in kernel


def test_kernels_with_scalar_prefetch_are_counted_for_the_estimate_caveat():
    """libtpu's static profile takes scalar-prefetch values as 0 (loops.PREFETCH_NOTE), so the
    estimate names such kernels: the grouped matmul's one, its backward's two, no matmul's."""
    from pallas_tune.kernels.grouped_matmul import grouped_matmul
    from pallas_tune.kernels.grouped_matmul_bwd import grouped_matmul_bwd
    from pallas_tune.measure.estimate import EstimateResult
    from pallas_tune.measure.loops import PREFETCH_NOTE, describe, kernel_census

    def prefetch_kernels(*args, **kwargs):
        return kernel_census(*args, **kwargs).prefetch_kernels

    bf = jnp.bfloat16
    lhs, rhs = jax.ShapeDtypeStruct((512, 256), bf), jax.ShapeDtypeStruct((2, 256, 256), bf)
    sizes, d = jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((512, 256), bf)
    tiles = dict(tm=128, tk=128, tn=128)
    assert prefetch_kernels(grouped_matmul.fn, [lhs, rhs, sizes], tiles, chip="v6e") == 1
    bwd_tiles = {f"{p}_{t}": 128 for p in ("dlhs", "drhs") for t in ("tm", "tk", "tn")}
    assert prefetch_kernels(grouped_matmul_bwd.fn, [lhs, rhs, sizes, d], bwd_tiles,
                            chip="v6e") == 2
    x = jax.ShapeDtypeStruct((256, 256), bf)
    assert prefetch_kernels(matmul.fn, [x, x], dict(matmul.space.default), chip="v6e") == 0
    detail = describe(EstimateResult(ok=True, kind="ok", cycles=1, prefetch_kernels=2))
    assert detail == f"2 kernel(s) with scalar prefetch: {PREFETCH_NOTE}"
    assert describe(EstimateResult(ok=True, kind="ok", cycles=1)) == ""


def test_a_vmem_limit_above_the_chips_vmem_is_named_for_the_estimate_caveat():
    """A kernel that sizes vmem_limit_bytes for another device (as one that reads its chip from
    jax.devices() does on a CPU host) asks more than the target has: 96 MiB is above 7x's 64
    MiB of VMEM, not v6e's 128; the estimate's detail names it (loops.LIMIT_NOTE)."""
    from pallas_tune.measure.estimate import EstimateResult
    from pallas_tune.measure.loops import LIMIT_NOTE, describe, kernel_census

    x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
    asked = dict(matmul.space.default, vmem_limit_bytes=96 * 2**20)
    assert kernel_census(matmul.fn, [x, x], asked, chip="7x").limit_over_chip == 96 * 2**20
    assert kernel_census(matmul.fn, [x, x], asked, chip="v6e").limit_over_chip == 0
    assert kernel_census(matmul.fn, [x, x], dict(matmul.space.default),
                         chip="7x").limit_over_chip == 0
    detail = describe(EstimateResult(ok=True, kind="ok", cycles=1, limit_over_chip=96 * 2**20))
    assert detail == f"a kernel asks vmem_limit_bytes 96 MiB, {LIMIT_NOTE}"
    assert "pallas_tune.current_chip()" in LIMIT_NOTE


@pytest.mark.libtpu
def test_an_estimate_trial_whose_kernel_asks_more_vmem_than_the_chip_says_so(cache_dir,
                                                                              monkeypatch):
    """Deviceless libtpu, for v5p (64 MiB of VMEM; libtpu 0.0.42 cannot profile this matmul
    for 7x): the matmul config that asks 100 MiB is estimated (the compiler caps the limit)
    and its trial names the limit; the others do not."""
    from pallas_tune.measure.loops import LIMIT_NOTE

    monkeypatch.setenv("PALLAS_TUNE_TPU_LOGS", "off")
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16)
    big = dict(matmul.space.default, vmem_limit_bytes=100 * 2**20)
    res = matmul.tune(x, x, chip="v5p", timer="tpu-estimate", trials=3, warm_configs=(big,),
                      write=False, transfer=False)
    noted = {r.config["vmem_limit_bytes"]: LIMIT_NOTE in (r.detail or "")
             for r in res.records if r.outcome.timed}
    assert noted[100 * 2**20] and not noted.get(0, False)
    if LIMIT_NOTE in (res.best_record.detail or ""):
        assert LIMIT_NOTE in res.provenance["estimate_caveat"]


def test_table_indexed_fetches_the_estimate_cannot_see_are_found():
    """libtpu's profile takes prefetched tables as 0, so a block whose index moves only through
    a table is, in its eyes, fetched once per move of the grid indices alone. Measured (libtpu
    0.0.50.1, 1024x4096 by 8x4096x4096, tm=128, tn=1024): tk=4096 (one k step) estimated
    0.1179 ms, under the 0.174 ms its HBM traffic needs; tk=2048 0.2662 ms, and 0.2621 ms with
    the tables replaced by program-id arithmetic (balanced routing). The census refuses the
    first (input fetches collapse), keeps the second (only output writes are left out), and
    refuses every drhs config of the backward (its visit axis is innermost)."""
    from pallas_tune.kernels.grouped_matmul import grouped_matmul
    from pallas_tune.kernels.grouped_matmul_bwd import grouped_matmul_bwd
    from pallas_tune.measure.estimate import EstimateResult
    from pallas_tune.measure.loops import describe, kernel_census

    bf = jnp.bfloat16
    lhs, rhs = jax.ShapeDtypeStruct((1024, 4096), bf), jax.ShapeDtypeStruct((8, 4096, 4096), bf)
    sizes, d = jax.ShapeDtypeStruct((8,), jnp.int32), jax.ShapeDtypeStruct((1024, 4096), bf)
    one_step = kernel_census(grouped_matmul.fn, [lhs, rhs, sizes], dict(tm=128, tk=4096, tn=1024),
                             chip="v6e")
    assert one_step.prefetch_kernels == 1 and len(one_step.blind_inputs) == 2
    assert "(1.00 MiB blocks) counted 1 time(s), up to 60 by the data" in one_step.blind_inputs[0]
    assert "(8.00 MiB blocks) counted 4 time(s), up to 60" in one_step.blind_inputs[1]
    two_steps = kernel_census(grouped_matmul.fn, [lhs, rhs, sizes],
                              dict(tm=128, tk=2048, tn=1024), chip="v6e")
    assert two_steps.blind_inputs == ()
    # The output tile (128x1024 bf16) is written per visit by the data, per n tile in its eyes.
    assert two_steps.unseen_write_bytes == 128 * 1024 * 2 * (4 * 15 - 4)
    assert "up to 14.0 MiB of output writes" in describe(EstimateResult(
        ok=True, kind="ok", cycles=1, unseen_write_bytes=two_steps.unseen_write_bytes))
    bwd = kernel_census(grouped_matmul_bwd.fn, [lhs, rhs, sizes, d],
                        {f"{p}_{t}": 512 for p in ("dlhs", "drhs") for t in ("tm", "tk", "tn")},
                        chip="v6e")
    drhs = "grouped_matmul_bwd_drhs_512x512x512"
    assert [b.split(":")[0] for b in bwd.blind_inputs] == [drhs] * 2
    x = jax.ShapeDtypeStruct((256, 256), bf)
    plain = kernel_census(matmul.fn, [x, x], dict(matmul.space.default), chip="v6e")
    assert plain == type(one_step)(floor_flops=(2.0 * 256 ** 3,))


def test_a_tune_stops_early_when_no_config_can_be_estimated():
    """A kernel the estimate refuses at every config (the grouped matmul backward) stops after
    NOT_ESTIMABLE_STOP refusals, not the whole attempt budget; once one config was timed,
    refusals no longer stop the search."""
    from pallas_tune.measure.records import Measurement, Outcome, TrialRecord
    from pallas_tune.tuning.log import NOT_ESTIMABLE_STOP, TrialLog
    from pallas_tune.tuning.options import TuneOptions

    def refused(i):
        return TrialRecord(number=i, config={"b": i}, outcome=Outcome.COMPILE_ERROR,
                           detail="no_estimate_config", error="not estimable: x")

    log = TrialLog(TuneOptions.build(trials=5), space_size=1000)
    for i in range(NOT_ESTIMABLE_STOP):
        assert log.wants_more()
        log.add(refused(i))
    assert not log.wants_more()

    log = TrialLog(TuneOptions.build(trials=5), space_size=1000)
    log.add(TrialRecord(number=0, config={"b": -1}, outcome=Outcome.OK,
                        measurement=Measurement(times_ms=(1.0,), compile_ms=1.0,
                                                timer="tpu-estimate")))
    for i in range(1, 2 * NOT_ESTIMABLE_STOP):
        log.add(refused(i))
    assert log.wants_more()


def test_vmem_rows_pad_to_eight_for_every_dtype():
    # Measured with libtpu: int8 (8, 1024) windows take 8 KiB, not a 32-row native tile.
    est = estimate_vmem(_windows, jax.ShapeDtypeStruct((1024, 1024), jnp.int8), block=(8, 1024),
                        chip="v6e")
    assert est == 4 * 8 * 1024
    est = estimate_vmem(_windows, jax.ShapeDtypeStruct((100, 4096), jnp.bfloat16),
                        block=(100, 1024), chip="7x")
    assert est == 4 * 104 * 1024 * 2


def test_tunable_kernel_fills_missing_params_from_its_resolution(cache_dir):
    odd = jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16)  # No shipped entry for this shape.
    matmul._memo.clear()
    with pytest.warns(pt.PallasTuneWarning), chips.target("v6e", abstract_mesh=False):
        cfg = matmul.config_for(odd, odd)
    matmul._memo.clear()
    matmul._warned.clear()
    with pytest.warns(pt.PallasTuneWarning):
        est = estimate_vmem(matmul, odd, odd, chip="v6e")
    matmul._memo.clear()
    assert est == estimate_vmem(matmul.fn, odd, odd, chip="v6e", **cfg) > 0


def test_works_on_jax_upstream_pallas_op():
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    q = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    sizes = fa.BlockSizes(block_q=512, block_k_major=512, block_k=512, block_b=1)
    est = estimate_vmem(fa.flash_attention, q, q, q, chip="v6e", causal=True, block_sizes=sizes)
    assert 1 * MiB < est < 8 * MiB


@pytest.mark.parametrize("text,kind", [
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
     "vmem. Scoped allocation with size 48.00M and limit 32.00M exceeded scoped vmem limit by "
     "16.00M.", "vmem_scoped_oom"),
    ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory", "vmem_scoped_oom"),
    ("Ran out of memory in memory space vmem. Used 64.00M of 63.94M vmem.", "vmem_physical_oom"),
    ("Allocation (size=25165824) would exceed memory (size=16777216) :: #allocation3 "
     "[shape = 'u8[25165824]{0}', space=vmem, size = 0x1800000, scoped", "vmem_physical_oom"),
    ("Ran out of memory in memory space smem. Used 1.00M of 1.00M smem.", "smem_oom"),
    ("INTERNAL: Mosaic failed to compile TPU kernel: Unsupported matmul RHS", "mosaic_rejected"),
    ("ValueError: The Pallas TPU lowering currently requires that the last two dimensions",
     "block_rule"),
    ("something else entirely", "compile_error"),
])
def test_classify_compiler_errors(text, kind):
    assert _compile.classify_error(text) == kind


def test_public_names_and_user_estimator():
    v = pt.check_feasible(matmul, X, X, chip="v6e", bm=512, bn=512, bk=512, buffering=2,
                          semantics=SEM, estimator=lambda *a, **k: 40 * MiB)
    assert not v.ok and "user estimator" in v.reason
    assert pt.chip_spec("v6e").name == "tpu_v6e"
    ok = pt.check_feasible(matmul, X, X, chip="v6e", bm=512, bn=512, bk=512, buffering=2,
                           semantics=SEM)
    assert ok.min_limit_bytes == 6 * MiB and ok.usable_bytes > 127 * MiB  # 4 MiB + 47% band.


def test_tuner_filter_uses_the_kernel_estimator_and_vreg_limit():
    from pallas_tune.measure.timing import Outcome
    from pallas_tune.tuning.loop import _check

    est = pt.tunable(bm=[512], bn=[512], bk=[512], buffering=[2], semantics=[SEM],
                     vmem_estimate=lambda x, y, **kw: 64 * MiB, name="est")(matmul.fn)
    cfg = dict(bm=512, bn=512, bk=512, buffering=2, semantics=SEM)
    rejected, _ = _check(est, cfg, (X, X), {}, "tpu_v6e", "model")
    assert rejected[0] is Outcome.INFEASIBLE and "user estimator" in rejected[1]
    assert _check(matmul, cfg, (X, X), {}, "tpu_v6e", "model")[0] is None
    spill, _ = _check(matmul, dict(cfg, bm=1024, bn=1024), (X, X), {}, "tpu_v6e", "model",
                      vreg_limit=1.0)
    assert spill[0] is Outcome.INFEASIBLE and spill[2] == "vreg_pressure"


def _weight_resident(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)


def _resident_matmul(x, w, *, bm, bn):
    m, k = x.shape
    n = w.shape[1]
    return pl.pallas_call(
        _weight_resident, grid=(m // bm, n // bn),
        in_specs=[pl.BlockSpec((bm, k), lambda i, j: (i, 0)),
                  pl.BlockSpec((k, bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32))(x, w)


@pytest.mark.parametrize("bn, w_fetches", [(512, 1), (256, 8)])
def test_a_window_whose_index_stays_put_is_fetched_once(bn, w_fetches):
    """A weight block over the whole weight (its index follows only an axis of extent 1) is
    fetched once, as Pallas's pipeline skips the copy while the index is unchanged; split in
    two along n it is fetched at every step. The models' bytes follow."""
    from pallas_tune.feasibility.roofline import fetches, roofline_calls

    x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
    (call,) = _inspect.find_pallas_calls(_resident_matmul, (x, w), {"bm": 256, "bn": bn})
    grid = list(call.grid)
    steps = grid[0] * grid[1]
    counts = [fetches(b, grid, steps) for b in call.blocks]
    assert counts == [4, w_fetches, steps]  # x: once per row block; the output: every step.
    nbytes = (4 * 256 * 256 * 2 + w_fetches * 256 * bn * 2 + steps * 256 * bn * 4)
    assert roofline_calls([call], chip_spec("v6e")).hbm_bytes == nbytes
