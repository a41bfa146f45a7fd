"""The tuning loop: ask → skip what is known → evaluate → tell → record.

Never imported on the dispatch path; :meth:`TunableKernel.tune` imports it on first use. The
parts: :mod:`.options` (what a run may be told), :mod:`.plan` (the chip, the evaluator),
:mod:`.study` (Optuna), :mod:`.log` (the trials and the stop rules), :mod:`.finish` (the
re-ranking, the result, the cache), and :mod:`pallas_tune.measure` below them all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from pallas_tune.measure.evaluate import Evaluator
from pallas_tune.measure.pool import importing_main_script
from pallas_tune.measure.records import Outcome, TrialRecord
from pallas_tune.tuning import finish, footing, grad
from pallas_tune.tuning.callspace import call_space, fold_for, folded_note
from pallas_tune.tuning.log import TrialLog, config_key
from pallas_tune.tuning.options import TuneOptions
from pallas_tune.tuning.plan import make_plan, open_evaluator, settle_chip
from pallas_tune.tuning.programs import ProgramClaims
from pallas_tune.tuning.result import TuningResult
from pallas_tune.tuning.study import Search, quiet_optuna, study_name
from pallas_tune.tuning.warm import own_configs, queue, warm_start_configs

__all__ = ["run", "tune", "warm_start_configs"]

# The stand-in check estimates at most this many candidates' stand-in scales.
STANDIN_SCAN = 512
WAIT_S = 0.5  # Poll interval while other workers finish the study's last trials.
FAIL_FAST = 5  # Stop when this many first candidates all failed with one same error.
FAIL_FAST_TRACE = 2  # ... or this many, where each failed while being traced (no compile).


def tune(kernel: Any, *args: Any, options: TuneOptions | None = None, **kwargs: Any
         ) -> TuningResult:
    """Searches ``kernel``'s space for a call with these arguments; caches the winner.

    Arguments may be arrays or ``jax.ShapeDtypeStruct``\\ s (inputs are then made for them).
    Keywords that name a :class:`TuneOptions` field are tuning options (unless ``options`` is
    given: then every keyword goes to the kernel); the rest are the kernel's static arguments.

    Example::

        result = pallas_tune.tune(matmul, x, y, trials=32)
        result.best, result.best_ms, result.trials, result.study
        result = pallas_tune.tune(matmul, x, y, trials=32, grad=True)  # and its backward
        result.backward.best
    """
    if options is None:
        options = TuneOptions.build(**{k: kwargs.pop(k) for k in TuneOptions.names()
                                       if k in kwargs})
    _check_kernel_kwargs(kernel, kwargs)
    if options.grad:  # Training: the forward, then its backward kernel (tuning.grad).
        grad.check_grad(kernel)
        return grad.tune_backward(kernel, args, kwargs, options,
                                  run(kernel, args, kwargs, options), run)
    result = run(kernel, args, kwargs, options)
    backend = getattr(kernel, "backward_backend", None)
    return dataclasses.replace(result, backward_backend=backend) if backend else result


def _check_kernel_kwargs(kernel: Any, kwargs: Mapping[str, Any]) -> None:
    """A keyword that is neither an option nor the kernel's own is a typo: say so now."""
    import inspect

    try:
        params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        TuneOptions.build(**dict.fromkeys(unknown))  # Raises, naming close option names.


def run(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any], options: TuneOptions, *,
        evaluator: Evaluator | None = None) -> TuningResult:
    """One tuning run, top to bottom (see the module docstring). ``evaluator``: evaluate with
    this one (started here) instead of the one the options call for, e.g. a fake in tests."""
    _refuse_recursion(kernel)
    plan = make_plan(kernel, args, kwargs, options)
    evaluator = open_evaluator(plan, options) if evaluator is None else _started(evaluator)
    with evaluator, quiet_optuna(), _full_disk(options):
        chip = settle_chip(plan, evaluator.device)
        if options.write:  # Before the first candidate: an unwritable cache costs no time.
            kernel.cache.check_writable(chip, kernel.name, kind=plan.kind)
        space, dims = call_space(kernel, args, kwargs)
        space, held = fold_for(space, evaluator.device, plan.estimating)
        extra = _prepare(evaluator, space, options)
        if options.confirm_top:  # The estimate's best K, measured: nothing else.
            warm, options = _confirm(kernel, space, chip, plan, options, extra)
        else:
            warm = _warm(evaluator, kernel, space, args, kwargs, chip, plan.key, options,
                         held)
        name = options.study_name or study_name(kernel, chip, plan.key, space)
        prior = _prior(kernel, space, chip, plan, options, extra)
        search = Search.open(space, name=name, storage=options.storage,
                             sampler=options.sampler, seed=options.seed, trials=options.trials,
                             warm=warm, prior=prior)
        log = TrialLog(options, space.size)
        claims = ProgramClaims(search) if search.shared else None
        evaluator.share(claims)  # Programs other workers on the study evaluate count too.
        try:
            _search_loop(search, log, evaluator, kernel, args, kwargs, claims)
        except BaseException:
            search.release()  # Ctrl-C, a crash: our running trials go back to the queue.
            raise
        search.close()
        changed, extra["figures"] = evaluator.one_scale(log.records)
        log.rescale(changed)  # One scale for every ranked figure (issue 55).
        if log.stopped and space.size > options.trials:  # The sampler's run ended early.
            finish.logger.warning("%s %s: %s", kernel.name, plan.key, log.stopped)
        xla = finish.xla_wanted(kernel, options, plan, evaluator.device)
        ranking = finish.rerank(evaluator, log, options, finish.default_config(space),
                                xla=xla and not plan.estimating)
        if xla and plan.estimating and log.best() is not None:  # Estimated once: no noise.
            extra["xla_estimate"] = finish.xla_estimate(evaluator, chip)
            extra["xla_estimate"]["floor_ms"] = footing.data_floor_ms(kernel, args, kwargs, chip)
        extra.update(strategy=search.strategy, evaluator=evaluator.kind, space=space,
                     dims=dims, **({"not_searched": folded_note(held)} if held else {}))
        result = finish.build_result(kernel, plan, chip, log, ranking, options=options,
                                     device=evaluator.device, study=search.study, extra=extra)
    if not options.write:
        return result
    with _full_disk(options, result):
        return finish.write(kernel, result)


@contextlib.contextmanager
def _full_disk(options: TuneOptions, result: TuningResult | None = None) -> Iterator[None]:
    """A full disk (a winners file, a ledger, the study's SQLite file) as one clear error,
    saying where the finished trials are; ``result``: the finished tune whose entry could not
    be written (kept on the error)."""
    from pallas_tune.errors import DiskFullError, is_disk_full

    try:
        yield
    except DiskFullError:
        raise
    except Exception as e:
        if not is_disk_full(e):
            raise
        if options.storage:
            kept = (f"every trial told before is kept in the study storage "
                    f"{_redacted(options.storage)}, and the same tune resumes from it")
        else:
            kept = ("this tune had no study storage, so its trials are not kept (with "
                    "storage=..., as pallas-tune sweep has by default, they are)")
        done = "" if result is None else (
            f"the tune finished (best {result.best}, {result.best_ms:.4g} ms) but its cache "
            "entry was not written: the result is this error's .result; ")
        raise DiskFullError(
            f"the disk is full ({_first_line(e)}): {done}{kept}. Free space (or point "
            "PALLAS_TUNE_CACHE_DIR, PALLAS_TUNE_TPU_LOGS or the storage elsewhere) and run it "
            "again.", result=result) from e


def _redacted(url: str) -> str:
    """A storage URL without its password."""
    import re

    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", url)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300]}" if text else type(e).__name__


def _search_loop(search: Search, log: TrialLog, evaluator: Evaluator, kernel: Any,
                 args: Sequence[Any], kwargs: Mapping[str, Any],
                 claims: ProgramClaims | None = None) -> None:
    """Ask, skip what is known, evaluate, tell, until the study has its ``trials`` (other
    workers' finished and running trials count: ``trials`` is the study's total)."""
    evaluator.learn(log.adopt(search.finished()))
    while True:
        pending = search.pending_elsewhere()
        if not log.wants_more(pending):
            if pending and log.wants_more(0):  # Others hold what is left: wait for them.
                time.sleep(WAIT_S)
                evaluator.learn(log.adopt(search.finished()))
                continue
            return
        asked, backed_off = search.ask(log.batch(evaluator.parallelism, pending),  # ask
                                       budget=log.options.trials)
        log.asked += len(asked) + backed_off
        evaluator.learn(log.adopt(search.finished()))  # What finished while we asked.
        fresh = log.fresh([config for _, config in asked])                  # skip known
        fresh = _declared(kernel, log, fresh, args, kwargs)                 # constraints
        if claims is not None:  # Their programs are claimed on these trials.
            trials = {config_key(config): trial for trial, config in asked}
            for number, config in fresh:
                claims.bind(number, trials[config_key(config)])
        try:
            for record in evaluator.evaluate(fresh):                        # evaluate
                log.add(record)                                             # record
        finally:  # Interrupted mid-batch: what was measured is still told (and saved).
            _tell(search, log, asked, {number for number, _ in fresh})      # tell
        evaluator.learn(log.adopt(search.finished()))  # Other hosts on the same study.
        _fail_fast(kernel, log)


def _fail_fast(kernel: Any, log: TrialLog) -> None:
    """Stops a run whose first ``FAIL_FAST`` candidates all failed with one and the same
    error: the call's arguments (a dtype the kernel refuses, say), not the configs, are then
    the problem, and the rest of the budget would fail the same way."""
    done = [r for r in log.records if r.duplicate_of is None]
    # Tracing is deterministic and spends no compile: the same error from two different
    # configs already says the arguments are at fault (a dtype the kernel refuses, say).
    traced = all((r.error or "").startswith("tracing failed") for r in done)
    if len(done) < (FAIL_FAST_TRACE if traced else FAIL_FAST) or any(r.outcome.timed
                                                                      for r in done):
        return
    errors = {(r.outcome, r.error) for r in done}
    if len(errors) != 1:
        return
    outcome, error = errors.pop()
    if not error:
        return
    from pallas_tune.errors import NoFeasibleConfigError

    raise NoFeasibleConfigError(
        f"{kernel.name}: the first {len(done)} candidates all failed the same way "
        f"({outcome.value}), so the call's arguments, not the configs, are the problem; "
        f"stopped before spending the rest of the budget. The error: {error.strip()[:2000]}")


def _tell(search: Search, log: TrialLog, asked: Sequence[tuple[Any, dict[str, Any]]],
          new: set[int]) -> None:
    """Tells the study each asked trial whose config has a record (all, after a whole batch)."""
    for trial, config in asked:
        record = log.by_config.get(config_key(config))
        if record is None:
            continue  # Not measured (an interrupt): released to the queue by the caller.
        search.tell(trial, record, new=record.number in new)
        new.discard(record.number)


def _declared(kernel: Any, log: TrialLog, fresh: list[tuple[int, dict[str, Any]]],
              args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[int, dict[str, Any]]]:
    """Records as infeasible the candidates the kernel's declared constraints refuse (the
    untraced part of its one validity check: no trace, no device); returns the others."""
    check = getattr(kernel, "declared_problems", None)
    if check is None:
        return fresh
    keep = []
    for number, config in fresh:
        problems = check(config, args, kwargs)
        if problems:
            log.add(TrialRecord(number=number, config=dict(config), outcome=Outcome.INFEASIBLE,
                                error="; ".join(problems), detail="constraint"))
        else:
            keep.append((number, config))
    return keep


def _started(evaluator: Evaluator) -> Evaluator:
    try:
        evaluator.start()
    except BaseException:
        evaluator.close()
        raise
    return evaluator


def _warm(evaluator: Any, kernel: Any, space: Any, args: Sequence[Any],
          kwargs: Mapping[str, Any], chip: str, key: str, options: TuneOptions,
          held: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The warm starts: the baseline, the caller's own configs, then the found ones (none
    needed when every point is evaluated anyway; see :func:`.warm.queue`); ``held``: the
    parameters not searched here (:func:`.callspace.fold_for`), at their one value."""
    given = own_configs(kernel, space, options.warm_configs, held)
    if space.size <= options.trials:
        return []
    found = (warm_start_configs(kernel, args, kwargs, chip, key, limit=options.warm_start,
                                rank=evaluator.roofline, space=space, held=held)
             if options.warm_start else [])
    return queue(kernel, space, given, found, options.trials)


def _confirm(kernel: Any, space: Any, chip: str, plan: Any, options: TuneOptions,
             extra: dict[str, Any]) -> tuple[list[dict[str, Any]], TuneOptions]:
    """``confirm_top``: the estimate's best configs for this chip and key as the only
    candidates (the options' budget cut to them), recorded in ``extra["confirmed"]``."""
    from pallas_tune.errors import TuneOptionError
    from pallas_tune.tuning.transfer import entry_shortlist, estimate_top

    if plan.estimating:
        raise TuneOptionError("confirm_top measures the estimate's best configs: give a "
                              "measuring timer (wallclock, profiler), not tpu-estimate.")
    # The estimate entry's shortlist where it keeps one; else the latest estimate run's trials.
    configs, estimates, source = (
        entry_shortlist(kernel, chip, plan.key, options.confirm_top, space, space.default)
        or estimate_top(kernel, chip, plan.key, options.confirm_top, space, space.default))
    if not configs:
        raise TuneOptionError(f"confirm_top={options.confirm_top}: no compiler estimates of "
                              f"{kernel.name} are recorded for {chip} at {plan.key}; "
                              + _confirm_hint(chip))
    extra["confirmed"] = {"from": source, "configs": configs, "estimate_ms": estimates}
    return configs, dataclasses.replace(options, trials=len(configs), warm_start=len(configs),
                                        transfer=False)


def _confirm_hint(chip: str) -> str:
    """How to get estimates to confirm: the same tune under the estimate timer for this TPU
    chip; on a host whose chip is not a TPU, there is nothing to confirm there."""
    from pallas_tune.chips import chip_spec

    try:
        tpu = chip_spec(chip).platform == "tpu"
    except ValueError:
        tpu = False
    if tpu:
        return (f"run the same tune with --timer tpu-estimate --chip {chip} first (or drop "
                "--confirm-top).")
    return (f"this host's chip is {chip!r}, not a TPU, so no TPU estimate is confirmed here: "
            "run the same tune with --timer tpu-estimate --chip v6e (or another TPU; any "
            "host can), then --confirm-top on a host with that TPU; or drop --confirm-top.")


def _prior(kernel: Any, space: Any, chip: str, plan: Any, options: TuneOptions,
           extra: dict[str, Any]) -> Any:
    """What the kernel measured at other shapes and chips (tuning.transfer), for the GP
    sampler; recorded in ``extra["prior"]`` for the provenance. None when ``transfer`` is off,
    the space is evaluated whole, or nothing was measured elsewhere."""
    if not options.transfer or space.size <= options.trials or options.sampler != "gp":
        return None
    from pallas_tune.tuning.transfer import prior_for

    names = [p.name for p in space.params if len(p.choices) > 1]
    prior, record = prior_for(kernel, chip, plan.key, names, kind=plan.kind,
                              defaults=space.default)
    if prior is not None:
        extra["prior"] = record
    return prior


def _prepare(evaluator: Any, space: Any, options: TuneOptions) -> dict[str, Any]:
    """Estimates only: whether to trust the kernel's stand-in (one candidate both ways)."""
    if options.timer != "tpu-estimate":
        return {}
    if not getattr(evaluator, "has_standin", False):
        return {"standin": False, "standin_check": {}}
    configs = list(itertools.islice(space.ordered_candidates(), STANDIN_SCAN))
    use, check = evaluator.check_standin(configs)
    return {"standin": use, "standin_check": check}


class UnguardedScriptError(RuntimeError):
    """Raised in a worker process that imports the parent's script and finds it tuning."""

    unguarded_script = True


def _refuse_recursion(kernel: Any) -> None:
    if importing_main_script():
        raise UnguardedScriptError(
            f"this script starts tuning {getattr(kernel, 'name', kernel)!r} when it is "
            "imported, and worker processes import it to find what it defines. Put the tuning "
            "under `if __name__ == \"__main__\":`, or define the kernel in an importable module.")


def _check(kernel: Any, config: Mapping[str, Any], args: Sequence[Any],
           kwargs: Mapping[str, Any], chip: str, stage: str, *, vreg_limit: float | None = None
           ) -> tuple[tuple[Any, str, str, int | None] | None, list[Any]]:
    """Screens one candidate in this process (the tests of the feasibility model use it).

    ``stage``: ``"off"`` (block rules only, as before), ``"model"`` or ``"compile"``. Returns
    ((outcome, error, detail, vmem bytes) or None, the traced pallas_calls)."""
    from pallas_tune.measure import candidate

    parts = candidate.KernelParts.of(kernel)
    full = {**kwargs, **config}
    try:
        from pallas_tune.feasibility.inspect import find_pallas_calls

        calls = find_pallas_calls(parts.fn, args, full)
    except Exception as e:  # noqa: BLE001
        outcome, error, detail = candidate._trace_failure(e)
        return (outcome, error, detail, None), []
    rejection, vmem = candidate.screen(parts, calls, args, full, chip=chip,
                                       stage="rules" if stage == "off" else stage,
                                       vreg_limit=vreg_limit)
    return ((*rejection, vmem) if rejection else None), calls
