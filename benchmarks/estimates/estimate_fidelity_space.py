"""estimate_fidelity's pure parts: tpu-inference's block-size table read as a literal, the
block-size space per key, the seeded key sample, the stand-in's batch blocks, the predicted compile
cost and the ranking metrics (no JAX, no libtpu)."""

from __future__ import annotations

import ast
import dataclasses
import math
import os
import random
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import _common as bench

TABLE_FILE = "kernels/quantized_matmul/tuned_block_sizes.py"
MISS_DEFAULT = (128, 128, 128)  # What tpu-inference runs for a key its table does not hold.
TPU_VERSION = 6  # v6e: the table's key[0].
CHIP = "v6e"
MIN_TILE = 128  # Lane width: the smallest out and in block.

Key = tuple[int, int, int]  # (n_batch, n_out, n_in) of a v6e int8 x int8 entry.
Blocks = tuple[int, int, int]  # (batch_block, out_block, in_block).


def parse_table(source: str) -> dict[tuple[Any, ...], tuple[int, ...]]:
    """``TUNED_BLOCK_SIZES_RAW`` from tuned_block_sizes.py's source text (a dict literal),
    read with ``ast.literal_eval``, never executed."""
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "TUNED_BLOCK_SIZES_RAW" for t in targets):
            raw = ast.literal_eval(node.value)
            return {tuple(k): tuple(v) for k, v in raw.items()}
    raise ValueError("no TUNED_BLOCK_SIZES_RAW dict literal in the source")


def v6e_int8(table: Mapping[tuple[Any, ...], tuple[int, ...]]) -> dict[Key, Blocks]:
    """The table's v6e int8 x int8 entries, as (n_batch, n_out, n_in) -> (batch_block,
    out_block, in_block); other chips and dtypes, and malformed rows, left out."""
    out: dict[Key, Blocks] = {}
    for k, v in table.items():
        if (len(k) == 6 and k[0] == TPU_VERSION and k[4:] == ("int8", "int8") and len(v) >= 3
                and all(isinstance(n, int) and n > 0 for n in (*k[1:4], *v[:3]))):
            out[(k[1], k[2], k[3])] = (v[0], v[1], v[2])
    return out


def load_table(root: str) -> dict[Key, Blocks]:
    with open(os.path.join(root, TABLE_FILE), encoding="utf-8") as f:
        return v6e_int8(parse_table(f.read()))


def powers_of_two(lo: int, hi: int) -> list[int]:
    out, p = [], 1
    while p <= hi:
        if p >= lo:
            out.append(p)
        p *= 2
    return out


def batch_floor(table: Mapping[Key, Blocks]) -> int:
    """The smallest batch block: the smallest power of two, at least 16 (a bf16 sublane tile),
    that is at least the table's smallest batch block (16: its n_batch=16 entries)."""
    least = min((v[0] for v in table.values()), default=16)
    return next(p for p in powers_of_two(16, max(16, least) * 2) if p >= least)


def block_choices(dim: int, lo: int, extra: Iterable[int] = (), *, divisors: bool = False
                  ) -> list[int]:
    """Powers of two from ``lo`` up to ``dim`` that divide it (no padding), plus ``extra``
    values (the real winner's, which need not be powers of two). With ``divisors``: every
    multiple of ``lo`` that divides ``dim`` (the powers of two among them, and e.g. 640, 896
    or the whole dimension), plus ``extra``."""
    if divisors:
        return sorted({m for m in range(lo, dim + 1, lo) if dim % m == 0} | set(extra))
    return sorted({p for p in powers_of_two(lo, dim) if dim % p == 0} | set(extra))


def space(key: Key, table: Mapping[Key, Blocks], *, divisors: bool = False) -> list[Blocks]:
    """Every (batch_block, out_block, in_block) of :func:`block_choices` per dimension (batch
    from :func:`batch_floor`, out and in from 128), with the real winner's value added to each
    (so the winner is in the space), and the miss default (128, 128, 128), which pads a batch
    under 128 (what tpu-inference runs for a key it has no entry for). VMEM is left to the
    compile: a config that does not fit fails there and is not ranked. ``divisors``: the
    wider space of every multiple of 128 (of the batch floor, for batch) dividing each
    dimension, which holds the powers-of-two space."""
    n_batch, n_out, n_in = key
    win = table.get(key)
    bb = block_choices(n_batch, batch_floor(table), [win[0]] if win else [], divisors=divisors)
    ob = block_choices(n_out, MIN_TILE, [win[1]] if win else [], divisors=divisors)
    ib = block_choices(n_in, MIN_TILE, [win[2]] if win else [], divisors=divisors)
    out = [(b, o, i) for b in bb for o in ob for i in ib]
    return out if MISS_DEFAULT in out else [*out, MISS_DEFAULT]


def grid_steps(key: Key, blocks: Blocks) -> int:
    return math.prod(-(-n // b) for n, b in zip(key, blocks, strict=True))


STANDIN_STEPS = 128  # As the shipped kernels' stand-ins: at least this many grid steps kept.


def standin_batch_blocks(key: Key, blocks: Blocks) -> int:
    """How many batch blocks (the one parallel grid axis) the stand-in keeps: enough for
    ``STANDIN_STEPS`` grid steps (``shrink_parallel``'s rule), and at least 2 where the key
    has 2, so that tpu-inference's VMEM limit (which counts x's second buffer only when there
    are several batch blocks or in blocks) is the full problem's."""
    nb = -(-key[0] // blocks[0])
    other = grid_steps(key, blocks) // nb
    need = -(-STANDIN_STEPS // max(1, other))
    return max(min(nb, 2), min(nb, need))


def sample_keys(table: Mapping[Key, Blocks], count: int, seed: int,
                affordable: Callable[[Key], bool] = lambda k: True) -> list[Key]:
    """``count`` keys spread over n_batch and shapes, drawn with ``random.Random(seed)`` among
    the ``affordable`` keys: every n_batch value that has one is drawn once (values cut into
    ``count`` even strata, one drawn per stratum, where there are more values than keys; the
    keys left over go to n_batch values drawn at random); per drawn n_batch, a shape (n_out,
    n_in) not drawn yet where one is left, at random."""
    rng = random.Random(seed)
    ok = sorted(k for k in table if affordable(k))
    batches = sorted({k[0] for k in ok})
    if not batches or count <= 0:
        return []
    if count <= len(batches):
        edges = [round(i * len(batches) / count) for i in range(count + 1)]
        picks = [rng.choice(batches[edges[i]:edges[i + 1]]) for i in range(count)]
    else:
        picks = batches + [rng.choice(batches) for _ in range(count - len(batches))]
    chosen: list[Key] = []
    shapes_used: set[tuple[int, int]] = set()
    for n_batch in sorted(picks):
        pool = [k for k in ok if k[0] == n_batch and k not in chosen]
        fresh = [k for k in pool if (k[1], k[2]) not in shapes_used] or pool
        if fresh:
            k = rng.choice(fresh)
            chosen.append(k)
            shapes_used.add((k[1], k[2]))
    return chosen



@dataclasses.dataclass(frozen=True, slots=True)
class KeyVerdict:
    """One figure's ranking of one key's space, against the real winner."""

    ranked: int  # Configs with a figure.
    winner_rank: int | None  # None: the real winner has no figure (rejected, crashed).
    pick: Blocks | None  # The figure's best (ties: the first in space order).
    ratio: float | None  # fig(real winner) / fig(pick): 1.0 = the pick is as good.
    pick_is_winner: bool
    winner_beats_default: bool | None  # None: the winner or the default has no figure.


def verdict(figures: Mapping[Blocks, float], winner: Blocks,
            default: Blocks = MISS_DEFAULT) -> KeyVerdict:
    """``figures``: config -> a time-like figure (smaller is better), only configs that have
    one. The default's comparison is None where the default is not in ``figures``."""
    if not figures:
        return KeyVerdict(0, None, None, None, False, None)
    pick = min(figures, key=lambda c: figures[c])
    w = figures.get(winner)
    d = figures.get(default)
    return KeyVerdict(
        ranked=len(figures), pick=pick,
        winner_rank=None if w is None else bench.winner_rank(figures, winner),
        ratio=None if w is None or figures[pick] <= 0 else w / figures[pick],
        pick_is_winner=pick == winner,
        winner_beats_default=None if w is None or d is None or winner == default else w < d)


@dataclasses.dataclass(frozen=True, slots=True)
class Summary:
    keys: int
    top1: int
    top3: int
    unranked: int  # Keys whose real winner got no figure.
    median_ratio: float | None
    worst_ratio: float | None
    within_2pct: int  # The pick is the winner, or the winner is within 2% of it.
    beats_default: int
    default_compared: int


def summarize(verdicts: Sequence[KeyVerdict]) -> Summary:
    ratios = [v.ratio for v in verdicts if v.ratio is not None]
    compared = [v.winner_beats_default for v in verdicts if v.winner_beats_default is not None]
    return Summary(
        keys=len(verdicts),
        top1=sum(v.winner_rank == 1 for v in verdicts),
        top3=sum(v.winner_rank is not None and v.winner_rank <= 3 for v in verdicts),
        unranked=sum(v.winner_rank is None for v in verdicts),
        median_ratio=statistics.median(ratios) if ratios else None,
        worst_ratio=max(ratios) if ratios else None,
        within_2pct=sum(v.pick_is_winner or (v.ratio is not None and v.ratio <= 1.02)
                        for v in verdicts),
        beats_default=sum(compared), default_compared=len(compared))


def blocks_text(b: Blocks | None) -> str:
    return "-" if b is None else "(" + ", ".join(map(str, b)) + ")"


# A config's compile with libtpu's static profile, in CPU seconds, on this 2-core host under
# load (fitted to probe compiles of this kernel): a fixed part, a part per multiply-accumulate
# of the compiled problem (the profile simulates every step's bundles) and a part per step.
FIXED_S, MAC_S, STEP_S = 1.0, 1.6e-9, 4e-3


def predicted_cost_s(key: Key, table: Mapping[Key, Blocks], *, divisors: bool = False
                     ) -> float:
    """A rough guess of one key's proxy compiles (on the stand-in) over its powers-of-two
    space (or the wider ``divisors`` space), only to keep the sample within the budget: keys
    are drawn by the first, the run compiles the second."""
    total = 0.0
    for b in space(key, table, divisors=divisors):
        keep = standin_batch_blocks(key, b)
        nb = -(-key[0] // b[0])
        total += (FIXED_S + MAC_S * keep * b[0] * key[1] * key[2]
                  + STEP_S * grid_steps(key, b) * keep / nb)
    return total


def pick_vs_winner(verdicts: Sequence[tuple[Blocks, KeyVerdict]]
                   ) -> dict[str, tuple[int, int, int]]:
    """Per block dimension, on how many keys the figure's pick is smaller, equal, larger than
    the real winner's (keys with a pick)."""
    out = {}
    for i, dim in enumerate(("batch_block", "out_block", "in_block")):
        pairs = [(v.pick[i], w[i]) for w, v in verdicts if v.pick is not None]
        out[dim] = (sum(p < w for p, w in pairs), sum(p == w for p, w in pairs),
                    sum(p > w for p, w in pairs))
    return out

