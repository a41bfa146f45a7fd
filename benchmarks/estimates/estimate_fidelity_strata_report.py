"""estimate_fidelity's stratified report: from a run's dump (every figure of every drawn config),
the real winner's rank distribution first (K95: the K for which the winner is inside a figure's
top K on at least 95% of keys), then top-1/3/8 and pick-within-2% rates, overall, per chip and
per stratum, for libtpu's estimate, pallas-tune's fitted model, its roofline, and what a tune
with ``--estimate-fallback model`` ranks (the larger of libtpu's figure and the fitted model's
calibrated onto it; the calibrated model's where libtpu aborts)."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections.abc import Mapping, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import estimate_fidelity_twopoint as tp  # noqa: E402
from estimate_fidelity_strata import BATCH_BANDS, SIZE_NAMES  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "estimate_fidelity.py")
RPA_RANKS = bench.result("data", "rpa_fidelity_ranks.json")  # rpa_fidelity.py writes it.
FIGURES = (("libtpu", "libtpu's estimate (of the proxy)"),
           ("tune", "a tune with --estimate-fallback model (the larger of libtpu's and the "
                    "calibrated model's; the model's where libtpu aborts)"),
           ("public", "pallas-tune's model, constants fitted to real-TPU winners of other keys "
                      "(feasibility.fitted.PUBLIC)"),
           ("fitted", "pallas-tune's model, constants fitted to libtpu's v6e estimates "
                      "(feasibility.fitted.V6E)"),
           ("roofline", "pallas-tune's roofline model"))
TOPS = (1, 3, 8)

Blocks = tuple[int, ...]


def figures(run: Mapping[str, Any], name: str) -> dict[Blocks, float]:
    """One figure of every drawn config that has it (ms): ``libtpu`` (the proxy's), or the
    run's ``<name>_ms`` (``fitted``, ``roofline``, ``public``...). ``tune``: what a tune with
    ``--estimate-fallback model`` ranks by, by the library's own rule
    (pallas_tune.measure.scale.scale_figures): configs whose profile aborted, or ran out of VMEM
    only with the profiling flag, get the model's figure, and every config is ranked by the
    larger of libtpu's figure and the model's calibrated onto it; where libtpu figured fewer
    than 3 configs, the model's figure alone. The model is the one a tune ranks by now, the
    public fit's, in runs that have it, else the fitted one's; ``tune+<model>``: that
    model's."""
    from estimate_fidelity_complete import drawn_tune

    if name == "libtpu":
        return {tuple(b): v for b, v in run["proxy_ms"]}
    if not name.startswith("tune"):
        return {tuple(b): v for b, v in run.get(f"{name}_ms", ())}
    return drawn_tune(run, name.partition("+")[2])


def whole_figures(run: Mapping[str, Any], name: str) -> dict[Blocks, float] | None:
    """A figure over the key's whole space (``--complete``): the models' (traced everywhere),
    the tune's (exact where it can decide the rank or the pick:
    :func:`estimate_fidelity_complete.whole_tune`); None for libtpu's own figure, which has no
    bound outside the drawn configs, and for runs not completed."""
    from estimate_fidelity_complete import whole_tune

    whole = run.get("whole")
    if not whole or name == "libtpu" or "+" in name:
        return None
    if name == "tune":
        return whole_tune(run)
    return {tuple(b): v for b, v in whole.get(f"{name}_ms", ())}


def judge(run: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The real winner under one figure: its rank in the key's whole space, exact where the
    run was completed and the figure has one there (``exact``), else estimated from the share
    of drawn rivals put ahead of it (exact where every config was drawn); its rank among the
    drawn configs; and fig(winner) / fig(pick) over the same configs."""
    winner = tuple(run["winner"])
    whole = whole_figures(run, name)
    figs = whole if whole is not None else figures(run, name)
    if winner not in figs:
        return {"rank": None, "est_rank": math.inf, "ratio": None, "ranked": len(figs),
                "exact": whole is not None}
    beat = bench.winner_rank(figs, winner) - 1  # Level or ahead of it (ties against it).
    pick = min(figs, key=figs.get)
    ratio = figs[winner] / figs[pick] if figs[pick] > 0 else None
    if whole is not None:
        return {"rank": 1 + beat, "est_rank": 1 + beat, "ranked": len(figs), "ratio": ratio,
                "exact": True}
    rivals = run["configs"] - 1
    est = 1 + (beat * (run["space"] - 1) / rivals if rivals else 0)
    return {"rank": 1 + beat, "est_rank": est, "ranked": len(figs), "ratio": ratio,
            "exact": False}


k95 = bench.k95  # The least K holding the winner on 95% of keys.


def rates(runs: Sequence[Mapping[str, Any]], name: str) -> dict[str, Any]:
    js = [judge(r, name) for r in runs]
    est = [j["est_rank"] for j in js]
    n = len(js)
    return {"keys": n, "k95": k95(est),
            **{f"top{t}": sum(e <= t for e in est) for t in TOPS},
            "within2": sum(j["ratio"] is not None and j["ratio"] <= 1.02 for j in js),
            "unranked": sum(j["rank"] is None for j in js)}


def k_text(k: float) -> str:
    return "-" if k != k else "none" if k == math.inf else str(int(k))


def frac(a: int, n: int) -> str:
    return f"{a}/{n}" if n else "-"


def stratum_order(name: str) -> tuple[int, int]:
    band, size = name.replace("n_batch ", "").split(" / ")
    lo = int(band.split("-")[0])
    return ([b[0] for b in BATCH_BANDS].index(lo), SIZE_NAMES.index(size))


def rate_rows(groups: Sequence[tuple[str, Sequence[Mapping[str, Any]]]]) -> list[str]:
    """One row per group: keys, then per figure K95, top 3, top 8, pick within 2%."""
    head = "| group | keys | " + " | ".join(
        f"{n}: K95 | {n}: top 1 / 3 / 8 | {n}: pick within 2%" for n, _ in FIGURES) + " |"
    lines = [head, "|" + "---|" * (2 + 3 * len(FIGURES))]
    for label, runs in groups:
        cells = []
        for n, _ in FIGURES:
            s = rates(runs, n)
            cells += [k_text(s["k95"]), " / ".join(frac(s[f"top{t}"], s["keys"]) for t in TOPS),
                      frac(s["within2"], s["keys"])]
        lines.append(f"| {label} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def user_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What a user's shape sees, per chip and n_batch band and per chip and size: keys, and
    for libtpu's figure, a tune's and the fitted model's, top 3 / top 8, K95 and on how many
    keys the pick is within 2% of the winner's figure."""
    names = ("libtpu", "tune", "public")
    lines = ["| chip | shapes | keys | " + " | ".join(
        f"{n}: top 3 / top 8 | {n}: K95 | {n}: pick within 2%" for n in names) + " |",
        "|" + "---|" * (3 + 3 * len(names))]
    for chip in sorted({r["chip"] for r in runs}):
        rs = [r for r in runs if r["chip"] == chip]
        groups = [(f"n_batch {lo}" + (f"-{hi}" if hi > lo else ""),
                   [r for r in rs if lo <= r["key"][0] <= hi]) for lo, hi in BATCH_BANDS]
        groups += [(f"{size} n_out x n_in", [r for r in rs if r["stratum"].endswith(size)])
                   for size in SIZE_NAMES]
        groups.append(("all", rs))
        for label, g in groups:
            if not g:
                continue
            cells = []
            for n in names:
                s = rates(g, n)
                cells += [f"{frac(s['top3'], s['keys'])} / {frac(s['top8'], s['keys'])}",
                          k_text(s["k95"]), frac(s["within2"], s["keys"])]
            lines.append(f"| {chip} | {label} | {len(g)} | " + " | ".join(cells) + " |")
    return lines


def header(meta: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> list[str]:
    planned = meta["planned"]
    v = meta["versions"]
    done = {(r["chip"], tuple(r["key"])) for r in runs}
    left = [p for p in planned if (p["chip"], tuple(p["key"])) not in done]
    return [
        "# Estimate fidelity on a stratified sample: libtpu's estimate and pallas-tune's "
        "models against real-hardware winners (TPU v6e int8, TPU7x float8)", "",
        f"Generated by `{bench.script(SCRIPT)}` (issue 55). **No figure here is a measurement.** "
        "The real winner of each key is the block size vLLM tpu-inference publishes as measured "
        "best on a real TPU (`tpu_inference/kernels/quantized_matmul/tuned_block_sizes.py`, "
        f"tpu-inference {v['tpu-inference']}, Apache-2.0: its v6e int8 x int8 and its v7 "
        "float8 x float8 entries); only the sampled keys and winners are reproduced here.", "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; wall time {meta.get('total_s', 0) / 60:.1f} min; "
        f"**{len(runs)} of {len(planned)} planned keys done**"
        + (f" (not run: {len(left)}: " + ", ".join(f"{p['chip']} {tuple(p['key'])}"
                                                   for p in left) + ")" if left else ""),
        "- versions: " + ", ".join(f"{k} {x}" for k, x in v.items()),
        f"- host: {meta['host']}, "
        + meta.get("load_note", "shared with other jobs (load average 9 to 13 during the run)")
        + f", {meta['workers']} compile worker(s)", ""]


def compared(meta: Mapping[str, Any]) -> list[str]:
    caps = meta["caps"]
    return [
        "## What is compared", "",
        "- Kernel: tpu-inference's `quantized_matmul_kernel(x, w_q, w_scale, x_q_dtype=<the "
        "weights' dtype>, tuned_value=TunedValue(batch_block, out_block, in_block))`, x bf16 "
        "(n_batch, n_in), w_q (n_out, n_in) int8 on v6e, float8_e4m3fn on 7x, w_scale f32.",
        "- Traced and compiled as on the chip: the kernel caps its `vmem_limit_bytes` at its "
        "TPU generation's limit, which it reads from `jax.devices()` (96 MiB on v6e, 48 MiB "
        "on v7); on this CPU host that lookup answers for the chip compiled for "
        "(`estimate_fidelity_qmm.on_target_chip`), so a config the kernel cannot run on the "
        "chip gets no figure here either." + (f" {meta['target_limit_rerun']}"
                                              if meta.get("target_limit_rerun") else ""),
        "- **libtpu**: libtpu's static cycle estimate (deviceless compile on this CPU host, "
        "v6e at 1.75 GHz, 7x at 2.2 GHz) of the proxy: the kernel with its in-kernel "
        "activation quantization's scale and reciprocal computed in f32 (the unmodified "
        "kernel aborts libtpu 0.0.50's profiler on v6e: `LLO_CHECK failure`; see "
        "`estimate_fidelity_qmm.py`). On 7x in float8 the profiler aborts on many configs "
        "(`Cannot schedule FIFO push instruction when the FIFO is full`): they get no "
        "libtpu figure, and are counted below, not dropped.",
        "- **tune**: what a tune with `--timer tpu-estimate --estimate-fallback model` ranks, "
        "by the library's own rule (`pallas_tune.measure.scale`): the model's figure with the "
        "chip's constants fitted to real-TPU winners of other keys (`public`; runs made before "
        "that fit: the fitted model's) is calibrated onto libtpu's, times the median of "
        "libtpu/model over libtpu's best 16 configs (at least 3 with both); each config is "
        "ranked by the larger of libtpu's figure and the calibrated model's, and a config "
        "whose profile aborted, or that ran out of VMEM only under the profiling flag "
        "(checked by an unprofiled compile of the same stand-in), by the calibrated model's. "
        "Where libtpu figured fewer than 3 configs, every config by the model's figure alone. "
        "The rule was chosen on 20 other keys (`scale_rule_selection.md`).",
        "- **public**: pallas-tune's model with constants fitted per chip to tpu-inference's "
        "published winners of other keys of these tables (`feasibility.fitted.PUBLIC`; "
        "`fallback_public_fit.md`), of the unmodified kernel; **fitted**: the same model with "
        "the constants fitted to libtpu's v6e estimates of other kernels "
        "(`feasibility.fitted.V6E`, never fitted on these tables); "
        "**roofline**: pallas-tune's roofline model (`--estimate-fallback roofline`). Both "
        "only for configs the block rules and the VMEM model accept.",
        f"- Sample: seed {meta['seed']}; per chip, strata of n_batch (16-64, 128-512, "
        "1024-4096, 8192, 16384) x problem size (n_out * n_in cut at the chip table's "
        f"tertiles: small, medium, large); {meta['per_stratum']} keys per stratum drawn at "
        "random (`random.Random` seeded by seed, chip and stratum), not by cost; the order "
        "covers every stratum once before any twice, so a stopped run keeps every stratum "
        "it reached. 7x's table has no n_batch 16384.",
        "- Space per key: power-of-two blocks dividing each dimension (batch from 16, out and "
        "in from 128) plus the winner's own values and the miss default (128, 128, 128), "
        "less batch blocks the kernel's block rule refuses (not a multiple of 128 nor the "
        f"whole batch). Compiling all of it is past this host's budget at large keys "
        f"(hundreds of configs), so each key's run estimates the real winner, the miss "
        f"default and {meta['rivals']} rivals drawn at random from its space (all of it where "
        "smaller).", *ranks_text(meta),
        f"- Stand-in (every compile bounded): fewer batch blocks (the parallel axis; at "
        f"least {caps['min_steps']} steps where they exist), then, while the compile would "
        f"simulate more than {caps['mac_cap']:.0e} multiply-accumulates or "
        f"{caps['step_cap']} grid steps, fewer out and then in blocks (never under 2 where "
        "there are 2); the figure scaled by blocks in the grid / blocks kept. Per key, the "
        "most-cut scaled config whose full compile is predicted to cost at most "
        f"{caps['check_cap_s']:g} CPU s is compiled in full and the error said (never acted "
        "on: the budget).", *tp.method_text(meta), ""]


def ranks_text(meta: Mapping[str, Any]) -> list[str]:
    """How the winner's rank in the whole space is had, per figure."""
    drawn = ("1 + (rivals ahead of it / rivals drawn) x (rivals in the space), exact where "
             "every config was drawn")
    if not meta.get("complete_command"):
        return [f"- `rank`: the winner's rank among the drawn configs; in brackets its rank in "
                f"the whole space estimated as {drawn}. Top-K rates and K95 use that estimate. "
                "`pick within 2%`: est(winner) <= 1.02 x est(best drawn config): the flattering "
                "side (the whole space's best can only be better)."]
    return [
        "- **Ranks over the whole space** (`--complete`: "
        f"`{meta['complete_command']}`"
        + (f"; {meta['complete_s'] / 60:.1f} min" if meta.get("complete_s") else "")
        + "). A drawn sample of 10 estimates a winner 1st whenever "
        "no drawn rival is ahead of it, and rarely holds its near rivals, so the models' "
        "ranks are taken over every config of the space (a trace each). A tune's figure is "
        "never below the calibrated model's, so only the configs whose calibrated model "
        "figure lies below the winner's tune figure (or the drawn pick's) can be ahead of it "
        "or be the pick: those were compiled too, as the drawn ones were, with the drawn "
        "sample's calibration, which makes the tune's rank over the whole space exact. "
        "**libtpu's own figure has no such bound**: its rank stays estimated from the draw, "
        f"as {drawn}, and its top-K rates and pick are the drawn sample's (flattering). "
        "`pick within 2%`: fig(winner) <= 1.02 x the best figure over the same configs."]


def cannot_profile(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["## Where libtpu cannot profile", "",
             "| chip | keys | keys with no libtpu figure at all | configs whose profile "
             "aborted | real winner's profile aborted | configs out of VMEM only with the "
             "profiling flag | real winner among them | real winner without a libtpu figure "
             "(any reason) |", "|---|---|---|---|---|---|---|---|"]
    for c in sorted({r["chip"] for r in runs}):
        rs = [r for r in runs if r["chip"] == c]
        lines.append(
            f"| {c} | {len(rs)} | {sum(not r['proxy_ms'] for r in rs)} | "
            f"{sum(len(r['aborted']) for r in rs)}/{sum(r['configs'] for r in rs)} | "
            f"{sum(r['winner'] in r['aborted'] for r in rs)} | "
            f"{sum(len(r.get('flag_only_oom', ())) for r in rs)} | "
            f"{sum(r['winner'] in r.get('flag_only_oom', ()) for r in rs)} | "
            f"{sum(not r['winner_kind'].startswith('ok') for r in rs)} |")
    # Each text's first sentence: the workers' messages are cut at a length, mid-detail.
    texts = sorted({t.split(". ")[0] for r in runs for t in r.get("abort_texts", [])})
    return lines + [""] + ([f"Abort texts seen: {'; '.join(f'`{t[:120]}`' for t in texts)}",
                            ""] if texts else [])


def standin_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    errs = []
    for r in runs:
        if "vs full compile" in r["standin_check"]:
            errs.append(float(r["standin_check"].split(": ")[1].split("%")[0]))
    unchecked = sum(r["standin_check"].startswith("unchecked") for r in runs)
    return ["## Stand-in checks", "",
            f"{sum(r.get('scaled', 0) for r in runs)} configs of {len(runs)} keys were "
            f"estimated on a scaled stand-in; on {len(errs)} keys one was checked against its "
            "full compile: error " + (f"median {statistics.median(errs):+.2f}%, worst "
                                      f"{max(errs, key=abs):+.2f}%, beyond 5% on "
                                      f"{sum(abs(e) > 5 for e in errs)}" if errs else "-")
            + f"; {unchecked} keys unchecked (every full compile over the cap)."
            + (" That was the run's own check, under its cost model; where the run was "
               "refined, the full compiles below replace it." if any(
                   "two_point" in r for r in runs) else ""), ""]


def rpa_lines(path: str = RPA_RANKS) -> list[str]:
    """Ragged paged attention's rows (``rpa_fidelity.py``'s like-for-like ranks), in this page's
    rank table: per page size and overall; none where that run's ranks are absent."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rows = data["rows"]
    pages = sorted({r["page"] for r in rows})
    groups = [(f"page {p} ({next(r['heads'] for r in rows if r['page'] == p)} q/kv heads)",
               [r for r in rows if r["page"] == p]) for p in pages] + [("all keys", rows)]
    lines = ["## Ragged paged attention (v6e, JAX's published winners)", "",
             "libtpu cannot estimate it as it is (loops over lengths read at run time): its "
             "figure is composed from the call's concrete lengths (`kernels/_rpa_estimate.py`). "
             "Ranked against the block sizes JAX publishes as measured best on v6e, on the "
             "metadata and over the configs they were timed on: the rank among every config "
             "of that space that estimated (a key whose winner did not is a miss). From "
             f"`{data['command']}` ({data['date']}; "
             f"{data['versions']}); method and every key: `rpa_fidelity.md`.", "",
             "| group | keys | K95 | top 1 / 3 / 8 | pick within 2% |", "|---|---|---|---|---|"]
    for label, g in groups:
        ranks = [r["rank"] if r["rank"] is not None else math.inf for r in g]
        within = sum(r["ratio"] is not None and r["ratio"] <= 1.02 for r in g)
        lines.append(f"| {label} | {len(g)} | {k_text(k95(ranks))} | "
                     + " / ".join(frac(sum(x <= t for x in ranks), len(g)) for t in TOPS)
                     + f" | {frac(within, len(g))} |")
    return lines + [""]


def key_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| chip | stratum | key (n_batch, n_out, n_in) | real winner | drawn / space | "
             "libtpu figures | " + " | ".join(f"{n}: rank" for n, _ in FIGURES)
             + " | libtpu ratio | no libtpu figure | stand-in check (refined: full compiles) |",
             "|" + "---|" * (9 + len(FIGURES))]
    for r in sorted(runs, key=lambda r: (r["chip"], stratum_order(r["stratum"]), r["key"])):
        cells = []
        for n, _ in FIGURES:
            j = judge(r, n)
            cells.append("-" if j["rank"] is None else f"{j['rank']} (exact)" if j["exact"]
                         else f"{j['rank']}/{j['ranked']} ({j['est_rank']:.0f})")
        ratio = judge(r, "libtpu")["ratio"]
        fails = ", ".join(f"{k} {n}" for k, n in sorted(r["failures"].items())) or "none"
        lines.append(
            f"| {r['chip']} | {r['stratum'].replace('n_batch ', '')} | {tuple(r['key'])} | "
            f"{tuple(r['winner'])} | {r['configs']}/{r['space']} | {len(r['proxy_ms'])} | "
            + " | ".join(cells) + f" | {'-' if ratio is None else f'{ratio:.3f}'} | {fails} | "
            f"{check_text(r)} |")
    return lines


def check_text(run: Mapping[str, Any]) -> str:
    """The key's stand-in check; where refined, its full compiles (and the winner's errors)."""
    if "two_point" not in run:
        return run["standin_check"]
    cs = {tuple(c["config"]): c for c in tp.checks(run)}
    c = cs.get(tuple(run["winner"]))
    return (f"{len(cs)} in full" + ("" if c is None else
            f"; the winner's scaled {c['scaled_error']:+.1%}, two-point "
            + ("-" if c["two_point_error"] is None else f"{c['two_point_error']:+.1%}")))


def tied_text(runs: Sequence[Mapping[str, Any]]) -> str:
    """Per figure, on how many keys some other config has exactly the winner's figure."""
    def tied(run: Mapping[str, Any], name: str) -> bool:
        whole = whole_figures(run, name)
        figs = whole if whole is not None else figures(run, name)
        w = figs.get(tuple(run["winner"]))
        return w is not None and any(v == w for b, v in figs.items()
                                     if b != tuple(run["winner"]))

    return ", ".join(f"{name} {sum(tied(r, name) for r in runs)}" for name, _ in FIGURES)


def report(data: Mapping[str, Any]) -> str:
    meta, runs = data["meta"], data["runs"]
    lines = header(meta, runs) + compared(meta)
    lines += ["## The real winner's rank: K95 first", "",
              "K95: the least K for which the real winner is inside the figure's top K on at "
              "least 95% of the keys (`none`: the winner has no figure on more than 5%); "
              "then on how many keys it is 1st, in the top 3, in the top 8 of the whole space "
              "(libtpu's: estimated from the draw), and on how many the figure's pick is "
              "within 2% of it. A config the figure puts level with the winner counts as ahead "
              "of it (a tune picks one of them, not the winner by right); keys where some "
              f"config is level with the winner: {tied_text(runs)}.", ""]
    chips = sorted({r["chip"] for r in runs})
    groups = [("all keys", runs)] + [(c, [r for r in runs if r["chip"] == c]) for c in chips]
    lines += rate_rows(groups) + [""]
    for c in chips:
        lines += [f"### {c}, per stratum", ""]
        names = sorted({r["stratum"] for r in runs if r["chip"] == c}, key=stratum_order)
        lines += rate_rows([(n.replace("n_batch ", ""), [r for r in runs if r["chip"] == c
                                                         and r["stratum"] == n])
                            for n in names]) + [""]
    lines += ["## What a user's shapes see", "",
              "The same, pooled by n_batch band and by problem size (the docs' table).", ""]
    lines += user_rows(runs) + [""]
    lines += (cannot_profile(runs) + standin_lines(runs) + tp.report_lines(runs, rate_rows)
              + rpa_lines())
    lines += ["## Per key", "", "`rank`: `(exact)` over the key's whole space; otherwise "
              "among the drawn configs with that figure (ranked), in brackets the rank in the "
              "whole space estimated from them.", ""]
    lines += key_rows(runs) + [""]
    return "\n".join(lines)
