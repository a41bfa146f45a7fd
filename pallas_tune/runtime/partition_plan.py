"""How a partitioned call is split (:mod:`pallas_tune.runtime.partition`): the rule's names
for the call's shapes, which mesh axes split each name, the shardings that follow, and the
rule in Shardy's terms. Plain functions of shapes, specs and a mesh; nothing is traced here."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pallas_tune.errors import SearchSpaceError, warn

__all__ = ["Dims", "assign", "expand", "shardings", "shardy_rule", "summed"]

Shape = tuple[int, ...]


class Dims:
    """Each operand's and result's dimension names, ``...`` expanded for the call's ranks."""

    __slots__ = ("operands", "results")

    def __init__(self, operands: list[tuple[str, ...]], results: list[tuple[str, ...]]):
        self.operands, self.results = operands, results


def _expand(name: str, text: str, what: str, dims: tuple[str, ...], shape: Shape
            ) -> tuple[str, ...]:
    if dims[:1] == ("...",):
        lead = len(shape) - (len(dims) - 1)
        if lead >= 0:  # Leading dimensions named from the right: the last is ell0 everywhere.
            return tuple(f"ell{lead - 1 - j}" for j in range(lead)) + dims[1:]
    elif len(dims) == len(shape):
        return dims
    raise SearchSpaceError(f"{name}: its partition rule {text!r} gives {what} the dimensions "
                           f"{' '.join(dims)}, but its shape is {shape}.")


def expand(name: str, rule: Any, shapes: Sequence[Shape], out_shapes: Sequence[Shape]) -> Dims:
    """The rule's names for these operand and result shapes; SearchSpaceError where a count or
    a rank does not match, naming the rule."""
    if len(rule.results) != len(out_shapes):
        raise SearchSpaceError(f"{name}: its partition rule {rule.text!r} names "
                               f"{len(rule.results)} result(s); the call returns "
                               f"{len(out_shapes)} array(s).")
    ops = [_expand(name, rule.text, f"operand {n}", d, s)
           for n, (d, s) in enumerate(zip(rule.operands, shapes, strict=True))]
    res = [_expand(name, rule.text, f"result {n}", d, s)
           for n, (d, s) in enumerate(zip(rule.results, out_shapes, strict=True))]
    return Dims(ops, res)


def _sizes(dims: Dims, shapes: Sequence[Shape], out_shapes: Sequence[Shape]
           ) -> dict[str, set[int]]:
    sizes: dict[str, set[int]] = {}
    for d, s in zip(dims.operands + dims.results, list(shapes) + list(out_shapes), strict=True):
        for f, n in zip(d, s, strict=True):
            sizes.setdefault(f, set()).add(n)
    return sizes


def assign(name: str, dims: Dims, shapes: Sequence[Shape], out_shapes: Sequence[Shape],
           specs: Sequence[tuple[Any, ...]], mesh: Any, *, quiet: bool = False
           ) -> dict[str, tuple[str, ...]]:
    """Which mesh axes split each name: the first operand sharded along it decides; a name
    that cannot be split there (UPPERCASE, sizes the axes do not divide, axes already taken)
    is gathered, warned about unless ``quiet``."""
    sizes = _sizes(dims, shapes, out_shapes)
    assigned: dict[str, tuple[str, ...]] = {}
    used: set[str] = set()
    for n, (d, shape, spec) in enumerate(zip(dims.operands, shapes, specs, strict=True)):
        for j, (f, size, entry) in enumerate(zip(d, shape, spec, strict=True)):
            if entry is None or f in assigned:
                continue  # Replicated, or decided: this operand is resharded to match.
            axes = tuple(entry) if isinstance(entry, tuple | list) else (entry,)
            if not axes:
                continue
            k = math.prod(mesh.shape[a] for a in axes)
            if f[0].isupper():
                why = "the kernel keeps that dimension whole (it cannot be split)"
            elif used & set(axes):
                why = "those mesh axes already split another dimension of the call"
            elif any(s % k for s in sizes[f] if s != 1):
                why = f"its size {size} is not a multiple of the {k} shards"
            else:
                assigned[f] = axes
                used.update(axes)
                continue
            if not quiet:
                warn_gathered(name, n, j, f, axes if len(axes) > 1 else axes[0], why)
    return assigned


def summed(mesh_axes: dict[str, tuple[str, ...]], dims: tuple[str, ...], shape: Shape
           ) -> tuple[str, ...]:
    """The mesh axes a cotangent of these dimensions is summed over: those of every split name
    it lacks, or has only at size 1 (its operand was broadcast over them)."""
    kept = {f for f, n in zip(dims, shape, strict=True) if n != 1}
    return tuple(a for f, axes in mesh_axes.items() if f not in kept for a in axes)


def _spec(mesh_axes: dict[str, tuple[str, ...]], dims: tuple[str, ...], shape: Shape) -> Any:
    from jax.sharding import PartitionSpec

    entries = []
    for f, size in zip(dims, shape, strict=True):
        axes = mesh_axes.get(f) if size != 1 else None
        entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*entries)


def shardings(mesh: Any, dims: Dims, mesh_axes: dict[str, tuple[str, ...]],
              shapes: Sequence[Shape], out_shapes: Sequence[Shape]) -> tuple[list[Any], list[Any]]:
    """The operands' and results' ``NamedSharding``\\ s for the assignment."""
    from jax.sharding import NamedSharding

    return ([NamedSharding(mesh, _spec(mesh_axes, d, s))
             for d, s in zip(dims.operands, shapes, strict=True)],
            [NamedSharding(mesh, _spec(mesh_axes, d, s))
             for d, s in zip(dims.results, out_shapes, strict=True)])


def shardy_rule(dims: Dims, shapes: Sequence[Shape], out_shapes: Sequence[Shape]) -> str:
    """The rule as Shardy takes it (``custom_partitioning(sharding_rule=)``): one factor per
    (name, size), since a Shardy factor has one size (attention's query and KV heads)."""
    names: dict[tuple[str, int], str] = {}
    taken: set[str] = set()

    def factor(f: str, size: int) -> str:
        if (f, size) not in names:
            new = f if f not in taken else f"{f}_{len(taken)}"
            names[(f, size)] = new
            taken.add(new)
        return names[(f, size)]

    def side(all_dims: list[tuple[str, ...]], all_shapes: Sequence[Shape]) -> str:
        return ", ".join(" ".join(factor(f, n) for f, n in zip(d, s, strict=True))
                         for d, s in zip(all_dims, all_shapes, strict=True))

    lhs = side(dims.operands, shapes)
    return f"{lhs} -> {side(dims.results, out_shapes)}"


def warn_gathered(name: str, operand: int, dim: int, label: str, axes: Any, why: str) -> None:
    """Once per kernel, dimension and mesh axes: a sharded dimension gathered for the call."""
    marker = (name, operand, dim, label, tuple(axes) if isinstance(axes, tuple) else axes)
    if marker in _GATHERED:
        return
    _GATHERED.add(marker)
    warn(f"{name}: operand {operand} is sharded along its dimension {dim} ('{label}' in the "
         f"kernel's partition rule) over mesh axes {axes}, but {why}; that dimension is "
         "gathered for this call (an all-gather before it). To avoid it, shard that operand "
         "along other dimensions, or call the kernel inside jax.shard_map with the split you "
         "mean (a partial sum needs its psum there).")


_GATHERED: set[Any] = set()
