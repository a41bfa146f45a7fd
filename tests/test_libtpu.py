"""Deviceless compiles with the real TPU compiler (libtpu, no TPU). Skipped without libtpu."""

import jax
import jax.numpy as jnp
import pytest

from jax.experimental import pallas as pl

from pallas_tune.feasibility import compile as _compile
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.feasibility.model import check_feasible
from pallas_tune.kernels.flash_attention import flash_attention
from pallas_tune.kernels.matmul import matmul

pytestmark = pytest.mark.libtpu
MiB = 2**20
SEM = ("parallel", "parallel", "arbitrary")
X = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)


def test_compiler_agrees_on_a_fit_and_reports_usage():
    v = check_feasible(matmul, X, X, chip="v6e", compile=True, bm=512, bn=512, bk=512,
                       buffering=2, semantics=SEM)
    assert v.ok and v.stage == "compiler" and v.vmem_bytes == 4 * MiB  # Model was exact.


def test_compiler_settles_an_uncertain_candidate_both_ways():
    kw = dict(bm=2048, bn=1024, buffering=2, semantics=SEM)
    over = check_feasible(matmul, X, X, chip="v6e", bk=1024, **kw)
    assert over.status == "uncertain"  # Estimate 33.6 MiB: within the band of 32 MiB.
    over = check_feasible(matmul, X, X, chip="v6e", compile=True, bk=1024, **kw)
    assert not over.ok and over.detail == "vmem_scoped_oom" and over.stage == "compiler"
    # The estimate (33.6 MiB) says no; the compiler needs 29.85 MiB and decides yes.
    kw.update(buffering=1, bk=2048)
    under = check_feasible(matmul, X, X, chip="v6e", **kw)
    assert under.status == "uncertain" and not under.ok
    under = check_feasible(matmul, X, X, chip="v6e", compile=True, **kw)
    assert under.ok and under.stage == "compiler" and under.vmem_bytes < 32 * MiB


def test_same_candidate_differs_by_chip():
    kw = dict(bm=1024, bn=1024, bk=1024, buffering=2, semantics=SEM)
    assert check_feasible(matmul, X, X, chip="v6e", compile=True, **kw).ok
    v5e = check_feasible(matmul, X, X, chip="v5e", compile=True, **kw)
    assert not v5e.ok and v5e.detail == "vmem_scoped_oom"


def test_flash_attention_compiles_deviceless():
    q = jax.ShapeDtypeStruct((1, 32, 2048, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    r = _compile.compile_deviceless(flash_attention.fn, (q, kv, kv),
                                    {"causal": True, "bq": 512, "bkv": 512}, chip="v6e")
    assert r.ok and r.scoped_vmem_bytes and r.scoped_vmem_bytes < 32 * MiB


def test_tuner_two_stage_filter_rejects_an_uncertain_oom_before_measuring():
    from pallas_tune.measure.timing import Outcome
    from pallas_tune.tuning.loop import _check

    cfg = dict(bm=2048, bn=1024, bk=1024, buffering=2, semantics=SEM)  # Uncertain, then OOM.
    (outcome, error, detail, _), _ = _check(matmul, cfg, (X, X), {}, "tpu_v6e", "compile")
    assert outcome is Outcome.INFEASIBLE and detail == "vmem_scoped_oom"
    assert error.startswith("compiler:")
    ok = dict(bm=2048, bn=2048, bk=256, buffering=2, semantics=SEM)
    assert _check(matmul, ok, (X, X), {}, "tpu_v6e", "compile")[0] is None
    model_only, _ = _check(matmul, dict(cfg, bk=2048), (X, X), {}, "tpu_v5e", "model")
    assert model_only[0] is Outcome.INFEASIBLE and model_only[1].startswith("model:")


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = (x_ref[...].astype(jnp.float32) * 2).astype(o_ref.dtype)


def _windows(x, *, block):
    grid = tuple(pl.cdiv(a, b or 1) for a, b in zip(x.shape, block, strict=True))
    return pl.pallas_call(_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=grid, in_specs=[pl.BlockSpec(block, lambda *i: i)],
                          out_specs=pl.BlockSpec(block, lambda *i: i))(x)


@pytest.mark.parametrize("chip,shape,dtype,block", [
    ("v6e", (1000, 1000), jnp.float32, (128, 128)),  # No tile divides 1000: padded edges.
    ("v5e", (100, 4100), jnp.bfloat16, (128, 1024)),  # Blocks larger than the array dims.
    ("7x", (1000, 1000), jnp.bfloat16, (8, 128)),  # Below bf16's native 16 rows on 7x.
    ("v6e", (1000, 1000), jnp.int8, (8, 384)),  # Below int8's native 32 rows.
    ("v6e", (1000, 1000), jnp.float32, (100, 128)),  # Rows not a multiple of 8.
    ("7x", (1000, 1000), jnp.bfloat16, (8, 100)),  # Lanes not a multiple of 128.
    ("v5e", (16, 128), jnp.float32, (None, 128)),  # Squeezed second-to-last dim.
    ("v6e", (4096,), jnp.bfloat16, (128,)),  # Rank 1 below 128 * 32 / 16.
])
def test_block_rules_agree_with_the_compiler_on_ragged_shapes(chip, shape, dtype, block):
    x = jax.ShapeDtypeStruct(shape, dtype)
    problems = _inspect.block_rule_violations(
        _inspect.find_pallas_calls(_windows, (x,), {"block": block}), spec=chip)
    result = _compile.compile_deviceless(_windows, (x,), {"block": block}, chip=chip)
    assert result.ok == (problems == []), (problems, result.message[:300])
    if problems:
        assert result.kind == "block_rule"


def test_raised_scoped_limit_reports_what_an_oom_candidate_needs():
    kw = dict(bm=2048, bn=2048, bk=1024, buffering=1, semantics=SEM)
    default = _compile.compile_deviceless(matmul.fn, (X, X), kw, chip="v6e")
    assert not default.ok and default.kind == "vmem_scoped_oom"
    raised = _compile.compile_deviceless(matmul.fn, (X, X), kw, chip="v6e",
                                         scoped_limit_bytes=100 * MiB)
    assert raised.ok and 32 * MiB < raised.scoped_vmem_bytes < 100 * MiB
