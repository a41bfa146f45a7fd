"""A step's glue: everything but its tunable calls, for composed step estimates (issue 28).

Compiling a whole layer deviceless with its kernels in it can outgrow a host (libtpu's static
profile simulates every grid step of every kernel in one process: a Llama-3.1-8B layer passed
7.7 GB). :func:`pallas_tune.step.figures.composed` compiles instead the **glue**, the step with
every
tunable call replaced by a *stub* (:func:`glue_function`), once, and then each distinct call
alone (:func:`alone`), counted as often as the step uses it (:func:`live_counts`).

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

from pallas_tune import chips
from pallas_tune.config import Config
from pallas_tune.runtime import vjp as _vjp
from pallas_tune.runtime.tunable import current_hook, register_alternative, resolution_hook

__all__ = ["StubCall", "glue_function", "record"]


@dataclasses.dataclass
class StubCall:
    """One tunable call met while tracing the glue: the kernel, its abstract arguments and
    keywords, its key, how many times the step calls it, and which of its arguments (by
    position) are the step's own (its parameters, in HBM; the others are intermediates)."""

    kernel: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    key: str
    count: int = 1
    params: tuple[int, ...] = ()
    tag: int = 0  # Its index among the calls met: its stubs' names end with it.


class _Stubs:
    """While active: the calls met, and how many stubs were traced."""

    def __init__(self) -> None:
        self.calls: dict[tuple[str, str], StubCall] = {}
        self.stubs = 0
        self.inputs: tuple[Any, ...] = ()  # The step's own arguments, as traced.
        self.last = -1  # The tag of the call met last.

    def met(self, kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]
            ) -> tuple[str, str]:
        from pallas_tune.feasibility.inspect import abstractify

        key = kernel.cache_key(*args, **kwargs)
        found = self.calls.get((kernel.name, key))
        if found is not None:
            found.count += 1
        else:
            params = tuple(i for i, a in enumerate(args)
                           if any(_primal(a) is x for x in self.inputs))
            found = self.calls[(kernel.name, key)] = StubCall(
                kernel, tuple(abstractify(list(args))), dict(kwargs), key, params=params,
                tag=len(self.calls))
        self.last = found.tag  # For its stub, made right after.
        return kernel.name, key

    def produce(self, arrays: Sequence[Any], shapes: Any, tag: int = -1) -> Any:
        """Results of ``shapes`` (a pytree of ShapeDtypeStructs) from an empty kernel that
        takes ``arrays``; ``tag`` (a call's index in :attr:`calls`) goes into its name."""
        import jax
        from jax.experimental import pallas as pl

        leaves, tree = jax.tree.flatten(shapes)
        self.stubs += 1
        anywhere = pl.BlockSpec(memory_space=pl.ANY)
        outs = pl.pallas_call(
            _nothing, out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
            in_specs=[anywhere] * len(arrays), out_specs=[anywhere] * len(leaves),
            name=STUB if tag < 0 else f"{STUB}_{tag}")(*arrays)
        return jax.tree.unflatten(tree, list(outs))


def _primal(x: Any) -> Any:
    """The value under autodiff's wrapping (a JVP tracer's primal), to compare identities."""
    while hasattr(x, "primal"):
        x = x.primal
    return x


def _nothing(*refs: Any) -> None:
    """The stub's body: its results are never written (their values do not matter)."""


STUB = "pallas_tune_stub"
_ACTIVE: list[_Stubs] = []


def _stub(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any], config: Config) -> Any:
    """A tunable call under :func:`_stubbed`: the stub described in the module docstring."""
    import jax

    stubs = _ACTIVE[-1]
    tag = stubs.last  # Set by the resolution hook that sent this call here.

    def arrays(a: Sequence[Any]) -> list[Any]:  # Its own arguments: no closed-over tracer.
        return [x for x in a if _vjp._is_array(x)]

    def forward(*a: Any, **kw: Any) -> Any:
        return stubs.produce(arrays(a), jax.eval_shape(functools.partial(kernel.fn, **kw), *a),
                             tag)

    if kernel.backward_backend is None:
        return forward(*args, **kwargs, **config)
    residuals = None
    if kernel.backward_residuals is not None:
        def residuals(*a: Any, **kw: Any) -> Any:
            shapes = jax.eval_shape(functools.partial(kernel.backward_residuals, **kw), *a)
            return stubs.produce(arrays(a), shapes, tag)

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

    outer = current_hook()  # A setting's configs (pallas_tune.step.figures.settings), if any.
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
        def step(*a: Any) -> Any:
            stubs.inputs = a
            return fn(*a)

        jax.eval_shape(step, *arrays)
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


def live_counts(fn: Callable[..., Any], arrays: Sequence[Any], calls: Sequence[StubCall]
                ) -> list[int]:
    """Per call of :func:`record` (same order), how many of its occurrences the program uses:
    a call whose results nothing needs (a forward's output under ``jax.grad`` of a sum) is
    dropped by the compiler (a kernel without side effects) and costs nothing. Read from the
    glue's jaxpr by a liveness pass that, unlike JAX's own dead-code elimination, may drop a
    stub; a stub inside a nested jaxpr counts when that jaxpr's equation is live."""
    import jax

    with _stubbed():
        jaxpr = jax.make_jaxpr(fn)(*arrays).jaxpr
    found = [0] * len(calls)
    used = {id(v) for v in jaxpr.outvars}
    for eqn in reversed(jaxpr.eqns):
        if not eqn.effects and not any(id(v) in used for v in eqn.outvars):
            continue  # Dead: nothing reads it.
        _count_stubs(eqn, found)
        used.update(id(v) for v in eqn.invars if type(v).__name__ != "Literal")
    # Under jax.grad a forward's stub appears once per occurrence (its primal or its fwd rule).
    return [min(f, c.count) for f, c in zip(found, calls, strict=True)]


def _count_stubs(eqn: Any, found: list[int]) -> None:
    import jax.extend

    if eqn.primitive.name == "pallas_call":
        name = str(eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"),
                                                      "name", ""))
        if name.startswith(STUB + "_"):
            found[int(name.rsplit("_", 1)[1])] += 1
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        for inner in sub.eqns:
            _count_stubs(inner, found)


def alone(call: StubCall, grad: bool = False, forward: bool = True
          ) -> tuple[Callable[..., Any], list[Any], int]:
    """``(g, arrays, stubs)``: a program of ``call`` alone, as the hooks and cache in force resolve it:
    its arguments that are the step's own are the program's; the others are made inside the
    program by a stub, and its results are taken by one (so that each is placed where the step
    places it: parameters in HBM, intermediates where the compiler puts them). With ``grad``, the call's
    VJP too (a cotangent from a stub): a call whose gradient is XLA's autodiff of it; its
    forward's results are taken too where the step uses them (``forward``), else XLA may drop
    the forward (a dot's VJP needs only the inputs and the cotangent), as it does in the step.
    ``stubs``: how many stubs the program holds."""
    import jax

    where = [i for i, a in enumerate(call.args) if _vjp._is_array(a)]
    specs = [jax.ShapeDtypeStruct(call.args[i].shape, call.args[i].dtype) for i in where]

    inner = [k for k, i in enumerate(where) if i not in call.params]

    def g(*arrays: Any) -> Any:
        stubs = _Stubs()
        made = list(arrays)  # The step's own arguments stay arguments; the rest are made.
        if inner:
            for k, x in zip(inner, stubs.produce([arrays[k] for k in inner],
                                                 [specs[k] for k in inner]), strict=True):
                made[k] = x

        def run(*xs: Any) -> Any:
            full = list(call.args)
            for i, x in zip(where, xs, strict=True):
                full[i] = x
            return call.kernel(*full, **call.kwargs)

        if not grad:
            results = jax.tree.leaves(run(*made))
        else:
            out, vjp = jax.vjp(run, *made)
            cot = stubs.produce(made, jax.tree.map(
                lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype), out))
            results = (jax.tree.leaves(out) if forward else []) + [
                x for x in jax.tree.leaves(vjp(cot))
                if x.dtype != jax.dtypes.float0]  # Integer inputs have none.
        return stubs.produce(results, [jax.ShapeDtypeStruct((8, 128), "float32")])

    return g, specs, bool(inner) + 1 + grad
