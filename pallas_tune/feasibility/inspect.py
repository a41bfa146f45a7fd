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

__all__ = ["BlockInfo", "PallasCallInfo", "block_rule_violations", "find_pallas_calls"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockInfo:
    """One operand window of a pallas_call."""

    origin: str  # e.g. "args[0]", "outputs"
    block_shape: tuple[int | None, ...]  # None: squeezed or not a plain blocked dim.
    array_shape: tuple[int, ...]
    dtype: np.dtype
    buffer_count: int | None  # From pipeline_mode; None when not set (the default, 2).
    is_output: bool
    trivial_window: bool = False  # Whole array, constant index: Mosaic single-buffers it.
    memory_space: str = ""  # "" (default, VMEM window), or e.g. "any", "smem".
    grid_axes: tuple[int, ...] | None = None  # Grid axes its block index depends on (if known).

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
    # spill to VMEM when larger than the vector register file. Shapes and dtypes.
    live_values: tuple[tuple[tuple[int, ...], np.dtype], ...] = ()
    # Which Pallas backend lowers it: "mosaic_tpu", "triton" or "mosaic_gpu" (from the type of
    # its compiler params; a call without any is lowered for TPU by Mosaic when run on a TPU).
    backend: str = "mosaic_tpu"


def _block_dim(d: Any) -> int | None:
    if isinstance(d, int):
        return d
    size = getattr(d, "block_size", None)
    if type(d).__name__ == "Blocked" and isinstance(size, int):
        return size
    return None  # Squeezed, Element, BoundedSlice: not subject to the tiling rule.


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

    def visit(j: Any) -> None:
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
                        live.append((tuple(shape), np.dtype(dtype)))
                if nbytes > largest_bytes:
                    largest, largest_bytes = (tuple(shape), np.dtype(dtype)), nbytes
            for sub in _subjaxprs(e.params):
                visit(sub)

    visit(jaxpr)
    return dots, largest, live


def _dependent_axes(bm: Any, rank: int) -> tuple[int, ...] | None:
    """Which grid axes the block index depends on, by evaluating the index map (None: unknown,
    e.g. with scalar-prefetch operands)."""
    closed = getattr(bm, "index_map_jaxpr", None)
    if closed is None or rank == 0:
        return ()
    try:
        from jax import core as jax_core

        jaxpr = getattr(closed, "jaxpr", closed)
        if len(jaxpr.invars) != rank:
            return None
        consts = getattr(closed, "consts", ())
        eval_jaxpr = getattr(jax_core, "eval_jaxpr", None)
        if eval_jaxpr is None:
            from jax._src.core import eval_jaxpr
        base = [int(x) for x in eval_jaxpr(jaxpr, consts, *([np.int32(0)] * rank))]
        axes = []
        for a in range(rank):
            idx = [np.int32(0)] * rank
            idx[a] = np.int32(1)
            if [int(x) for x in eval_jaxpr(jaxpr, consts, *idx)] != base:
                axes.append(a)
        return tuple(axes)
    except Exception:  # noqa: BLE001 - index maps we cannot evaluate: unknown.
        return None


def _space_name(aval: Any) -> str:
    space = getattr(aval, "memory_space", None)
    if space is None:
        return ""
    text = str(getattr(space, "value", space)).lower()
    return "" if text in ("none", "default", "vmem", "memoryspace.default") else text


def _info(eqn: Any) -> PallasCallInfo:
    gm = eqn.params["grid_mapping"]
    n_in = gm.num_inputs
    blocks = []
    for i, bm in enumerate(gm.block_mappings):
        aval = bm.array_aval
        mode = bm.pipeline_mode
        count = getattr(mode, "buffer_count", None) if mode is not None else None
        if isinstance(count, tuple):
            count = max(count)
        blocks.append(
            BlockInfo(
                origin=str(bm.origin),
                block_shape=tuple(_block_dim(d) for d in bm.block_shape),
                array_shape=tuple(aval.shape),
                dtype=np.dtype(aval.dtype),
                buffer_count=count,
                is_output=i >= n_in,
                trivial_window=bool(getattr(bm, "has_trivial_window", lambda: False)()),
                grid_axes=_dependent_axes(bm, len(gm.grid)),
                memory_space=_space_name(getattr(bm, "transformed_block_aval", None)),
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
    cp = eqn.params.get("compiler_params")
    if isinstance(cp, dict):  # Older JAX keyed compiler params by backend.
        cp = cp.get("mosaic_tpu") or cp.get("mosaic") or next(iter(cp.values()), None)
    backend = _backend(cp)
    sem = getattr(cp, "dimension_semantics", None)
    if sem is not None:
        sem = tuple(str(getattr(s, "value", s)).lower() for s in sem)
    grid = tuple(int(g) if isinstance(g, int | np.integer) else -1 for g in gm.grid)
    body = eqn.params.get("jaxpr")
    dots, largest, live = (_body_values(getattr(body, "jaxpr", body)) if body is not None
                           else ([], None, []))
    return PallasCallInfo(
        backend=backend,
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
    closed over as static), and those leaves as ShapeDtypeStructs (shardings kept)."""
    leaves, treedef = jax.tree_util.tree_flatten(abstractify(args))
    is_arr = [isinstance(x, jax.ShapeDtypeStruct) for x in leaves]

    def flat_fn(*arrs: Any) -> Any:
        it = iter(arrs)
        full = [next(it) if a else x for x, a in zip(leaves, is_arr, strict=True)]
        return fn(*jax.tree_util.tree_unflatten(treedef, full), **kwargs)

    return flat_fn, [x for x, a in zip(leaves, is_arr, strict=True) if a]


def find_pallas_calls(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
) -> list[PallasCallInfo]:
    """Traces ``fn(*args, **kwargs)`` abstractly and returns every pallas_call it makes.

    Non-array arguments are closed over (treated as static). Raises whatever tracing raises.
    """
    flat_fn, arrays = array_function(fn, args, kwargs)
    closed = jax.make_jaxpr(flat_fn)(*arrays)
    return [_info(e) for e in _walk(closed.jaxpr)]


def block_rule_violations(calls: Sequence[PallasCallInfo], *, sublanes: int = 8,
                          lanes: int = 128) -> list[str]:
    """Returns the TPU block-rule violations of the given pallas_calls (empty: all fine).

    Rules (notes/pallas-on-cpu.md §5, checked by Mosaic at lowering or by XLA at compile time):
    every blocked dim divides its array dim (or equals it), and the last two dims of a rank ≥ 2
    block are multiples of (sublanes, lanes) or equal the full array dims.
    """
    problems = []
    for call in calls:
        if call.backend != "mosaic_tpu":
            continue  # GPU backends have rules of their own (Triton: power-of-two shapes).
        for b in call.blocks:
            where = f"{call.name or 'pallas_call'} {b.origin}"
            for axis, (blk, full) in enumerate(zip(b.block_shape, b.array_shape, strict=True)):
                if blk is None or blk == full:
                    continue
                if blk <= 0 or full % blk != 0:
                    problems.append(
                        f"{where}: block dim {axis} = {blk} does not divide array dim {full}"
                    )
            rank = len(b.block_shape)
            if rank >= 2:
                for axis, mult in ((rank - 2, sublanes), (rank - 1, lanes)):
                    blk, full = b.block_shape[axis], b.array_shape[axis]
                    if blk is None or blk == full or blk % mult == 0:
                        continue
                    problems.append(
                        f"{where}: block dim {axis} = {blk} is neither a multiple of {mult} nor "
                        f"the full array dim {full}"
                    )
            elif rank == 1:
                blk, full = b.block_shape[0], b.array_shape[0]
                min_pow2 = lanes * max(1, 32 // (8 * b.dtype.itemsize))
                is_pow2 = blk is not None and blk > 0 and blk & (blk - 1) == 0
                if (
                    blk is not None
                    and blk != full
                    and blk % (sublanes * lanes) != 0
                    and not (is_pow2 and blk >= min_pow2)
                ):
                    problems.append(
                        f"{where}: rank-1 block {blk} is not the full dim {full}, a multiple of "
                        f"{sublanes * lanes}, or a power of two >= {min_pow2}"
                    )
    return problems
