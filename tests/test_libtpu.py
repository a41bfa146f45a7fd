"""Deviceless compiles with the real TPU compiler (libtpu, no TPU). Skipped without libtpu."""

import jax
import jax.numpy as jnp
import pytest

from pallas_tune.feasibility import compile as _compile
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


def test_compiler_settles_a_borderline_candidate_both_ways():
    over = check_feasible(matmul, X, X, chip="v6e", compile=True, bm=2048, bn=2048, bk=1024,
                          buffering=1, semantics=SEM)
    assert not over.ok and over.detail == "vmem_scoped_oom" and over.stage == "compiler"
    under = check_feasible(matmul, X, X, chip="v6e", compile=True, bm=2048, bn=2048, bk=256,
                           buffering=2, semantics=SEM)
    assert under.ok and under.vmem_bytes == 28 * MiB


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


def test_tuner_two_stage_filter_rejects_a_borderline_oom_before_measuring():
    from pallas_tune.measure.timing import Outcome
    from pallas_tune.tuning.loop import _check

    cfg = dict(bm=2048, bn=2048, bk=1024, buffering=1, semantics=SEM)
    (outcome, error, detail, _), _ = _check(matmul, cfg, (X, X), {}, "tpu_v6e", "compile")
    assert outcome is Outcome.INFEASIBLE and detail == "vmem_scoped_oom"
    assert error.startswith("compiler:")
    ok = dict(bm=2048, bn=2048, bk=256, buffering=2, semantics=SEM)
    assert _check(matmul, ok, (X, X), {}, "tpu_v6e", "compile")[0] is None
    model_only, _ = _check(matmul, dict(cfg, bk=2048), (X, X), {}, "tpu_v5e", "model")
    assert model_only[0] is Outcome.INFEASIBLE and model_only[1].startswith("model:")
