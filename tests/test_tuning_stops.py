"""A run that runs out of distinct programs stops and says so (issue 56.3): the call's space
of distinct effective configs used up, or the sampler finding only programs it evaluated
before. With a fake evaluator whose programs collapse, on the CPU."""

from __future__ import annotations

import logging

import numpy as np
from test_tuner import Landscape

import pallas_tune as pt
from pallas_tune.measure.records import Measurement, Outcome, TrialRecord
from pallas_tune.tuning import TuneOptions, log, run

DUPLICATE_STREAK = getattr(log, "DUPLICATE_STREAK", 16)  # The code before had none.


class Programs(Landscape):
    """Landscape whose configs run as the programs ``program(config)`` names: a config whose
    program was evaluated is a duplicate, as the real evaluators find by fingerprint."""

    def __init__(self, cost, program):
        super().__init__(cost)
        self.program = program

    def _evaluate(self, candidates):
        out = []
        for number, config in candidates:
            fingerprint = str(self.program(config))
            first = self._answer(("claim", fingerprint, number))
            if first is not None:
                out.append(TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                                       fingerprint=fingerprint, duplicate_of=first))
                continue
            self.evaluated.append(config)
            rec = TrialRecord(number=number, config=dict(config), outcome=Outcome.OK,
                              measurement=Measurement(times_ms=(self.cost(config),),
                                                      compile_ms=0.0),
                              fingerprint=fingerprint)
            self._note(rec)
            out.append(rec)
        return out


def test_a_space_of_two_programs_stops_after_a_streak_of_duplicates_and_says_so(cache_dir,
                                                                               caplog):
    """Issue 56.3: flash_attention_bwd at S=100, a space of 1250 configs running as 2
    programs, asked 100 trials: 2 timed, 98 duplicates, never said why. The sampler now stops
    after DUPLICATE_STREAK duplicates in a row, and the result and the log say so."""

    @pt.tunable(a=list(range(8)), b=list(range(8)), c=list(range(4)), name="two_programs")
    def kern(x, *, a, b, c):
        return x

    ev = Programs(lambda cfg: 1.0 + (cfg["c"] % 2), lambda cfg: cfg["c"] % 2)
    with caplog.at_level(logging.WARNING, logger="pallas_tune.tuning"):
        res = run(kern, (np.ones((8, 128), np.float32),), {},
                  TuneOptions(trials=100, write=False, retime_top=0, seed=0), evaluator=ev)
    assert len(ev.evaluated) == 2 and res.tally["timed"] == 2
    assert res.tally["duplicates"] <= DUPLICATE_STREAK + 4, res.tally  # Not 98 (or 254).
    stopped = res.provenance["stopped"]
    assert f"the last {DUPLICATE_STREAK} candidates were all programs evaluated before" in stopped
    assert "2 distinct programs" in stopped and stopped.endswith("stopping after 2 of 100 trials")
    assert stopped[1:] in str(res).splitlines()[1]
    assert any(stopped in r.getMessage() for r in caplog.records)


def test_a_used_up_call_space_is_said_used_up(cache_dir):
    """Declared clamps make the call's space its distinct programs: the run evaluates them
    all, stops, and says so, with the count of the trials it was asked for."""

    @pt.tunable(b=[8, 16, 32, 64, 128], u=[1, 2], clamp={"b": "x.shape[0]"},
                name="clamped_space_toy")
    def kern(x, *, b, u):
        return x

    ev = Landscape(lambda cfg: float(cfg["b"]))
    res = run(kern, (np.ones((16, 128), np.float32),), {},
              TuneOptions(trials=10, write=False, retime_top=0, seed=0), evaluator=ev)
    assert len(ev.evaluated) == 4  # b in {8, 16} (16 runs as 16..128) x u in {1, 2}.
    assert res.provenance["stopped"] == ("all 4 distinct programs of this call evaluated; "
                                         "stopping after 4 of 10 trials")


def test_a_run_that_meets_its_budget_says_nothing_of_stopping(cache_dir):
    @pt.tunable(a=list(range(8)), b=list(range(8)), name="budget_toy")
    def kern(x, *, a, b):
        return x

    res = run(kern, (np.ones((8, 128), np.float32),), {},
              TuneOptions(trials=6, write=False, retime_top=0, seed=0),
              evaluator=Landscape(lambda cfg: 1.0 + cfg["a"] + cfg["b"]))
    assert res.tally["timed"] == 6 and "stopped" not in res.provenance
