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
def test_with_the_roofline_fallback_an_aborting_kernel_is_ranked_by_the_model(cache_dir,
                                                                             monkeypatch,
                                                                             tmp_path):
    import toy_kernels

    monkeypatch.setenv("PALLAS_TUNE_TPU_LOGS", "off")
    x = jnp.ones((256, 256), jnp.bfloat16)
    result = toy_kernels.scale.tune(x, factor=1.4427, timer="tpu-estimate", chip="v6e",
                                    trials=4, write=False, transfer=False, workers=1,
                                    warm_start=0, estimate_fallback="roofline")
    modelled = [r for r in result.records if r.outcome.timed]
    assert modelled and all(r.measurement.timer == "roofline" for r in modelled)
    assert all("libtpu's static profile aborted: LLO_CHECK failure" in r.detail
               for r in modelled)
    assert result.best_record in modelled
