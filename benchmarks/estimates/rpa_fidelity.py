"""Does the composed estimate of ragged paged attention rank the published real-TPU winners?

libtpu cannot estimate JAX's ragged paged attention as it is (its loops run over lengths read at
run time), so pallas-tune composes the call's figure from the concrete lengths: libtpu's
estimates of the same kernel with static trip counts give the cycles of a grid step and of a
KV-block iteration, and the call's metadata gives how many of each it runs
(``kernels/_rpa_estimate.py``). This script checks that figure against the block sizes JAX
ships beside the kernel it estimates, measured on real v6e chips
(``jax/experimental/pallas/ops/tpu/ragged_paged_attention/tuned_block_sizes.py``, 'TPU v6':
(q dtype, kv dtype, q heads and kv heads per block, head dim, page size, max_num_batched_tokens,
max_model_len) -> (num_kv_pages_per_block, num_queries_per_block)): per sampled key, the
winner's rank among the configs, the pick, and est(winner)/est(pick). tpu-inference's v3 table
is for another kernel (its own RPA v3, a different program) and is not used here.

The concrete inputs, like for like: those the published winners were timed on. The public
autotune script of JAX's table times each key on one "typical distribution of kv_lens and
cu_q_lens" (``get_qkv_lens_example(..., actual_num_seqs=35)``): 34 sequences decoding one token
and one prefill of min(max_num_batched_tokens, max_model_len) - 34 tokens, every sequence at
max_model_len (here padded to 256 sequences), over bkv in (4, 8, ..., 256) up to the pages per
sequence and bq in (32, 64, 128, 256), at vmem_limit_bytes 100 MiB; so the configs ranked are
those, at that limit. Beside it: the adapter's whole space (bkv from 1, bq from 8), and the
adapter's own serving mix (256 sequences decoding at max_model_len, the rest of the tokens
prefill: what a shape-set sweep estimates), a decode-heavier load than the one timed.

Sampled: the table's (q heads, kv heads, page size) groups, one per page size (16 to 256)
drawn with a seeded RNG, whatever their compile cost (the pieces' compiles are per group and
config; every key of a drawn group, each max_num_batched_tokens x max_model_len, is then
ranked without another compile). Every figure is a v6e compiler ESTIMATE, not a measurement.

    PALLAS_TUNE_TPU_LOGS=off python benchmarks/estimates/rpa_fidelity.py [--seed 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import os
import random
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import _common as bench  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_tune.kernels import _rpa_estimate as rpa  # noqa: E402
from pallas_tune.kernels import upstream_decode as ud  # noqa: E402
from pallas_tune.measure.estimate import Estimator  # noqa: E402

S = jax.ShapeDtypeStruct
SEQS = 256
VMEM = 100 * 2**20
BKV = [1, 2, 4, 8, 16, 32, 64, 128]
BQ = [8, 16, 32, 64, 128, 256]
ALL_BKV, ALL_BQ = tuple(BKV), tuple(BQ)  # The adapter's space (BKV, BQ: those estimated).
RANKS = bench.result("data", "rpa_fidelity_ranks.json")
_table = importlib.import_module(
    "jax.experimental.pallas.ops.tpu.ragged_paged_attention.tuned_block_sizes")


def groups() -> dict[tuple, dict[tuple[int, int], tuple[int, int]]]:
    """The 'TPU v6' table by (q dtype, kv dtype, q heads, kv heads, head dim, page size): its
    keys' (max_num_batched_tokens, max_model_len) -> (bkv, bq)."""
    out: dict[tuple, dict] = collections.defaultdict(dict)
    for key, value in _table.TUNED_BLOCK_SIZES["TPU v6"].items():
        out[key[:6]][key[6:]] = value
    return dict(out)


def sample(all_groups: dict, seed: int, per_page: int) -> list[tuple]:
    """``per_page`` groups per page size, drawn with ``seed``."""
    rng = random.Random(seed)
    by_page = collections.defaultdict(list)
    for g in sorted(all_groups):
        by_page[g[5]].append(g)
    return [g for page in sorted(by_page) for g in rng.sample(by_page[page], per_page)]


def call_args(group: tuple, pps: int, tokens: int) -> list:
    qd, kd, hq, hkv, d, page = group
    return [S((tokens, hq, d), jnp.dtype(qd)), S((SEQS * pps, page, 2 * hkv, d), jnp.dtype(kd)),
            S((SEQS,), jnp.int32), S((SEQS, pps), jnp.int32), S((SEQS + 1,), jnp.int32),
            S((1,), jnp.int32)]


def piece_costs(est: Estimator, group: tuple, keys: dict, done: dict, log, save,
                retry: bool = False) -> dict:
    """(bkv, bq) -> (fixed, per step, per iteration) cycles, or the failure's kind; ``done``:
    those already estimated (the data file), kept (``retry``: a failure kept is estimated
    again, and replaced)."""
    pps_max = max(mml // group[5] for _, mml in keys)
    args = call_args(group, pps_max, max(t for t, _ in keys))
    out = {}
    t0 = time.perf_counter()
    for bkv in [b for b in BKV if b <= pps_max]:
        for bq in BQ:
            name = f"{bkv},{bq}"
            if name not in done or (retry and not isinstance(done[name], list)):
                t1 = time.perf_counter()
                rs = [est.map(ud.ragged_paged_attention, a, k, [cfg(bkv, bq)], "v6e",
                              standin=False)[0] for a, k in rpa.piece_problems(args, {}, bq)]
                bad = next((r for r in rs if not r.ok), None)
                try:
                    done[name] = bad.kind if bad else list(rpa.costs([r.cycles for r in rs]))
                except ValueError:
                    done[name] = "inconsistent"
                log(f"    {group[2]}/{group[3]} page {group[5]} bkv={bkv} bq={bq}: {done[name]} "
                    f"({time.perf_counter() - t1:.0f} s)")
                save()
            out[(bkv, bq)] = tuple(done[name]) if isinstance(done[name], list) else done[name]
    log(f"  {group}: {len(out)} configs x 3 pieces, {time.perf_counter() - t0:.0f} s this run")
    return out


def method_check(est: Estimator, group: tuple, costs: dict, log) -> list[tuple]:
    """The composition checked where one compile is exact: each query block holds one whole
    sequence of K KV blocks (bq tokens each), so upstream's kernel runs the static-trip kernel's
    program at ``blocks`` query blocks and K iterations; its libtpu estimate against
    fixed + blocks * per_step + blocks * K * per_iteration from the three pieces."""
    out = []
    blocks, k = 4, 3
    for bkv, bq in CHECKED:
        c = costs.get((bkv, bq))
        if not isinstance(c, tuple):
            continue
        piece, _ = rpa.piece_problems(call_args(group, 16, blocks * bq), {}, bq)[0]
        problem = [S((blocks * bq, *piece[0].shape[1:]), piece[0].dtype), *piece[1:]]
        whole = est.map(ud.ragged_paged_attention, problem, {"static_kv_blocks": k},
                        [cfg(bkv, bq)], "v6e", standin=False)[0]
        composed = c[0] + blocks * c[1] + blocks * k * c[2]
        out.append(((bkv, bq), composed, whole.cycles if whole.ok else whole.kind))
        log(f"    method check {group[2]}/{group[3]} page {group[5]} ({bkv}, {bq}): composed "
            f"{composed:.0f}, whole {out[-1][2]}")
    return out


CHECKED = [(2, 32), (4, 64), (8, 128)]


def cfg(bkv: int, bq: int) -> dict:
    return {"num_kv_pages_per_block": bkv, "num_queries_per_block": bq, "vmem_limit_bytes": VMEM}


def tuner_example(tokens: int, pps: int, page: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The metadata the published winners were measured on (the autotune script of JAX's
    table, ``get_qkv_lens_example(max_num_batched_tokens, max_model_len, actual_num_seqs=35)``:
    "a typical distribution of kv_lens and cu_q_lens"): 34 sequences decoding one token and one
    prefill of min(tokens, max_model_len) - 34 tokens, all at max_model_len, padded to SEQS."""
    mml, n = pps * page, min(35, tokens)
    cu = np.zeros(SEQS + 1, np.int64)
    cu[:n] = np.arange(n)
    cu[n:] = min(tokens, mml)
    lens = np.zeros(SEQS, np.int64)
    lens[:n] = mml
    return lens, cu, n


MIXES = {"tuner": tuner_example,  # Like for like: how the winners were measured.
         "serving": lambda t, pps, page: rpa.serving_metadata(t, SEQS, pps, page)}
# The published tuner's space: bkv in (4, 8, ..., 256) up to the pages per sequence, bq 32..256.
PUBLISHED = lambda bkv, bq: bkv >= 4 and bq >= 32  # noqa: E731


def rank_key(group: tuple, tokens: int, mml: int, winner: tuple, costs: dict,
             mix: str = "tuner", space: str = "published") -> dict:
    """The key's row: every distinct effective config's composed cycles under the ``mix``'s
    metadata, over the ``space`` (the published tuner's, or the adapter's), the winner's rank."""
    page = group[5]
    pps = mml // page
    lens, cu, n = MIXES[mix](tokens, pps, page)
    rpa.check_metadata(lens, np.zeros((SEQS, pps), np.int64), cu, np.array([n]), tokens=tokens,
                       page_size=page, total_pages=SEQS * pps)
    hq_blk, _ = ud._rpa.get_min_heads_per_blk(group[2], 2 * group[3], jnp.dtype(group[0]),
                                              jnp.dtype(group[1]))
    figs = {}
    whole = {(bkv, bq) for bkv in ALL_BKV if bkv <= pps for bq in ALL_BQ}
    if space == "adapter" and not whole <= set(costs):  # Not every config estimated: no row.
        return None
    for (bkv, bq), c in costs.items():
        eff = (min(bkv, pps), min(bq, tokens))
        if (not isinstance(c, tuple) or eff in figs
                or (space == "published" and not (PUBLISHED(bkv, bq) and bkv <= pps))):
            continue
        w = rpa.work(lens, cu, n, tokens=tokens, page_size=page, bq=eff[1], bkv=eff[0],
                     heads_blocks=group[2] // hq_blk, page_bytes=0)
        fixed, per_step, per_iter = c
        figs[eff] = fixed + w.steps * per_step + w.iterations * per_iter
    win = (min(winner[0], pps), min(winner[1], tokens))
    row = {"group": group, "tokens": tokens, "mml": mml, "winner": win, "pick": None,
           "ranked": len(figs), "rank": None, "ratio": None}
    if figs:
        row["pick"] = min(figs, key=figs.get)
    if win in figs:
        row["rank"] = bench.winner_rank(figs, win)
        row["ratio"] = figs[win] / figs[row["pick"]]
    return row


def k95(rows: list[dict]) -> str:
    """K95 (:func:`_common.k95`) of the rows' winner ranks, as estimate_fidelity counts it."""
    k = bench.k95([r["rank"] or math.inf for r in rows])
    return "none" if k == math.inf else "-" if k != k else str(k)


def within2(rows: list[dict]) -> int:
    """Keys whose pick is within 2% of the winner's figure."""
    return sum(r["ratio"] is not None and r["ratio"] <= 1.02 for r in rows)


def summary(rows: list[dict]) -> str:
    ranked = [r for r in rows if r["rank"] is not None]
    top = lambda k: sum(r["rank"] <= k for r in ranked)  # noqa: E731
    ratios = [r["ratio"] for r in ranked]
    chance = sum(min(3, r["ranked"]) / r["ranked"] for r in ranked)  # A random ranking's.
    return (f"published winner in the estimate's top 3 on {top(3)} of {len(rows)} keys "
            f"({100 * top(3) / max(1, len(rows)):.0f}%; a random ranking of the same configs: "
            f"{chance:.1f} expected); top 1 on {top(1)}, top 8 on {top(8)}, K95 {k95(rows)}; "
            f"pick within 2% of the winner on {within2(rows)}; "
            + (f"median est(winner)/est(pick) {statistics.median(ratios):.3f}, worst "
               f"{max(ratios):.3f}" if ratios else "no winner ranked"))


def save_ranks(path: str, rows: list[dict], command: str) -> None:
    """The like-for-like rows, for estimate_fidelity's page (its RPA rows)."""
    keep = [{"page": r["group"][5], "heads": f"{r['group'][2]}/{r['group'][3]}",
             "tokens": r["tokens"], "max_model_len": r["mml"], "winner": list(r["winner"]),
             "rank": r["rank"], "ranked": r["ranked"], "ratio": r["ratio"]} for r in rows]
    _save(bench.output(path), {"command": command, "date": bench.today(),
                               "versions": bench.versions("jax", "jaxlib", "libtpu"),
                               "rows": keep})


VARIANTS = {("tuner", "published"): "the published tuner's metadata and space (like for like)",
            ("tuner", "adapter"): "the same metadata over the adapter's whole space (bkv from 1, "
                                  "bq from 8: configs the published tuner never timed; the "
                                  "groups estimated over all of it)",
            ("serving", "published"): "the adapter's serving mix (what a shape-set sweep "
                                      "estimates) over the published space"}


def render(rows: dict, sampled: list, n_groups: int, seed: int, wall: float,
           log: list[str], checks: list) -> str:
    main_rows = rows[("tuner", "published")]
    lines = ["# Ragged paged attention: the composed estimate against JAX's published v6e "
             "winners (ESTIMATES)", "", *[p.replace("\n", " ") + "\n" for p in
                                          __doc__.split("\n\n")[1:4]],
             f"    {bench.command(__file__, env='PALLAS_TUNE_TPU_LOGS=off')}", "",
             f"{bench.today()}; {bench.versions('jax', 'jaxlib', 'libtpu')}; {bench.host()}; "
             f"wall {wall / 60:.1f} min (this run; the pieces' costs are kept in "
             f"`benchmarks/results/data/rpa_fidelity.json`); seed {seed}: {len(sampled)} of the "
             f"table's {n_groups} (heads, page size) groups, every key of each", "",
             f"**Like for like: {summary(main_rows)}.**", ""]
    lines += [f"- {text}: {summary(rows[v])}." for v, text in VARIANTS.items()
              if v != ("tuner", "published")]
    lines += ["", "## Per page size (like for like)", ""]
    by_page = collections.defaultdict(list)
    for r in main_rows:
        by_page[r["group"][5]].append(r)
    lines += bench.table(["page size", "q/kv heads", "keys", "K95", "top 1", "top 3", "top 8",
                          "pick within 2%", "median ratio"], sorted(by_page.items()), lambda kv: [
        kv[0], f"{kv[1][0]['group'][2]}/{kv[1][0]['group'][3]}", len(kv[1]), k95(kv[1]),
        *(sum((r["rank"] or 99) <= k for r in kv[1]) for k in (1, 3, 8)), within2(kv[1]),
        f"{statistics.median([r['ratio'] for r in kv[1] if r['ratio']] or [0]):.3f}"])
    lines += ["", "## Per key", "", "(bkv, bq) as they run (clamped to the pages per sequence); "
              "rank / configs ranked (distinct effective configs whose three pieces all "
              "estimated); the last two columns: the winner's rank in the variants above.", ""]
    other = {v: {(r["group"], r["tokens"], r["mml"]): r for r in rows[v]} for v in VARIANTS}
    lines += bench.table(
        ["q/kv heads", "page", "tokens", "max_model_len", "winner", "rank / ranked", "pick",
         "est(winner)/est(pick)", "rank, adapter's space", "rank, serving mix"], main_rows,
        lambda r: [f"{r['group'][2]}/{r['group'][3]}", r["group"][5], r["tokens"], r["mml"],
                   r["winner"], f"{r['rank'] or 'not ranked'} / {r['ranked']}", r["pick"],
                   f"{r['ratio']:.3f}" if r["ratio"] else "-",
                   *(f"{o['rank'] or '-'} / {o['ranked']}" if o else "not estimated"
                     for o in (other[v].get((r["group"], r["tokens"], r["mml"]))
                               for v in list(VARIANTS)[1:]))])
    lines += ["", "## The composition checked", "", method_check.__doc__.split("\n\n")[0]
              .replace("\n    ", " ").replace("``", "`") + f" ({checks[0] if checks else '-'} "
              "group, 4 query blocks, K = 3).", ""]
    lines += bench.table(["(bkv, bq)", "composed cycles", "one compile", "composed / one"],
                         checks[1:], lambda r: [r[0], f"{r[1]:.0f}", r[2], f"{r[1] / r[2]:.3f}"
                                                if isinstance(r[2], int) else "-"])
    lines += ["", "## Compile log", "", *[f"    {x.strip()}" for x in log], ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--per-page", type=int, default=1)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=bench.result("rpa_fidelity.md"))
    p.add_argument("--data", default=bench.result("data", "rpa_fidelity.json"),
                   help="the pieces' costs per group and config, kept across runs")
    p.add_argument("--ranks", default=RANKS,
                   help="where the like-for-like ranks go (estimate_fidelity's RPA rows)")
    p.add_argument("--only", type=int, nargs="*", help="estimate only these sampled groups "
                   "(indices), e.g. to split the compiles over processes; the others are read "
                   "from --data where there")
    p.add_argument("--timeout-s", type=float, default=None,
                   help="a compile's time limit: a config past it is not ranked (counted)")
    p.add_argument("--published-only", action="store_true",
                   help="estimate only the published tuner's configs (bkv >= 4, bq >= 32)")
    p.add_argument("--retry-failed", action="store_true",
                   help="estimate again the configs of the groups estimated whose compile "
                        "failed before (kept in --data as the failure's kind), e.g. a worker "
                        "that ran out of memory beside other jobs")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="check the composition against single compiles (3 more compiles)")
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    all_groups = groups()
    sampled = sample(all_groups, a.seed, a.per_page)
    if a.published_only:
        BKV[:], BQ[:] = [b for b in BKV if b >= 4], [q for q in BQ if q >= 32]
    if bench.SMOKE:  # One small group, two keys, two block sizes each way.
        sampled = [min(sampled, key=lambda g: (g[2] * g[5], g))]
        BKV[:], BQ[:] = [2, 4], [32, 64]
    t0, log, rows = time.perf_counter(), [], {}

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    data_path = bench.output(a.data)
    data = json.load(open(data_path)) if os.path.exists(data_path) else {}
    with Estimator(a.workers, timeout_s=a.timeout_s) as est:
        for i, g in enumerate(sampled):
            keys = all_groups[g]
            if bench.SMOKE:
                keys = dict(sorted(keys.items())[:2])
            done = data.setdefault(repr(g), {})
            if a.only is not None and i not in a.only:
                costs = {tuple(map(int, c.split(","))): tuple(v) if isinstance(v, list) else v
                         for c, v in done.items()}
            else:
                costs = piece_costs(est, g, keys, done, say, lambda: _save(data_path, data),
                                    retry=a.retry_failed)
            failed = collections.Counter(v for v in costs.values() if not isinstance(v, tuple))
            if failed:
                say(f"    not estimated: {dict(failed)}")
            for v in VARIANTS if costs else ():
                rows.setdefault(v, []).extend(
                    r for (t, mml), w in sorted(keys.items())
                    if (r := rank_key(g, t, mml, w, costs, *v)) is not None)
        checked = min((g for g in sampled if data.get(repr(g))), key=lambda g: g[2] * g[5],
                      default=None)
        checks = [] if checked is None else [f"{checked[2]}/{checked[3]} page {checked[5]}"] + (
            method_check(est, checked, {tuple(map(int, c.split(","))): tuple(v) for c, v in
                                        data[repr(checked)].items() if isinstance(v, list)},
                         say) if a.check else [])
    bench.write(a.out, render(rows, sampled, len(all_groups), a.seed,
                              time.perf_counter() - t0, log, checks))
    save_ranks(a.ranks, rows.get(("tuner", "published"), []),
               bench.command(__file__, env="PALLAS_TUNE_TPU_LOGS=off"))


def _save(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
