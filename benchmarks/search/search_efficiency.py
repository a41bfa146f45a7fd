"""How good is each search strategy after few evaluations? Replayed on measured landscapes.

Landscapes: every Kernel Tuner cache file under ../shared/landscapes (or --landscapes, or
$PALLAS_TUNE_LANDSCAPES: real GPU measurements, 5 kernels on 10 devices) and benchmarks/landscapes
(full-space v6e compiler ESTIMATES from benchmarks/estimates/tpu_estimate.py). Each evaluation
draws one recorded repeat (noisy), a failure costs an evaluation, a repeated proposal costs
nothing; every strategy runs on the same seeds.

Strategies: pallas-tune's `default`; `default+prior`, the same with the other devices'
landscapes of the same kernel as its prior (transfer, leave-one-device-out: the files beside
the landscape; `pallas_tune.search.prior`); `random`; Optuna's samplers (`tpe`: TPESampler as it comes,
`tpe-mv`: multivariate and grouped, `cmaes`: CmaEsSampler over value ranks, `optuna-gp`:
GPSampler, where PyTorch is installed); Kernel Tuner 1.5 strategies in its own simulation mode
(`KT:*`, fed per-seed files whose times are drawn repeats: the same noise), among them the
generated `adaptive_tabu_greywolf` and `hybrid_vndx` (Kernel Tuner's names for the MLSys 2026
`gen_*` strategies).

Scores: `@N` is the mean over seeds of min(1, optimum / t), t the *mean* recorded time of the
config that measured best in the first N evaluations (what a user would ship; a lucky noisy draw
earns nothing), optimum the best mean time in the file. `to 5%`: median evaluations until that
config is within 5% of the optimum (inf when fewer than half the seeds got there within the
budget; the share that did in brackets). `ms/sugg`: the strategy's own wall time per proposal
(for KT: its whole simulated run, file reading included, per evaluation). `AM score`: the
autotuning-methodology package's performance score (mean over evaluations 1..budget of its
standardised curve against its calculated random-search baseline: 0 = random, 1 = optimum at
once; random search itself scores below 0 here because the noisy best-measured config is not
the best config measured, and the baseline counts expected ranks).

The summary compares the default with the best peer per landscape, its evaluations to 5%
with random search's expected (N + 1) / (k + 1) (k configs within 5% of the optimum), and the
default's own CPU time per proposal on the largest space. Leave one device out: among the
default's variants replayed (`default`, the previous default, any `default[...]`), the one
chosen by mean @50 on every other landscape, scored on the device left out.

Replays are cached per (landscape, strategy, seed, budget) under benchmarks/results/cache/
(pallas-tune's own strategies also by a hash of the search package), so a rerun resumes.

    nice -n 10 python benchmarks/search/search_efficiency.py [--seeds 20] [--budget 100] [--jobs 1]
        [--strategies default,random,...] [--landscapes DIR] [--out FILE]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): one seed, 50 evaluations, a few strategies, on
benchmarks/landscapes alone (not ../shared, so that it runs in a plain clone).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import search_harness as h  # noqa: E402

from pallas_tune.search import gp, replay  # noqa: E402

KT = ["adaptive_tabu_greywolf", "hybrid_vndx", "dual_annealing", "firefly_algorithm", "pso",
      "genetic_algorithm"]
# +prior: the other devices' landscapes as its prior; PREVIOUS: the default before its initial
# design of 15 and its cycle's multivariate TPE step (an ablation, and a variant for the
# leave-one-device-out choice).
PREVIOUS = h.PREVIOUS_DEFAULT
OURS = ["default", "default+prior", PREVIOUS]
PEERS = ["random", "tpe-mv", "cmaes", "optuna-gp"] + [f"KT:{s}" for s in KT]
SMOKE_STRATEGIES = ["default", "default+prior", PREVIOUS, "random", "tpe-mv",
                    "KT:pso"]


def _available(labels: list[str]) -> tuple[list[str], list[str]]:
    notes, keep = [], []
    for lab in labels:
        mod = {"KT": "kernel_tuner", "optuna-gp": "torch"}.get(lab.split(":")[0])
        if mod:
            try:
                __import__(mod)
            except ImportError:
                notes.append(f"{lab} skipped: {mod} is not installed "
                             "(pip install 'pallas-tune[bench]', torch for optuna-gp)")
                continue
        keep.append(lab)
    return keep, notes


def _row(land, label: str, recs: list[dict], budget: int) -> dict:
    vals = {n: [h.at(land, r, n) for r in recs] for n in (20, 50, 100) if n <= budget}
    evals = sum(len(r["configs"]) for r in recs)
    return {
        "label": label, "seeds": len(recs),
        **{f"@{n}": statistics.mean(v) for n, v in vals.items()},
        "se50": (statistics.stdev(vals[50]) / math.sqrt(len(recs)) if len(recs) > 1 else 0.0),
        "reach": h.median_reach(land, recs, 0.05, budget),
        "ms": 1000 * sum(r["seconds"] for r in recs) / max(1, evals),
        "am": h.methodology_score(land, recs, budget),
    }


def _fmt(row: dict, budget: int) -> str:
    med, share = row["reach"]
    cells = [row["label"], str(row["seeds"]), f"{row.get('@20', math.nan):.3f}",
             f"{row['@50']:.3f} ± {row['se50']:.3f}", f"{row.get('@100', math.nan):.3f}",
             f"{med:g} ({share:.0%})", f"{row['ms']:.1f}", f"{row['am']:.3f}"]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=bench.smoke(20, 1))
    p.add_argument("--peer-seeds", type=int, default=None,
                   help="seeds for the peers (default: --seeds; the first ones, so shared)")
    p.add_argument("--budget", type=int, default=bench.smoke(100, 50))
    p.add_argument("--jobs", type=int, default=1, help="processes (the machine is shared)")
    p.add_argument("--strategies", default=",".join(bench.smoke(OURS + PEERS, SMOKE_STRATEGIES)))
    p.add_argument("--landscapes", default=None,
                   help=f"folder of Kernel Tuner files (default: ${replay.LANDSCAPES_ENV} or "
                        "../shared/landscapes)")
    p.add_argument("--only", default="", help="comma-separated landscape ids (kernel/device)")
    p.add_argument("--cache", default=h.CACHE)
    p.add_argument("--out", default=None, help="also write the report here")
    p.add_argument("--run-only", action="store_true", help="replay (fill the cache), no report")
    p.add_argument("--cached-only", action="store_true",
                   help="report only the replays already cached (rows say how many seeds)")
    a = p.parse_args()
    labels, notes = _available(h.split_labels(a.strategies))
    smoke_only = bench.SMOKE and a.landscapes is None  # A plain clone has no ../shared.
    paths = [] if smoke_only else replay.find_landscapes(a.landscapes)
    if not paths:
        notes.append("no shared landscapes found (set --landscapes or "
                     f"${replay.LANDSCAPES_ENV}): GPU landscapes skipped")
    paths += sorted(glob.glob(os.path.join(bench.LANDSCAPES, "*.json")))
    if a.only:
        paths = [q for q in paths if h.landscape_id(q) in a.only.split(",")]
    peer_seeds = a.seeds if a.peer_seeds is None else a.peer_seeds
    # Small spaces first, so that an interrupted run has covered the most landscapes.
    units = [(q, lab, a.budget, s) for q in sorted(paths, key=os.path.getsize)
             for lab in labels for s in range(a.seeds if lab in OURS else peer_seeds)]
    if a.cached_only:
        cached = [u for u in units if os.path.exists(h._cache_path(a.cache, *u))]
        units = cached
    recs = h.replay_many(units, a.jobs, cache=a.cache)
    if a.run_only:
        return
    by = {}
    for (q, lab, _, _), r in zip(units, recs, strict=True):
        by.setdefault((q, lab), []).append(r)
    lines = [f"# $ {bench.command(__file__)}",
             f"# {bench.today()}; {platform.machine()} CPU shared with other jobs (wall times "
             "are under load); " + bench.versions("optuna", "kernel_tuner",
                                                  "autotuning_methodology", "torch")]
    lines += [f"# note: {n}" for n in notes]
    summary = []
    am: dict[str, list[float]] = {}
    for q in paths:
        land = h.load(q)
        lid = h.landscape_id(q)
        tuned = "yes" if lid in gp.TUNING_SET else "no"
        lines += ["", f"#### {lid}: {len(land.configs)} configs, {len(land.keys)} parameters, "
                  f"optimum {land.optimum:.5g} ms; used to choose the default's settings: {tuned}",
                  "| strategy | seeds | @20 | @50 | @100 | to 5% (reached) | ms/sugg | AM score |",
                  "|---|---|---|---|---|---|---|---|"]
        rows = []
        for lab in labels:
            ok = [r for r in by.get((q, lab), []) if "error" not in r]
            if ok and "benchmark_hub" in q:
                am.setdefault(lab, []).append(h.methodology_score(land, ok, a.budget))
            if not by.get((q, lab)):
                lines.append(f"| {lab} | 0 | not run (compute) | | | | | |")
            elif ok:
                rows.append(_row(land, lab, ok, a.budget))
                lines.append(_fmt(rows[-1], a.budget))
            else:
                lines.append(f"| {lab} | 0 | failed: {by[(q, lab)][0]['error']} | | | | | |")
        ours = next((r for r in rows if r["label"] == "default"), None)
        peers = [r for r in rows if r["label"] not in OURS]
        if ours and peers:
            best = max(peers, key=lambda r: r["@50"])
            common = statistics.mean(h.at(land, r, 50) for r in by[(q, "default")][:peer_seeds])
            summary.append((lid, len(land.configs), tuned, ours, best, common,
                            _random_reach(land)))
    lines += _summary(summary, peer_seeds)
    lines += _peer_cross_fit(paths, labels, by, peer_seeds)
    lines += _held_out(paths, labels, by)
    lines += _proposal_time(max(paths, key=lambda q: len(h.load(q).configs)))
    lines += ["", "#### autotuning-methodology score over the GPU landscapes (mean of the per-"
              "landscape scores above; the package aggregates search spaces the same way)",
              "| strategy | landscapes | mean AM score |", "|---|---|---|"]
    lines += [f"| {lab} | {len(v)} | {np.nanmean(v):.3f} |"
              for lab, v in sorted(am.items(), key=lambda kv: -np.nanmean(kv[1]))]
    bench.write(a.out, "\n".join(lines) + "\n")


def _random_reach(land) -> float:
    """Random search's expected evaluations until it measures a config within 5% of the
    optimum (by mean times): (N + 1) / (k + 1) draws without replacement, k such configs."""
    means = list(land.means.values())
    k = sum(m <= 1.05 * land.optimum for m in means)
    return (len(means) + 1) / (k + 1)


def _proposal_time(path: str, n: int = 50) -> list[str]:
    """The default's own time per proposal on the largest space (process CPU time, which the
    other jobs on a shared host do not inflate, and wall time), over a 50-evaluation search."""
    land = h.load(path)
    bo = gp.CandidateBO(land.configs, land.choices, seed=0, budget=n)  # As a 50-trial tune.
    rng = np.random.default_rng(0)
    measured: dict = {}
    cpu, wall = [], []
    for _ in range(min(n, len(land.configs))):
        t0, w0 = time.process_time(), time.perf_counter()
        c = bo.propose(measured)
        cpu.append(1000 * (time.process_time() - t0))
        wall.append(1000 * (time.perf_counter() - w0))
        reps = land.times[c]
        measured[c] = float(rng.choice(reps)) if reps else math.inf
    return ["", f"#### The default's time per proposal on {h.landscape_id(path)} "
            f"({len(land.configs)} configs, {len(cpu)} proposals, seed 0)",
            f"CPU ms: mean {np.mean(cpu):.1f}, median {np.median(cpu):.1f}, max "
            f"{max(cpu):.1f}; wall ms (shared host): mean {np.mean(wall):.1f}. The larger ones "
            "are the GP's hyperparameter fits (every 5, then 10, then 20 evaluations)."]


def cross_fit(ours: Sequence[float], peers: dict[str, Sequence[float]]
              ) -> tuple[float, float, list[str]]:
    """The default against the best peer with the peer chosen on other seeds: the seeds split
    in two halves; on each half, the peer with the best mean on the other half is scored, and
    per seed the default's score minus that peer's (the seeds share their noise draws, so the
    difference is paired). Returns the mean difference, its standard error and the peers
    chosen. Choosing and scoring the best of nine on the same seeds overstates it (a maximum
    of noisy means): this does not."""
    n = min([len(ours)] + [len(v) for v in peers.values()])
    halves = [range(0, n // 2), range(n // 2, n)]
    diffs, chosen = [], []
    for score, choose in ((halves[0], halves[1]), (halves[1], halves[0])):
        best = max(peers, key=lambda lab: statistics.mean(peers[lab][i] for i in choose))
        chosen.append(best)
        diffs += [ours[i] - peers[best][i] for i in score]
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.inf
    return statistics.mean(diffs), se, chosen


def _peer_cross_fit(paths: list[str], labels: list[str], by: dict, n: int) -> list[str]:
    if n < 4:
        return []
    out = ["", f"#### The default against the best peer chosen on other seeds ({n} seeds, "
           "@50)", "The best of nine peers' means, chosen and scored on the same seeds, is "
           "biased upwards (the largest of nine noisy means). Here the seeds split in halves: "
           "each half scores the peer that was best on the other half, paired per seed with "
           "the default (same noise draws). `verdict`: above or below where the mean "
           "difference is more than twice its standard error, else within noise.", "",
           "| landscape | default @50 | peer chosen on the other half | default − peer | "
           "verdict |", "|---|---|---|---|---|"]
    for q in paths:
        land = h.load(q)
        vals = {lab: [h.at(land, r, 50) for r in by.get((q, lab), [])[:n] if "error" not in r]
                for lab in labels if lab not in OURS or lab == "default"}
        ours = vals.pop("default", [])
        peers = {k: v for k, v in vals.items() if len(v) == n}
        if len(ours) < n or not peers:
            continue
        diff, se, chosen = cross_fit(ours[:n], peers)
        verdict = ("above" if diff > 2 * se else "below" if diff < -2 * se
                   else "within noise")
        out.append(f"| {h.landscape_id(q)} | {statistics.mean(ours[:n]):.3f} | "
                   f"{' / '.join(dict.fromkeys(chosen))} | {diff:+.3f} ± {se:.3f} | {verdict} |")
    return out


def _held_out(paths: list[str], labels: list[str], by: dict) -> list[str]:
    """Leave one device out over the default's variants replayed (labels `default[...]` and
    `default`): per landscape, the variant chosen on every other landscape, scored there."""
    variants = [lab for lab in labels if lab.startswith("default") and "+" not in lab]
    score = {}
    for q in paths:
        land = h.load(q)
        for v in variants:
            recs = [r for r in by.get((q, v), []) if "error" not in r]
            if not recs:
                return []
            score[(h.landscape_id(q), v)] = statistics.mean(h.at(land, r, 50) for r in recs)
    if len(variants) < 2:
        return []
    ids = [h.landscape_id(q) for q in paths]
    return ["", "#### Leave one device out: the default's variant chosen on every other "
            "landscape (mean @50), scored on the device left out",
            f"Variants: {', '.join(f'`{v}`' for v in variants)}.", ""] + \
        h.leave_one_device_out(ids, variants, score,
                               {h.landscape_id(q): h.kernel_of(q) for q in paths})


def _summary(summary: list, peer_seeds: int) -> list[str]:
    out = ["", "#### Default against the best peer at 50 evaluations (mean opt/best over seeds)",
           f"`margin` compares on the {peer_seeds} seeds every strategy ran "
           f"(0..{peer_seeds - 1}); "
           "`chose settings`: the landscape was used to choose the default's settings "
           "(gp.TUNING_SET).", "",
           "`to 5%`: the default's median evaluations until its best-measured config is within "
           "5% of the optimum (`>budget` when fewer than half the seeds got there), against "
           "random search's expected (N + 1) / (k + 1).", "",
           "| landscape | configs | chose settings | default @50 (seeds) | default @50 "
           "(shared seeds) | best peer @50 | best peer | margin | ≥ 0.95 | above best peer | "
           "to 5%: default / random | ms/sugg |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lid, n, tuned, ours, best, common, rand in summary:
        margin = common - best["@50"]
        med, _ = ours["reach"]
        reach = (f"{med:g} / {rand:.0f} ({med / rand:.2f}x)" if math.isfinite(med)
                 else f">budget / {rand:.0f}")
        out.append(f"| {lid} | {n} | {tuned} | {ours['@50']:.3f} ({ours['seeds']}) | "
                   f"{common:.3f} | "
                   f"{best['@50']:.3f} | {best['label']} | {margin:+.3f} | "
                   f"{'yes' if ours['@50'] >= 0.95 else 'no'} | "
                   f"{'yes' if margin > 0 else ('tie' if margin == 0 else 'no')} | "
                   f"{reach} | {ours['ms']:.0f} |")
    if summary:
        d = np.array([s[5] for s in summary])
        b = np.array([s[4]["@50"] for s in summary])
        a = np.array([s[3]["@50"] for s in summary])
        out.append(f"| mean | | | {a.mean():.3f} | {d.mean():.3f} | {b.mean():.3f} | | "
                   f"{np.mean(d - b):+.3f} | {int((a >= 0.95).sum())}/{len(d)} | "
                   f"{int((d > b).sum())}/{len(d)} | | |")
    return out


if __name__ == "__main__":
    main()
