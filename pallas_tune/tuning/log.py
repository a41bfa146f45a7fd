"""The run's trial log: every record, what is known by config, the budget and the stop rules."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune.measure.loops import NOT_ESTIMABLE
from pallas_tune.measure.records import Outcome, TrialRecord
from pallas_tune.tuning.options import TuneOptions
from pallas_tune.tuning.result import Progress

__all__ = ["NOT_ESTIMABLE_STOP", "TrialLog"]

logger = logging.getLogger("pallas_tune.tuning")

# Stop asking once this many candidates had no estimate (NOT_ESTIMABLE: what
# libtpu's profile cannot follow, see pallas_tune.measure.loops) while none was timed: a
# kernel refused at every config (the grouped matmul backward's drhs) fails after these, not
# after the whole attempt budget.
NOT_ESTIMABLE_STOP = 10
# Stop once this many new candidates in a row were programs already evaluated (duplicates),
# where the sampler chooses (not an exhaustive run): the call's configs then run as few
# distinct programs (values clamped to its shape, parameters its program ignores), and asking
# on spends a trace and a lowering per candidate to find none.
DUPLICATE_STREAK = 16


def config_key(config: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(sorted(config.items()))


class TrialLog:
    """Records in trial order; a config is evaluated once per run (or study).

    What is asked of it each trial (the budget, the stop rules, the progress) is kept as
    running figures, so a trial costs the same at the 300th as at the first."""

    def __init__(self, options: TuneOptions, space_size: int):
        self.options = options
        self.space_size = space_size
        self.records: list[TrialRecord] = []
        self.by_config: dict[tuple[Any, ...], TrialRecord] = {}
        self.imported: set[int] = set()
        self.asked = 0
        self.started = time.perf_counter()
        self.timed = 0  # Distinct programs timed (imported ones included: a resumed study
        # only measures what is missing).
        self._timed_imported = 0
        self._duplicates_here = 0
        self._not_estimable = 0  # Configs refused an estimate (NOT_ESTIMABLE_STOP).
        self._streak = 0  # New candidates in a row whose program was evaluated before.
        self.stopped: str | None = None  # Why the run stopped short of ``trials``, if it did.
        self._best: TrialRecord | None = None
        self._lowest: list[float] = []  # Lowest median of the first i+1 timed trials.
        self._recent: collections.deque[float] = collections.deque(
            maxlen=max(1, options.patience or 1))

    # ---- what is known --------------------------------------------------------------------

    def adopt(self, finished: Sequence[tuple[dict[str, Any], TrialRecord]]) -> list[TrialRecord]:
        """Takes trials finished elsewhere (a resumed study, other hosts); returns the new ones."""
        new = []
        for config, record in finished:
            if config_key(config) in self.by_config:
                continue
            record = dataclasses.replace(record, number=len(self.records))
            self.imported.add(record.number)
            self._store(record)
            new.append(record)
        return new

    def fresh(self, configs: Sequence[Mapping[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
        """Numbers the configs not evaluated yet (each once), skipping what is known."""
        out: list[tuple[int, dict[str, Any]]] = []
        taken = set()
        for config in configs:
            k = config_key(config)
            if k in self.by_config or k in taken:
                continue
            taken.add(k)
            out.append((len(self.records) + len(out), dict(config)))
        return out

    def record_of(self, config: Mapping[str, Any]) -> TrialRecord:
        return self.by_config[config_key(config)]

    # ---- recording ------------------------------------------------------------------------

    def add(self, record: TrialRecord) -> None:
        assert record.number == len(self.records), (record.number, len(self.records))
        self._store(record)
        logger.debug("trial %d %s -> %s %.4g ms%s", record.number, record.config,
                     record.outcome.value, record.median_ms,
                     f" (same program as trial {record.duplicate_of})"
                     if record.duplicate_of is not None else "")
        progress = self.progress()
        for callback in self.options.callbacks:
            callback(record, progress)

    def _store(self, record: TrialRecord) -> None:
        self.records.append(record)
        self.by_config[config_key(record.config)] = record
        imported = record.number in self.imported
        if record.duplicate_of is not None and not imported:
            self._duplicates_here += 1
        if not imported:
            self._streak = self._streak + 1 if record.duplicate_of is not None else 0
        self._not_estimable += record.detail == NOT_ESTIMABLE
        if record.spent_device_time:
            self.timed += 1
            self._timed_imported += imported
            ms = record.median_ms
            self._lowest.append(min(ms, self._lowest[-1]) if self._lowest else ms)
            self._recent.append(ms)
        if record.outcome is Outcome.OK and record.duplicate_of is None and (
                self._best is None or record.median_ms < self._best.median_ms):
            self._best = record

    def rescale(self, records: Sequence[TrialRecord]) -> None:
        """Puts ``records`` (figures the evaluator put on the run's one scale, or ranked
        apart: measure.unprofiled.one_scale) in place of the trials of their numbers; the
        best follows them."""
        for record in records:
            self.records[record.number] = record
            self.by_config[config_key(record.config)] = record
        ok = [r for r in self.records if r.outcome is Outcome.OK and r.duplicate_of is None]
        self._best = min(ok, key=lambda r: r.median_ms, default=None)

    # ---- budget and stop rules ------------------------------------------------------------

    def wants_more(self, pending: int = 0) -> bool:
        """Whether to ask for more; ``pending``: trials other workers run now (they count
        against ``trials``, the study's total, and against the space). Where it stops short of
        ``trials``, :attr:`stopped` says why."""
        if self.timed + pending >= self.options.trials:
            return False
        why = self._why_stop(pending)
        if why:
            self.stopped = why
        return not why

    def _why_stop(self, pending: int) -> str | None:
        o = self.options
        attempts = o.max_attempts or max(10 * o.trials, 100)
        of = f"stopping after {self.timed} of {o.trials} trials"
        if len(self.by_config) + pending >= self.space_size:
            programs = self.programs()
            return (f"all {programs} distinct programs of this call evaluated"
                    + (f" (its {self.space_size} configs)" if programs != self.space_size
                       else "") + f"; {of}")
        if self._streak >= DUPLICATE_STREAK and self.space_size > o.trials:
            return (f"the last {self._streak} candidates were all programs evaluated before "
                    f"({self.programs()} distinct programs in {len(self.by_config)} configs): "
                    "this call's configs run as few distinct programs (values clamped to its "
                    f"shape, parameters its program ignores); {of}")
        if self.asked >= attempts:
            return f"{self.asked} candidates asked (max_attempts={attempts}); {of}"
        if self._plateaued():
            return (f"{o.patience} timed trials in a row did not improve the best by 1% "
                    f"(patience={o.patience}); {of}")
        if self.timed == 0 and self._not_estimable >= NOT_ESTIMABLE_STOP:
            return (f"{self._not_estimable} candidates had no estimate and none was timed; "
                    f"{of}")
        return None

    def programs(self) -> int:
        """Distinct programs evaluated (by fingerprint; a config without one counts alone)."""
        seen = {r.fingerprint or ("config", config_key(r.config)) for r in self.records
                if r.duplicate_of is None}
        return len(seen)

    def batch(self, parallelism: int, pending: int = 0) -> int:
        return max(1, min(parallelism, self.options.trials - self.timed - pending))

    def _plateaued(self) -> bool:
        """``patience`` timed trials in a row without improving the best by more than 1%."""
        n = self.options.patience
        if not n or self.timed <= n:
            return False
        return min(self._recent) > self._lowest[-n - 1] * 0.99

    # ---- summaries ------------------------------------------------------------------------

    def best(self) -> TrialRecord | None:
        """The fastest ``ok`` trial that timed its program (the first of equals)."""
        return self._best

    def progress(self) -> Progress:
        best = self._best
        return Progress(asked=self.asked, evaluated=len(self.records) - len(self.imported),
                        timed=self.timed - self._timed_imported,
                        duplicates=self._duplicates_here,
                        budget=self.options.trials, best_ms=best.median_ms if best else math.inf,
                        best=dict(best.config) if best else None,
                        elapsed_s=time.perf_counter() - self.started,
                        from_storage=self._timed_imported)

    def counts(self) -> dict[str, int]:
        """Asked of the sampler, evaluated, distinct programs, device timings spent, ..."""
        here = [r for r in self.records if r.number not in self.imported]
        outcomes: dict[str, int] = {}
        for r in here:
            outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
        return {"asked": self.asked, "evaluated": len(here),
                "programs": len({r.fingerprint for r in here if r.fingerprint}),
                "timed": sum(r.spent_device_time for r in here),
                "duplicates": sum(r.duplicate_of is not None for r in here),
                "from_storage": len(self.imported), **{f"outcome_{k}": v
                                                       for k, v in sorted(outcomes.items())}}
