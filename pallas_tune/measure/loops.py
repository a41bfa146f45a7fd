"""What libtpu's static profile cannot know about a Pallas kernel (see :mod:`.estimate`): loops
whose trip count only the data knows, and scalar-prefetch operands, whose values it takes as 0."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["PREFETCH_NOTE", "data_dependent_loops", "dynamic_loop_message", "kernel_census",
           "prefetch_kernels"]


def kernel_census(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                  chip: str) -> tuple[int, int]:
    """(loops, prefetch kernels) of the Pallas kernels of ``fn(*args, **kwargs)``, from one
    trace: how many loops inside them have a trip count that is not static (``while`` in a
    kernel's jaxpr: ``lax.while_loop``, or ``fori_loop`` over traced bounds, e.g. a length read
    from memory), outside the else branches of conditionals; and how many of them take
    scalar-prefetch operands (``PrefetchScalarGridSpec``: group, page or length tables).

    libtpu's static profile cannot know such a trip count and counts a fixed guess whatever the
    data (libtpu 0.0.50.1: JAX's ragged paged attention over 2.1 GB of KV cache "estimated" at
    14 us), so an estimate of such a kernel would rank configs on made-up work. Prefetched
    values it takes as 0 (:data:`PREFETCH_NOTE`): such an estimate is made, with a caveat.
    """
    import jax

    from pallas_tune import chips
    from pallas_tune.feasibility import inspect as _inspect

    def count(jaxpr: Any, inside: bool) -> tuple[int, int]:
        loops = prefetch = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            loops += inside and name == "while"
            if name == "pallas_call":
                prefetch += getattr(eqn.params["grid_mapping"], "num_index_operands", 0) > 0
                subs = [eqn.params["jaxpr"]]
            elif name == "cond" and len(eqn.params["branches"]) == 2:
                # Loops are looked for in the true branch only (a loop in an else branch
                # changed nothing: JAX's paged attention estimates identically without it).
                subs = [eqn.params["branches"][1]]
            else:
                subs = list(_inspect._subjaxprs(eqn.params))
            for sub in subs:
                sub_loops, sub_prefetch = count(getattr(sub, "jaxpr", sub),
                                                inside or name == "pallas_call")
                loops, prefetch = loops + sub_loops, prefetch + sub_prefetch
        return loops, prefetch

    flat_fn, arrays = _inspect.array_function(fn, args, kwargs)
    with chips.target(chip, abstract_mesh=True):
        closed = jax.make_jaxpr(flat_fn)(*arrays)
    return count(closed.jaxpr, False)


def data_dependent_loops(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                         chip: str) -> int:
    """The loops of :func:`kernel_census`: those whose trip count only the data knows."""
    return kernel_census(fn, args, kwargs, chip=chip)[0]


def prefetch_kernels(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                     chip: str) -> int:
    """The kernels of :func:`kernel_census` with scalar-prefetch operands, whose static
    estimate does not follow the data (:data:`PREFETCH_NOTE`)."""
    return kernel_census(fn, args, kwargs, chip=chip)[1]


def dynamic_loop_message(ref: str, loops: int) -> str:
    return (f"no static estimate for {ref}: its Pallas kernel has {loops} loop(s) whose trip "
            "count is only known at run time (while_loop, or fori_loop over values read from "
            "the inputs), and libtpu's static profile counts such a loop as a fixed guess, not "
            "by the data. Time it on a TPU (--timer wallclock), or use a config without such "
            "loops.")


PREFETCH_NOTE = ("libtpu's static profile takes scalar-prefetch values as 0 (measured, libtpu "
                 "0.0.50.1: the same matmul under pl.when(s[i] == 0) counts, under s[i] == 1 "
                 "it does not), so work and block indices that depend on them are not "
                 "modelled: configs whose cost depends on them are not ranked by it")

