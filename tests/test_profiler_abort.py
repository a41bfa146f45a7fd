"""libtpu's static profiler aborts on some kernels that compile without it (libtpu 0.0.50 on
v6e: a bf16 vector times a packed bf16 constant). Such a tune stops after a few candidates and
says why, or, with the roofline fallback, ranks by the model, labelled."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from pallas_tune.errors import NoFeasibleConfigError
from pallas_tune.measure import estimate, loops

ABORT = ("F1127 21:49:31.761301   11307 llo_module.cc:75] Check failed: TakeStatus() is OK "
         "(INTERNAL: LLO_CHECK failure (platforms/xla/service/jellyfish/llo/llo_region.cc:411)"
         " type_check_result.ok() Expected vector-bf16packed, got vector-int32, for operand #0"
         " of instruction %v159_v1 = vmul.bf16 1069105081, %v157_v0\nOperands:\n")


def test_the_abort_is_read_from_the_workers_output():
    assert loops.profiler_abort("the worker died from signal SIGABRT during compile\n"
                                + ABORT) == ("LLO_CHECK failure: Expected vector-bf16packed, "
                                             "got vector-int32")
    assert loops.profiler_abort("the worker died from signal SIGKILL during compile") == ""
    text = loops.abort_message("k", "LLO_CHECK failure: X", 3)
    assert "--estimate-fallback roofline" in text and "first 3 candidates" in text


@pytest.mark.libtpu
@pytest.mark.slow
def test_a_kernel_the_profiler_aborts_on_stops_after_three_candidates(cache_dir, monkeypatch,
                                                                      tmp_path):
    import toy_kernels

    monkeypatch.setenv("PALLAS_TUNE_TPU_LOGS", str(tmp_path))
    x = jnp.ones((256, 256), jnp.bfloat16)
    with pytest.raises(NoFeasibleConfigError) as err:
        toy_kernels.scale.tune(x, factor=1.4427, timer="tpu-estimate", chip="v6e", trials=12,
                               write=False, transfer=False, workers=1, warm_start=0)
    text = str(err.value)
    assert f"aborted on each of the first {estimate.ABORTS_TO_STOP} candidates" in text
    assert "Expected vector-bf16packed, got vector-int32" in text and "libtpu's logs" in text


@pytest.mark.libtpu
@pytest.mark.slow
@pytest.mark.parametrize("fallback", ["roofline", "model"])
def test_with_a_fallback_an_aborting_kernel_is_ranked_by_the_model(cache_dir, monkeypatch,
                                                                   tmp_path, fallback):
    import toy_kernels

    monkeypatch.setenv("PALLAS_TUNE_TPU_LOGS", "off")
    x = jnp.ones((256, 256), jnp.bfloat16)
    result = toy_kernels.scale.tune(x, factor=1.4427, timer="tpu-estimate", chip="v6e",
                                    trials=3, write=False, transfer=False, workers=1,
                                    warm_start=0, estimate_fallback=fallback)
    modelled = [r for r in result.records if r.outcome.timed]
    assert modelled and all(r.measurement.timer == "roofline" for r in modelled)
    name = "fitted" if fallback == "model" else "roofline"
    assert all(r.detail.startswith(f"{name} model (libtpu's static profile aborted: "
                                   "LLO_CHECK failure") for r in modelled)
    assert result.best_record in modelled
    assert result.provenance["timer"] == "tpu-estimate+roofline"
    assert "by a MODEL" in result.provenance["timing_note"]


def _failed(detail, error):
    from pallas_tune.measure.records import Outcome, TrialRecord

    return TrialRecord(number=1, config={"b": 8}, outcome=Outcome.COMPILE_ERROR, error=error,
                       detail=detail, phase="compile")


def test_a_config_out_of_vmem_only_under_the_profiling_flag_is_not_refused():
    """The profiling flag's own allocation can overflow VMEM where the program compiles
    without it (tpu-inference's real v6e winner at 4096x128x8192: 165 MiB used with the flag,
    67.8 MiB without). Such a config is never recorded infeasible: not estimable, or with the
    roofline fallback the model's figure, labelled; one that fails without the flag too stays
    what it was."""
    from pallas_tune.measure.unprofiled import settle

    oom = _failed("vmem_physical_oom", "Used 165.12M of 127.94M vmem")
    fits = lambda c: (True, "compiles without the profiling flag in 67.8 MiB of scoped VMEM")  # noqa: E731
    r, why = settle(oom, fallback=None, model=lambda c: 1e-3, fits=fits)
    assert why == "" and r.detail == loops.NOT_ESTIMABLE and not r.outcome.timed
    assert "out of VMEM only with libtpu's profiling flag" in r.error and "67.8 MiB" in r.error
    r, _ = settle(oom, fallback="roofline", model=lambda c: 1e-3, fits=fits)
    assert r.outcome.timed and r.measurement.timer == "roofline"
    assert r.measurement.times_ms == (1.0,) and r.detail.startswith("roofline model (out of VMEM")
    r, _ = settle(oom, fallback="roofline", model=lambda c: 1e-3, fits=lambda c: (False, "no"))
    assert r is oom
    crashed = _failed("worker_crashed", "the worker died from signal SIGABRT\n" + ABORT)
    r, why = settle(crashed, fallback=None, model=lambda c: 1e-3, fits=fits)
    assert r is crashed and why.startswith("LLO_CHECK failure")


@pytest.mark.libtpu
def test_the_unprofiled_check_compiles_in_a_worker_without_the_flag():
    import jax

    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.measure import candidate as cand
    from pallas_tune.measure.unprofiled import UnprofiledCheck

    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    refs = cand.KernelParts.of(matmul).refs()
    check = UnprofiledCheck("pallas_tune.measure.estimate:EstimateSession",
                            (None, None, None, False, None, False), env=estimate._ENV,
                            main_path=None, memory_limit=None, limits={"compile": 300})
    try:
        ok, said = check.fits(refs, cand.to_wire([x, x]), cand.to_wire({}),
                              dict(bm=512, bn=512, bk=512, buffering=2, vmem_limit_bytes=0,
                                   semantics=("parallel", "parallel", "arbitrary")), "v6e")
        assert ok is True and said.startswith("compiles without the profiling flag"), said
        ok, said = check.fits(refs, cand.to_wire([x, x]), cand.to_wire({}),
                              dict(bm=1024, bn=1024, bk=1024, buffering=2,
                                   vmem_limit_bytes=4 * 2**20,
                                   semantics=("parallel", "parallel", "arbitrary")), "v6e")
        assert ok is False, said
    finally:
        check.close()
