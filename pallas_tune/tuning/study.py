"""The Optuna side of a tuning run: the study, its sampler, warm starts, resumed trials.

Parameters are stored with their real values (``bm: 512``, not a choice index), so
``study.best_params``, Optuna's plots and optuna-dashboard read naturally. Choices Optuna
cannot store (tuples such as ``("parallel", "parallel", "arbitrary")``) are stored as readable
strings that map back one to one; parameters with a single choice are study user attributes.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final

from pallas_tune.errors import SearchSpaceError
from pallas_tune.measure.records import Measurement, Outcome, TrialRecord

__all__ = ["GP_MAX_CANDIDATES", "ParamCodec", "Search", "quiet_optuna", "stored_record",
           "study_name"]

# Spaces up to this size are searched by the GP over every candidate; larger ones by TPE.
GP_MAX_CANDIDATES: Final = 50_000
_PLAIN: Final = (bool, int, float, str)


def study_name(kernel: Any, chip: str, key: str, space: Any = None) -> str:
    """The stored study of (kernel, chip, key) when no ``study_name`` is given. It names the
    kernel's code fingerprint when known, so that a run on changed kernel code starts a study
    of its own instead of resuming trials measured on the old code (their values would be told
    again, not measured); and, when the call's space of effective configs is smaller than the
    kernel's (``space``), a digest of its choices (an Optuna study keeps its distributions)."""
    fingerprint = getattr(kernel, "fingerprint", None)
    name = f"{kernel.name}|{chip}|{key}"
    name = f"{name}|kernel={fingerprint}" if fingerprint else name
    if space is not None and space is not getattr(kernel, "space", space):
        import hashlib

        text = repr([(p.name, p.choices) for p in space.params]).encode()
        name += f"|space={hashlib.sha256(text).hexdigest()[:8]}"
    return name


class ParamCodec:
    """Configs to Optuna parameters and back, keeping the real values."""

    def __init__(self, space: Any):
        self.space = space
        self._to: dict[str, dict[Any, Any]] = {}
        self._from: dict[str, dict[Any, Any]] = {}
        for p in space.params:
            if len(p.choices) == 1:
                continue
            encoded = [_plain(v) for v in p.choices]
            if len({(type(e), e) for e in encoded}) != len(encoded):  # Two texts alike.
                encoded = [f"{i}: {e}" for i, e in enumerate(encoded)]
            self._to[p.name] = dict(zip(p.choices, encoded, strict=True))
            self._from[p.name] = dict(zip(encoded, p.choices, strict=True))

    @property
    def distributions(self) -> dict[str, Any]:
        """The Optuna distribution of each parameter with several choices."""
        from optuna.distributions import CategoricalDistribution

        return {n: CategoricalDistribution(list(enc.values())) for n, enc in self._to.items()}

    @property
    def constants(self) -> dict[str, Any]:
        """Parameters with a single choice (not Optuna parameters), JSON-friendly."""
        return {p.name: _plain(p.choices[0]) for p in self.space.params if len(p.choices) == 1}

    def encode(self, config: Mapping[str, Any]) -> dict[str, Any]:
        return {n: enc[config[n]] for n, enc in self._to.items()}

    def decode(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The config of a trial's params (KeyError if they are not of this space)."""
        return {p.name: self._from[p.name][params[p.name]] if p.name in self._from
                else p.choices[0] for p in self.space.params}

    def suggest(self, trial: Any) -> dict[str, Any]:
        return self.decode({n: trial.suggest_categorical(n, list(enc.values()))
                            for n, enc in self._to.items()})


def _plain(v: Any) -> Any:
    if v is None or isinstance(v, _PLAIN):
        return v
    if isinstance(v, tuple):
        return "(" + ", ".join(str(_plain(x)) for x in v) + ")"
    return repr(v)


@contextlib.contextmanager
def quiet_optuna() -> Iterator[None]:
    """Optuna's own INFO lines (one per trial) off while our loop runs; restored after."""
    import optuna

    before = optuna.logging.get_verbosity()
    if before < optuna.logging.WARNING:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(before)


class Search:
    """Asks configs of an Optuna study and tells it the outcomes."""

    def __init__(self, study: Any, codec: ParamCodec, *, strategy: str):
        self.study = study
        self.codec = codec
        self.strategy = strategy
        self._seen: set[int] = set()  # Study trial numbers already imported or told.
        # The study's finished trials, each read once (see _refresh):
        self._scan_from = 0  # Every trial numbered below was finished at the last read.
        self._read: set[int] = set()  # Finished trials read (numbers).
        self._unadopted: list[tuple[dict[str, Any], TrialRecord]] = []  # For finished().
        self._timed: list[int] = []  # COMPLETE trials that timed a program, sorted.
        self.programs: dict[str, TrialRecord] = {}  # Fingerprint -> the trial that timed it.
        self.examined = 0  # Trials our reads went through (the work per trial stays flat).
        self._active: dict[int, Any] = {}  # Our RUNNING trials, by trial id.
        self._heartbeat: Any = None
        self._run: str | None = None  # This run's token in its trials' owner tag (storage).

    @classmethod
    def open(cls, space: Any, *, name: str, storage: Any, sampler: str, seed: int | None,
             trials: int, warm: Sequence[Mapping[str, Any]], prior: Any = None) -> Search:
        """A new (or resumed, with ``storage``) study over ``space``. When the space has no
        more points than ``trials`` every point is enqueued (exhaustive); else the ``warm``
        configs are, in order, and the sampler proposes the rest."""
        import optuna

        from pallas_tune.tuning import storage as _storage

        codec = ParamCodec(space)
        exhaustive = space.size <= trials
        strategy = ("exhaustive" if exhaustive else
                    sampler if space.size <= GP_MAX_CANDIDATES else "tpe")
        chosen = _sampler(space, codec, strategy, seed, trials, prior)
        if storage is None:
            study, created = optuna.create_study(direction="minimize", sampler=chosen), True
        else:
            study, created = _storage.load_or_create(_storage.open_storage(storage), name,
                                                     sampler=chosen)
        search = cls(study, codec, strategy=strategy)
        if created:
            study.set_user_attr("constant_params", codec.constants)
            _name_metric(study)
        else:
            _storage.fail_dead(study)  # A resume after kill -9: this host's dead trials.
        if created or not search.running():  # Loaders top up a queue only when nobody runs.
            fresh = not any(t.state.is_finished() for t in study.trials)
            queue = space.ordered_candidates() if exhaustive else (warm if fresh else ())
            for config in queue:
                study.enqueue_trial(codec.encode(config), skip_if_exists=not created)
        search._heartbeat = _storage.Heartbeat(study._storage, lambda: list(search._active))
        search._run = _storage.open_run()
        return search

    @property
    def shared(self) -> bool:
        """Whether the study is in a storage other workers may share (not in memory)."""
        return self.study._storage.__class__.__name__ != "InMemoryStorage"

    def running(self) -> list[Any]:
        """The study's RUNNING trials (of any worker)."""
        from optuna.trial import TrialState

        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        self.examined += len(running)
        return running

    def pending_elsewhere(self) -> int:
        """Trials other workers are evaluating now (dead workers' trials failed first)."""
        if not self.shared:
            return 0
        from pallas_tune.tuning import storage as _storage

        _storage.fail_dead(self.study)
        mine = {t.number for t in self._active.values()}
        return sum(t.number not in mine for t in self.running())

    def finished(self) -> list[tuple[dict[str, Any], TrialRecord]]:
        """Finished trials not seen before (a resumed study; other hosts sharing it), as
        (config, record) with the outcome, median and fingerprint they stored."""
        self._refresh()
        out, self._unadopted = self._unadopted, []
        return out

    def timed_program(self, fingerprint: str) -> TrialRecord | None:
        """The record of the COMPLETE trial (of any worker) that timed this program, if any."""
        self._refresh()
        return self.programs.get(fingerprint)

    def _refresh(self) -> None:
        """Reads the trials finished since the last read, each once. Optuna lists a study's
        trials by number, so a read starts at the first trial that was unfinished at the last
        one: a trial costs the same to read at the 300th as at the first."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        start = self._scan_from if trials and trials[-1].number == len(trials) - 1 else 0
        first_open = None
        for t in trials[start:]:
            self.examined += 1
            if not t.state.is_finished():
                first_open = t.number if first_open is None else first_open
                continue
            if t.number in self._read:
                continue
            self._read.add(t.number)
            if t.state == TrialState.COMPLETE or (t.state == TrialState.FAIL
                                                  and "outcome" in t.user_attrs):
                self._complete(t)  # A FAIL with an outcome is a told failure, not released.
        self._scan_from = len(trials) if first_open is None else first_open

    def _complete(self, t: Any) -> None:
        attrs = t.user_attrs
        timed = ("worker" in attrs and not attrs.get("duplicate") and t.value is not None
                 and math.isfinite(t.value))
        if timed:
            bisect.insort(self._timed, t.number)
        theirs = t.number not in self._seen
        if not (theirs or timed):
            return
        self._seen.add(t.number)
        try:
            config = self.codec.decode(t.params)
        except KeyError:
            return  # Not a point of this space (an older version of it).
        record = stored_record(t, config)
        if theirs:
            self._unadopted.append((config, record))
        if attrs.get("fingerprint") and not attrs.get("duplicate"):
            self.programs.setdefault(attrs["fingerprint"], record)

    def ask(self, n: int, *, budget: int | None = None
            ) -> tuple[list[tuple[Any, dict[str, Any]]], int]:
        """Up to ``n`` new trials and their configs, each asked after the previous one
        suggested (so the sampler sees the earlier ones as pending), and how many were given
        up because another worker runs the same config (see :mod:`.storage`: claims) or
        because ``budget`` timed trials are done or running ahead of it in the study."""
        import warnings

        from pallas_tune.tuning import storage as _storage

        asked, backed_off = [], 0
        for _ in range(n):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna: heartbeats outside optimize().
                trial = self.study.ask()
            self._active[trial._trial_id] = trial
            self._heartbeat.beat(trial._trial_id)
            try:
                trial.storage.set_trial_system_attr(trial._trial_id, _storage.OWNER_ATTR,
                                                    _storage.owner(self._run))
                config = self.codec.suggest(trial)
            except ValueError as e:  # Optuna: a stored study with other distributions.
                self._drop(trial)
                raise SearchSpaceError(
                    f"the stored study {self.study.study_name!r} was made for another search "
                    f"space ({e}); pass another study_name= or storage=.") from None
            if self._claimed_elsewhere(trial) or (budget is not None and
                                                  self._ahead(trial) >= budget):
                self._drop(trial, pruned=True)
                backed_off += 1
                continue
            asked.append((trial, config))
        return asked, backed_off

    def _claimed_elsewhere(self, trial: Any) -> bool:
        """Whether another worker's RUNNING trial holds the same params (read after ours were
        written, so of two simultaneous claims at least one sees the other)."""
        if not self.shared:
            return False
        params = trial.params
        for t in self.running():
            if t.number != trial.number and (
                    t.params or t.system_attrs.get("fixed_params")) == params:
                return True
        return False

    def _ahead(self, trial: Any) -> int:
        """Trials before this one in the study that are timed or running (the study's
        ``trials`` budget is shared: of workers that ask at once, the later ones wait)."""
        if not self.shared:
            return 0
        self._refresh()
        return bisect.bisect_left(self._timed, trial.number) + sum(
            t.number < trial.number for t in self.running())

    def _drop(self, trial: Any, *, pruned: bool = False) -> None:
        from optuna.trial import TrialState

        self._active.pop(trial._trial_id, None)
        if pruned:
            trial.set_user_attr("backed_off", True)
        self.study.tell(trial, state=TrialState.PRUNED if pruned else TrialState.FAIL,
                        skip_if_finished=True)

    def release(self) -> None:
        """Gives back the trials this worker holds (an interrupt, an error): failed, and
        their params queued again so that any worker (or the resumed run) takes them."""
        from pallas_tune.tuning import storage as _storage

        for trial in list(self._active.values()):
            try:
                self._drop(trial)
                if self.shared:
                    _storage._retry()(self.study, self.study._storage.get_trial(
                        trial._trial_id))
            except Exception:  # noqa: BLE001  Best effort: heartbeats expire otherwise.
                pass
        self.close()

    def close(self) -> None:
        heartbeat = getattr(self, "_heartbeat", None)
        if heartbeat is not None:
            heartbeat.close()
        from pallas_tune.tuning import storage as _storage

        _storage.close_run(self._run)  # Its trials still RUNNING are dead from now on.

    def tell(self, trial: Any, record: TrialRecord, *, new: bool) -> None:
        """Tells the study a trial's value: the median for a timed one (``slow`` included, at
        the median seen). A candidate that did not run (infeasible, failed) is a FAIL trial,
        as Optuna's plots and optuna-dashboard expect, its outcome and error in its user
        attributes (our GP sampler reads FAIL as the worst value); under TPE, which ignores
        FAIL trials and would keep proposing there, it is told +inf instead. ``new``: the
        record was made for this trial (not a config known before), so its details are
        stored with it."""
        attrs: dict[str, Any] = {"outcome": record.outcome.value}
        if new:
            from pallas_tune.tuning.storage import owner

            attrs.update(worker=owner(), duplicate=record.duplicate_of is not None or None,
                         fingerprint=record.fingerprint, error=record.error[:1000],
                         detail=record.detail)
            if record.measurement is not None:
                attrs["timer"] = record.measurement.timer
        for k, v in attrs.items():
            if v not in (None, ""):
                trial.set_user_attr(k, v)
        self._seen.add(trial.number)
        self._active.pop(trial._trial_id, None)
        if record.outcome.timed:
            self.study.tell(trial, record.median_ms)
        elif self.strategy == "tpe":
            self.study.tell(trial, math.inf)
        else:
            from optuna.trial import TrialState

            self.study.tell(trial, state=TrialState.FAIL)


def _name_metric(study: Any) -> None:
    """Names the objective for Optuna's plots and optuna-dashboard ("median_ms", not
    "Objective Value")."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ExperimentalWarning on some Optuna versions.
        try:
            study.set_metric_names(["median_ms"])
        except (AttributeError, NotImplementedError):  # Optuna without metric names.
            pass


def stored_record(t: Any, config: dict[str, Any]) -> TrialRecord:
    attrs = t.user_attrs
    try:
        outcome = Outcome(attrs.get("outcome", "ok" if t.value is not None else
                                    "runtime_error"))
    except ValueError:
        outcome = Outcome.RUNTIME_ERROR
    m = None
    if outcome.timed and t.value is not None and math.isfinite(t.value):
        m = Measurement(times_ms=(float(t.value),), compile_ms=math.nan,
                        timer=attrs.get("timer", "wallclock"))
    return TrialRecord(number=-1, config=config, outcome=outcome, measurement=m,
                       error=(attrs.get("error", "") + " (from the stored study)").strip(),
                       detail=attrs.get("detail", ""), fingerprint=attrs.get("fingerprint"),
                       # Another trial's program: no device time (-1: not a number here).
                       duplicate_of=-1 if attrs.get("duplicate") else None)


def _sampler(space: Any, codec: ParamCodec, strategy: str, seed: int | None, trials: int,
             prior: Any = None) -> Any:
    """``gp``: :class:`pallas_tune.search.gp.CandidateSampler` (a GP's expected improvement
    over every candidate, its mean from ``prior``, a :class:`~pallas_tune.search.prior.Prior`
    over the parameters with several choices, where given); ``tpe``: multivariate TPE with constant liar; ``exhaustive``: every
    point is enqueued, so the sampler is never consulted. All see running trials as pending."""
    import optuna

    if strategy == "exhaustive":
        return optuna.samplers.RandomSampler(seed=seed)
    if strategy == "gp":
        from pallas_tune.constraints import config_admits
        from pallas_tune.search.gp import CandidateSampler

        # Not the points a rule between parameters refuses (they would only fail as trials).
        configs = [c for c in space if config_admits(space.constraints, c)] or list(space)
        scores = None
        if prior is not None:  # Scored on the real values, aligned with the candidates.
            names = list(codec.distributions)
            scores = prior.scores([tuple(c[n] for n in names) for c in configs],
                                  [space[n].choices for n in names])
        return CandidateSampler([codec.encode(c) for c in configs], codec.distributions,
                                seed=seed, prior=scores, budget=trials)
    return optuna.samplers.TPESampler(
        seed=seed, multivariate=True, group=False, constant_liar=True,
        n_startup_trials=max(1, min(5, trials // 5)))
