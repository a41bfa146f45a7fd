"""A step's glue: everything but its tunable calls, for composed step estimates (issue 28).

Compiling a whole layer deviceless with its kernels in it can outgrow a host (libtpu's static
profile simulates every grid step of every kernel in one process: a Llama-3.1-8B layer passed
7.7 GB). :func:`pallas_tune.step.composed` compiles instead the **glue**, the step with every
tunable call replaced by a *stub*, and then the glue with one call put back at a time.

A stub is an empty Pallas kernel (``name="pallas_tune_stub"``): its operands and results stay
in place (``memory_space=pl.ANY``) and its body does nothing, so whatever feeds the call is
computed and materialized, as it is for a kernel (a custom call), whatever reads its results
reads them from memory, and libtpu's static profile gives the stub itself no cycles.

Under ``jax.grad`` a stub has the kernel's custom VJP: a backward kernel is a tunable call of
its own and is stubbed the same way; a kernel whose backward is XLA's autodiff of its
reference (``backward="xla"``) keeps that backward in the glue, since no tunable call stands
for it. A call inside ``lax.scan`` or a loop is traced once and counted once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pallas_tune import _vjp, chips
from pallas_tune.config import Config
from pallas_tune.tunable import current_hook, register_alternative, resolution_hook

__all__ = ["StubCall", "glue_function", "record"]


@dataclasses.dataclass
class StubCall:
    """One tunable call met while tracing the glue: the kernel, its abstract arguments and
    keywords, its key, and how many times the step calls it."""

    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str
    count: int = 1


class _Stubs:
    """While active: the calls met, and how many stubs were traced."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], StubCall] = {}
        self.stubs = 0

    def met(self, kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
            ) -> tuple[str, str]:
        from pallas_tune.feasibility.inspect import abstractify

        key = kernel.cache_key(*args, **kwargs)
        found = self.calls.get((kernel.name, key))
        if found is not None:
            found.count += 1
        else:
            self.calls[(kernel.name, key)] = StubCall(
                kernel, tuple(abstractify(list(args))), dict(kwargs), key)
        return kernel.name, key

    def produce(self, arrays: Sequence[Any], shapes: Any) -> Any:
        """Results of ``shapes`` (a pytree of ShapeDtypeStructs) from an empty kernel that
        takes ``arrays``."""
        import jax
        from jax.experimental import pallas as pl

        leaves, tree = jax.tree.flatten(shapes)
        self.stubs += 1
        anywhere = pl.BlockSpec(memory_space=pl.ANY)
        outs = pl.pallas_call(
            _nothing, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
            in_specs=[anywhere] * len(arrays), out_specs=[anywhere] * len(leaves),
            name="pallas_tune_stub")(*arrays)
        return jax.tree.unflatten(tree, list(outs))


def _nothing(*refs: Any) -> None:
    """The stub's body: its results are never written (their values do not matter)."""


_ACTIVE: list[_Stubs] = []


def _stub(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any], config: Config) -> Any:
    """A tunable call under :func:`_stubbed`: the stub described in the module docstring."""
    import jax

    stubs = _ACTIVE[-1]

    def arrays(a: Sequence[Any]) -> list[Any]:  # Its own arguments: no closed-over tracer.
        return [x for x in a if _vjp._is_array(x)]

    def forward(*a: Any, **kw: Any) -> Any:
        return stubs.produce(arrays(a), jax.eval_shape(functools.partial(kernel.fn, **kw), *a))

    if kernel.backward_backend is None:
        return forward(*args, **kwargs, **config)
    residuals = None
    if kernel.backward_residuals is not None:
        def residuals(*a: Any, **kw: Any) -> Any:
            shapes = jax.eval_shape(functools.partial(kernel.backward_residuals, **kw), *a)
            return stubs.produce(arrays(a), shapes)

    proxy = types.SimpleNamespace(
        fn=forward, backward_residuals=residuals, backward_backend=kernel.backward_backend,
        backward=kernel.backward, reference=kernel.reference, name=kernel.name)
    return _vjp.call_with_vjp(proxy, args, kwargs, config)


@contextlib.contextmanager
def _stubbed(real: tuple[str, str] | None = None, clear: bool = True) -> Iterator[_Stubs]:
    """Every tunable call traced inside is a stub, except those of ``real`` (a kernel's name
    and a key), which run as the hooks and the cache in force resolve them (the kernel at its
    config, or its reference where that says XLA)."""
    import jax

    outer = current_hook()  # A setting's configs (pallas_tune.step.settings), if any.
    stubs = _Stubs()

    def hook(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config:
        config = outer(kernel, args, kwargs) if outer is not None else None
        if config is None:
            config = kernel._resolve_slow(chips.current_chip(), args, kwargs)  # noqa: SLF001
        if stubs.met(kernel, args, kwargs) == real:
            return config  # type: ignore[no-any-return]
        return Config(config, source=config.source, implementation="stub")

    _ACTIVE.append(stubs)
    register_alternative("stub", _stub)
    # JAX caches traces by function and shapes, not by what our calls resolve to: traced
    # afresh here (no cached kernel), and nothing stubbed is left cached for later traces.
    # Not inside a trace (``clear=False``): its caller clears before and after.
    if clear:
        jax.clear_caches()
    try:
        with resolution_hook(hook):
            yield stubs
    finally:
        _ACTIVE.pop()
        if clear:
            jax.clear_caches()


def record(fn: Callable[..., Any], arrays: Sequence[Any], real: tuple[str, str] | None = None
           ) -> tuple[list[StubCall], int]:
    """Traces ``fn(*arrays)`` with stubs (nothing runs; ``real`` as in :func:`glue_function`):
    the tunable calls met (stubbed or real) with their counts, and the number of stubs."""
    import jax

    with _stubbed(real) as stubs:
        jax.eval_shape(fn, *arrays)
    return list(stubs.calls.values()), stubs.stubs


def glue_function(fn: Callable[..., Any], real: tuple[str, str] | None = None
                  ) -> Callable[..., Any]:
    """``fn`` with its tunable calls stubbed, but those of ``real`` (a kernel's name and a
    key), which run as the hooks and the cache in force resolve them. To be traced between
    two ``jax.clear_caches()`` (JAX's trace caches do not know of stubs)."""

    def glue(*arrays: Any) -> Any:
        with _stubbed(real, clear=False):
            return fn(*arrays)

    return glue
