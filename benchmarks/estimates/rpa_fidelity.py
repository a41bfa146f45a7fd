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
winner's rank among the adapter's space (num_kv_pages_per_block 1..128 clamped to the pages per
sequence, num_queries_per_block 8..256, at vmem_limit_bytes 100 MiB), the pick, and
est(winner)/est(pick). tpu-inference's v3 table is for another kernel (its own RPA v3) and is
not used here.

The concrete inputs: 256 sequences (vLLM's max_num_seqs on TPU), each decoding one token at
the full max_model_len, the rest of max_num_batched_tokens prefill given to the last sequences
(what the adapter's ``inputs=`` and vLLM's TPU tuner use: the largest KV read a step of that
size can hold, the case block sizes are tuned for). Sampled: the table's (heads, page size)
groups, one per page size drawn with a seeded RNG (the pieces' compiles are per group and
config; every key of a drawn group, i.e. each max_num_batched_tokens x max_model_len, is then
ranked at no further compile). Every figure is a v6e compiler ESTIMATE, not a measurement.

    PALLAS_TUNE_TPU_LOGS=off python benchmarks/estimates/rpa_fidelity.py [--seed 5] [--workers 2]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
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


def piece_costs(est: Estimator, group: tuple, keys: dict, done: dict, log, save) -> dict:
    """(bkv, bq) -> (fixed, per step, per iteration) cycles, or the failure's kind; ``done``:
    those already estimated (the data file), kept."""
    pps_max = max(mml // group[5] for _, mml in keys)
    args = call_args(group, pps_max, max(t for t, _ in keys))
    out = {}
    t0 = time.perf_counter()
    for bkv in [b for b in BKV if b <= pps_max]:
        for bq in BQ:
            name = f"{bkv},{bq}"
            if name not in done:
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


def cfg(bkv: int, bq: int) -> dict:
    return {"num_kv_pages_per_block": bkv, "num_queries_per_block": bq, "vmem_limit_bytes": VMEM}


def rank_key(group: tuple, tokens: int, mml: int, winner: tuple, costs: dict) -> dict:
    """The key's row: every distinct effective config's composed cycles, the winner's rank."""
    page = group[5]
    pps = mml // page
    lens, cu, n = rpa.serving_metadata(tokens, SEQS, pps, page)
    hq_blk, hkv2_blk = ud._rpa.get_min_heads_per_blk(group[2], 2 * group[3], jnp.dtype(group[0]),
                                                     jnp.dtype(group[1]))
    figs = {}
    for (bkv, bq), c in costs.items():
        eff = (min(bkv, pps), min(bq, tokens))
        if not isinstance(c, tuple) or eff in figs:
            continue
        w = rpa.work(lens, cu, n, tokens=tokens, page_size=page, bq=eff[1], bkv=eff[0],
                     heads_blocks=group[2] // hq_blk, page_bytes=0)
        fixed, per_step, per_iter = c
        figs[eff] = fixed + w.steps * per_step + w.iterations * per_iter
    win = (min(winner[0], pps), min(winner[1], tokens))
    pick = min(figs, key=figs.get)
    row = {"group": group, "tokens": tokens, "mml": mml, "winner": win, "pick": pick,
           "ranked": len(figs), "rank": None, "ratio": None}
    if win in figs:
        row["rank"] = 1 + sum(v < figs[win] for v in figs.values())
        row["ratio"] = figs[win] / figs[pick]
    return row


def render(rows: list[dict], sampled: list, n_groups: int, seed: int, wall: float,
           log: list[str]) -> str:
    ranked = [r for r in rows if r["rank"] is not None]
    n = len(rows)
    top = lambda k: sum(r["rank"] <= k for r in ranked)  # noqa: E731
    ratios = [r["ratio"] for r in ranked]
    lines = ["# Ragged paged attention: the composed estimate against JAX's published v6e "
             "winners (ESTIMATES)", "", __doc__.split("\n\n")[1].replace("\n", " "), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             f"    {bench.command(__file__, env='PALLAS_TUNE_TPU_LOGS=off')}", "",
             f"{bench.today()}; {bench.versions('jax', 'jaxlib', 'libtpu')}; {bench.host()}; "
             f"wall {wall / 60:.1f} min; seed {seed}: {len(sampled)} of the table's {n_groups} "
             "(heads, page size) groups", "",
             f"**Published winner in the estimate's top 3 on {top(3)} of {n} keys** "
             f"({100 * top(3) / max(1, n):.0f}%); top 1 on {top(1)}, top 8 on {top(8)}; "
             + (f"median est(winner)/est(pick) {statistics.median(ratios):.3f}, worst "
                f"{max(ratios):.3f}" if ratios else "no winner ranked") + ".", "",
             "## Per page size", ""]
    by_page = collections.defaultdict(list)
    for r in rows:
        by_page[r["group"][5]].append(r)
    lines += bench.table(["page size", "keys", "top 1", "top 3", "top 8", "median ratio"],
                         sorted(by_page.items()), lambda kv: [
        kv[0], len(kv[1]), sum((r["rank"] or 99) <= 1 for r in kv[1]),
        sum((r["rank"] or 99) <= 3 for r in kv[1]), sum((r["rank"] or 99) <= 8 for r in kv[1]),
        f"{statistics.median([r['ratio'] for r in kv[1] if r['ratio']] or [0]):.3f}"])
    lines += ["", "## Per key", "", "(bkv, bq) as they run: clamped to the pages per sequence "
              "and the tokens; rank among the configs ranked (distinct effective configs that "
              "compiled at every piece).", ""]
    lines += bench.table(
        ["q/kv heads", "page", "tokens", "max_model_len", "winner", "rank / ranked", "pick",
         "est(winner)/est(pick)"], rows, lambda r: [
            f"{r['group'][2]}/{r['group'][3]}", r["group"][5], r["tokens"], r["mml"],
            r["winner"], f"{r['rank'] or 'not ranked'} / {r['ranked']}", r["pick"],
            f"{r['ratio']:.3f}" if r["ratio"] else "-"])
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
    p.add_argument("--only", type=int, nargs="*", help="estimate only these sampled groups "
                   "(indices), e.g. to split the compiles over processes; the others are read "
                   "from --data where there")
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    all_groups = groups()
    sampled = sample(all_groups, a.seed, a.per_page)
    if bench.SMOKE:  # One small group, two keys, two block sizes each way.
        sampled = [min(sampled, key=lambda g: (g[2] * g[5], g))]
        BKV[:], BQ[:] = [2, 4], [32, 64]
    t0, log, rows = time.perf_counter(), [], []

    def say(line: str) -> None:
        log.append(line)
        print(line, flush=True)

    data_path = bench.output(a.data)
    data = json.load(open(data_path)) if os.path.exists(data_path) else {}
    with Estimator(a.workers) as est:
        for i, g in enumerate(sampled):
            keys = all_groups[g]
            if bench.SMOKE:
                keys = dict(sorted(keys.items())[:2])
            done = data.setdefault(repr(g), {})
            if a.only is not None and i not in a.only:
                costs = {tuple(map(int, c.split(","))): tuple(v) if isinstance(v, list) else v
                         for c, v in done.items()}
            else:
                costs = piece_costs(est, g, keys, done, say, lambda: _save(data_path, data))
            failed = collections.Counter(v for v in costs.values() if not isinstance(v, tuple))
            if failed:
                say(f"    not estimated: {dict(failed)}")
            if costs:
                rows += [rank_key(g, t, mml, w, costs) for (t, mml), w in sorted(keys.items())]
    bench.write(a.out, render(rows, sampled, len(all_groups), a.seed,
                              time.perf_counter() - t0, log))


def _save(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
