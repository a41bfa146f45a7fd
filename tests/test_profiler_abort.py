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
    assert "--estimate-fallback model" in text and "first 3 candidates" in text


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
    # What was checked, not asserted: the same program compiled without the profiling flag.
    assert "checked once on one of them: the same program compiles without the profiling " \
           "flag" in text and "--estimate-fallback model" in text


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
    name = "fitted" if fallback == "model" else "roofline"
    assert modelled and all(r.measurement.timer == f"{name}-model" for r in modelled)
    assert all(r.detail.startswith(f"{name} model (libtpu's static profile aborted: "
                                   "LLO_CHECK failure") for r in modelled)
    assert all("checked once: the same program compiles without the profiling flag"
               in r.detail for r in modelled)
    assert result.best_record in modelled
    # Every candidate has the model's figure: the entry names it, not "tpu-estimate+...".
    assert result.provenance["timer"] == f"{name}-model"
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
    assert r.outcome.timed and r.measurement.timer == "roofline-model"
    assert r.measurement.times_ms == (1.0,) and r.detail.startswith("roofline model (out of VMEM")
    r, _ = settle(oom, fallback="roofline", model=lambda c: 1e-3, fits=lambda c: (False, "no"))
    assert r is oom
    crashed = _failed("worker_crashed", "the worker died from signal SIGABRT\n" + ABORT)
    r, why = settle(crashed, fallback=None, model=lambda c: 1e-3, fits=fits)
    assert not r.outcome.timed and why.startswith("LLO_CHECK failure")
    assert "checked once: the same program compiles without the profiling flag" in r.error


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


# Issue 55, item 2: every abort of the profiled compile is caught, whatever its text, where
# the unprofiled compile of the same program succeeds (checked once per kind, never assumed).
FIFO = ("F1204 10:02:11.5 12345 scheduler.cc:812] Check failed: Cannot schedule FIFO push "
        "instruction when the FIFO is full: %v88 = vmatpush1.f8e4m3.xpose %v87\n")
DIED = "the worker died from signal SIGABRT during compile\n"
BARE = DIED + "worker output (last lines):\n*** "


def _crashed(text, a=1):
    from pallas_tune.measure.records import Outcome, TrialRecord

    return TrialRecord(number=a, config={"b": a}, outcome=Outcome.COMPILE_ERROR, error=text,
                       detail="worker_crashed", phase="compile")


class _Check:
    """The unprofiled compile, faked: whether the program compiles without the flag."""

    def __init__(self, ok):
        self.ok, self.calls = ok, 0

    def fits(self, refs, args, kwargs, config, chip):
        self.calls += 1
        return ((True, "compiles without the profiling flag in 12.0 MiB of scoped VMEM")
                if self.ok else (False, "Used 200M of 128M vmem"))


def _evaluator(ok, fallback=None):
    import types

    ev = object.__new__(estimate.EstimateEvaluator)
    ev._target = (None, types.SimpleNamespace(args=(), kwargs={}))
    ev._unprofiled, ev.fallback, ev._name, ev.device = _Check(ok), fallback, "k", {"chip": "7x"}
    ev._checked, ev._aborts, ev._estimated, ev._unfigured = {}, 0, 0, 0
    ev.pool = types.SimpleNamespace(logs=types.SimpleNamespace(note=lambda: ""))
    ev._model = lambda config: 1e-3
    return ev


@pytest.mark.parametrize("text, why", [
    (DIED + ABORT, "LLO_CHECK failure: Exp"),
    (DIED + FIFO, "FIFO: Cannot schedule FIFO"),
    (BARE, "SIGABRT with no known message"),
    ("the worker died from signal SIGSEGV during compile", "SIGSEGV with no known message"),
])
def test_each_kind_of_abort_stops_the_tune_after_three_with_what_was_checked(text, why):
    ev = _evaluator(ok=True)
    for a in range(estimate.ABORTS_TO_STOP - 1):
        r = ev._settle(_crashed(text, a))
        assert not r.outcome.timed and "checked once: the same program compiles" in r.error
    with pytest.raises(NoFeasibleConfigError) as err:
        ev._settle(_crashed(text, 9))
    said = str(err.value)
    assert why in said and "--estimate-fallback model" in said and "roofline" not in said
    assert ("checked once on one of them: the same program compiles without the profiling "
            "flag in 12.0 MiB") in said
    assert ev._unprofiled.calls == 1  # Once per kind of abort, not per candidate.


@pytest.mark.parametrize("text", [DIED + FIFO, BARE])
def test_with_the_model_fallback_an_abort_gets_the_models_figure(text):
    r = _evaluator(ok=True, fallback="model")._settle(_crashed(text))
    assert r.outcome.timed and r.measurement.timer == "fitted-model"
    assert r.detail.startswith("fitted model (libtpu's static profile aborted: ")


def test_a_signal_where_the_unprofiled_compile_fails_too_is_a_compile_failure():
    ev = _evaluator(ok=False, fallback="model")
    for a in range(estimate.ABORTS_TO_STOP + 1):  # Never stops the tune, never modelled.
        r = ev._settle(_crashed(BARE, a))
        assert not r.outcome.timed and r.detail == "worker_crashed"
        assert "not a profiler abort: the same program without the profiling flag does not " \
               "compile either (Used 200M of 128M vmem)" in r.error
    assert ev._aborts == 0 and ev._unprofiled.calls == 1
    # A worker killed (its memory limit) is no abort at all: nothing is compiled to check.
    killed = _crashed("the worker died from signal SIGKILL during compile")
    assert ev._settle(killed) is killed and loops.profiler_abort(killed.error) == ""


def test_a_pick_made_without_the_aborted_configs_says_so():
    from pallas_tune.errors import PallasTuneWarning
    from pallas_tune.measure.records import Measurement, Outcome, TrialRecord

    ev = _evaluator(ok=True)
    ev._settle(_crashed(DIED + FIFO))
    ok = TrialRecord(number=2, config={"b": 2}, outcome=Outcome.OK, phase="compile",
                     measurement=Measurement(times_ms=(1.0,), compile_ms=0.0,
                                             timer="tpu-estimate"))
    with pytest.warns(PallasTuneWarning, match="1 candidate.s. got no libtpu figure .1 by a "
                                               "profiler abort"):
        changed, note = ev.one_scale([ok])
    assert changed == [] and "--estimate-fallback model" in note["unfigured"]


def test_a_flag_only_oom_is_figured_by_the_same_route():
    """Out of VMEM only under the profiling flag: with the model fallback, the model's figure
    (then on libtpu's scale, see test_estimate_one_scale); without, not estimable, counted in
    the pick's warning."""
    ev = _evaluator(ok=True, fallback="model")
    r = ev._settle(_failed("vmem_physical_oom", "Used 165.12M of 127.94M vmem"))
    assert r.outcome.timed and r.measurement.timer == "fitted-model"
    assert r.detail.startswith("fitted model (out of VMEM only with libtpu's profiling flag")
    ev = _evaluator(ok=True)
    r = ev._settle(_failed("vmem_physical_oom", "Used 165.12M of 127.94M vmem"))
    assert r.detail == loops.NOT_ESTIMABLE and ev._unfigured == 1
