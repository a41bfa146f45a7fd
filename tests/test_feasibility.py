"""The chip table and the VMEM/SMEM/VREG model (pure tracing: no libtpu needed here)."""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.feasibility import compile as _compile
from pallas_tune.feasibility.model import check_feasible, estimate_vmem
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


def test_verdicts_ok_borderline_infeasible():
    ok = check_feasible(matmul, X, X, chip="v6e", bm=512, bn=512, bk=512, buffering=2,
                        semantics=SEM)
    assert ok.ok and ok.status == "ok" and ok.limit_bytes == 32 * MiB and ok.stage == "model"
    big = check_feasible(matmul, X, X, chip="v5e", bm=2048, bn=2048, bk=1024, buffering=2,
                         semantics=SEM)
    assert not big.ok and big.status == "infeasible" and big.detail == "vmem_scoped_oom"
    assert "scoped VMEM limit 16.00 MiB" in big.reason
    edge = check_feasible(matmul, X, X, chip="v6e", bm=2048, bn=2048, bk=256, buffering=2,
                          semantics=SEM)
    assert edge.status == "borderline"


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
    bad = check_feasible(matmul, jax.ShapeDtypeStruct((1000, 1000), jnp.float32),
                         jax.ShapeDtypeStruct((1000, 1000), jnp.float32), chip="v6e", bm=128,
                         bn=128, bk=128, buffering=2, semantics=SEM)
    assert not bad.ok and bad.detail == "block_rule"
    v = check_feasible(matmul, X, X, chip="v6e", bm=1024, bn=1024, bk=256, buffering=2,
                       semantics=SEM)
    assert v.vreg_pressure > 1  # A 1024x1024 f32 dot result is 16 vreg files.
    tight = check_feasible(matmul, X, X, chip="v6e", bm=1024, bn=1024, bk=256, buffering=2,
                           semantics=SEM, vreg_limit=4)
    assert not tight.ok and tight.detail == "vreg_pressure"


def test_tunable_kernel_fills_missing_params_from_its_resolution(cache_dir):
    odd = jax.ShapeDtypeStruct((1536, 1536), jnp.bfloat16)  # No shipped entry near it fits.
    matmul._memo.clear()
    with pytest.warns(pt.PallasTuneWarning):
        est = estimate_vmem(matmul, odd, odd, chip="v6e")  # Default config: 256^3, 2 buffers.
    matmul._memo.clear()
    assert est == 1 * MiB


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
    assert ok.min_limit_bytes == 5 * MiB and ok.usable_bytes > 127 * MiB


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
