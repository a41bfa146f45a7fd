"""Kernels inside ``jax.shard_map`` with its defaults (``check_vma=True``).

Inside such a shard_map every value's type says over which mesh axes it varies, and a
``pallas_call`` must declare that of each output (``ShapeDtypeStruct(manual_axis_type=...)``).
No shipped kernel, no upstream kernel (splash, megablox, ragged paged attention) and no user
kernel written before that rule declares it, and JAX's HLO interpreter (interpret mode on a CPU
host) cannot run a kernel whose blocks vary at all: it lowers the kernel body with the mesh's
checks on and fails on the first op that mixes a block with a constant.

So pallas-tune types the call, not the kernel:

- :func:`align`: before the call (outside its custom VJP), every array operand is cast to vary
  over the union of the operands' varying axes (``jax.lax.pcast(..., to="varying")``). Its
  transpose is a ``psum``: the gradient of a weight replicated over the data axis is summed over
  it, exactly as JAX does for the same ``jnp`` code.
- :func:`typed_call`: the kernel body (its ``pallas_call``\\s) is traced with the checks off and
  its outputs are cast to vary over those axes, *inside* the custom VJP, so that no ``psum``
  is transposed into the backward pass (the declared backward gives the cotangents, itself
  typed the same way). In interpret mode the body runs on JAX's TPU interpreter
  (``pltpu.InterpretParams``), which lowers under the mesh's checks (JAX 0.11 and newer: JAX
  0.10's hangs there, so a CPU host on 0.10 gets a clear error); on a TPU nothing changes
  but the types: Mosaic's program is the one a ``check_vma=False`` shard_map would compile.

Outside a checking shard_map both are the identity, at the cost of reading one config flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["align", "checking", "typed_call", "typed_vjp_call", "unchecked"]


_FLAG: list[Any] = []  # JAX's check_vma state, looked up once (a call's hot path reads it).


def _flag() -> Any:
    if not _FLAG:
        try:
            from jax._src import config as jax_config

            _FLAG.append(jax_config._check_vma)
        except (ImportError, AttributeError):  # A JAX without varying-axis types.
            _FLAG.append(None)
    return _FLAG[0]


def checking() -> bool:
    """Whether the trace in progress is inside a ``shard_map`` that checks varying axes."""
    flag = _flag()
    return bool(flag is not None and flag.value)


def _varying(tree: Any) -> frozenset[Any]:
    import jax

    axes: frozenset[Any] = frozenset()
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            mat = getattr(jax.typeof(leaf), "mat", None)
            if mat is not None:
                axes |= mat.varying
    return axes


def _cast(tree: Any, axes: frozenset[Any]) -> Any:
    import jax

    def cast(leaf: Any) -> Any:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            return leaf
        mat = getattr(jax.typeof(leaf), "mat", None)
        missing = tuple(sorted(axes - (mat.varying if mat is not None else frozenset()),
                               key=str))
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree_util.tree_map(cast, tree)


def align(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """``(args, kwargs)`` with every array cast to vary over all the axes any of them varies
    over; unchanged outside a checking shard_map."""
    if not checking():
        return args, kwargs
    axes = _varying((args, kwargs))
    return _cast((args, kwargs), axes) if axes else (args, kwargs)


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Varying-axis checks off for what is traced inside (a candidate judged by its trace)."""
    flag = _flag()
    if flag is None or not flag.value:
        yield
        return
    with flag(False):
        yield


def interpreter_runs_sharded() -> bool:
    """Whether this JAX's TPU interpreter runs kernels inside a checking shard_map: from JAX
    0.11 on. JAX 0.10.2's hangs there on scalar-prefetch kernels (hstu attention, megablox,
    upstream flash attention: measured on four host devices), so it is not used at all."""
    import jax

    try:
        return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
    except ValueError:
        return True


@contextlib.contextmanager
def tpu_interpreter(refusal: Callable[[], str | None]) -> Iterator[None]:
    """Where pallas-tune interprets kernels with the HLO interpreter (a CPU host), the block
    runs on JAX's TPU interpreter instead: only it types a checking shard_map's shards and
    simulates remote DMAs. ``refusal()`` says why it cannot run there (raised as
    NotImplementedError), or None. A TPU compile, or the user's own interpret params, are left
    as they are."""
    from jax._src import config as jax_config
    from jax.experimental.pallas import tpu as pltpu

    state = jax_config.pallas_tpu_interpret_mode_context_manager
    if state.value is not True:  # Off (compiling for a TPU), or the user's own params.
        yield
        return
    reason = refusal()
    if reason:
        raise NotImplementedError(reason)
    prev = state.swap_local(pltpu.InterpretParams())
    try:
        yield
    finally:
        state.set_local(prev)


def _sharded_refusal() -> str | None:
    if interpreter_runs_sharded():
        return None
    import jax

    return (f"JAX {jax.__version__}'s Pallas interpreters cannot run a kernel inside a "
            "jax.shard_map that checks varying axes (check_vma=True, its default) on a host "
            "without a TPU: the HLO interpreter fails on the shard's types and the TPU "
            "interpreter hangs on some kernels. Use JAX 0.11 or newer (pip install -U jax), "
            "pass check_vma=False to jax.shard_map, or run on a TPU, where this works.")


def _tpu_interpreter() -> contextlib.AbstractContextManager[None]:
    return tpu_interpreter(_sharded_refusal)


def typed_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a kernel body called inside pallas-tune's own custom VJP,
    typed for a checking shard_map (see above)."""
    if not checking():
        return fn(*args, **kwargs)
    axes = _varying((args, kwargs))
    with _tpu_interpreter(), unchecked():
        out = fn(*args, **kwargs)
    return _cast(out, axes) if axes else out


def _strip(x: Any) -> Any:
    """``x`` typed as varying over no axis, for a trace with the checks off (where an op types
    its result so); its derivative is the identity."""
    import jax.numpy as jnp

    if jnp.issubdtype(x.dtype, jnp.number):
        return x * jnp.ones((), x.dtype)
    return x


def typed_vjp_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for a kernel with no backward declared to pallas-tune (an
    upstream adapter with a custom VJP of its own, or none), typed for a checking shard_map.

    Its outputs are cast inside a custom VJP of ours whose backward is ``fn``'s own VJP, taken
    with the checks off: casting them outside would transpose into a ``psum`` of the cotangent
    over the shards."""
    if not checking():
        return fn(*args, **kwargs)
    import jax
    import jax.numpy as jnp

    axes = _varying((args, kwargs))
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    where = [i for i, x in enumerate(leaves) if hasattr(x, "shape") and hasattr(x, "dtype")]

    def run(*arrays: Any) -> Any:  # Traced with the checks off.
        full = list(leaves)
        for i, a in zip(where, arrays, strict=True):
            full[i] = a
        a, k = tree.unflatten(full)
        return fn(*a, **k)

    # fn sees its operands typed as varying over no axis, as a check_vma=False shard_map would
    # give them, so that its own custom VJPs (upstream kernels have them) see one type.
    @jax.custom_vjp
    def call(*arrays: Any) -> Any:
        with _tpu_interpreter(), unchecked():
            out = run(*map(_strip, arrays))
        return _cast(out, axes)

    def fwd(*arrays: Any) -> tuple[Any, Any]:
        with _tpu_interpreter(), unchecked():
            out, vjp = jax.vjp(run, *map(_strip, arrays))
        return _cast(out, axes), vjp

    def bwd(vjp: Any, g: Any) -> tuple[Any, ...]:
        with _tpu_interpreter(), unchecked():
            # The cotangent typed as fn's unchecked outputs are, as its VJP expects.
            cts = vjp(jax.tree_util.tree_map(_strip, g))
        return tuple(None if not jnp.issubdtype(leaves[i].dtype, jnp.inexact) else _cast(ct, axes)
                     for i, ct in zip(where, cts, strict=True))

    call.defvjp(fwd, bwd)
    return call(*[leaves[i] for i in where])
