"""Finds the ``pallas_call``\\ s a function makes, by tracing it with abstract inputs.

This is how pallas-tune checks any kernel's candidates against the TPU block rules (and, later,
models their VMEM) without a hand-written estimator: trace ``fn(*args, **config)`` to a jaxpr,
walk it, and read each ``pallas_call``'s grid, block shapes, buffering and scratch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import jax
import numpy as np

from pallas_tune import _vma
from pallas_tune.feasibility.rules import block_rule_violations

__all__ = ["BlockInfo", "PallasCallInfo", "block_rule_violations", "find_pallas_calls"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockInfo:
    """One operand window of a pallas_call."""

    origin: str  # e.g. "args[0]", "outputs"
    block_shape: tuple[int | None, ...]  # Sizes; None: squeezed (size 1, dropped in the kernel).
    array_shape: tuple[int, ...]
    dtype: np.dtype
    buffer_count: int | None  # From pipeline_mode; None when not set (the default, 2).
    is_output: bool
    trivial_window: bool = False  # Whole array, constant index: Mosaic single-buffers it.
    memory_space: str = ""  # "" (default, VMEM window), or e.g. "any", "smem".
    grid_axes: tuple[int, ...] | None = None  # Grid axes its block index depends on (if known).
    # Per dim: "blocked", "squeezed", "element", "boundedslice", "indirect" (empty: unknown).
    dim_kinds: tuple[str, ...] = ()
    # Per dim, the largest first element any grid step's block starts at (None: unknown, e.g.
    # index maps with scalar-prefetch refs, or element/slice dims); None when not evaluated.
    max_start: tuple[int | None, ...] | None = None
    split_buffering: bool = False  # pl.Buffered((n_in, n_out)): emit_pipeline only.

    @property
    def block_bytes(self) -> int:
        dims = [b if b is not None else 1 for b in self.block_shape]
        return math.prod(dims) * self.dtype.itemsize


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class PallasCallInfo:
    name: str
    grid: tuple[int, ...]
    blocks: tuple[BlockInfo, ...]
    scratch: tuple[tuple[tuple[int, ...], np.dtype, str], ...]  # (shape, dtype, memory space)
    dimension_semantics: tuple[str, ...] | None
    vmem_limit_bytes: int | None
    # Values computed inside the kernel body: each dot as (result shape, result dtype,
    # contraction size, lhs dtype, operand shapes and dtypes), and the largest intermediate of any
    # op (what may spill from vector registers to VMEM).
    dots: tuple[tuple[Any, ...], ...] = ()
    largest_value: tuple[tuple[int, ...], np.dtype] | None = None
    # Non-dot values that live in registers between ops (not stored straight to a ref): each may
    # spill to VMEM when larger than the vector register file. (shape, dtype, copies): copies is
    # how many instances an unrolled loop around it keeps at once (1 outside such loops).
    live_values: tuple[tuple[tuple[int, ...], np.dtype, int], ...] = ()
    # Which Pallas backend lowers it: "mosaic_tpu", "triton" or "mosaic_gpu" (from the type of
    # its compiler params; a call without any is lowered for TPU by Mosaic when run on a TPU).
    backend: str = "mosaic_tpu"


def _block_dim(d: Any) -> tuple[int | None, str]:
    """(size, kind) of one block dim; size None for squeezed dims."""
    if isinstance(d, int | np.integer):
        return int(d), "blocked"
    kind = type(d).__name__.lower()
    if d is None or kind in ("squeezed", "mapped"):
        return None, "squeezed"
    size = getattr(d, "block_size", None)
    if isinstance(size, int | np.integer):
        return int(size), kind
    return None, kind


def _subjaxprs(params: dict[str, Any]) -> Iterator[Any]:
    def visit(v: Any) -> Iterator[Any]:
        if hasattr(v, "eqns"):  # Jaxpr
            yield v
        elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):  # ClosedJaxpr
            yield v.jaxpr
        elif isinstance(v, tuple | list):
            for x in v:
                yield from visit(x)

    for v in params.values():
        yield from visit(v)


def _walk(jaxpr: Any) -> Iterator[Any]:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
            continue  # Do not descend into the kernel body.
        for sub in _subjaxprs(eqn.params):
            yield from _walk(sub)


_STORES: Final = ("swap", "store", "masked_swap", "masked_store")


def _body_values(jaxpr: Any) -> tuple[list[Any], Any, list[Any]]:
    """(dot results, largest intermediate, live non-dot values) over a kernel body and its
    nested regions."""
    dots, largest, largest_bytes = [], None, -1
    live: list[Any] = []

    def visit(j: Any, copies: int) -> None:
        nonlocal largest, largest_bytes
        consumers: dict[Any, list[str]] = {}
        for e in j.eqns:
            for v in e.invars:
                if hasattr(v, "aval") and not hasattr(v, "val"):
                    consumers.setdefault(v, []).append(e.primitive.name)
        for e in j.eqns:
            for v in e.outvars:
                aval = getattr(v, "aval", None)
                shape, dtype = getattr(aval, "shape", None), getattr(aval, "dtype", None)
                if shape is None or dtype is None:
                    continue
                try:
                    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
                except TypeError:
                    continue
                if e.primitive.name == "dot_general":
                    lhs = e.invars[0].aval
                    (contract, _), _ = e.params["dimension_numbers"]
                    k = math.prod(lhs.shape[d] for d in contract)
                    operands = tuple((tuple(x.aval.shape), np.dtype(x.aval.dtype))
                                     for x in e.invars[:2])
                    dots.append((tuple(shape), np.dtype(dtype), int(k), np.dtype(lhs.dtype),
                                 operands))
                elif shape and e.primitive.name not in ("get", "load", *_STORES):
                    uses = consumers.get(v, [])
                    stored_only = uses and all(u in _STORES for u in uses)
                    # acc + dot stored straight back is fused by Mosaic; values that are only
                    # stored never live in registers between ops.
                    fused_acc = (e.primitive.name == "add" and all(u in _STORES for u in uses)
                                 and any(getattr(x, "aval", None) is not None for x in e.invars))
                    if not (stored_only or fused_acc):
                        live.append((tuple(shape), np.dtype(dtype), copies))
                if nbytes > largest_bytes:
                    largest, largest_bytes = (tuple(shape), np.dtype(dtype)), nbytes
            inner = copies * _unrolled_copies(e)
            for sub in _subjaxprs(e.params):
                visit(sub, inner)

    visit(jaxpr, 1)
    return dots, largest, live


def _unrolled_copies(eqn: Any) -> int:
    """How many iterations of a loop body the compiler sees at once: a scan's unroll factor
    (``lax.fori_loop(..., unroll=True)`` unrolls it fully), else 1."""
    if eqn.primitive.name != "scan":
        return 1
    length, unroll = int(eqn.params.get("length", 1)), eqn.params.get("unroll", 1)
    if unroll is True:
        return max(1, length)
    return max(1, min(int(unroll or 1), length))


def _eval_index_map(bm: Any, rank: int) -> Callable[[Sequence[int]], list[int]] | None:
    closed = getattr(bm, "index_map_jaxpr", None)
    if closed is None:
        return None
    from jax import core as jax_core

    jaxpr = getattr(closed, "jaxpr", closed)
    if len(jaxpr.invars) != rank:
        return None  # Scalar-prefetch refs as extra arguments.
    consts = getattr(closed, "consts", ())
    eval_jaxpr = getattr(jax_core, "eval_jaxpr", None)
    if eval_jaxpr is None:
        from jax._src.core import eval_jaxpr

    def f(idx: Sequence[int]) -> list[int]:
        return [int(x) for x in eval_jaxpr(jaxpr, consts, *(np.int32(i) for i in idx))]

    return f


def _probe_index_map(bm: Any, grid: tuple[int, ...]
                     ) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(grid axes the block index depends on, the largest block index per dim over the grid),
    by evaluating the index map at the origin, the unit steps and, per dim, the grid corner its
    slopes point to (exact for affine maps). None where unknown."""
    rank = len(grid)
    try:
        f = _eval_index_map(bm, rank)
        if f is None:
            return (None, None) if getattr(bm, "index_map_jaxpr", None) is not None else ((), None)
        zero = [0] * rank
        base = f(zero)
        slopes, axes = [], []
        for a in range(rank):
            step = f([1 if i == a else 0 for i in range(rank)])
            slopes.append([v - b for v, b in zip(step, base, strict=True)])
            if step != base:
                axes.append(a)
        if any(g <= 0 for g in grid):
            return tuple(axes), None
        best, seen = list(base), {}
        for d in range(len(base)):
            corner = tuple(g - 1 if slopes[a][d] > 0 else 0 for a, g in enumerate(grid))
            if corner not in seen:
                seen[corner] = f(corner)
            best[d] = max(best[d], seen[corner][d])
        return tuple(axes), tuple(best)
    except Exception:  # noqa: BLE001 - index maps we cannot evaluate: unknown.
        return None, None


def _max_start(sizes: Sequence[int | None], kinds: Sequence[str],
               max_index: tuple[int, ...] | None) -> tuple[int | None, ...] | None:
    if max_index is None or len(max_index) != len(sizes):
        return None
    out: list[int | None] = []
    for size, kind, idx in zip(sizes, kinds, max_index, strict=True):
        if kind == "blocked" and size is not None:
            out.append(idx * size)
        elif kind == "squeezed":
            out.append(idx)
        else:
            out.append(None)  # Element offsets (with padding) and slices: not checked.
    return tuple(out)


def _space_name(aval: Any) -> str:
    space = getattr(aval, "memory_space", None)
    if space is None:
        return ""
    text = str(getattr(space, "value", space)).lower()
    return "" if text in ("none", "default", "vmem", "memoryspace.default") else text


def _info(eqn: Any) -> PallasCallInfo:
    gm = eqn.params["grid_mapping"]
    n_in = gm.num_inputs
    grid = tuple(int(g) if isinstance(g, int | np.integer) else -1 for g in gm.grid)
    blocks = []
    for i, bm in enumerate(gm.block_mappings):
        aval = bm.array_aval
        mode = bm.pipeline_mode
        count = getattr(mode, "buffer_count", None) if mode is not None else None
        split = isinstance(count, tuple)
        if split:
            count = max(count)
        dims = [_block_dim(d) for d in bm.block_shape]
        sizes, kinds = tuple(d[0] for d in dims), tuple(d[1] for d in dims)
        axes, max_index = _probe_index_map(bm, grid)
        blocks.append(
            BlockInfo(
                origin=str(bm.origin),
                block_shape=sizes,
                array_shape=tuple(aval.shape),
                dtype=np.dtype(aval.dtype),
                buffer_count=count,
                is_output=i >= n_in,
                trivial_window=bool(getattr(bm, "has_trivial_window", lambda: False)()),
                grid_axes=axes,
                memory_space=_space_name(getattr(bm, "transformed_block_aval", None)),
                dim_kinds=kinds,
                max_start=_max_start(sizes, kinds, max_index),
                split_buffering=split,
            )
        )
    scratch = []
    for s in gm.scratch_avals:
        inner = getattr(s, "inner_aval", s)
        shape = tuple(getattr(inner, "shape", ()))
        dtype = getattr(inner, "dtype", None)
        space = str(getattr(s, "memory_space", "vmem")).lower()
        try:
            dtype = np.dtype(dtype)
        except TypeError:  # Semaphores and other non-array scratch.
            dtype = np.dtype("int32")
        scratch.append((shape, dtype, space))
    cp = _compiler_params(eqn)
    sem = getattr(cp, "dimension_semantics", None)
    if sem is not None:
        sem = tuple(str(getattr(s, "value", s)).lower() for s in sem)
    body = eqn.params.get("jaxpr")
    dots, largest, live = (_body_values(getattr(body, "jaxpr", body)) if body is not None
                           else ([], None, []))
    return PallasCallInfo(
        backend=_backend(cp),
        dots=tuple(dots),
        live_values=tuple(live),
        largest_value=largest,
        name=str(eqn.params.get("name") or getattr(eqn.params.get("name_and_src_info"), "name", "")),
        grid=grid,
        blocks=tuple(blocks),
        scratch=tuple(scratch),
        dimension_semantics=sem,
        vmem_limit_bytes=getattr(cp, "vmem_limit_bytes", None),
    )


def _compiler_params(eqn: Any) -> Any:
    """A pallas_call equation's compiler params (its ``pltpu.CompilerParams``), or None."""
    cp = eqn.params.get("compiler_params")
    if isinstance(cp, dict):  # Older JAX keyed compiler params by backend.
        cp = cp.get("mosaic_tpu") or cp.get("mosaic") or next(iter(cp.values()), None)
    return cp


def _backend(compiler_params: Any) -> str:
    module = type(compiler_params).__module__ if compiler_params is not None else ""
    if ".triton" in module:
        return "triton"
    if ".mosaic_gpu" in module:
        return "mosaic_gpu"
    return "mosaic_tpu"


def abstractify(args: Sequence[Any]) -> list[Any]:
    """Replaces arrays with ShapeDtypeStructs (leaves everything else untouched)."""

    def conv(a: Any) -> Any:
        if isinstance(a, jax.ShapeDtypeStruct):
            return a
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return jax.ShapeDtypeStruct(np.shape(a), a.dtype)
        return a

    return [jax.tree_util.tree_map(conv, a) for a in args]


def array_function(fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
                   ) -> tuple[Callable[..., Any], list[jax.ShapeDtypeStruct]]:
    """``fn(*args, **kwargs)`` as a function of its array leaves only (non-array arguments
    closed over as static), and those leaves as ShapeDtypeStructs (shardings kept). Arrays
    among the keywords (e.g. flash attention's ``segment_ids``) are leaves too, after the
    positional ones."""
    leaves, treedef = jax.tree_util.tree_flatten(abstractify(args))
    arrays_kw = {k: v for k, v in kwargs.items() if any(
        hasattr(x, "shape") and hasattr(x, "dtype") for x in jax.tree_util.tree_leaves(v))}
    kw_leaves, kw_tree = jax.tree_util.tree_flatten(abstractify([arrays_kw])[0])
    n = len(leaves)
    leaves = leaves + kw_leaves
    is_arr = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

    def flat_fn(*arrs: Any) -> Any:
        it = iter(arrs)
        full = [next(it) if a else x for x, a in zip(leaves, is_arr, strict=True)]
        if not arrays_kw:
            return fn(*jax.tree_util.tree_unflatten(treedef, full), **kwargs)
        return fn(*jax.tree_util.tree_unflatten(treedef, full[:n]),
                  **{**kwargs, **jax.tree_util.tree_unflatten(kw_tree, full[n:])})

    return flat_fn, [x for x, a in zip(leaves, is_arr, strict=True) if a]


def find_pallas_calls(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> list[PallasCallInfo]:
    """Traces ``fn(*args, **kwargs)`` abstractly and returns every pallas_call it makes.

    Non-array arguments are closed over (treated as static). Raises whatever tracing raises.
    Inside a ``shard_map`` that checks varying axes, the kernel is traced with the checks off
    (its config is judged by its blocks, not by how its outputs are typed: see ``_vma``).
    """
    flat_fn, arrays = array_function(fn, args, kwargs)
    with _vma.unchecked():
        closed = jax.make_jaxpr(flat_fn)(*arrays)
    return [_info(e) for e in _walk(closed.jaxpr)]
