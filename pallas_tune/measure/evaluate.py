"""The evaluation boundary: an :class:`Evaluator` takes candidates and returns trial records.

Everything that can go wrong for a candidate happens inside it: the trace, the block rules,
the feasibility model, the deviceless compile, the compile, the correctness check, the timing.
Three implementations:

- :class:`InProcessEvaluator`: in this process. Fast, for tests and CPU runs; a candidate that
  hangs or kills the process takes the tuning with it.
- :class:`PoolEvaluator` over :class:`~.session.MeasureSession`: the same path in worker
  processes (:mod:`.pool`), a time limit per phase; a hang or a crash becomes that trial's
  outcome, the worker is replaced, the sweep goes on. The default wherever a device measures.
- :class:`~.estimate.EstimateEvaluator`: the TPU compiler's cycle estimate, in workers.

Every implementation measures each program once: a candidate whose lowered program has the
fingerprint of one already evaluated (here or in a resumed study, see :meth:`Evaluator.learn`)
is recorded with ``duplicate_of`` and that trial's outcome, at no device time. With a
:class:`SharedPrograms` (:meth:`Evaluator.share`: the tuning loop's stored study), a program
evaluated or being evaluated by another worker on the same study counts too.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol

from pallas_tune.measure.records import Outcome, TrialRecord

__all__ = ["Evaluator", "InProcessEvaluator", "PoolEvaluator", "SharedPrograms"]

Candidates = Sequence[tuple[int, Mapping[str, Any]]]


class SharedPrograms(Protocol):
    """The programs of a study shared by several workers (implemented by the tuning loop)."""

    def claim(self, fingerprint: str, number: int, *, wait: bool) -> TrialRecord | None:
        """None when trial ``number`` is to evaluate ``fingerprint`` (no other worker's trial
        holds it); else the record of the trial elsewhere that evaluated it. ``wait``: while
        another worker's trial is evaluating it, wait for its outcome (else evaluate it here:
        the caller holds unevaluated programs of its own, which that worker may be waiting
        for)."""


class Evaluator(abc.ABC):
    """Turns ``(trial number, config)`` candidates into :class:`TrialRecord`\\ s.

    Contract: call :meth:`start` once, then :meth:`evaluate` any number of times from one
    thread, then :meth:`close` (or use it as a context manager). :meth:`evaluate` returns one
    record per candidate, in order, and never raises for a candidate's failure; it raises only
    for what no candidate can fix (a worker that cannot start, a broken compiler setup).
    Implementations provide :meth:`_evaluate` and call :meth:`_note` after each record, so the
    slow cut-off sees the best time as soon as it improves.
    """

    kind: ClassVar[str] = ""
    parallelism: int = 1  # Candidates worth evaluating at once.

    def __init__(self) -> None:
        self.device: dict[str, Any] = {}  # What the session reported: chip, platform, ...
        self.best_ms = math.inf  # Best median of an ``ok`` trial so far.
        self._programs: dict[str, int] = {}  # Fingerprint -> the trial that evaluated it.
        self._claimed: dict[int, str] = {}  # Trial number -> the fingerprint it claimed.
        self._done: dict[int, TrialRecord] = {}
        self._open: set[int] = set()  # Trials that claimed a program and have no record yet.
        self._shared: SharedPrograms | None = None
        self._elsewhere = 0  # Programs another worker evaluated (keys -2, -3, ... of _done).

    def share(self, programs: SharedPrograms | None) -> None:
        """Checks each new program against ``programs`` too (other workers on one study)."""
        self._shared = programs

    @abc.abstractmethod
    def start(self) -> dict[str, Any]:
        """Prepares the session (inputs, reference); returns :attr:`device`."""

    def evaluate(self, candidates: Candidates) -> list[TrialRecord]:
        """One record per candidate; duplicates of evaluated programs carry ``duplicate_of``."""
        records = self._evaluate(list(candidates))
        return [self._resolve(r) if r.duplicate_of is not None else r for r in records]

    @abc.abstractmethod
    def _evaluate(self, candidates: Candidates) -> list[TrialRecord]:
        ...

    def learn(self, records: Sequence[TrialRecord]) -> None:
        """Takes evaluated trials from elsewhere (a resumed study), so their programs are not
        evaluated again."""
        for r in records:
            if r.fingerprint and r.duplicate_of is None and r.fingerprint not in self._programs:
                self._programs[r.fingerprint] = r.number
                self._note(r)

    def rerank(self, configs: Sequence[Mapping[str, Any]], rounds: int, *,
               reference: bool = False) -> list[list[float]] | None:
        """The configs re-timed interleaved (ms per run), or None where this evaluator cannot
        (estimates) or re-timing failed. ``reference``: the kernel's reference too, last
        (absent from the result when the kernel has none)."""
        del configs, rounds, reference  # Unused.
        return None

    @abc.abstractmethod
    def roofline(self, configs: Sequence[Mapping[str, Any]], chip: str) -> list[float | None]:
        """The roofline model's time (s) of each config, None where it breaks the block rules
        or cannot be traced."""

    def one_scale(self, records: Sequence[TrialRecord]
                  ) -> tuple[list[TrialRecord], dict[str, Any]]:
        """After the search: the records whose figure is put on the run's one scale (or
        ranked apart), and what the figures are (see measure.unprofiled.one_scale). Measured
        figures are one scale already: nothing changes."""
        del records  # Unused.
        return [], {}

    def close(self) -> None:
        """Releases workers and their resources."""

    def __enter__(self) -> Evaluator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- bookkeeping shared by the implementations --------------------------------------

    def _answer(self, question: Any) -> Any:
        """Answers a session's question: ``("claim", fingerprint, number)`` returns the trial
        that evaluated that program, or None (and the program is this trial's now)."""
        kind, fingerprint, number = question
        assert kind == "claim", question
        if fingerprint in self._programs:
            return self._programs[fingerprint]
        if self._shared is not None:
            held = self._shared.claim(fingerprint, number, wait=not self._open)
            if held is not None:  # Another worker's trial: kept under a number of its own.
                key = -2 - self._elsewhere
                self._elsewhere += 1
                self._done[key] = held
                self._programs[fingerprint] = key
                return key
        self._programs[fingerprint] = number
        self._claimed[number] = fingerprint
        self._open.add(number)
        return None

    def _note(self, record: TrialRecord) -> None:
        self._open.discard(record.number)
        if record.duplicate_of is None:
            self._done[record.number] = record
            if record.outcome is Outcome.OK:
                self.best_ms = min(self.best_ms, record.median_ms)

    def _resolve(self, dup: TrialRecord) -> TrialRecord:
        original = self._done.get(dup.duplicate_of)  # type: ignore[arg-type]
        if original is None:  # Cannot happen: a program is claimed by a trial that ends.
            return dataclasses.replace(dup, outcome=Outcome.RUNTIME_ERROR,
                                       error=f"duplicate of trial {dup.duplicate_of}, unknown")
        return dataclasses.replace(
            original, number=dup.number, config=dup.config, duplicate_of=original.number,
            fingerprint=dup.fingerprint, phase=dup.phase, seconds=dup.seconds)


class InProcessEvaluator(Evaluator):
    """Evaluates in this process, with no time limits (see the module docstring).

    ``compile_workers`` > 1 compiles a batch in that many threads, then runs the candidates
    one at a time."""

    kind = "in-process"

    def __init__(self, session: Any, *, compile_workers: int = 1):
        super().__init__()
        self.session = session
        self.compile_workers = max(1, compile_workers)
        self._reference_tried = False

    @property
    def parallelism(self) -> int:
        return self.compile_workers

    def start(self) -> dict[str, Any]:
        self.device = self.session.info()
        return self.device

    def _evaluate(self, candidates: Candidates) -> list[TrialRecord]:
        from pallas_tune.measure.pool import Channel

        if self.session.reference is None and not self._reference_tried:
            self._reference_tried = True
            self.session.compute_reference()
        channel = Channel(answer=self._answer)
        if self.compile_workers == 1 or len(candidates) == 1:
            out = []
            for number, config in candidates:
                record, _ = self.session.evaluate(number, config, self.best_ms, channel)
                self._note(record)
                out.append(record)
            return out
        import concurrent.futures

        from pallas_tune.measure.candidate import Prepared

        prepared = [self.session.prepare(n, c, channel) for n, c in candidates]
        todo = [p for p in prepared if isinstance(p, Prepared)]
        with concurrent.futures.ThreadPoolExecutor(self.compile_workers) as threads:
            list(threads.map(self.session.compile, todo))
        out = []
        for p in prepared:
            record = self.session.run(p, self.best_ms, channel)[0] if isinstance(p, Prepared) \
                else p
            self._note(record)
            out.append(record)
        return out

    def rerank(self, configs: Sequence[Mapping[str, Any]], rounds: int, *,
               reference: bool = False) -> list[list[float]] | None:
        return self.session.rerank(configs, rounds, reference=reference)

    def roofline(self, configs: Sequence[Mapping[str, Any]], chip: str) -> list[float | None]:
        return [self.session.roofline(c, chip) for c in configs]


class PoolEvaluator(Evaluator):
    """Evaluates in worker processes hosting a session (:mod:`.pool`): the isolated evaluator.

    ``reference``: compute the kernel's reference output in a worker at start (once; it is
    handed to every later worker). Without one, the first good output becomes the reference."""

    kind = "workers"

    def __init__(self, pool: Any, *, reference: bool = True):
        super().__init__()
        self.pool = pool
        self._want_reference = reference

    @property
    def parallelism(self) -> int:
        return self.pool.size

    def start(self) -> dict[str, Any]:
        from pallas_tune.errors import MeasurementError
        from pallas_tune.measure.pool import WorkerStartError

        try:
            self.device = self.pool.start()
        except WorkerStartError as e:
            raise MeasurementError(f"a worker process could not start: {e}") from None
        return self.device

    def _reference(self) -> None:
        from pallas_tune.errors import MeasurementError

        self._want_reference = False
        reply = self.pool.call("compute_reference", phase="run")
        if reply.kind != "done":
            raise MeasurementError(f"the kernel's reference= failed in the worker ({reply.kind} "
                                   f"in {reply.phase}): {reply.message}")
        if reply.value is not None:
            self.pool.remember("set_reference", reply.value)

    def _evaluate(self, candidates: Candidates) -> list[TrialRecord]:
        if self._want_reference:
            self._reference()
        if self.pool.size == 1:  # One at a time, each with the best time so far.
            return [self._record(n, c, self.pool.call("evaluate", n, c, self.best_ms,
                                                      phase="trace", answer=self._answer))
                    for n, c in candidates]
        calls = [("evaluate", (n, c, self.best_ms), "trace") for n, c in candidates]
        replies = self.pool.map(calls, answer=self._answer)
        return [self._record(n, c, r) for (n, c), r in zip(candidates, replies, strict=True)]

    def _record(self, number: int, config: Mapping[str, Any], reply: Any) -> TrialRecord:
        if reply.kind == "done":
            record, adopted = reply.value
            if adopted is not None:
                self.pool.remember("set_reference", adopted)
        else:
            record = failed_record(number, config, reply, self._claimed.get(number))
        self._note(record)
        return record

    def rerank(self, configs: Sequence[Mapping[str, Any]], rounds: int, *,
               reference: bool = False) -> list[list[float]] | None:
        reply = self.pool.call("rerank", [dict(c) for c in configs], rounds, reference,
                               phase="compile")
        return reply.value if reply.kind == "done" else None

    def roofline(self, configs: Sequence[Mapping[str, Any]], chip: str) -> list[float | None]:
        replies = self.pool.map([("roofline", (dict(c), chip), "trace") for c in configs])
        return [r.value if r.kind == "done" else None for r in replies]

    def close(self) -> None:
        self.pool.close()


def failed_record(number: int, config: Mapping[str, Any], reply: Any,
                  fingerprint: str | None) -> TrialRecord:
    """The record of a candidate whose worker timed out, died, or whose session raised."""
    ran = reply.phase == "run"
    if reply.kind == "timeout":
        outcome, detail = Outcome.TIMEOUT, f"timeout_{reply.phase}"
    elif reply.kind == "crashed":
        outcome = Outcome.RUNTIME_ERROR if ran else Outcome.COMPILE_ERROR
        detail = "worker_crashed"
    else:
        outcome = Outcome.RUNTIME_ERROR if ran else Outcome.COMPILE_ERROR
        detail = "evaluator_error"
    return TrialRecord(number=number, config=dict(config), outcome=outcome, error=reply.message,
                       detail=detail, phase=reply.phase, seconds=reply.seconds,
                       fingerprint=fingerprint)


def host_platform() -> tuple[str, bool]:
    """(the platform JAX measures on here, whether this process has initialised it), found
    without initialising any backend: a process that holds a TPU keeps workers off it.

    Order: an initialised backend; ``JAX_PLATFORMS``; an installed TPU or CUDA plugin with a
    device node present; else the CPU."""
    import glob
    import importlib.util
    import os

    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            return jax.default_backend(), True
    except (ImportError, AttributeError):
        pass
    wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if wanted:
        return ("gpu" if wanted in ("cuda", "rocm") else wanted), False
    def installed(module: str) -> bool:
        try:  # find_spec("a.b") imports "a", and raises when there is no "a".
            return importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            return False

    if installed("libtpu") and (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")):
        return "tpu", False
    cuda = any(installed(m)
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12"))
    if cuda and glob.glob("/dev/nvidia[0-9]*"):
        return "gpu", False
    return "cpu", False
