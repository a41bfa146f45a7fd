"""The evaluation boundary's parts: timing rules, program fingerprints, the worker pool."""

import math
import os
import time

import jax
import jax.numpy as jnp
import pytest

from pallas_tune import chips
from pallas_tune.measure import fingerprint as fp
from pallas_tune.measure.records import Outcome
from pallas_tune.measure.timing import TimingPolicy, run_and_time, time_calls


def _sleeper(ms):
    return lambda: time.sleep(ms / 1e3)


def test_timing_stops_at_the_time_budget():
    times = time_calls(_sleeper(40), TimingPolicy(repeats=1000, max_time_s=0.2))
    assert 2 <= len(times) <= 7  # 0.2 s of 40 ms runs, not 1000 runs.
    times = time_calls(_sleeper(1), TimingPolicy(repeats=5, max_time_s=10))
    assert len(times) == 5  # The count ends it first.


def test_timing_cuts_a_clearly_slower_candidate_after_two_runs():
    policy = TimingPolicy(repeats=50, max_time_s=10, slow_factor=2.0)
    cut = policy.cutoff_ms(best_ms=2.0)
    assert cut == 4.0
    assert len(time_calls(_sleeper(20), policy, cut)) == 2
    assert len(time_calls(_sleeper(20), TimingPolicy(repeats=1, slow_factor=2.0), cut)) == 1
    assert TimingPolicy(slow_factor=None).cutoff_ms(2.0) == math.inf
    assert TimingPolicy().cutoff_ms(math.inf) == math.inf  # Nothing to compare with yet.


def test_run_and_time_records_slow_with_the_runs_seen():
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, a: jnp.sin(a) @ a, x))
    x = jnp.ones((128, 128)) / 128
    compiled = slow.lower(x).compile()
    outcome, m, _, why, _ = run_and_time(compiled, [x], reference=None, best_ms=1e-4,
                                         policy=TimingPolicy(repeats=50, max_time_s=30))
    assert outcome is Outcome.SLOW and len(m.times_ms) == 2 and "best so far" in why
    outcome, m, _, _, _ = run_and_time(compiled, [x], reference=None,
                                       policy=TimingPolicy(repeats=50, max_time_s=0.05))
    assert outcome is Outcome.OK and 1 <= len(m.times_ms) < 50  # The budget, no best yet.


def test_a_first_call_far_over_the_cut_off_is_enough():
    def slow_host(a):
        time.sleep(1.3)
        return a

    f = jax.jit(lambda x: jax.pure_callback(slow_host, jax.ShapeDtypeStruct(x.shape, x.dtype), x))
    x = jnp.ones((8,))
    compiled = f.lower(x).compile()
    outcome, m, _, why, _ = run_and_time(compiled, [x], reference=None, best_ms=0.01,
                                         policy=TimingPolicy(repeats=5))
    assert outcome is Outcome.SLOW and len(m.times_ms) == 1 and "first call" in why
    assert m.timer == "wallclock (first call only)"


def _digest(fn, args, kwargs, platforms=None):
    ctx = chips.target("v6e") if platforms else chips.interpret_mode()
    with ctx:
        return fp.digest(fp.lower(fp.trace(fn, args, kwargs), platforms=platforms))


@pytest.mark.parametrize("platforms", [None, pytest.param(("tpu",), marks=pytest.mark.libtpu)])
def test_fingerprints_ignore_names_and_tell_programs_apart(platforms):
    import toy_kernels

    x = jax.ShapeDtypeStruct((16, 128), jnp.float32)
    # The kernel names itself after the unclamped size: clamped_32 and clamped_64 are equal.
    same = {_digest(toy_kernels.clamped.fn, [x], dict(b=b, buffering=2), platforms)
            for b in (16, 32, 64)}
    assert len(same) == 1
    other = _digest(toy_kernels.clamped.fn, [x], dict(b=8, buffering=2), platforms)
    assert other not in same
    b1 = _digest(toy_kernels.clamped.fn, [x], dict(b=16, buffering=1), platforms)
    # Buffer depth: the same program when interpreted, another one for the TPU.
    assert (b1 in same) == (platforms is None)


def test_programs_that_call_back_into_python_are_never_merged():
    import toy_kernels

    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    raise_, hang = (_digest(toy_kernels.misbehaving.fn, [x], dict(mode=m, br=8))
                    for m in ("raise", "hang"))
    assert raise_ != hang  # Their texts are equal: only the Python function differs.


def test_the_renamed_program_computes_what_the_kernel_does():
    import numpy as np
    import toy_kernels

    x = toy_kernels.ones((16, 128))
    with chips.interpret_mode():
        traced = fp.trace(toy_kernels.clamped.fn, [x], dict(b=64, buffering=2))
        out = fp.lower(traced).compile()(*traced.arrays_for([x]))
    np.testing.assert_allclose(out, 2 * x)


@pytest.fixture
def pool():
    from pallas_tune.measure.pool import Pool

    p = Pool("toy_kernels:ToySession", ("t",), limits={"trace": 2.0, "run": 3.0})
    yield p
    p.close()


def test_pool_applies_each_phase_limit_and_replaces_the_worker(pool):
    first = pool.start()
    assert first["tag"] == "t"
    pool.remember("keep", 42)
    ok = pool.call("work", "trace", 0.1, phase="trace")
    assert ok.kind == "done" and ok.value == "trace"
    # 2.5 s is within the run limit but over the trace limit.
    assert pool.call("work", "run", 2.5, phase="trace").kind == "done"
    late = pool.call("work", "trace", 2.5, phase="trace")
    assert late.kind == "timeout" and late.phase == "trace" and "trace limit of 2 s" in late.message
    died = pool.call("die", phase="trace")
    assert died.kind == "crashed" and died.phase == "run" and "SIGABRT" in died.message
    bug = pool.call("fail")
    assert bug.kind == "error" and "a bug in the session" in bug.message
    after = pool.call("kept")  # A fresh worker, handed what was remembered.
    assert after.kind == "done" and after.value == 42 and pool.restarts == 2


def test_pool_answers_questions_and_runs_calls_in_parallel():
    from pallas_tune.measure.pool import Pool

    with Pool("toy_kernels:ToySession", ("p",), size=2, limits={"run": 30}) as pool:
        pool.start()
        assert pool.call("question", 20, answer=lambda q: q + 1).value == 21
        (pid_a, start_a, end_a), (pid_b, start_b, end_b) = (
            r.value for r in pool.map([("span", (1.5,), "run")] * 2))
        assert pid_a != pid_b and start_a < end_b and start_b < end_a  # At once, two workers.


def test_a_worker_imports_the_callers_pallas_tune_not_the_working_directorys(tmp_path,
                                                                                monkeypatch):
    """Run from a directory holding another pallas_tune (a source checkout beside an
    installed wheel, as on a lent GPU machine), a worker started with ``python -c`` imported
    that one and never started; it must import the caller's."""
    from pallas_tune.measure.pool import Pool, safe_path_env

    decoy = tmp_path / "pallas_tune"
    decoy.mkdir()
    (decoy / "__init__.py").write_text("raise ImportError('the checkout, not the caller')\n")
    monkeypatch.chdir(tmp_path)
    assert safe_path_env() == {"PYTHONSAFEPATH": "1"}
    p = Pool("toy_kernels:ToySession", ("t",), limits={"trace": 2.0, "run": 3.0})
    try:
        p.start()
        assert p.call("work", "trace", 0.1, phase="trace").kind == "done"
    finally:
        p.close()
    import pallas_tune

    home = os.path.dirname(os.path.dirname(os.path.abspath(pallas_tune.__file__)))
    assert safe_path_env(home) == {}  # Run from the caller's own checkout: as before.
