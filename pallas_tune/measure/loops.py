"""What libtpu's static profile cannot know about a Pallas kernel (see :mod:`.estimate`): loops
whose trip count only the data knows, and scalar-prefetch operands, whose values it takes as 0,
so that a block whose index follows such a table is fetched, in its eyes, only when the grid
indices alone would move it; and a floor no estimate may fall far below: the dot work each
kernel does at every grid step whatever the data."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

__all__ = ["FLAG", "FLOOR_SHARE", "LIMIT_NOTE", "NOT_ESTIMABLE", "NO_ESTIMATE", "PREFETCH_NOTE",
           "Census", "abort_kind", "abort_message", "below_floor", "blind_fetch_message", "describe",
           "dynamic_loop_message", "floor_flops", "floor_message", "kernel_census",
           "profiler_abort", "unfigured_message"]

# The kinds of an estimate refused (a trial's ``detail``): NO_ESTIMATE, no config of the kernel
# can be estimated (the tune stops); NOT_ESTIMABLE, this config cannot (a failed trial, the
# search goes on).
FLAG: Final = "--xla_jf_dump_static_llo_profile_to"  # libtpu's static-profile flag.
NO_ESTIMATE: Final = "no_estimate"
NOT_ESTIMABLE: Final = "no_estimate_config"


@dataclasses.dataclass(frozen=True, slots=True)
class Census:
    """What :func:`kernel_census` found. ``blind_inputs``: one line per input block whose fetches
    the profile collapses (its index changes along a grid axis only through a table, and no
    inner axis refetches it anyway); ``unseen_write_bytes``: output writes it leaves out the
    same way (overlapped with compute on a TPU, so noted, not refused)."""

    loops: int = 0
    prefetch_kernels: int = 0
    blind_inputs: tuple[str, ...] = ()
    unseen_write_bytes: int = 0
    # Per kernel, in program order: the dot FLOPs every grid step must do whatever the data
    # (:func:`floor_flops`) times the steps: no estimate can be far below their MXU time.
    floor_flops: tuple[float, ...] = ()
    # The largest vmem_limit_bytes a kernel asks, where it is more than the chip's VMEM
    # (:data:`LIMIT_NOTE`), else 0.
    limit_over_chip: int = 0


def kernel_census(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], *,
                  chip: str) -> Census:
    """The :class:`Census` of the Pallas kernels of ``fn(*args, **kwargs)``, from one trace:
    how many loops inside them have a trip count that is not static (``while`` in a kernel's
    jaxpr: ``lax.while_loop``, or ``fori_loop`` over traced bounds, e.g. a length read from
    memory), outside the else branches of conditionals; how many take scalar-prefetch operands
    (``PrefetchScalarGridSpec``: group, page or length tables); and which of their blocks the
    profile sees fetched less often than the data would fetch them (:func:`_table_fetches`).

    libtpu's static profile cannot know such a trip count and counts a fixed guess whatever the
    data (libtpu 0.0.50.1: JAX's ragged paged attention over 2.1 GB of KV cache "estimated" at
    14 us), so an estimate of such a kernel would rank configs on made-up work. Prefetched
    values it takes as 0 (:data:`PREFETCH_NOTE`): such an estimate is made, with a caveat.
    """
    import jax

    from pallas_tune import chips
    from pallas_tune.feasibility import inspect as _inspect

    blind: list[str] = []
    unseen = [0]
    floors: list[float] = []
    limits = [0]

    def count(jaxpr: Any, inside: bool) -> tuple[int, int]:
        loops = prefetch = 0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            loops += inside and name == "while"
            if name == "pallas_call":
                gm = eqn.params["grid_mapping"]
                body = eqn.params["jaxpr"]
                steps = math.prod(int(g) if isinstance(g, int) else 0 for g in gm.grid)
                floors.append(steps * floor_flops(getattr(body, "jaxpr", body)))
                asked = getattr(_inspect._compiler_params(eqn), "vmem_limit_bytes", None)
                limits[0] = max(limits[0], int(asked or 0))
                if getattr(gm, "num_index_operands", 0) > 0:
                    prefetch += 1
                    for line, is_output, nbytes in _table_fetches(gm, eqn.params.get("name")):
                        if is_output:
                            unseen[0] += nbytes
                        else:
                            blind.append(line)
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
    loops, prefetch = count(closed.jaxpr, False)
    over = limits[0] if limits[0] > chips.chip_spec(chip).vmem_bytes > 0 else 0
    return Census(loops, prefetch, tuple(blind), unseen[0], tuple(floors), over)


def floor_flops(jaxpr: Any, int8: bool | None = None) -> float:
    """Dot FLOPs one pass of ``jaxpr`` does whatever the data: a conditional counts its
    cheapest branch (pl.when's else is empty: 0), a scan its body times its length, a loop
    whose trip count is not static nothing. ``int8``: only the dots whose operands are both
    8-bit integers (True), or only the others (False)."""
    import numpy as np

    from pallas_tune.feasibility.inspect import _subjaxprs

    total = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            dts = [np.dtype(v.aval.dtype) for v in eqn.invars]
            if int8 is None or int8 == all(d.kind in "iu" and d.itemsize == 1 for d in dts):
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval
                total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                    lhs.shape[d] for d in contract)
        elif name == "cond":
            total += min(floor_flops(getattr(b, "jaxpr", b), int8)
                         for b in eqn.params["branches"])
        elif name == "scan":
            body = eqn.params["jaxpr"]
            total += int(eqn.params["length"]) * floor_flops(getattr(body, "jaxpr", body), int8)
        elif name != "while":
            total += sum(floor_flops(getattr(sub, "jaxpr", sub), int8)
                         for sub in _subjaxprs(eqn.params))
    return total


def _table_fetches(gm: Any, kernel: Any) -> list[tuple[str, bool, int]]:
    """(description, is output or small, bytes the profile leaves out) per block of a
    scalar-prefetch kernel whose fetch count, under tables of zeros (what libtpu's profile
    assumes), is lower than under tables whose entries all differ (what moving data does). An
    input block :data:`SMALL_BLOCK` times smaller than the kernel's largest counts as an output:
    noted, not refused. A block is refetched
    when an axis at or outside the innermost grid axis (of extent > 1) its index depends on
    advances, as in :mod:`pallas_tune.feasibility.roofline`; the dependence is probed by unit
    steps from the origin, exact for the affine maps of table lookups. Index maps that cannot
    be evaluated are skipped (the estimate keeps :data:`PREFETCH_NOTE` only)."""
    import numpy as np

    try:  # Private, and its signature differs between JAX versions: probe, never fail.
        from jax import core as jax_core
        from jax._src.state.discharge import discharge_state

        from pallas_tune.feasibility.inspect import _block_dim
        eval_jaxpr = getattr(jax_core, "eval_jaxpr", None)
        if eval_jaxpr is None:
            from jax._src.core import eval_jaxpr
        grid = tuple(int(g) for g in gm.grid)
    except Exception:  # noqa: BLE001 - unknown: no finding.
        return []
    rank, found = len(grid), []

    def block_bytes(bm: Any) -> int:
        return (math.prod(_block_dim(d)[0] or 1 for d in bm.block_shape)
                * np.dtype(bm.array_aval.dtype).itemsize)

    largest = max((block_bytes(bm) for bm in gm.block_mappings[:gm.num_inputs]), default=0)
    for i, bm in enumerate(gm.block_mappings):
        closed = bm.index_map_jaxpr
        if len(closed.jaxpr.invars) <= rank:
            continue  # Its index does not read a table.
        try:
            out = discharge_state(closed)
            jaxpr, consts = ((out.jaxpr, out.consts) if hasattr(out, "consts")
                             else (out, closed.consts))
            n_out = len(closed.jaxpr.outvars)
            zero = [np.zeros(v.aval.shape, v.aval.dtype) for v in jaxpr.invars[rank:]]
            moving = [np.arange(t.size).reshape(t.shape).astype(t.dtype) for t in zero]

            def fetches(tables: list[Any]) -> int:
                def at(idx: Sequence[int]) -> list[int]:
                    vals = eval_jaxpr(jaxpr, consts, *(np.int32(x) for x in idx), *tables)
                    return [int(x) for x in vals[:n_out]]
                base = at([0] * rank)
                axes = [a for a in range(rank) if grid[a] > 1
                        and at([int(b == a) for b in range(rank)]) != base]
                return math.prod(grid[: max(axes) + 1]) if axes else 1

            seen, data = fetches(zero), fetches(moving)
        except Exception:  # noqa: BLE001 - an index map we cannot evaluate: no finding.
            continue
        if data <= seen:
            continue
        size = block_bytes(bm)
        # A small block (a scale row beside its weight tile) moves a small share of each step's
        # bytes: its missed fetches are noted with the outputs' writes, not refused.
        is_output = i >= gm.num_inputs or size * SMALL_BLOCK <= largest
        line = (f"{kernel or 'pallas_call'}: {'output' if is_output else 'input'} {bm.origin} "
                f"({size / 2**20:.2f} MiB blocks) counted {seen} time(s), up to {data} by the data")
        found.append((line, is_output, size * (data - seen)))
    return found


SMALL_BLOCK: Final = 16  # An input block this many times smaller than the largest is small.


def blind_fetch_message(ref: str, blind: Sequence[str]) -> str:
    return (f"no static estimate for {ref} with this config: libtpu's static profile takes "
            "scalar-prefetch tables as 0, so it counts fewer fetches of these blocks than the "
            "data needs and leaves their DMA time out: " + "; ".join(blind) + ". Time it on a "
            "TPU (--timer wallclock), or use tiles under which an inner grid axis refetches "
            "these blocks at every step anyway (the grouped matmul's forward: tk < K).")


# An estimate below this share of the MXU time its kernel's unconditional dots need is not
# believed (seen, libtpu 0.0.50.1: a (groups, tk, tn) output block, 0.0018 ms estimated for a
# kernel whose dots need 0.131 ms at peak). Half, not all: the chip's peak rate is a spec figure.
FLOOR_SHARE: Final = 0.5


def below_floor(floors: Sequence[float], result: Any, chip: str) -> str:
    """Why a compile's estimate is below what its kernels' dots need (``FLOOR_SHARE`` of their
    FLOPs at the chip's bf16 peak), or "": per kernel where each was compiled alone, else for
    a one-kernel program as a whole (its other ops only add)."""
    from pallas_tune.chips import chip_spec

    spec = chip_spec(chip)
    per_cycle = (spec.bf16_flops or 0) / spec.clock_hz if spec.clock_hz else 0.0
    if result.kernel_cycles and len(result.kernel_cycles) == len(floors):
        pairs = list(zip(result.kernel_cycles, floors, strict=True))
    elif len(floors) == 1:
        pairs = [(sum(result.estimated_cycles), floors[0])]
    else:
        return ""
    for i, (have, flops) in enumerate(pairs):
        need = flops / per_cycle if per_cycle else 0.0
        if need and have < FLOOR_SHARE * need:
            return (f"kernel {i + 1} of {len(pairs)}: {have} cycles estimated, but the dots it "
                    f"does at every grid step need at least {need:.0f} at the chip's peak")
    return ""


def floor_message(ref: str, why: str) -> str:
    return (f"no static estimate for {ref} with this config: libtpu's static profile did not "
            f"follow its program ({why}); the figure is not ranked. Time it on a TPU "
            "(--timer wallclock), or report the kernel's form to us: a form the profile "
            "follows can often be found.")


def dynamic_loop_message(ref: str, loops: int) -> str:
    return (f"no static estimate for {ref}: its Pallas kernel has {loops} loop(s) whose trip "
            "count is only known at run time (while_loop, or fori_loop over values read from "
            "the inputs), and libtpu's static profile counts such a loop as a fixed guess, not "
            "by the data. Time it on a TPU (--timer wallclock), or use a config without such "
            "loops.")


LIMIT_NOTE = ("more than the chip's VMEM (the compiler caps it there, here as on the chip); "
              "a kernel that sizes its limit from jax.devices() sized it for this host, not "
              "the chip, and may admit configs it would refuse on the chip: read "
              "pallas_tune.current_chip() instead")
PREFETCH_NOTE = ("libtpu's static profile takes scalar-prefetch values as 0 (measured, libtpu "
                 "0.0.50.1: the same matmul under pl.when(s[i] == 0) counts, under s[i] == 1 "
                 "it does not), so work and block indices that depend on them are not "
                 "modelled: configs whose cost depends on them are not ranked by it")



_ABORT_RE = re.compile(r"LLO_CHECK failure \([^)]*\)\s*(?:type_check_result\.ok\(\)\s*)?"
                       r"(?P<what>[^\n]*?)(?:, for operand|\)?\s*$)", re.MULTILINE)
# libtpu 7x, fp8 (issue 55): "Cannot schedule FIFO push instruction when the FIFO is full ...
# vmatpush1.f8e4m3.xpose".
_FIFO_RE = re.compile(r"(?P<what>Cannot schedule FIFO push instruction[^\n]*)")
# A worker that died of a fatal signal while compiling (pool.Pool's crash message). SIGKILL is
# not among them: that is the worker's memory limit or a kill, not the compiler aborting.
_SIGNAL_RE = re.compile(r"the worker died from signal (?P<sig>SIG(?:ABRT|SEGV|BUS|ILL|FPE|TRAP)|"
                        r"6|11)\b[^\n]* during compile")


def profiler_abort(error: str) -> str:
    """What a crashed compile worker's output shows of an abort ("" if it shows none): the
    known texts of libtpu's static profiler (``LLO_CHECK failure ... Expected
    vector-bf16packed, got vector-int32``, libtpu 0.0.50 on v6e; ``Cannot schedule FIFO push
    instruction when the FIFO is full``, fp8 on 7x), else a fatal signal during the compile.
    Whether it is the profiler's abort, not the compiler's failure, only an unprofiled compile
    of the same program says (:func:`pallas_tune.measure.unprofiled.settle` checks it)."""
    text = error or ""
    m = _ABORT_RE.search(text)
    if m:
        return f"LLO_CHECK failure: {m.group('what').strip()[:200]}"
    m = _FIFO_RE.search(text)
    if m:
        return f"FIFO: {m.group('what').strip()[:200]}"
    m = _SIGNAL_RE.search(text)
    if m:
        sig = {"6": "SIGABRT", "11": "SIGSEGV"}.get(m.group("sig"), m.group("sig"))
        return f"{sig} with no known message"
    return ""


def abort_kind(why: str) -> str:
    """The class of an abort :func:`profiler_abort` named (what the unprofiled compile is
    checked once per tuning run for): its text up to the first colon or space."""
    return why.split(":", 1)[0].split(" ", 1)[0]


def abort_message(ref: str, why: str, count: int, checked: str = "") -> str:
    """Why a tune stops: the profiler aborted on its first ``count`` candidates; ``checked``:
    what the unprofiled compile of one of them said (never assumed)."""
    said = f"; checked once on one of them: the same program {checked}" if checked else ""
    return (f"no static estimate for {ref}: libtpu's static profiler aborted on each of the "
            f"first {count} candidates ({why}{said}). Rank them by pallas-tune's fitted model "
            "instead, labelled as such and calibrated onto libtpu's figures where libtpu "
            "estimates some configs (--estimate-fallback model, estimate_fallback='model'), or "
            "time it on the chip (--timer wallclock).")


def unfigured_message(count: int, aborts: int) -> str:
    """What a pick made without a fallback leaves out: ``count`` candidates libtpu gave no
    figure, ``aborts`` of them by a profiler abort."""
    return (f"{count} candidate(s) got no libtpu figure ({aborts} by a profiler abort; the "
            "others out of VMEM only under the profiling flag, or not estimable), so the pick "
            "is among those libtpu estimated; --estimate-fallback model ranks them by the "
            "fitted model, calibrated onto libtpu's figures")


def describe(r: Any) -> str:
    """How an estimate (``estimate.EstimateResult``) was made, where not as one whole compile
    of the full problem: a composed estimate's note first (:mod:`.pieces`)."""
    return "; ".join(([r.message] if r.ok and r.message else []) + (
        [f"estimate x{r.scale:g}"] if r.scale != 1 else []) + (
        [f"sum of {r.kernels_alone} kernels compiled alone"] if r.kernels_alone else []) + (
        [f"{r.prefetch_kernels} kernel(s) with scalar prefetch: {PREFETCH_NOTE}"]
        if r.prefetch_kernels else []) + (
        [f"up to {r.unseen_write_bytes / 2**20:.1f} MiB of output writes and small input "
         "blocks follow a table and are not counted (overlapped with compute on a TPU)"]
        if r.unseen_write_bytes else []) + (
        [f"a kernel asks vmem_limit_bytes {r.limit_over_chip / 2**20:.0f} MiB, {LIMIT_NOTE}"]
        if r.limit_over_chip else []))


def estimate_flag_missing_message() -> str:
    from importlib import metadata

    try:
        version = metadata.version("libtpu")
    except metadata.PackageNotFoundError:
        version = "not installed"
    return (f"libtpu {version} compiled the kernel but reported no \"estimated_cycles\" with "
            f"{FLAG}; the flag is internal to libtpu and may have changed. Pin libtpu 0.0.42-0.0.50 "
            "(tested), or allow the model fallback (tune(..., estimate_fallback='model')).")
