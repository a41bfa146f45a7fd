"""Kernels under ``jax.jit`` on sharded arrays: split by the rule each kernel declares.

Mosaic cannot partition a ``pallas_call``: compiled for several TPU chips, a kernel whose
operands are sharded fails ("Mosaic kernels cannot be automatically partitioned"). A kernel that
declares ``@tunable(partition=RULE)`` splits itself instead whenever one of its array operands
carries a mesh of more than one device (a sharded ``jax.Array``, a ``ShapeDtypeStruct`` with a
``sharding``, a value computed from them under ``jit``) outside ``shard_map``; each device runs
the kernel on its shard, traced for the *shard's* shapes, with the config resolved for those
shapes and the mesh's chip. Calls on unsharded or single-device operands, and calls inside
``shard_map``, take the path they always took (one attribute read per operand decides).

- Mesh axes ``Explicit`` (``jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))``): the
  operands' specs are in their types at trace time, so the call becomes a ``jax.shard_map``
  over them (compiles for TPU, GPU and CPU alike).
- Mesh axes ``Auto`` (the default): the specs are known only when XLA partitions the program, so
  the call goes through ``jax.experimental.custom_partitioning``, whose callback traces the
  kernel per shard. libtpu does not run that callback ("Custom emitter for
  CustomSPMDPartitioning not found", even registered with its PJRT API), so on a TPU mesh such a
  call is left as written and warned about once (replicated operands still compile); CPU and
  GPU hosts partition it.

``RULE`` is an einsum-like string over the call's array positional arguments and its results,
e.g. ``"b h S D, b h T D, b h T D -> b h S D"`` (attention), ``"m K, K n -> m n"`` (a matmul),
``"... D, D -> ... D"`` (a norm over its last axis): one name per dimension, ``...`` for any
number of leading dimensions. A lowercase name may be split over mesh axes; an UPPERCASE one
(a contracted axis, the sequence axis of causal attention) is kept whole. Dimensions of one name
are split alike (attention's query and KV heads: the shard's query heads stay with their KV
heads), a dimension of size 1 is broadcast. Or a function of the call's arguments returning
such a string (flash attention: the query axis splits only without a causal mask or window).

Where an operand is sharded along a dimension that cannot be split (an UPPERCASE name, a size
the mesh axes do not divide, a mesh axis another dimension uses), that dimension is gathered
for the call, and a :class:`~pallas_tune.errors.PallasTuneWarning` says which operand, which
dimension and what to do; every other dimension stays sharded. Array keywords (flash
attention's ``segment_ids``) are refused with the way out (``shard_map``).

Gradients: the kernel's declared backward is split by the same rule (the cotangent as the
result, each operand's cotangent as the operand, summed over the mesh axes it was broadcast
over). A backward that needs the forward's residuals (``backward_residuals``, e.g. flash
attention's output and log-sum-exp) gets each device's own, kept by the forward (explicit
axes), or recomputes the forward on the shard (custom_partitioning).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pallas_tune import chips
from pallas_tune.errors import SearchSpaceError, warn
from pallas_tune.runtime import vjp as _vjp

__all__ = ["Rule", "call", "declared", "parse", "sharded", "splitting"]

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")


class Rule:
    """A parsed partition rule: each operand's and result's dimension names."""

    __slots__ = ("operands", "results", "text")

    def __init__(self, text: str, operands: tuple[tuple[str, ...], ...],
                 results: tuple[tuple[str, ...], ...]):
        self.text, self.operands, self.results = text, operands, results

    def __repr__(self) -> str:
        return f"Rule({self.text!r})"


@functools.lru_cache(maxsize=256)
def parse(text: str, name: str = "kernel") -> Rule:
    """``"b h S D, b h T D -> b h S D"`` as a :class:`Rule`; SearchSpaceError naming what is
    wrong otherwise."""
    if not isinstance(text, str) or text.count("->") != 1:
        raise SearchSpaceError(f"{name}: partition={text!r} must be an einsum-like string "
                               "'OPERANDS -> RESULTS', e.g. \"m K, K n -> m n\".")

    def side(part: str) -> tuple[tuple[str, ...], ...]:
        values = []
        for value in part.split(","):
            dims = tuple(value.split())
            bad = [d for d in dims if not (_NAME.match(d) or d == "...")]
            if bad or "..." in dims[1:] or not value.strip():
                raise SearchSpaceError(
                    f"{name}: partition={text!r}: {value.strip()!r} is not a list of dimension "
                    "names (letters, digits, _; '...' first for any leading dimensions).")
            values.append(dims)
        return tuple(values)

    lhs, rhs = text.split("->")
    return Rule(text, side(lhs), side(rhs))


def declared(name: str, partition: Any) -> Any:
    """What ``@tunable(partition=)`` declared, checked at declaration: None, a parsed rule, or
    a function of the call's arguments returning a rule string."""
    if partition is None or callable(partition):
        return partition
    return parse(partition, name)


def _mesh(x: Any) -> Any:
    return getattr(getattr(getattr(x, "aval", None), "sharding", None), "mesh", None)


def _operand_mesh(args: Sequence[Any]) -> Any:
    for a in args:
        mesh = _mesh(a)
        if mesh is not None and mesh.size > 1 and not mesh._any_axis_manual:  # noqa: SLF001
            return mesh
    return None


def _explicit(mesh: Any) -> bool:
    """Whether every axis of the mesh is Explicit: the operands' specs are in their types."""
    from jax.sharding import AxisType

    return all(t == AxisType.Explicit for t in mesh.axis_types)


def sharded(kernel: Any, args: Sequence[Any]) -> bool:
    """Whether to partition this call: an operand carries a mesh of several devices and no
    manual axis (outside ``shard_map``). The hot path's test, one attribute chain per argument.

    A TPU mesh with automatic axes is left to the call's usual path (warned once): its
    shardings are not in the operands' types, and libtpu does not run
    ``custom_partitioning``; replicated operands compile there, sharded ones fail in Mosaic."""
    mesh = _operand_mesh(args)
    if mesh is None:
        return False
    if _explicit(mesh) or getattr(getattr(mesh, "abstract_device", None), "platform",
                                   None) != "tpu":
        return True
    if kernel.name not in _WARNED:
        _WARNED.add(kernel.name)
        warn(f"{kernel.name}: called under jax.jit on arrays of a TPU mesh with automatic "
             f"axes {mesh.axis_names}: their shardings are not in their types at trace time, "
             "and libtpu does not run jax.experimental.custom_partitioning, so the call is "
             "compiled as written (Mosaic refuses sharded operands: 'cannot be automatically "
             "partitioned'). Give the mesh explicit axes (jax.make_mesh(..., axis_types="
             "(jax.sharding.AxisType.Explicit, ...)) and jax.set_mesh) so that the kernel splits "
             "itself by its operands' shardings, or call it inside jax.shard_map.")
    return False


def _is_array(a: Any) -> bool:
    return hasattr(a, "shape") and hasattr(a, "dtype")


def call(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """``kernel(*args, **kwargs)`` partitioned by its rule (see the module docstring)."""
    import jax

    rule = kernel.partition
    if callable(rule) and not isinstance(rule, Rule):
        rule = parse(rule(*args, **{k: v for k, v in kwargs.items()
                                    if k not in kernel.space.names}), kernel.name)
    where = [i for i, a in enumerate(args) if _is_array(a)]
    held = [k for k, v in kwargs.items() if v is not None and any(
        _is_array(x) for x in jax.tree_util.tree_leaves(v))]
    if held:
        raise NotImplementedError(
            f"{kernel.name}: a call on sharded arrays with array keyword(s) {held} cannot be "
            "partitioned by its rule; call it inside jax.shard_map, which gives it the shard's "
            "arrays.")
    if len(rule.operands) != len(where):
        raise SearchSpaceError(f"{kernel.name}: its partition rule {rule.text!r} names "
                               f"{len(rule.operands)} operand(s); the call has {len(where)} "
                               "array argument(s).")
    arrays = [args[i] for i in where]

    def full(local: Sequence[Any]) -> list[Any]:
        out, it = list(args), iter(local)
        for i in where:
            out[i] = next(it)
        return out

    def forward(*local: Any) -> Any:  # At the shard's shapes: resolved for them.
        return kernel(*full(local), **kwargs)

    reference = kernel.reference
    whole = (lambda *a: reference(*full(a), **_untuned(kernel, kwargs))) if reference else forward
    concrete = not any(isinstance(a, jax.core.Tracer) for a in arrays)
    if kernel.backward_backend is None:
        run = functools.partial(_partitioned, kernel, rule, forward, whole)
        return jax.jit(run)(*arrays) if concrete else run(*arrays)

    @jax.custom_vjp
    def differentiable(*operands: Any) -> Any:
        return _partitioned(kernel, rule, forward, whole, *operands)

    mesh = _operand_mesh(arrays)
    saving = (kernel.backward_residuals is not None and kernel.backward_backend == "pallas"
              and mesh is not None and _explicit(mesh))
    trees: list[Any] = []  # The residuals' structure, met when the forward is traced.

    def keeping(*local: Any) -> Any:  # The forward on a shard, its residuals kept.
        a = full(local)
        config = kernel.config_for(*a, **kwargs)
        if config.implementation != "pallas":
            raise NotImplementedError  # Caught below: the residuals are recomputed.
        with _vjp.interpreting():
            out, res = kernel.backward_residuals(*a, **_untuned(kernel, kwargs), **config)
        trees.append(jax.tree_util.tree_structure(res))
        return out, res

    def fwd(*operands: Any) -> tuple[Any, Any]:
        if saving:  # Flash attention's o and lse kept per device, not recomputed.
            kept: list[Any] = []
            try:
                out = _partitioned(kernel, rule, keeping, whole, *operands, keep=kept)
                return out, (operands, kept)
            except NotImplementedError:
                pass
        return differentiable(*operands), (operands, [])

    def bwd(res: Any, g: Any) -> tuple[Any, ...]:
        operands, kept = res
        return _backward(kernel, rule, args, kwargs, where, operands, g,
                         (kept, trees[-1]) if kept else None)

    differentiable.defvjp(fwd, bwd)
    return jax.jit(differentiable)(*arrays) if concrete else differentiable(*arrays)


def _untuned(kernel: Any, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in kernel.space.names}


def _backward(kernel: Any, rule: Rule, args: Sequence[Any], kwargs: Mapping[str, Any],
              where: Sequence[int], operands: Sequence[Any], g: Any,
              kept: tuple[list[Any], Any] | None = None) -> tuple[Any, ...]:
    """The operands' cotangents: the kernel's backward, partitioned as its forward; ``kept``:
    each device's residuals, stacked, and their structure (else they are recomputed)."""
    import jax
    import jax.numpy as jnp

    diff = [n for n, x in enumerate(operands) if jnp.issubdtype(x.dtype, jnp.inexact)]
    g_leaves, g_tree = jax.tree_util.tree_flatten(g)
    grad_rule = Rule(f"{rule.text} (backward)", rule.operands + rule.results,
                     tuple(rule.operands[n] for n in diff))
    plain = _untuned(kernel, kwargs)

    def full(local: Sequence[Any]) -> list[Any]:
        out, it = list(args), iter(local)
        for i in where:
            out[i] = next(it)
        return out

    def grads(*local: Any) -> tuple[Any, ...]:
        n_ct = len(g_leaves)
        a, ct = full(local[:len(where)]), g_tree.unflatten(local[len(where):len(where) + n_ct])
        if kept is not None:  # The forward's residuals on this device.
            res = kept[1].unflatten(local[len(where) + n_ct:])
            got = _vjp._select(kernel.name, kernel.backward(*res, ct, **plain),  # noqa: SLF001
                               len(args), where)
        elif kernel.backward_backend == "xla" or not _pallas_here(kernel, a, kwargs):
            got = _vjp._xla_backward(kernel.reference, a, plain, ct, where)  # noqa: SLF001
        elif kernel.backward_residuals is not None:  # Its residuals: the forward again.
            config = kernel.config_for(*a, **kwargs)
            with _vjp.interpreting():
                _, res = kernel.backward_residuals(*a, **plain, **config)
            got = _vjp._select(kernel.name, kernel.backward(*res, ct, **plain),  # noqa: SLF001
                               len(args), where)
        else:
            got = _vjp._select(kernel.name, kernel.backward(*a, ct, **plain),  # noqa: SLF001
                               len(args), where)
        return tuple(got[n] for n in diff)

    def whole(*local: Any) -> tuple[Any, ...]:
        if kernel.reference is None:
            return grads(*local)
        a, ct = full(local[:len(where)]), g_tree.unflatten(local[len(where):])
        got = _vjp._xla_backward(kernel.reference, a, plain, ct, where)  # noqa: SLF001
        return tuple(got[n] for n in diff)

    out = iter(_partitioned(kernel, grad_rule, grads, whole, *operands, *g_leaves, reduce=True,
                            kept=kept[0] if kept is not None else ()))
    cts = [next(out) if n in diff else None for n in range(len(operands))]
    mesh = _operand_mesh(operands)
    if mesh is not None and _explicit(mesh):  # Typed as its operand (a gathered dimension).
        cts = [ct if ct is None or jax.typeof(ct).sharding.spec == jax.typeof(x).sharding.spec
               else jax.sharding.reshard(ct, jax.typeof(x).sharding)
               for ct, x in zip(cts, operands, strict=True)]
    return tuple(cts)


def _pallas_here(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether the forward at these (shard) shapes runs the kernel (not XLA, by its entry)."""
    return kernel.config_for(*args, **kwargs).implementation == "pallas"


def _partitioned(kernel: Any, rule: Rule, local: Callable[..., Any], whole: Callable[..., Any],
                 *arrays: Any, reduce: bool = False, keep: list[Any] | None = None,
                 kept: Sequence[Any] = ()) -> Any:
    """``local`` on each shard of ``arrays``: a ``shard_map`` where their specs are in their
    types (explicit mesh axes), else ``custom_partitioning`` (the specs known when XLA
    partitions; ``whole``, the reference where there is one, is what JAX traces for the
    result's type). ``reduce`` (cotangents): a result is summed over the mesh axes of every
    split name it lacks (or has only at size 1), as its operand was broadcast over them.
    Explicit axes only: ``keep`` (a list): ``local`` returns ``(result, residuals)``, and the
    residuals, each device's own, are appended to it stacked along a new axis over every mesh
    axis; ``kept``: such stacks, given back to ``local`` (after the arrays) as each device's."""
    import jax

    from pallas_tune.runtime import partition_plan as plan

    shapes = [tuple(a.shape) for a in arrays]
    plain = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    # The result's shapes, typed apart from any mesh in force (explicit axes would ask some
    # ops, e.g. ragged_dot, for an out_sharding).
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        result = jax.eval_shape(whole, *plain)
    out_shapes = [tuple(o.shape) for o in jax.tree_util.tree_leaves(result)]
    dims = plan.expand(kernel.name, rule, shapes, out_shapes)
    mesh = _operand_mesh(arrays)

    def summing(specs: Any, out_tree: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        sums = [plan.summed(specs, d, s) if reduce else ()
                for d, s in zip(dims.results, out_shapes, strict=True)]

        def run(*shards: Any) -> Any:
            out = jax.tree_util.tree_leaves(fn(*shards))
            return out_tree.unflatten([jax.lax.psum(o, axes) if axes else o
                                       for o, axes in zip(out, sums, strict=True)])
        return run

    if mesh is not None and _explicit(mesh):
        from jax.sharding import NamedSharding

        types = [jax.typeof(a).sharding.spec for a in arrays]
        specs = plan.assign(kernel.name, dims, shapes, out_shapes,
                            [tuple(t) + (None,) * (len(s) - len(t)) for t, s in
                             zip(types, shapes, strict=True)], mesh)
        arg_sh, out_sh = plan.shardings(mesh, dims, specs, shapes, out_shapes)
        arrays = tuple(a if tuple(jax.typeof(a).sharding.spec) == tuple(sh.spec) else
                       jax.sharding.reshard(a, NamedSharding(mesh, sh.spec))
                       for a, sh in zip(arrays, arg_sh, strict=True))
        out_tree = jax.tree_util.tree_structure(result)
        out_specs = out_tree.unflatten([sh.spec for sh in out_sh])
        each = jax.sharding.PartitionSpec(tuple(mesh.axis_names))  # One slice per device.
        body = summing(specs, out_tree, local)
        if kept:
            body = _unstacking(body, len(arrays))
        if keep is not None:
            body, out_specs = _stacking(local, out_tree), (out_specs, each)
        out = jax.shard_map(body, mesh=mesh, in_specs=(*(sh.spec for sh in arg_sh),
                                                       *[each] * len(kept)),
                            out_specs=out_specs, check_vma=False)(*arrays, *kept)
        if keep is None:
            return out
        keep.extend(out[1])
        return out[0]
    return _custom_partitioned(kernel, dims, shapes, out_shapes, summing, local, whole,
                               arrays)


def _stacking(local: Callable[..., Any], out_tree: Any) -> Callable[..., Any]:
    import jax

    def run(*shards: Any) -> Any:
        out, residuals = local(*shards)
        return (out_tree.unflatten(jax.tree_util.tree_leaves(out)),
                [r[None] for r in jax.tree_util.tree_leaves(residuals)])
    return run


def _unstacking(body: Callable[..., Any], n: int) -> Callable[..., Any]:
    def run(*shards: Any) -> Any:
        return body(*shards[:n], *[r[0] for r in shards[n:]])
    return run


def _custom_partitioned(kernel: Any, dims: Any, shapes: Any, out_shapes: Any,
                        summing: Callable[..., Any], local: Callable[..., Any],
                        whole: Callable[..., Any], arrays: Sequence[Any]) -> Any:
    """Through ``jax.experimental.custom_partitioning`` (CPU and GPU hosts)."""
    import jax
    from jax.experimental.custom_partitioning import custom_partitioning

    from pallas_tune.runtime import partition_plan as plan

    op = custom_partitioning(whole)

    def partition(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        specs = plan.assign(kernel.name, dims, shapes, out_shapes,
                            _specs(arg_shapes, len(shapes)), mesh)
        arg_sh, out_sh = plan.shardings(mesh, dims, specs, shapes, out_shapes)
        out_tree = jax.tree_util.tree_structure(result_shape)
        run = summing(specs, out_tree, local)

        def lower(*shards: Any) -> Any:
            _SPLITTING.append(mesh)
            try:
                with _chip_of(mesh):
                    return run(*shards)
            finally:
                _SPLITTING.pop()

        return mesh, lower, out_tree.unflatten(out_sh), tuple(arg_sh)

    def infer(mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        specs = plan.assign(kernel.name, dims, shapes, out_shapes,
                            _specs(arg_shapes, len(shapes)), mesh, quiet=True)
        out_sh = plan.shardings(mesh, dims, specs, shapes, out_shapes)[1]
        return jax.tree_util.tree_structure(result_shape).unflatten(out_sh)

    op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule=plan.shardy_rule(dims, shapes, out_shapes))
    return op(*arrays)


def _specs(arg_shapes: Any, n: int) -> list[tuple[Any, ...]]:
    """Each operand's partition spec (one entry per dimension), replicated where unknown."""
    out = []
    for s in list(arg_shapes)[:n]:
        spec = tuple(getattr(getattr(s, "sharding", None), "spec", ()) or ())
        out.append(spec + (None,) * (len(s.shape) - len(spec)))
    return out


def _chip_of(mesh: Any) -> Any:
    """The mesh's chip as the target of what is traced for a shard (a deviceless TPU mesh from
    a CPU host: its configs, Mosaic's lowering); nothing for a mesh of this host's devices."""
    import contextlib

    device = mesh.devices.flat[0]
    if getattr(device, "platform", None) in ("tpu", "gpu") and chips.should_interpret():
        return chips.target(device.device_kind)
    return contextlib.nullcontext()


_WARNED: set[Any] = set()
_SPLITTING: list[Any] = []  # The meshes custom_partitioning's callbacks are splitting over.


def splitting() -> str:
    """The mesh the kernel call traced now runs split over, as ``"data=2,model=2"``: a
    ``shard_map``'s (the kernel's own or the caller's), or the one a custom_partitioning
    callback is splitting over; ``""`` outside any."""
    import jax

    mesh = _SPLITTING[-1] if _SPLITTING else jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or not (_SPLITTING or mesh._any_axis_manual):  # noqa: SLF001
        return ""  # Not inside a shard_map (a mesh merely set, jax.set_mesh, splits nothing).
    return ",".join(f"{name}={size}" for name, size in dict(mesh.shape).items())
