"""estimate_fidelity's stratified sample (issue 55): keys of tpu-inference's v6e int8 table and of
its v7 float8 table drawn at random within strata of n_batch x problem size (n_out * n_in), never
by cost; a stand-in that bounds every compile (fewer batch, then out, then in blocks, the figure
scaled, checked against a full compile per key where one is affordable); and one key's run,
every figure of every config kept, so that the report is computed (and re-computed) from them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

from estimate_fidelity_qmm import config, model_figures, operands, proxy_qmm
from estimate_fidelity_space import (
    FIXED_S, MAC_S, MISS_DEFAULT, STEP_S, Blocks, Key, blocks_text, space)

# chip -> (the table's key[0], its (x_q, w_q) dtypes, pallas-tune's chip name). tpu-inference's
# v7 table is float8 x float8 (and float8 x float4, left out: the kernel quantizes x to the
# weights' dtype here).
CHIPS: Mapping[str, tuple[int, tuple[str, str], str]] = {
    "v6e": (6, ("int8", "int8"), "v6e"), "7x": (7, ("float8_e4m3fn", "float8_e4m3fn"), "7x")}
# n_batch bands (inclusive), and problem sizes cut at the table's tertiles of n_out * n_in.
BATCH_BANDS: tuple[tuple[int, int], ...] = ((16, 64), (128, 512), (1024, 4096), (8192, 8192),
                                            (16384, 16384))
SIZE_NAMES = ("small", "medium", "large")
# Sized to the host: 2 cores shared by several jobs (load average 3 to 13), about 1500 CPU s.
MAC_CAP = 5.0e8  # Multiply-accumulates a stand-in's compile simulates at most (~0.8 CPU s).
MIN_STEPS = 128  # As the shipped stand-ins: about this many grid steps kept where they exist:
STEP_CAP = 192  # libtpu's profile costs memory and time per step (2 GB at 1000).
CHECK_CAP_S = 8.0  # A full compile predicted to cost more is not run to check the stand-in.
RIVALS = 8  # Configs drawn per key beside the real winner and the miss default.
STANDIN_TOLERANCE = 0.05


def chip_table(raw: Mapping[tuple[Any, ...], tuple[int, ...]], chip: str) -> dict[Key, Blocks]:
    """The raw table's entries for ``chip`` and its dtypes, as (n_batch, n_out, n_in) ->
    (batch_block, out_block, in_block); malformed rows left out."""
    version, dtypes, _ = CHIPS[chip]
    out: dict[Key, Blocks] = {}
    for k, v in raw.items():
        if (len(k) == 6 and k[0] == version and tuple(k[4:]) == dtypes and len(v) >= 3
                and all(isinstance(n, int) and n > 0 for n in (*k[1:4], *v[:3]))):
            out[(k[1], k[2], k[3])] = (v[0], v[1], v[2])
    return out


def size_edges(table: Mapping[Key, Blocks]) -> tuple[int, int]:
    """The tertiles of n_out * n_in over the table's keys: small < lo <= medium < hi <= large."""
    sizes = sorted(k[1] * k[2] for k in table)
    return sizes[len(sizes) // 3], sizes[2 * len(sizes) // 3]


def stratum(key: Key, edges: tuple[int, int]) -> str:
    """``"n_batch 16-64 / small"``: the key's n_batch band and size third."""
    band = next(f"{lo}-{hi}" if hi > lo else f"{lo}" for lo, hi in BATCH_BANDS
                if lo <= key[0] <= hi)
    size = key[1] * key[2]
    return f"n_batch {band} / {SIZE_NAMES[(size >= edges[0]) + (size >= edges[1])]}"


def turn(name: str) -> tuple[int, int]:
    """A stratum's place in a round: diagonals of the n_batch band x size grid, so that the
    first five keys of a chip hold every n_batch band and the first three every size."""
    band, size = name.replace("n_batch ", "").split(" / ")
    b = [lo for lo, _ in BATCH_BANDS].index(int(band.split("-")[0]))
    return (SIZE_NAMES.index(size) - b) % len(SIZE_NAMES), b


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    chip: str
    key: Key
    winner: Blocks
    stratum: str


def draw(tables: Mapping[str, Mapping[Key, Blocks]], per_stratum: Mapping[str, int],
         seed: int) -> list[Entry]:
    """``per_stratum[chip]`` keys of each stratum (all its keys where it holds fewer), drawn
    with ``random.Random`` seeded by (seed, chip, stratum), in an order that covers every
    stratum once before any twice, the chips taking turns within a round: a run stopped early
    still has keys of both chips and of every stratum it reached."""
    rounds: dict[int, dict[str, list[Entry]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for chip, table in tables.items():
        edges = size_edges(table)
        by: dict[str, list[Key]] = collections.defaultdict(list)
        for k in sorted(table):
            by[stratum(k, edges)].append(k)
        for name in sorted(by, key=turn):
            rng = random.Random(f"{seed}:{chip}:{name}")
            picks = rng.sample(by[name], min(per_stratum.get(chip, 0), len(by[name])))
            for i, k in enumerate(picks):
                rounds[i][chip].append(Entry(chip, k, table[k], name))
    out = []
    for i in sorted(rounds):
        turns = list(rounds[i].values())
        for j in range(max(map(len, turns))):
            out += [t[j] for t in turns if j < len(t)]
    return out


def valid(key: Key, b: Blocks) -> bool:
    """tpu-inference's block rule on (1, batch_block) of the row maxima: a batch block is a
    multiple of 128 or the whole (padded) batch; every compile of one that is not fails."""
    return b[0] % 128 == 0 or b[0] >= key[0]


def strata_space(key: Key, table: Mapping[Key, Blocks]) -> tuple[list[Blocks], int]:
    """The powers-of-two space (:func:`space`: the winner's values and the miss default added)
    less the batch blocks the block rule refuses, and how many those were."""
    full = space(key, table)
    kept = [b for b in full if valid(key, b)]
    return kept, len(full) - len(kept)


def drawn_space(entry: Entry, table: Mapping[Key, Blocks], rivals: int, seed: int
                ) -> tuple[list[Blocks], int]:
    """The configs a key's run estimates: the real winner, the miss default and ``rivals``
    others drawn at random (seeded by the key) from :func:`strata_space` (all of them where it
    holds fewer); and that space's size. Every compile of the whole space is past this host's
    budget at large keys (hundreds of configs); the winner's rank in the space is estimated
    from the share of drawn rivals that the figure puts ahead of it."""
    full, _ = strata_space(entry.key, table)
    others = [b for b in full if b not in (entry.winner, MISS_DEFAULT)]
    rng = random.Random(f"{seed}:{entry.chip}:{entry.key}")
    drawn = others if len(others) <= rivals else rng.sample(others, rivals)
    head = [entry.winner] + ([MISS_DEFAULT] if MISS_DEFAULT != entry.winner else [])
    return head + sorted(drawn), len(set(full) | {entry.winner})


def counts(key: Key, b: Blocks) -> tuple[int, int, int]:
    return tuple(-(-n // s) for n, s in zip(key, b, strict=True))  # type: ignore[return-value]


def macs(key: Key, b: Blocks, keep: tuple[int, int, int]) -> float:
    return math.prod(k * s for k, s in zip(keep, b, strict=True))


def standin_keep(key: Key, b: Blocks) -> tuple[int, int, int]:
    """Blocks kept per grid axis (batch, out, in). Batch (the parallel axis) first, as the first
    sample's stand-in: enough for ``MIN_STEPS`` steps, at least 2 where there are 2; then, while
    the compile would simulate more than ``MAC_CAP`` multiply-accumulates, batch to 2, out and
    then in blocks down to what fits (never under 2 where there are 2: tpu-inference's VMEM
    limit and its x caching change at 1). Every kept block is the same work as a dropped one
    but for the pipeline's first fetch and last write-back, which scaling overcounts."""
    nb, no, ni = counts(key, b)
    other = no * ni
    kb = max(min(nb, 2), min(nb, -(-MIN_STEPS // max(1, other))))
    keep = [kb, no, ni]
    if macs(key, b, tuple(keep)) <= MAC_CAP and math.prod(keep) <= STEP_CAP:
        return kb, no, ni
    keep[0] = min(nb, 2)
    for axis in (1, 2):
        if macs(key, b, tuple(keep)) > MAC_CAP or math.prod(keep) > STEP_CAP:
            rest = math.prod(keep) / keep[axis]
            fit = min(int(MAC_CAP // (macs(key, b, tuple(keep)) / keep[axis])),
                      int(STEP_CAP // rest))
            keep[axis] = max(min(keep[axis], 2), min(keep[axis], fit))
    return keep[0], keep[1], keep[2]


def compile_cost_s(key: Key, b: Blocks, keep: tuple[int, int, int] | None = None) -> float:
    """Predicted CPU seconds of one profiled compile (the first sample's fit), of the stand-in
    keeping ``keep`` blocks per axis (None: the full problem)."""
    keep = keep or counts(key, b)
    return FIXED_S + MAC_S * macs(key, b, keep) + STEP_S * math.prod(keep)


def predicted_cost_s(entry: Entry, table: Mapping[Key, Blocks], rivals: int, seed: int
                     ) -> float:
    blocks, _ = drawn_space(entry, table, rivals, seed)
    return sum(compile_cost_s(entry.key, b, standin_keep(entry.key, b)) for b in blocks)


def capped_standin(args: Sequence[Any], kwargs: Mapping[str, Any], cfg: Mapping[str, int]
                   ) -> tuple[list[Any], dict[str, Any], float]:
    """pallas-tune's ``standin=`` protocol for :func:`standin_keep`: the operands cut to the
    kept blocks, and the scale (blocks in the full grid / blocks kept)."""
    import jax

    x, w_q, w_scale = args
    key = (x.shape[0], w_q.shape[0], x.shape[1])
    b = (cfg["batch_block"], cfg["out_block"], cfg["in_block"])
    full, keep = counts(key, b), standin_keep(key, b)
    rows, outs, ins = (min(n, k * s) for n, k, s in zip(key, keep, b, strict=True))
    return ([jax.ShapeDtypeStruct((rows, ins), x.dtype),
             jax.ShapeDtypeStruct((outs, ins), w_q.dtype),
             jax.ShapeDtypeStruct((outs,), w_scale.dtype)], dict(kwargs),
            math.prod(full) / math.prod(keep))


def proxy_parts() -> Any:
    from pallas_tune.measure.candidate import KernelParts

    return KernelParts(name="tpu_inference.quantized_matmul_kernel (proxy, capped stand-in)",
                       fn=proxy_qmm, standin=capped_standin)


def abort_of(r: Any) -> str:
    """The profiler abort a failed estimate shows ("" if none): libtpu's texts or a signal."""
    from pallas_tune.measure.loops import profiler_abort

    return profiler_abort(r.message or "") if not r.ok else ""


def check_standin(est: Any, entry: Entry, results: Mapping[Blocks, Any], dtype: str) -> str:
    """One scaled config (the most cut whose full compile is predicted to cost at most
    ``CHECK_CAP_S``) against its full compile; said, never acted on (the budget)."""
    key = entry.key
    scaled = [(r.scale, b) for b, r in results.items() if r.ok and r.cycles and r.scale > 1]
    if not scaled:
        return "no config needed a stand-in"
    cheap = [(s, b) for s, b in scaled if compile_cost_s(key, b) <= CHECK_CAP_S]
    if not cheap:
        return (f"unchecked: {len(scaled)} scaled, every full compile predicted over "
                f"{CHECK_CAP_S:g} s")
    scale, b = max(cheap)
    (full,) = est.map(proxy_qmm, operands(key, dtype), {},
                      [config(b)], CHIPS[entry.chip][2], standin=False)
    if not (full.ok and full.cycles):
        return f"{blocks_text(b)} x{scale:.3g}: full compile failed ({full.kind})"
    err = (results[b].cycles - full.cycles) / full.cycles
    flag = "" if abs(err) <= STANDIN_TOLERANCE else " (beyond 5%)"
    return f"{blocks_text(b)} x{scale:.3g}: {err:+.2%} vs full compile{flag}"


def flag_only_oom(unprofiled: Any, entry: Entry, results: Mapping[Blocks, Any], dtype: str
                  ) -> list[Blocks]:
    """The configs whose profiled compile ran out of VMEM and that compile without the
    profiling flag (in ``unprofiled``'s worker, whose libtpu never saw it), on the same
    stand-in: a tune gives them the fallback's figure, as it does aborted ones."""
    from pallas_tune.feasibility.compile import VMEM_PHYSICAL, VMEM_SCOPED
    from pallas_tune.measure.loops import NO_ESTIMATE

    oom = [b for b, r in results.items() if not r.ok and r.kind in (VMEM_SCOPED, VMEM_PHYSICAL)]
    if not oom or unprofiled is None:
        return []
    rr = unprofiled.map(proxy_parts(), operands(entry.key, dtype), {}, [config(b) for b in oom],
                        CHIPS[entry.chip][2])
    return [b for b, r in zip(oom, rr, strict=True) if r.ok or r.kind == NO_ESTIMATE]


def rows(figs: Mapping[Blocks, float | None], k: float = 1.0) -> list[list[Any]]:
    """A dict of figures as a dump's sorted [[blocks, figure x k], ...] rows (None kept: a
    compile that gave no figure)."""
    return [[list(b), None if v is None else v * k] for b, v in sorted(figs.items())]


def run_entry(est: Any, entry: Entry, table: Mapping[Key, Blocks], rivals: int, seed: int,
              unprofiled: Any = None) -> dict[str, Any]:
    """Every figure of every config of the entry's space, as JSON-ready lists: libtpu's estimate
    of the proxy (ms, on the capped stand-in), the roofline and fitted models (ms), why a
    config has no libtpu figure, and the stand-in's check."""
    from pallas_tune.chips import chip_spec

    t0 = time.perf_counter()
    chip = CHIPS[entry.chip][2]
    dtype = CHIPS[entry.chip][1][1]
    blocks, space_size = drawn_space(entry, table, rivals, seed)
    roof, fitted, public = model_figures(entry.key, blocks, chip, dtype)
    results = dict(zip(blocks, est.map(proxy_parts(), operands(entry.key, dtype), {},
                                       [config(b) for b in blocks], chip), strict=True))
    clock = chip_spec(chip).clock_hz
    proxy = {b: r.cycles / clock * 1e3 for b, r in results.items() if r.ok and r.cycles}
    aborts = {b: abort_of(r) for b, r in results.items() if abort_of(r)}
    failures = collections.Counter(
        ("profiler abort" if b in aborts else r.kind) for b, r in results.items()
        if b not in proxy)
    w = results.get(entry.winner)
    winner_kind = ("ok" if entry.winner in proxy else "not in space" if w is None
                   else f"{w.kind}: {(aborts.get(entry.winner) or w.message or '')[:160]}")
    check = check_standin(est, entry, results, dtype)
    flag_only = flag_only_oom(unprofiled, entry, results, dtype)
    scaled = sum(1 for r in results.values() if r.ok and r.scale > 1)

    return {"chip": entry.chip, "key": list(entry.key), "winner": list(entry.winner),
            "stratum": entry.stratum, "configs": len(blocks), "space": space_size,
            "proxy_ms": rows(proxy), "roofline_ms": rows(roof, 1e3),
            "fitted_ms": rows(fitted, 1e3), "public_ms": rows(public, 1e3),
            "aborted": [list(b) for b in sorted(aborts)],
            "flag_only_oom": [list(b) for b in sorted(flag_only)],
            "abort_texts": sorted(set(aborts.values()))[:3], "failures": dict(failures),
            "winner_kind": winner_kind, "standin_check": check, "scaled": scaled,
            "miss_default": list(MISS_DEFAULT), "wall_s": time.perf_counter() - t0}
