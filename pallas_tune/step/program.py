"""Tune the step, not the kernel: every tunable call in a program, tuned at once.

``pallas_tune.autotune(fn, *args)`` traces ``fn`` (it may apply ``jax.jit``, ``jax.grad``,
``jax.vmap``, ``jax.checkpoint``, ``lax.scan`` inside: whatever traces), records every call of
a ``@tunable`` kernel with the shapes and static values it was traced with (a backward
kernel's too, when ``fn`` takes a gradient), and tunes each distinct (kernel, key) that has no
cache entry, each with its own study, options and evaluator. The result lists every call
(kernel, key, config, where the config came from, the default's and the tuned time, the XLA
time where measured) and is a context manager that applies its configs without touching the
cache::

    result = pallas_tune.autotune(train_step, params, batch, trials=16)
    with result:
        jax.jit(train_step)(params, batch)   # traced here: the result's configs
    result.dump("step.json"); pallas_tune.AutotuneResult.load("step.json")
    result.write()                           # or put them in the user cache

Entering and leaving the result clears JAX's trace caches (they key on shapes, not on the
configs our calls resolve to), so programs jitted before are traced and compiled again with the
configs in force. A storage shared by several hosts shares each call's
study between them, as ``pallas-tune sweep`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune import chips
from pallas_tune.config import Config
from pallas_tune.errors import NoFeasibleConfigError, PallasTuneError
from pallas_tune.runtime import partition
from pallas_tune.runtime.tunable import current_hook, resolution_hook
from pallas_tune.step import figures as step
from pallas_tune.step.result import AutotuneResult, TunedCall

__all__ = ["AutotuneResult", "TunedCall", "autotune", "find_calls"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One tunable call met while tracing: the kernel, its abstract arguments, its key; and
    ``error``: why no config of the kernel can run it (the dispatcher's refusal), if so."""

    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str
    error: str = ""
    mesh: str = ""  # The mesh the call runs split over, where it does (its shapes a shard's).


STANDIN_TRACES = 8  # Configs of a call no config can run traced for its result's shape, at most.


def find_calls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Call]:
    """Every distinct (kernel, key) that tracing ``fn(*args, **kwargs)`` calls, in the order
    first met. Nothing runs: ``fn`` is traced to a jaxpr on abstract values.

    A call no config can run (:class:`~pallas_tune.errors.NoFeasibleConfigError`) is kept,
    with ``error``, and the trace goes on past it with a stand-in for its result: a config of
    its space that traces (refused, e.g. by a declared constraint, but of the right shape), else
    its reference. With neither, the trace stops there and the error says so."""
    import jax

    from pallas_tune.errors import PallasTuneWarning, RecordWarning
    from pallas_tune.feasibility.inspect import abstractify

    found: dict[tuple[str, str], Call] = {}
    standins: dict[tuple[str, str], Config] = {}
    stopped: list[tuple[str, str]] = []  # The call the trace stopped at, if it did.
    outer = current_hook()  # One applied around this trace (a result, a step's setting).

    def record(kernel: Any, a: Sequence[Any], kw: Mapping[str, Any]) -> Config | None:
        key = kernel.cache_key(*a, **kw)
        at = (kernel.name, key)
        if at not in found:
            # Keyword arrays (a mask's segment ids) abstracted too: no tracer outlives the trace.
            found[at] = Call(kernel, tuple(abstractify(list(a))),
                             dict(zip(kw, abstractify(list(kw.values())), strict=True)), key,
                             mesh=partition.splitting())
        if at in standins:
            return standins[at]
        config = outer(kernel, a, kw) if outer is not None else None
        if config is not None:
            return config  # type: ignore[no-any-return]
        resolve = kernel._resolve_slow  # noqa: SLF001  The dispatcher: this hook stands before it.
        try:  # As the call would resolve, its refusal caught.
            return resolve(chips.current_chip(), a, kw)  # type: ignore[no-any-return]
        except NoFeasibleConfigError as e:
            standin = _stand_in(kernel, a, kw)
            why = str(e) if standin is not None else (
                f"{e} (nothing stands in for its result, so the trace stopped there: calls "
                "after it in the program were not found)")
            found[at] = dataclasses.replace(found[at], error=why)
            if standin is None:
                stopped.append(at)
                raise
            standins[at] = standin
            return standin

    import warnings

    with resolution_hook(record), warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasTuneWarning)  # Misses: what is to be tuned.
        warnings.simplefilter("default", RecordWarning)  # A receipts file not written: not.
        try:
            jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args)
            if _auto_sharded(args):  # Split as XLA partitions it: its shards met then.
                _partition_calls(fn, args, kwargs)
        except NoFeasibleConfigError:
            if not stopped:
                raise  # Not a refusal this hook met (its calls' are all kept).
    return list(found.values())


def _auto_sharded(args: Sequence[Any]) -> bool:
    """Whether an argument is sharded over a mesh of several devices with automatic axes: a
    kernel call on it is split when XLA partitions the program (custom_partitioning), so its
    per-shard calls are met only when the program is compiled."""
    import jax
    from jax.sharding import AxisType

    for leaf in jax.tree_util.tree_leaves(args):
        mesh = getattr(getattr(getattr(leaf, "aval", None) or (
            leaf if isinstance(leaf, jax.ShapeDtypeStruct) else None), "sharding", None),
            "mesh", None)
        if mesh is not None and mesh.size > 1 and any(
                t == AxisType.Auto for t in mesh.axis_types):
            return True
    return False


def _partition_calls(fn: Callable[..., Any], args: Sequence[Any],
                     kwargs: Mapping[str, Any]) -> None:
    """``fn`` compiled for its arguments' shardings, so that the calls split at partitioning
    meet the hook at their shards' shapes; a compile that fails is warned about (the calls met
    so far are kept)."""
    import jax

    from pallas_tune import errors

    try:
        jax.jit(lambda *a: fn(*a, **kwargs)).lower(*args).compile()
    except NoFeasibleConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - what was found stands; say what was not.
        errors.warn(f"autotune: the program could not be compiled for its arguments' "
                    f"shardings ({type(e).__name__}: {str(e)[:300]}), so kernel calls split "
                    "when XLA partitions it (a mesh with automatic axes) were not found; give "
                    "the mesh explicit axes (jax.sharding.AxisType.Explicit) to find them at "
                    "trace time.")


def _stand_in(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config | None:
    """Something to trace in place of a call no config can run, for its result's shape only
    (nothing runs): the first of the space's configs that traces, else the reference."""
    import itertools

    from pallas_tune.feasibility.inspect import find_pallas_calls

    for candidate in itertools.islice(kernel.space.ordered_candidates(), STANDIN_TRACES):
        config = Config(candidate, source="default")
        try:
            find_pallas_calls(kernel.fn, args, {**kwargs, **config})
        except Exception:  # noqa: BLE001, S112  Refused by the kernel too: the next one.
            continue
        return config
    if kernel.reference is not None:
        return Config(kernel.space.default or {}, source="default", implementation="xla")
    return None


def autotune(fn: Callable[..., Any], *args: Any, step_time: bool | str = False,
             options: Any = None, static_argnums: int | Sequence[int] | None = None,
             static_argnames: str | Sequence[str] | None = None,
             **kwargs: Any) -> AutotuneResult:
    """Tunes every tunable call of ``fn(*args, **kwargs)`` that has no cache entry.

    Keywords naming a :class:`pallas_tune.TuneOptions` field are tuning options for every
    call (``write`` defaults to False here: the result holds the configs; :meth:`write`
    stores them); the rest go to ``fn``. ``static_argnums`` and ``static_argnames``: as
    ``jax.jit``'s, the arguments ``fn`` uses as Python values (a loop count, a shape), given to
    it as they are wherever ``fn`` is traced (finding the calls, timing or estimating the step);
    keyword arguments are always given as they are. ``step_time``: also time the whole program
    (jitted) with the default configs, the tuned ones and XLA for every kernel with a reference;
    with ``timer="tpu-estimate"``, the whole step compiled deviceless for the chip and every
    op's static estimate summed instead (:func:`pallas_tune.step.figures.estimates`), or, with
    ``step_time="composed"``, the step's glue estimated whole and each call alone, for steps
    too large to compile whole on the host (:func:`pallas_tune.step.figures.composed`). Under
    that timer the
    calls are looked up in, and tuned for, the target chip's cache (``chip=``).

    A call that cannot be tuned (no config of its kernel can run it, or its tuning fails) is
    listed as ``untuned`` with why, and warned about; the other calls are tuned all the same.
    """
    from pallas_tune.tuning import TuneOptions

    if step_time not in (False, True, "composed"):
        raise ValueError(f"step_time={step_time!r}: use True (the whole step), \"composed\" "
                         "(tpu-estimate only: glue + each call) or False.")
    fn, args = static_bound(fn, args, kwargs, static_argnums, static_argnames)
    if options is None:
        given = {k: kwargs.pop(k) for k in TuneOptions.names() if k in kwargs}
        given.setdefault("write", False)
        options = TuneOptions.build(**given)
    estimating = options.timer == "tpu-estimate"
    if step_time == "composed" and not estimating:
        raise ValueError("step_time=\"composed\" adds compiler estimates of the glue and of "
                         "each call: it needs timer=\"tpu-estimate\"; on a device, use "
                         "step_time=True (the whole step, measured).")
    target = (lambda: chips.target(options.chip)) if estimating and options.chip else _nothing
    # Estimates fill the target chip's cache: its entries are looked up, not this host's.
    with target():
        found = [(call, None if call.error else _cached(call))
                 for call in find_calls(fn, *args, **kwargs)]
    out = _tune(found, options, target)
    if step_time:
        _time_step(out, fn, args, kwargs, options, composed=step_time == "composed")
    return out


def _tune(found: Sequence[tuple[Call, TunedCall | None]], options: Any,
          target: Callable[[], Any]) -> AutotuneResult:
    """Each call found tuned (or taken from the cache); one that cannot be is listed untuned."""
    from pallas_tune.measure import shared

    calls, results = [], {}
    # The calls' estimate runs share their compile workers; each call is tuned on one device,
    # at the shapes found (a sharded step's: the shard's), outside the step's mesh.
    with shared.shared_pools(), _outside_mesh():
        for call, done in found:
            if done is not None:
                calls.append(done)
                continue
            try:
                if call.error:  # No config can run it: nothing to tune.
                    raise NoFeasibleConfigError(call.error)
                result = call.kernel.tune(*call.args, options=options, **call.kwargs)
            except PallasTuneError as e:  # One call that cannot be tuned loses no other's.
                with target():
                    calls.append(_untuned(call, e))
                continue
            results[(call.kernel.name, call.key)] = (call.kernel, result)
            calls.append(_tuned(call, result))
    return AutotuneResult(calls, results=results)


def _outside_mesh() -> Any:
    """``jax.set_mesh(None)`` where a mesh of this host's devices is set (a sharded step's,
    e.g. explicit axes): a candidate traced under it would take its arrays as sharded over
    it. A deviceless mesh (another platform's) is left: it names the chip tuned for."""
    import jax

    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None)
    if (getattr(jax, "set_mesh", None) is None or mesh.empty
            or getattr(device, "platform", None) != jax.default_backend()):
        return _nothing()
    return jax.set_mesh(None)


def _time_step(out: AutotuneResult, fn: Callable[..., Any], args: Sequence[Any],
               kwargs: Mapping[str, Any], options: Any, *, composed: bool) -> None:
    """The whole step's time (see :func:`autotune`) into ``out``; where the step cannot run
    (a call no config can run), warned about and left out: the calls' results stand."""
    from pallas_tune import errors

    try:
        if options.timer == "tpu-estimate":
            chip = options.chip or (out.calls[0].chip if out.calls else "v6e")
            how = step.composed if composed else step.estimates
            out.step_ms, out.step_timer, out.step_detail = how(
                fn, args, kwargs, out, chip, workers=min(options.workers, 3))
        else:
            out.step_ms, out.step_timer = step.wall_clock(fn, args, kwargs, out)
    except PallasTuneError as e:
        errors.warn(f"autotune: the step's time was not taken: {str(e)[:500]}")


def static_bound(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any],
                 static_argnums: int | Sequence[int] | None,
                 static_argnames: str | Sequence[str] | None
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``fn`` with its static positional arguments bound (given to it as they are), and its
    other positional arguments. ``jax.jit``'s meaning: either one alone is completed from the
    signature (a name given by position is static; a position's name too), negative positions
    count from the end of ``args``. Raises ValueError for a position past ``args`` or a name
    ``fn`` does not take."""
    import inspect

    if static_argnums is None and static_argnames is None:
        return fn, tuple(args)
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums or ())
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(
        static_argnames or ())
    try:
        params = dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # No signature (a builtin): positions and names as given.
        params = {}
    kinds = inspect.Parameter
    by_name = [k for k, p in params.items() if p.kind is kinds.POSITIONAL_OR_KEYWORD]
    flexible = not params or any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    for name in names:
        if name not in params and name not in kwargs and not flexible:
            raise ValueError(f"static_argnames names {name!r}, which "
                             f"{getattr(fn, '__qualname__', fn)} does not take")
    n = len(args)
    for i in nums:
        if not -n <= i < n:
            raise ValueError(f"static_argnums={i}: only {n} positional argument(s) given")
    at = {i % n for i in nums}
    if static_argnums is None:  # Names given by position are static too (jax.jit's rule).
        at |= {list(params).index(k) for k in names if k in by_name
               and list(params).index(k) < n}
    if not at:
        return fn, tuple(args)
    static = {i: args[i] for i in at}

    def bound(*dynamic: Any, **kw: Any) -> Any:
        it = iter(dynamic)
        return fn(*[static[i] if i in static else next(it) for i in range(n)], *it, **kw)

    return bound, tuple(a for i, a in enumerate(args) if i not in at)


def _tuned(call: Call, result: Any) -> TunedCall:
    return TunedCall(kernel=call.kernel.name, key=call.key, chip=result.chip, config=result.best,
                     source="tuned", implementation=result.implementation,
                     default_ms=result.default_ms, best_ms=result.best_ms,
                     xla_ms=result.xla_ms, xla_partial=result.xla_partial,
                     timer=str(result.provenance.get("timer", "")), effective=result.effective,
                     mesh=call.mesh)


def _untuned(call: Call, error: Exception) -> TunedCall:
    """A call whose tuning failed: it runs with what the dispatcher resolves (a default, a
    neighbour's entry; nothing, ``{}``, where no config can run it), and the result says why;
    warned about, as a miss is."""
    from pallas_tune import errors

    config = Config({}) if call.error else call.kernel.config_for(*call.args, **call.kwargs)
    errors.warn(f"autotune: {call.kernel.name} {call.key} could not be tuned: "
                f"{str(error)[:500]}")
    return TunedCall(kernel=call.kernel.name, key=call.key, chip=chips.current_chip(),
                     config=config.to_dict(), source="untuned",
                     implementation=config.implementation, error=str(error)[:2000],
                     mesh=call.mesh)


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _cached(call: Call) -> TunedCall | None:
    config = call.kernel.config_for(*call.args, **call.kwargs)
    if config.source != "cache":
        return None
    return TunedCall(kernel=call.kernel.name, key=call.key, chip=chips.current_chip(),
                     config=config.to_dict(), source="cache",
                     implementation=config.implementation, mesh=call.mesh)
