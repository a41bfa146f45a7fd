"""``@tunable``: declare a kernel's tunable parameters; resolve them from the cache at trace time.

Keywords the caller passes explicitly always win. The rest is resolved once per (chip, key) and
process by :mod:`pallas_tune.runtime.dispatch`, whose docstring gives the order (exact cache entry,
strict/tune modes, nearest tuned shape, declared default, the cost model's best valid config):
every config it serves, from whichever source, has passed :meth:`TunableKernel.violations` for
the call's shapes. The result is memoized, so a repeated call costs one tuple build and one dict
lookup, and nothing of this runs inside the compiled program: the kernel is traced with plain
Python values, exactly as if they had been written by hand.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pallas_tune import _vma, chips, keys
from pallas_tune.cache import TuningCache, declared, default_cache, entries
from pallas_tune.constraints import Constraint
from pallas_tune.errors import SearchSpaceError, warn
from pallas_tune.runtime import arguments as _arguments
from pallas_tune.runtime import dispatch, partition as _partition
from pallas_tune.runtime import record as _record
from pallas_tune.runtime import vjp as _vjp
from pallas_tune.runtime.arguments import fast_part as _fast_part
from pallas_tune.runtime.declare import declared_space, default_name, key_names, library_cache
from pallas_tune.space import Config, SearchSpace

__all__ = ["TunableKernel", "tunable"]

_UNSET: Any = object()


class TunableKernel:
    """A kernel function with a declared search space. Create it with :func:`tunable`."""

    def __init__(self, fn: Callable[..., Any], space: SearchSpace, *, name: str | None,
                 key: Callable[..., Any] | Sequence[str] | None,
                 reference: Callable[..., Any] | None, inputs: Callable[..., Any] | None,
                 cache: TuningCache | None = None,
                 vmem_estimate: Callable[..., int] | None = None,
                 standin: Callable[..., Any] | None = None, version: str | None = None,
                 fallback: str | None = None, backward: Any = None,
                 backward_args: Callable[..., Any] | None = None,
                 backward_residuals: Callable[..., Any] | None = None,
                 key_optional: Sequence[str] = (), partition: Any = None):
        space.check_function(fn)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.space = space
        self.name = name if name is not None else default_name(fn)
        if not isinstance(self.name, str) or not self.name.strip():
            raise SearchSpaceError(f"name={name!r} must be a non-empty string.")
        self.key_names: frozenset[str] | None = None
        if key is not None and not callable(key):
            self.key_names = key_names(fn, key, frozenset(space.names))
            key = None
        self.key_fn = key
        self.key_optional = key_names(fn, key_optional, frozenset(space.names), optional=True)
        self.reference = reference
        self.inputs = inputs
        self.vmem_estimate = vmem_estimate
        self.standin = standin
        if version is not None and (not isinstance(version, str) or not version.strip()):
            raise SearchSpaceError(f"version={version!r} must be a non-empty string, e.g. "
                                   "version=\"2\".")
        self.version = version
        if fallback not in (None, "reference"):
            raise SearchSpaceError(f"fallback={fallback!r} must be None or \"reference\".")
        if fallback is not None and reference is None:
            raise SearchSpaceError("fallback=\"reference\" needs a reference= implementation "
                                   "to fall back to.")
        self.fallback = fallback
        self.backward_backend = _vjp.check_declaration(self.name, backward, backward_args,
                                                       backward_residuals)
        if self.backward_backend == "xla" and reference is None:
            raise SearchSpaceError(f"{self.name}: backward=\"xla\" is jax.vjp of the "
                                   "reference: declare reference=.")
        self.backward = backward if self.backward_backend == "pallas" else None
        if self.backward is not None:
            _vjp.check_signatures(self.name, fn, frozenset(space.names), backward,
                                  backward_residuals)
        self.backward_args = backward_args
        self.backward_residuals = backward_residuals
        self.partition = _partition.declared(self.name, partition)  # runtime.partition
        self._fingerprint: Any = _UNSET
        self._cache = cache
        self._sig = inspect.signature(fn)
        self.signature = self._sig
        self._tuned = frozenset(space.names)
        self._statics = _arguments.Statics(self.name, self._sig, self._tuned)
        self._memo: dict[Any, Config] = {}
        self._checked: set[Any] = set()  # Explicit configs that passed violations(), by shapes.
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        declared.declare(self)  # cache.write refuses what its lookups would skip.

    @property
    def fingerprint(self) -> str | None:
        """The version of the kernel's code its cache entries are tuned on: 16 hex digits
        of the code of the module defining the function (docstrings and comments aside), or
        of ``version=`` when given; None when the source cannot be read (see
        :mod:`pallas_tune._kernel_hash`). Computed once, on first use (never on a memo hit)."""
        fp = self._fingerprint
        if fp is _UNSET:
            from pallas_tune import _kernel_hash

            fp = (_kernel_hash.version_fingerprint(self.version) if self.version is not None
                  else _kernel_hash.code_fingerprint(self.fn))
            self._fingerprint = fp
        return fp  # type: ignore[no-any-return]

    @property
    def cache(self) -> TuningCache:
        return self._cache if self._cache is not None else default_cache()

    def __repr__(self) -> str:
        return f"<tunable {self.name} over {dict((p.name, p.choices) for p in self.space.params)}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # On methods: bind as functions.
        return self if obj is None else functools.partial(self, obj)

    # ---- the hot path --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args = self._statics.apply(args, kwargs)  # Static numpy/JAX scalars: Python values.
        if self.partition is not None and _partition.sharded(self, args):  # Split by its rule.
            return _partition.call(self, args, kwargs)
        if _vma.checking():  # Inside jax.shard_map with its defaults: see pallas_tune._vma.
            args, kwargs = _vma.align(args, kwargs)
        tuned = self._tuned
        explicit = {k: kwargs.pop(k) for k in tuned.intersection(kwargs)} if kwargs else {}
        if len(explicit) != len(tuned):
            config = self._resolve(args, kwargs)
            if explicit:
                config = _arguments.explicit(self, args, kwargs, {**config, **explicit})
            elif config.implementation != "pallas":
                if config.implementation == "xla":  # Its cache entry: XLA wins at these shapes.
                    return _vjp.call_plain(self.reference, args, kwargs, {})
                return _ALTERNATIVES[config.implementation](self, args, kwargs, config)
        else:
            config = _arguments.explicit(self, args, kwargs, explicit)
        if self.backward_backend is not None:  # Differentiable: its declared backward.
            return _vjp.call_with_vjp(self, args, kwargs, config)
        return _vjp.call_plain(self.fn, args, kwargs, config)

    def _resolve(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config:
        if _HOOK is not None:  # pallas_tune.autotune: recording calls, or applying a result.
            found = _HOOK(self, args, kwargs)
            if found is not None:
                return found  # type: ignore[no-any-return]
        chip = chips.current_chip()
        try:
            if kwargs:
                fast = (chip, 1, tuple(map(_fast_part, args)),
                        tuple(sorted((k, _fast_part(v)) for k, v in kwargs.items())))
            else:
                fast = (chip, 0, *map(_fast_part, args))
            hit = self._memo.get(fast)
        except TypeError:  # Unhashable static argument: resolve without memoizing.
            fast, hit = None, None
        if hit is not None:
            return hit
        config = self._resolve_slow(chip, args, kwargs)
        if fast is not None:
            with self._lock:
                self._memo[fast] = config
        return config

    # ---- resolution ----------------------------------------------------------------------

    def cache_key(self, *args: Any, **kwargs: Any) -> str:
        """The cache key of a call with these arguments (tuned keywords are ignored)."""
        kwargs = {k: v for k, v in kwargs.items() if k not in self._tuned}
        args = self._statics.apply(args, kwargs)
        if self.key_fn is not None:
            return keys.custom_key(self.key_fn(*args, **kwargs))
        return keys.call_key(self._sig, self._tuned, args, kwargs, self.key_names,
                             self.key_optional)

    def call_space(self, *args: Any, **kwargs: Any) -> tuple[SearchSpace, dict[str, int]]:
        """The space of distinct effective configs for a call with these arguments, and the
        dimension each clamped parameter is capped at (see :mod:`pallas_tune.effective`)."""
        from pallas_tune import effective

        dims = effective.clamp_dims(self.space, effective.call_env(self._sig, args, kwargs))
        return effective.call_space(self.space, dims), dims

    def effective(self, config: Mapping[str, Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        """What ``config`` runs as for a call with these arguments (clamped values capped)."""
        from pallas_tune import effective

        return effective.effective(config, self.call_space(*args, **kwargs)[1])

    def config_for(self, *args: Any, **kwargs: Any) -> Config:
        """The config a call with these arguments would use, with ``.source`` saying why.

        Keywords naming tuned parameters are applied on top, as in a call; if they name all of
        them, the source is ``"explicit"``.
        """
        explicit = {k: kwargs.pop(k) for k in list(kwargs) if k in self._tuned}
        args = self._statics.apply(args, kwargs)
        if len(explicit) == len(self._tuned):
            return Config(explicit, source="explicit")
        config = self._resolve(args, kwargs)
        return config.replace(**explicit) if explicit else config

    def _warn_once(self, key: str, message: str, *, topic: str = "miss") -> None:
        """Warns once per process: a miss (``topic`` ``"miss:SOURCE"``) once per kernel, chip
        and fallback (default, nearest shape, model): a step's other shapes served the same way
        would repeat the same advice; anything else (a stale or malformed entry) once per key."""
        chip = chips.current_chip()
        miss = topic.startswith("miss")
        marker = (chip, topic) if miss else (chip, key, topic)
        if marker not in self._warned:
            self._warned.add(marker)
            if miss:
                message += (". Later shapes of this kernel served the same way are not warned "
                            "again; PALLAS_TUNE_RECORD=FILE records them all, for pallas-tune "
                            "sweep --from-record FILE")
            warn(message)

    def _resolve_slow(self, chip: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config:
        key = self.cache_key(*args, **kwargs)
        by_key = ("key", chip, key)  # Same cache key from another fast key: no re-validation.
        hit = self._memo.get(by_key)
        if hit is None:
            hit = dispatch.resolve(self, chip, key, args, kwargs)
            if hit.source != "cache":  # A miss: PALLAS_TUNE_RECORD may want it.
                _record.miss(self, chip, key, args, kwargs, hit.source)
            _record.receipt(self, chip, key, hit)
            with self._lock:
                self._memo[by_key] = hit
        return hit

    def violations(self, config: Mapping[str, Any], args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> list[str]:
        """Why ``config`` cannot run for these arguments; empty if it can.

        The one validity check, used for every config the dispatcher serves (cache entries,
        nearest shapes, the default, the cost model's pick) and every candidate the tuner
        measures: parameter names and value types, the kernel's declared ``constraints``, then
        a trace of the kernel (:class:`~pallas_tune.errors.InvalidConfig` and tracing errors
        become problems) and the TPU block rules on its pallas_calls."""
        return dispatch.check(self, config, args, kwargs)[0]

    def declared_problems(self, config: Mapping[str, Any], args: Sequence[Any],
                          kwargs: Mapping[str, Any]) -> list[str]:
        """The untraced part of :meth:`violations`: names, value types, declared constraints.
        The tuner applies it before a candidate reaches the evaluation boundary."""
        return dispatch.declared_problems(self, config, args, kwargs)

    def check(self, config: Mapping[str, Any], args: Sequence[Any], kwargs: Mapping[str, Any]
              ) -> tuple[list[str], list[Any] | None]:
        """:meth:`violations` and the traced ``pallas_call`` infos (None when the check stopped
        before tracing), for callers that go on to model the calls without tracing again."""
        return dispatch.check(self, config, args, kwargs)

    def entry_problems(self, entry: Mapping[str, Any]) -> list[str]:
        """Why a cache entry (``{"config": ..., "outside_space": ...}``) cannot be this
        kernel's whatever the shapes: unknown or missing parameters, values of other types,
        values outside the declared space (unless marked ``"outside_space": true``)."""
        problem = entries.entry_problem(entry)
        return [problem] if problem else dispatch.entry_problems(self, entry)

    # ---- tuning --------------------------------------------------------------------------

    def tune(self, *args: Any, options: Any = None, **kwargs: Any) -> Any:
        """Tunes the space for these arguments, writes the winner to the cache, returns a
        :class:`pallas_tune.tuning.TuningResult` (``.best``, ``.best_ms``, ``.trials``,
        ``.study``). Same as ``pallas_tune.tune(kernel, *args, **kwargs)``.

        Arguments may be arrays or ``jax.ShapeDtypeStruct``\\ s (inputs are made for them).
        Keywords naming a :class:`pallas_tune.TuneOptions` field (``trials``, ``seed``,
        ``timer``, ``repeats``, ...) are tuning options, unless ``options=`` is given; the rest
        are static arguments of the kernel.

        ``grad=True`` (a tuning option) tunes for training: this kernel for these arguments,
        then its ``backward=`` kernel for the backward's arguments (``backward_args``), each
        against its own reference; the result's ``.backward`` is the backward's
        :class:`~pallas_tune.tuning.TuningResult` (None for an ``"xla"`` backward).
        """
        from pallas_tune import tuning

        args = self._statics.apply(args, kwargs)
        result = tuning.tune(self, *args, options=options, **kwargs)
        with self._lock:
            self._memo.clear()
        return result

    def _tune_from_trace(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        # Tuning needs concrete inputs and eager execution; under a trace the args are tracers.
        # Run it in a fresh thread (JAX's trace state is thread-local), on abstract inputs.
        import concurrent.futures
        import contextvars

        from pallas_tune.feasibility import inspect as _inspect

        abstract = _inspect.abstractify(args)
        ctx = contextvars.copy_context()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(ctx.run, self.tune, *abstract, **kwargs)
            return fut.result()


# A function (kernel, args, kwargs) -> Config | None consulted before the cache while set:
# pallas_tune.step.program records a program's calls with it, and applies a result's configs.
_HOOK: Callable[..., Any] | None = None
# Implementations other than "pallas" and "xla" a hook's Config may name, by name: ``fn(kernel,
# args, kwargs, config)``; pallas_tune.step.glue registers "stub" (composed estimates).
_ALTERNATIVES: dict[str, Callable[..., Any]] = {}


def current_hook() -> Callable[..., Any] | None:
    """The resolution hook in force (None: calls resolve from the cache)."""
    return _HOOK


def register_alternative(name: str, fn: Callable[..., Any]) -> None:
    """Lets a hook's Config name ``implementation=name``: the call then runs
    ``fn(kernel, args, kwargs, config)`` instead of the kernel."""
    _ALTERNATIVES[name] = fn


@contextlib.contextmanager
def resolution_hook(hook: Callable[..., Any]) -> Iterator[None]:
    """Consults ``hook(kernel, args, kwargs)`` before every lookup while open (innermost
    first; a None answer falls through to the next hook, then to the cache)."""
    global _HOOK
    outer = _HOOK

    def chained(kernel: Any, args: Any, kwargs: Any) -> Any:
        found = hook(kernel, args, kwargs)
        return found if found is not None or outer is None else outer(kernel, args, kwargs)

    _HOOK = chained
    try:
        yield
    finally:
        _HOOK = outer


def tunable(
    fn: Callable[..., Any] | None = None,
    *,
    default: Mapping[str, Any] | None = None,
    name: str | None = None,
    key: Callable[..., Any] | Sequence[str] | None = None,
    key_optional: Sequence[str] = (),
    reference: Callable[..., Any] | None = None,
    space: SearchSpace | str | None = None,
    inputs: Callable[..., Any] | None = None,
    vmem_estimate: Callable[..., int] | None = None,
    standin: Callable[..., Any] | None = None,
    constraints: Mapping[str, str | Callable[..., Any]] | Sequence[Constraint] | None = None,
    clamp: Mapping[str, str | Callable[..., Any]] | None = None,
    cache: TuningCache | str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    version: str | None = None, fallback: str | None = None,
    backward: Any = None,
    backward_args: Callable[..., Any] | None = None,
    backward_residuals: Callable[..., Any] | None = None,
    partition: str | Callable[..., str] | None = None,
    **choices: Sequence[Any],
) -> Any:
    """Declares the tunable keyword-only parameters of a kernel function.

    Example::

        @pallas_tune.tunable(bm=[128, 256, 512], bn=[128, 256, 512], bk=[128, 256, 512],
                             buffering=[1, 2], semantics=[("parallel", "parallel", "arbitrary")])
        def matmul(x, y, *, bm, bn, bk, buffering, semantics):
            ...  # builds and calls a pl.pallas_call

        matmul(x, y)                       # config from the cache for this chip and shape
        matmul.tune(x, y, trials=32)       # Optuna TPE search; writes the cache
        matmul.config_for(x, y).source     # "cache", "nearest", "default" or "model"

    Args:
      default: the config used on a cache miss when it is valid for the call (else the best
        valid point of the space by the roofline cost model).
      name: cache name (default: ``module.qualname``, ``tune.matmul`` for ``python tune.py``;
        required inside a function, for lambdas or with no file: names are not unique there).
      key: maps the call's arguments to the cache key (default: shapes and dtypes of array
        arguments plus the values of static non-tuned arguments, see :mod:`pallas_tune.keys`),
        or, like Triton's ``key=``, a list of the argument names that make the key (the
        others, e.g. a scale factor, do not change which config is best); ``key_optional``:
        names keyed only off their default (a feature added later keeps old calls' keys).
      reference: a function with the kernel's signature (minus tuned parameters) whose output
        each candidate must match while tuning (default: the output of the default config).
      space: a :class:`SearchSpace` or the name of a file under ``search_spaces/``; keyword
        choices are added to it (and override parameters of the same name).
      inputs: ``inputs(*args, **kwargs) -> (args, kwargs)`` builds concrete inputs from
        ``jax.ShapeDtypeStruct`` arguments for tuning (default: random normal floats, zero ints).
      vmem_estimate: ``vmem_estimate(*args, **kwargs_and_config) -> bytes``, your own VMEM
        estimate, used by the tuner's feasibility filter instead of the automatic model.
      standin: ``standin(args, kwargs, config) -> (args, kwargs, scale)``: a smaller problem with
        the same tiles whose compiler estimate times ``scale`` stands for the full one (the
        ``tpu-estimate`` timer compiles it instead; see :mod:`pallas_tune.measure.estimate`).
      constraints: named predicates relating the parameters to the call's arguments, as a
        mapping name → expression string or callable (see :mod:`pallas_tune.constraints`), e.g.
        ``{"bk_divides_k": "x.shape[1] % bk == 0"}``; added to those of a ``space=`` file. A
        config that breaks one is never measured nor served.
      clamp: tuned parameter name → expression (or callable) of the dimension the kernel caps
        it at, e.g. ``{"bm": "x.shape[0]"}`` for ``bm = min(bm, M)``; added to a space file's
        ``[clamp]``. Tuning then searches one config per distinct program, and results and
        caches show the effective config (see :mod:`pallas_tune.effective`).
      cache: where this kernel's tuned configs are looked up besides the user cache: a
        directory (or several) of ``<chip>/<kernel>.json`` files that a library ships in its
        wheel, e.g. ``cache=importlib.resources.files("mylib") / "caches"``. They rank after
        the user cache and before ``PALLAS_TUNE_CACHE_PATH`` and pallas-tune's own caches
        (see :mod:`pallas_tune.cache.store`). Or a :class:`~pallas_tune.cache.TuningCache`.
      version: the version of the kernel's code that each new cache entry records (default:
        a hash of the code of its module, comments and docstrings aside; see
        :mod:`pallas_tune._kernel_hash`). Set it when the code spans several modules, or to
        decide when caches go stale.
      fallback: ``"reference"``: the reference (plain JAX, compiled by XLA) is a candidate
        implementation: where a device measures, tuning times it beside the best configs and,
        where it is faster, the cache entry says so and calls run it (``TuneOptions.xla``).
      backward, backward_args, backward_residuals: the kernel's gradient (a
        ``jax.custom_vjp``): ``backward`` a ``@tunable`` kernel of its own, called by the
        gradient with no tile keywords, or ``"xla"`` (``jax.vjp`` of ``reference``);
        ``backward_args(args, kwargs) -> (bwd_args, bwd_kwargs)`` its example arguments for
        ``tune(..., grad=True)``. The contract is :mod:`pallas_tune.runtime.vjp`'s docstring.
      partition: how a sharded call splits under ``jax.jit``: :mod:`pallas_tune.runtime.partition`.
      **choices: parameter name → list of choices.

    Raises:
      SearchSpaceError: a name is not a keyword-only parameter, or choices are empty or unhashable.
    """

    def wrap(f: Callable[..., Any]) -> TunableKernel:
        s, file_fallback = declared_space(f, space, choices, default, constraints, clamp)
        return TunableKernel(f, s, name=name, key=key, key_optional=key_optional,
                             reference=reference, inputs=inputs, vmem_estimate=vmem_estimate,
                             standin=standin, cache=library_cache(cache), version=version,
                             fallback=fallback if fallback is not None else file_fallback,
                             backward=backward, backward_args=backward_args,
                             backward_residuals=backward_residuals, partition=partition)

    if fn is not None and not callable(fn):
        raise SearchSpaceError(f"@tunable expects a function, got {fn!r}.")
    return wrap if fn is None else wrap(fn)
