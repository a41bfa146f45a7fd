"""Programs claimed through the storage: two workers on one study never time one program twice.

Several configs often lower to one program (tiles clamped to a small shape; in interpret mode,
the buffer depth). Each evaluator knows the programs of its own process and of the trials it
has read from the study; :class:`ProgramClaims` adds the programs other workers are evaluating
right now. As soon as a candidate's program is known (lowered and hashed, before it is
compiled or timed), its trial records a claim on it, and the worker reads the study:

- a COMPLETE trial that evaluated that program (not itself a duplicate): the candidate is its
  duplicate, with its outcome, at no device time;
- a RUNNING trial of another worker claiming it first: the worker waits for that trial's outcome
  (polling, with backoff; a dead worker's trial is failed as usual, and then the claim passes
  to the next in line);
- else the program is this trial's to evaluate.

"First" is decided as in Lamport's bakery: a claim is written without a ticket, the worker reads
the others' tickets and writes its own, one more than the largest it saw, and then waits while
any other claim is still without a ticket; the smallest (ticket, trial number) holds the
program. A claim written before another was read gets a smaller ticket than that one, so of two
workers claiming one program at the same moment exactly one evaluates it, whatever the order in
which their writes become visible. Waiting happens only while the worker holds no unevaluated
program of its own (one candidate at a time, the default): a worker evaluating a batch does not
wait (see :meth:`pallas_tune.measure.evaluate.SharedPrograms.claim`), so two workers never wait
on each other.
"""

from __future__ import annotations

import time
from typing import Any, Final

from pallas_tune.measure.records import TrialRecord
from pallas_tune.tuning.study import Search

__all__ = ["PROGRAM_ATTR", "ProgramClaims"]

PROGRAM_ATTR: Final = "pallas_tune:program"  # Trial system attribute: [fingerprint, ticket].
POLL_S: Final = 0.1  # First wait between reads of the study; grows to MAX_POLL_S.
MAX_POLL_S: Final = 2.0
DEAD_CHECK_S: Final = 5.0  # How often a waiting worker looks for dead workers' trials.
WAIT_LIMIT_S: Final = 3600.0  # Past this, evaluate it here (a holder that never ends).


class ProgramClaims:
    """:class:`pallas_tune.measure.evaluate.SharedPrograms` over a stored study.

    ``bind`` tells which study trial a candidate number belongs to; candidates not bound (none
    in memory) are never checked against the study."""

    def __init__(self, search: Search):
        self.search = search
        self._trials: dict[int, Any] = {}  # Candidate number -> our Optuna trial.
        self.waited_s = 0.0  # Time spent waiting for other workers' programs.

    def bind(self, number: int, trial: Any) -> None:
        self._trials[number] = trial

    def claim(self, fingerprint: str, number: int, *, wait: bool) -> TrialRecord | None:
        trial = self._trials.pop(number, None)
        if trial is None:
            return None
        storage = self.search.study._storage
        storage.set_trial_system_attr(trial._trial_id, PROGRAM_ATTR, [fingerprint, None])
        done, others = self._read(fingerprint, trial.number)
        if done is not None:
            return done
        ticket = 1 + max((t for t, _ in others if t is not None), default=0)
        storage.set_trial_system_attr(trial._trial_id, PROGRAM_ATTR, [fingerprint, ticket])
        return self._wait(fingerprint, (ticket, trial.number), wait)

    def _wait(self, fingerprint: str, me: tuple[int, int], wait: bool) -> TrialRecord | None:
        from pallas_tune.tuning import storage as _storage

        started = last_check = time.monotonic()
        delay = POLL_S
        try:
            while True:
                done, others = self._read(fingerprint, me[1])
                if done is not None:
                    return done
                choosing = any(t is None for t, _ in others)
                ahead = any(t is not None and (t, n) < me for t, n in others)
                if not choosing and (not ahead or not wait):
                    return None
                now = time.monotonic()
                if now - started > WAIT_LIMIT_S:
                    return None
                if now - last_check > DEAD_CHECK_S:
                    _storage.fail_dead(self.search.study)
                    last_check = now
                time.sleep(delay)
                delay = min(delay * 1.5, MAX_POLL_S)
        finally:
            self.waited_s += time.monotonic() - started

    def _read(self, fingerprint: str, mine: int
              ) -> tuple[TrialRecord | None, list[tuple[int | None, int]]]:
        """(the record of a COMPLETE original of ``fingerprint``, or None; the other RUNNING
        trials claiming it, as (ticket or None, trial number))."""
        others = []
        for t in self.search.running():
            claim = t.system_attrs.get(PROGRAM_ATTR)
            if t.number != mine and isinstance(claim, list) and claim[:1] == [fingerprint]:
                others.append((claim[1], t.number))
        return self.search.timed_program(fingerprint), others
