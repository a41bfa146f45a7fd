"""Workers on one stored study: a program (the lowered code several configs may share) is timed
once across all of them, its claim going through the storage (tuning.programs)."""

from __future__ import annotations

import threading

import jax.numpy as jnp
import pytest
from sweep_harness import postgres_url

import pallas_tune as pt
from pallas_tune.measure.evaluate import Evaluator
from pallas_tune.measure.records import Measurement, Outcome, TrialRecord


@pt.tunable(a=list(range(6)), name="tests.one_program")
def one_program(x, *, a):
    """Six configs, one program (as tiles clamped to a small shape are)."""
    return x


class OneProgram(Evaluator):
    """Every config lowers to program "P". A candidate to time first waits until the other
    worker has reached its own first claim, so both hold a candidate of P at the same time."""

    kind = "fake"

    def __init__(self, me: threading.Event, other: threading.Event, timed: list):
        super().__init__()
        self.me, self.other, self.timed = me, other, timed

    def start(self):
        self.device = {"chip": "cpu", "platform": "cpu", "device_kind": "fake"}
        return self.device

    def _evaluate(self, candidates):
        out = []
        for number, config in candidates:
            self.me.set()
            original = self._answer(("claim", "P", number))
            if original is None:
                self.other.wait(timeout=20)
                self.timed.append((self.me, config))
                rec = TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                                  measurement=Measurement(times_ms=(1.0,), compile_ms=0.0),
                                  fingerprint="P")
            else:
                rec = TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                                  fingerprint="P", duplicate_of=original)
            self._note(rec)
            out.append(rec)
        return out

    def roofline(self, configs, chip):
        return [0.0 for _ in configs]


def _two_workers(url: str) -> tuple[list, list]:
    from pallas_tune.tuning import TuneOptions, run

    events = [threading.Event(), threading.Event()]
    timed: list = []
    results: list = [None, None]
    errors: list = []
    x = jnp.ones((8, 128))

    def work(i):
        try:
            opts = TuneOptions(trials=6, seed=i, write=False, retime_top=0, storage=url,
                               study_name="one-program")
            results[i] = run(one_program, (x,), {}, opts,
                             evaluator=OneProgram(events[i], events[1 - i], timed))
        except BaseException as e:  # noqa: BLE001  Re-raised below, in the test's thread.
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    return timed, results


def _check(timed, results):
    assert len(timed) == 1, f"program P timed {len(timed)} times: {timed}"
    assert sum(res.counts["timed"] for res in results) == 1
    dups = [r for res in results for r in res.records if r.duplicate_of is not None]
    assert dups and all(r.outcome is Outcome.OK and r.median_ms == 1.0 for r in dups)


def test_two_workers_on_sqlite_time_a_shared_program_once(tmp_path):
    _check(*_two_workers(f"sqlite:///{tmp_path / 'study.db'}"))


def test_two_workers_on_postgres_time_a_shared_program_once(tmp_path):
    with postgres_url(str(tmp_path / "pg")) as url:
        _check(*_two_workers(url))


@pytest.mark.parametrize("wait", [True, False])
def test_a_claim_waits_for_the_worker_that_claimed_first(tmp_path, wait):
    """The bakery order, step by step on one storage: the first claim holds the program, the
    second waits for its outcome (or, told not to wait, evaluates it too); a holder that fails
    passes the program on."""
    import optuna

    from pallas_tune.tuning.programs import PROGRAM_ATTR, ProgramClaims
    from pallas_tune.tuning.study import Search

    url = f"sqlite:///{tmp_path / 'claims.db'}"
    kw = {"name": "claims", "storage": url, "sampler": "gp", "seed": 0, "trials": 2,
          "warm": []}
    first, second = Search.open(one_program.space, **kw), Search.open(one_program.space, **kw)
    try:
        (t1, _), = first.ask(1)[0]
        (t2, _), = second.ask(1)[0]
        c1, c2 = ProgramClaims(first), ProgramClaims(second)
        c1.bind(0, t1)
        c2.bind(0, t2)
        assert c1.claim("P", 0, wait=True) is None  # Nobody else: ours.
        assert first.study._storage.get_trial(t1._trial_id).system_attrs[PROGRAM_ATTR] == \
            ["P", 1]
        done = threading.Timer(0.5, lambda: first.tell(t1, TrialRecord(
            number=0, config={"a": 0}, outcome=Outcome.OK, fingerprint="P",
            measurement=Measurement(times_ms=(2.5,), compile_ms=0.0)), new=True))
        done.start()
        got = c2.claim("P", 0, wait=wait)
        done.join()
        if wait:
            assert got is not None and got.median_ms == 2.5 and got.fingerprint == "P"
            assert c2.waited_s >= 0.3
        else:
            assert got is None  # Holding a program of its own: evaluates this one too.
        # A program whose holder fails (a dead worker, an interrupt) goes to the next in line.
        (t3, _), = first.ask(1)[0]
        (t4, _), = second.ask(1)[0]
        c1.bind(1, t3)
        c2.bind(1, t4)
        assert c1.claim("Q", 1, wait=True) is None
        first.study.tell(t3, state=optuna.trial.TrialState.FAIL)
        assert c2.claim("Q", 1, wait=True) is None
    finally:
        first.close()
        second.close()


def test_two_processes_never_pop_one_queued_trial_on_sqlite(tmp_path):
    """Optuna claims a queued trial by reading WAITING then writing RUNNING; on SQLite both
    must happen in one write transaction, or two workers both claim it (and both evaluate
    it: seen as a trial told twice in a two-worker sweep)."""
    import subprocess
    import sys

    import optuna

    from pallas_tune.tuning.storage import open_storage

    url = f"sqlite:///{tmp_path / 'queue.db'}"
    study = optuna.create_study(storage=open_storage(url), study_name="queue")
    for i in range(60):
        study.enqueue_trial({"i": i})
    pop = ("import sys, optuna; from pallas_tune.tuning.storage import open_storage; "
           "optuna.logging.set_verbosity(optuna.logging.ERROR); "
           "s = optuna.load_study(study_name='queue', storage=open_storage(sys.argv[1])); "
           "print(*[s.ask().number for _ in range(30)])")
    procs = [subprocess.Popen([sys.executable, "-c", pop, url], stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    popped = [int(n) for p in procs for n in p.communicate(timeout=300)[0].split()]
    assert all(p.returncode == 0 for p in procs)
    assert len(popped) == 60 and len(set(popped)) == len(popped), sorted(popped)
