"""``@tunable``: declare a kernel's tunable parameters; resolve them from the cache at trace time.

Resolution order for a call (documented once, here):

1. keywords the caller passes explicitly win;
2. an exact cache entry for (chip, kernel, key): measured entries before estimates, the user's
   cache directory before the caches shipped in the package;
3. ``PALLAS_TUNE_MODE=strict`` raises :class:`CacheMissError`; ``=tune`` tunes now and caches;
4. the config of the nearest tuned shape of the same kernel on the same chip, if it satisfies the
   TPU block rules for this call's shapes;
5. the declared ``default=``, else the first point of the space that satisfies the block rules.

Steps 3 to 5 warn once per (kernel, key). The result is memoized per process, so a repeated call
costs one tuple build and one dict lookup, and nothing of this runs inside the compiled program:
the kernel is traced with plain Python values, exactly as if they had been written by hand.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune import _settings, chips, keys
from pallas_tune.cache import TuningCache, default_cache
from pallas_tune.errors import CacheMissError, NoFeasibleConfigError, SearchSpaceError, warn
from pallas_tune.space import Config, SearchSpace, load_space

__all__ = ["TunableKernel", "tunable"]

def _fast_part(v: Any) -> Any:
    shape = getattr(v, "shape", None)
    if shape is not None:
        return (shape, v.dtype)
    if isinstance(v, list):
        return tuple(_fast_part(x) for x in v)
    if isinstance(v, tuple):
        return tuple(_fast_part(x) for x in v)
    return v


class TunableKernel:
    """A kernel function with a declared search space. Create it with :func:`tunable`."""

    def __init__(self, fn: Callable[..., Any], space: SearchSpace, *, name: str | None,
                 key: Callable[..., Any] | None, reference: Callable[..., Any] | None,
                 inputs: Callable[..., Any] | None, cache: TuningCache | None = None,
                 vmem_estimate: Callable[..., int] | None = None,
                 standin: Callable[..., Any] | None = None):
        space.check_function(fn)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.space = space
        self.name = name or f"{fn.__module__}.{fn.__qualname__}"
        self.key_fn = key
        self.reference = reference
        self.inputs = inputs
        self.vmem_estimate = vmem_estimate
        self.standin = standin
        self._cache = cache
        self._sig = inspect.signature(fn)
        self._tuned = frozenset(space.names)
        self._memo: dict[Any, Config] = {}
        self._warned: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    @property
    def cache(self) -> TuningCache:
        return self._cache if self._cache is not None else default_cache()

    def __repr__(self) -> str:
        return f"<tunable {self.name} over {dict((p.name, p.choices) for p in self.space.params)}>"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        # Support use on methods: bind like a function would.
        return self if obj is None else functools.partial(self, obj)

    # ---- the hot path --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tuned = self._tuned
        explicit = {k: kwargs.pop(k) for k in tuned.intersection(kwargs)} if kwargs else {}
        if len(explicit) != len(tuned):
            config = self._resolve(args, kwargs)
            if explicit:
                config = {**config, **explicit}
        else:
            config = explicit
        if chips.should_interpret():
            with chips.interpret_mode():
                return self.fn(*args, **kwargs, **config)
        return self.fn(*args, **kwargs, **config)

    def _resolve(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config:
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
        if self.key_fn is not None:
            return keys.custom_key(self.key_fn(*args, **kwargs))
        return keys.call_key(self._sig, self._tuned, args, kwargs)

    def config_for(self, *args: Any, **kwargs: Any) -> Config:
        """The config a call with these arguments would use, with ``.source`` saying why.

        Keywords naming tuned parameters are applied on top, as in a call; if they name all of
        them, the source is ``"explicit"``.
        """
        explicit = {k: kwargs.pop(k) for k in list(kwargs) if k in self._tuned}
        if len(explicit) == len(self._tuned):
            return Config(explicit, source="explicit")
        config = self._resolve(args, kwargs)
        return config.replace(**explicit) if explicit else config

    def _warn_once(self, key: str, message: str) -> None:
        marker = (chips.current_chip(), key)
        if marker not in self._warned:
            self._warned.add(marker)
            warn(message)

    def _resolve_slow(self, chip: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config:
        key = self.cache_key(*args, **kwargs)
        found = self.cache.lookup(chip, self.name, key)
        if found is not None:
            entry, path = found
            return Config(_coerce(entry["config"]), source="cache", origin=path)
        mode = _settings.mode()
        if mode == "strict":
            raise CacheMissError(
                f"PALLAS_TUNE_MODE=strict: no tuned config of kernel {self.name!r} on chip "
                f"{chip!r} for key {key!r} (looked in {self.cache.roots()}). Fill it with:\n"
                f"  pallas-tune sweep {self._cli_ref()} --shapes '{key}'\n"
                "or unset PALLAS_TUNE_MODE to run on a fallback config."
            )
        if mode == "tune":
            result = self._tune_from_trace(args, kwargs)
            return Config(result.best, source="tuned", origin=key)
        nearest = self._nearest(chip, key, args, kwargs)
        if nearest is not None:
            self._warn_once(
                key,
                f"pallas-tune: no tuned config of {self.name!r} on {chip!r} for {key!r}; using "
                f"that of the nearest tuned shape {nearest.origin!r}: {nearest.to_dict()}. Tune "
                f"this shape with: pallas-tune sweep {self._cli_ref()} --shapes '{key}'",
            )
            return nearest
        config = self._fallback(args, kwargs)
        self._warn_once(
            key,
            f"pallas-tune: no tuned config of {self.name!r} on {chip!r} for {key!r}; using the "
            f"default {config.to_dict()}. Tune it with: pallas-tune sweep {self._cli_ref()} "
            f"--shapes '{key}'",
        )
        return config

    def _cli_ref(self) -> str:
        return f"{self.fn.__module__}:{self.fn.__qualname__}"

    def violations(self, config: Mapping[str, Any], args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> list[str]:
        """Why ``config`` cannot run for these arguments (TPU block rules, tracing errors)."""
        from pallas_tune.feasibility import inspect as _inspect

        try:
            calls = _inspect.find_pallas_calls(self.fn, args, {**kwargs, **config})
        except Exception as e:  # noqa: BLE001 - any tracing failure makes the config invalid.
            return [f"tracing failed: {type(e).__name__}: {e}"]
        return _inspect.block_rule_violations(calls)

    def _nearest(self, chip: str, key: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any]) -> Config | None:
        if self.key_fn is not None:
            return None  # Custom keys have no notion of distance.
        ranked = []
        for other, entry, _ in self.cache.entries(chip, self.name):
            d = keys.key_distance(key, other)
            if d != float("inf"):
                ranked.append((d, other, entry))
        for _, other, entry in sorted(ranked, key=lambda t: (t[0], t[1])):
            config = _coerce(entry.get("config", {}))
            if set(config) != set(self._tuned):
                continue
            if not self.violations(config, args, kwargs):
                return Config(config, source="nearest", origin=other)
        return None

    def _fallback(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config:
        if self.space.default is not None and set(self.space.default) == set(self._tuned):
            return Config(self.space.default, source="default")
        first_error = None
        for i, candidate in enumerate(self.space.ordered_candidates()):
            problems = self.violations(candidate, args, kwargs)
            if not problems:
                return Config(candidate, source="default")
            first_error = first_error or problems[0]
            if i >= 4096:
                break
        raise NoFeasibleConfigError(
            f"no config of {self.name!r} satisfies the TPU block rules for "
            f"{self.cache_key(*args, **kwargs)!r} (first problem: {first_error}); add block sizes "
            "that divide these shapes to the declared space."
        )

    # ---- tuning --------------------------------------------------------------------------

    def tune(self, *args: Any, options: Any = None, **kwargs: Any) -> Any:
        """Tunes the space for these arguments, writes the winner to the cache, returns a
        :class:`pallas_tune.tuning.TuningResult` (``.best``, ``.best_ms``, ``.trials``,
        ``.study``). Same as ``pallas_tune.tune(kernel, *args, **kwargs)``.

        Arguments may be arrays or ``jax.ShapeDtypeStruct``\\ s (inputs are made for them).
        Keywords naming a :class:`pallas_tune.TuneOptions` field (``trials``, ``seed``,
        ``timer``, ``repeats``, ...) are tuning options, unless ``options=`` is given; the rest
        are static arguments of the kernel.
        """
        from pallas_tune import tuning

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


def _coerce(config: Mapping[str, Any]) -> dict[str, Any]:
    from pallas_tune.space import _freeze

    return {k: _freeze(v) for k, v in config.items()}


def tunable(
    fn: Callable[..., Any] | None = None,
    *,
    default: Mapping[str, Any] | None = None,
    name: str | None = None,
    key: Callable[..., Any] | None = None,
    reference: Callable[..., Any] | None = None,
    space: SearchSpace | str | None = None,
    inputs: Callable[..., Any] | None = None,
    vmem_estimate: Callable[..., int] | None = None,
    standin: Callable[..., Any] | None = None,
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
        matmul.config_for(x, y).source     # "cache", "nearest" or "default"

    Args:
      default: the config used on a cache miss (else the first valid point of the space).
      name: cache name of the kernel (default: ``module.qualname``).
      key: maps the call's arguments to the cache key (default: shapes and dtypes of array
        arguments plus the values of static non-tuned arguments, see :mod:`pallas_tune.keys`).
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
      **choices: parameter name → list of choices.

    Raises:
      SearchSpaceError: a declared name is not a keyword-only parameter of the function, or a
        choice list is empty or unhashable.
    """

    def wrap(f: Callable[..., Any]) -> TunableKernel:
        base: dict[str, Sequence[Any]] = {}
        base_default = None
        if isinstance(space, str):
            loaded = load_space(space)["space"]
            base = {p.name: p.choices for p in loaded.params}
            base_default = loaded.default
        elif isinstance(space, SearchSpace):
            base = {p.name: p.choices for p in space.params}
            base_default = space.default
        elif space is not None:
            raise SearchSpaceError(f"space={space!r} must be a SearchSpace or a file name.")
        merged = {**base, **choices}
        if not merged:
            raise SearchSpaceError(
                f"@tunable on {getattr(f, '__qualname__', f)} declares no parameters; pass e.g. "
                "bm=[128, 256]."
            )
        s = SearchSpace.from_choices(merged, default=default if default is not None
                                     else base_default)
        return TunableKernel(f, s, name=name, key=key, reference=reference, inputs=inputs,
                             vmem_estimate=vmem_estimate, standin=standin)

    if fn is not None:
        if not callable(fn):
            raise SearchSpaceError(f"@tunable expects a function, got {fn!r}.")
        return wrap(fn)
    return wrap
