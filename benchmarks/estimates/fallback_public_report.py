"""fallback_public_fit's parts: the traced-features cache and the Markdown report (the fitted
constants; the published winner's rank under each figure, on the training keys and on the
stratified fidelity sample's keys, which the fit never saw)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import _common as bench
import estimate_fidelity_strata_report as srep

Blocks = tuple[int, int, int]
WHOLE = (("fitted", "fitted to libtpu's v6e estimates (shipped)"),
         ("public", "fitted to the public tables (this fit)"),
         ("roofline", "the roofline model"))
DRAWN = ("libtpu", "tune+fitted", "tune", "fitted", "public", "roofline")


def common_args(p: Any, page: str) -> None:
    """The options both scripts that trace the public fit's features take: ``--features`` (a
    cache file) and ``--out``."""
    p.add_argument("--features", default="",
                   help="a file of traced features, reused across runs that name it "
                        "(default: a temporary one)")
    p.add_argument("--out", default=bench.output(bench.result(page)))


def no_tpu_inference(what: str) -> int:
    """Says tpu-inference is missing and how to get it; the scripts' exit status (2)."""
    print("tpu-inference is not installed: pip install --no-deps tpu-inference==0.32.0. "
          f"Nothing to {what}.", file=sys.stderr)
    return 2


def load_features(path: str) -> dict[str, Any]:
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    return {}


def save_features(path: str, cache: Mapping[str, Any]) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(cache, f, separators=(",", ":"))
        os.replace(path + ".tmp", path)


@dataclasses.dataclass(frozen=True, slots=True)
class Traced:
    """One config's traced pallas_calls, as the fitted model and the roofline read them."""

    calls: tuple[Any, ...]  # feasibility.fitted.CallFeatures, one per pallas_call.
    roofline_s: float

    @classmethod
    def of(cls, entry: Mapping[str, Any]) -> Traced:
        """From a features file's entry (``fallback_public_fit.trace_features``)."""
        from pallas_tune.feasibility.fitted import CallFeatures

        return cls(tuple(CallFeatures(**{**x, "dots": tuple(tuple(d) for d in x["dots"])})
                         for x in entry["features"]), entry["roofline_s"])


def features_of(cache: dict[str, Any], chip: str, key: Sequence[int],
                configs: Sequence[Blocks], spec_name: str, w_dtype: str,
                trace: Callable[..., Mapping[Blocks, Any]]) -> dict[Blocks, Traced | None]:
    """The configs' traced features, from the cache or traced now (and cached); None where
    the model has no figure."""
    entry = cache.setdefault(f"{chip}|{','.join(map(str, key))}", {})
    todo = [b for b in configs if ",".join(map(str, b)) not in entry]
    if todo:
        for b, f in trace(tuple(key), todo, spec_name, w_dtype).items():
            entry[",".join(map(str, b))] = f
    raw = {tuple(b): entry[",".join(map(str, b))] for b in configs}
    return {b: None if f is None else Traced.of(f) for b, f in raw.items()}


def model_times(feats: Mapping[Blocks, Traced | None], spec: Any, c: Any
                ) -> dict[Blocks, float]:
    """The fitted model's time (s) with constants ``c`` of each config that has features."""
    from pallas_tune.feasibility.fitted import time_of

    return {b: time_of(f.calls, spec, c) for b, f in feats.items() if f is not None}


def exact(figs: Mapping[Blocks, float], winner: Blocks) -> dict[str, Any]:
    """The winner's exact rank among ``figs`` (inf: no figure) and fig(winner)/fig(pick)."""
    if winner not in figs:
        return {"rank": math.inf, "ratio": None}
    w = figs[winner]
    return {"rank": bench.winner_rank(figs, winner),
            "ratio": w / min(figs.values())}


def whole_figures(name: str, feats: Mapping[Blocks, Traced | None], spec: Any, c: Any
                  ) -> dict[Blocks, float]:
    from pallas_tune.feasibility.fitted import V6E

    if name == "roofline":
        return {b: f.roofline_s for b, f in feats.items() if f is not None}
    return model_times(feats, spec, V6E if name == "fitted" else c)


def within_2pct(js: Sequence[Mapping[str, Any]]) -> int:
    """Keys whose pick's figure is within 2% of the winner's."""
    return sum(j["ratio"] is not None and j["ratio"] <= 1.02 for j in js)


def rate_cells(js: Sequence[Mapping[str, Any]]) -> list[str]:
    n = len(js)
    ranks = [j["rank"] for j in js]
    ratios = [j["ratio"] for j in js if j["ratio"] is not None]
    return [srep.k_text(srep.k95(ranks)),
            " / ".join(srep.frac(sum(r <= t for r in ranks), n) for t in srep.TOPS),
            srep.frac(within_2pct(js), n),
            f"{statistics.median(ratios):.3f}" if ratios else "-"]


def whole_rows(fits: Mapping[str, Any], which: str) -> list[str]:
    """Per chip and figure: the winner's exact rank over each key's configs (``which``:
    ``held``, the whole space of the fidelity sample's keys; ``valid``, the whole space of the
    table's other keys; ``train``, the drawn configs of the training keys)."""
    lines = ["| chip | figure | keys | K95 | top 1 / 3 / 8 | pick within 2% | median "
             "fig(winner) / fig(pick) |", "|---|---|---|---|---|---|---|"]
    for chip, f in fits.items():
        sets = ([(tuple(r["winner"]), feats) for r, feats in f["held"]] if which == "held"
                else f[which])
        for name, _ in WHOLE:
            js = [exact(whole_figures(name, feats, f["spec"], f["constants"]), w)
                  for w, feats in sets]
            lines.append(f"| {chip} | {name} | {len(js)} | " + " | ".join(rate_cells(js))
                         + " |")
    return lines


# n_batch bands of the validation keys (the fidelity sample's strata, the two largest pooled).
BANDS = ((0, 64, "up to 64"), (65, 512, "128-512"), (513, 4096, "1024-4096"),
         (4097, math.inf, "8192 and up"))


def band_rows(fits: Mapping[str, Any]) -> list[str]:
    """The validation keys per n_batch band: per figure, on how many keys the winner is in the
    top 3 and the pick within 2% of it (``valid_keys``: the keys of ``valid``, in order)."""
    lines = ["| chip | n_batch | keys | " + " | ".join(
        f"{n}: top 3 | {n}: pick within 2%" for n, _ in WHOLE) + " |",
        "|---|---|---|" + "---|" * (2 * len(WHOLE))]
    for chip, f in fits.items():
        for lo, hi, label in BANDS:
            sets = [s for s, k in zip(f["valid"], f["valid_keys"], strict=True)
                    if lo <= k[0] <= hi]
            if not sets:
                continue
            cells = []
            for name, _ in WHOLE:
                js = [exact(whole_figures(name, feats, f["spec"], f["constants"]), w)
                      for w, feats in sets]
                cells += [srep.frac(sum(j["rank"] <= 3 for j in js), len(js)),
                          srep.frac(within_2pct(js), len(js))]
            lines.append(f"| {chip} | {label} | {len(sets)} | " + " | ".join(cells) + " |")
    return lines


def drawn_runs(fits: Mapping[str, Any]) -> list[dict]:
    """The fidelity runs with ``public_ms``: the public fit's figure (ms) of every drawn
    config the fitted model has a figure for."""
    out = []
    for f in fits.values():
        for r, feats in f["held"]:
            t = model_times(feats, f["spec"], f["constants"])
            drawn = {tuple(b) for b, _ in r["fitted_ms"]}
            out.append({**r, "whole": None,  # Ranked from the draw (the section's scope).
                        "public_ms": [[list(b), 1e3 * v] for b, v in t.items() if b in drawn]})
    return out


def drawn_rows(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = ["| chip | keys | " + " | ".join(f"{n}: K95 | {n}: top 3 / 8 | {n}: within 2%"
                                              for n in DRAWN) + " |",
             "|" + "---|" * (2 + 3 * len(DRAWN))]
    for chip in ["all", *sorted({r["chip"] for r in runs})]:
        rs = [r for r in runs if chip in ("all", r["chip"])]
        cells = []
        for n in DRAWN:
            s = srep.rates(rs, n)
            cells += [srep.k_text(s["k95"]), f"{srep.frac(s['top3'], s['keys'])} / "
                      f"{srep.frac(s['top8'], s['keys'])}", srep.frac(s["within2"], s["keys"])]
        lines.append(f"| {chip} | {len(rs)} | " + " | ".join(cells) + " |")
    return lines


def constants_rows(fits: Mapping[str, Any]) -> list[str]:
    from pallas_tune.feasibility.fitted import V6E

    lines = ["| chip | training keys | loss | " + " | ".join(
        f.name for f in dataclasses.fields(V6E)) + " |", "|---|---|---|" + "---|" * 4]
    lines.append("| (shipped: libtpu's v6e estimates) | - | - | " + " | ".join(
        f"{getattr(V6E, f.name):.3g}" for f in dataclasses.fields(V6E)) + " |")
    for chip, f in fits.items():
        c = f["constants"]
        lines.append(f"| {chip} | {len(f['train'])} | {f['loss']:.3f} | " + " | ".join(
            f"{getattr(c, x.name):.3g}" for x in dataclasses.fields(c)) + " |")
    return lines


def report(fits: Mapping[str, Any], meta: Mapping[str, Any]) -> str:
    lines = [
        "# The fallback model fitted on public tables (real-hardware winners)", "",
        "Generated by `benchmarks/estimates/fallback_public_fit.py`. **No figure here is a "
        "measurement**: the model's and libtpu's figures are estimates; the only measurement "
        "is which block size tpu-inference 0.32.0 publishes as best for each key "
        "(`kernels/quantized_matmul/tuned_block_sizes.py`, Apache-2.0; v6e int8, v7 float8).",
        "", f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; wall time {meta['wall_s'] / 60:.1f} min (traces reused "
        "from the --features file where it held them); host: "
        f"{meta['host']}; {meta['versions']}",
        f"- the fit: pallas-tune's fitted model's four constants, per chip, minimizing the "
        f"mean softmax cross-entropy of each training key's published winner over its "
        f"configs (log time / {meta['tau']}), Nelder-Mead in log space. Training keys: drawn "
        "at random from the chip's table, never a key of estimate fidelity's stratified, "
        "seeded or correction-fit samples; each with its winner and rivals drawn at random "
        "from its powers-of-two space.", "",
        "## The constants", ""] + constants_rows(fits) + [
        "", "## Held out: the stratified fidelity sample's keys, every config of each key's "
        "space", "",
        "The published winner's exact rank in the key's whole space (the fidelity run drew "
        "10 configs a key; the models need no compile, so every config is ranked here). "
        "`fitted`: the constants fitted to libtpu's v6e estimates; `public`: this fit. A "
        "config a figure puts level with the winner counts as ahead of it.", ""] + whole_rows(
        fits, "held") + [
        "", "## Validation: the table's other keys, every config of each key's space", "",
        "Every key of the chip's table that the fit did not train on and no report scores "
        "(many more keys than the held-out sample: a difference there is more likely real), "
        "ranked as above. The fit never sees them; nothing is chosen on them either.",
        ""] + whole_rows(fits, "valid") + [
        "", "The same keys per n_batch band:", ""] + band_rows(fits) + [
        "", "## Held out, on the configs the fidelity run drew, beside libtpu's", "",
        "The winner's rank in the space estimated from the drawn rivals, as "
        "`estimate_fidelity.md` ranked them before it ranked over the whole space (where a "
        "tune's rank is exact: that page): `tune` is what a tune ranks with this fit as its "
        "fallback "
        "(pallas_tune.measure.scale: the larger of libtpu's figure and this fit's calibrated "
        "onto it; the calibrated fit's where libtpu has none; the fit's alone where libtpu "
        "figured fewer than 3 configs), `tune+fitted` the same with the constants fitted to "
        "libtpu's estimates (the fallback before this fit).",
        ""] + drawn_rows(drawn_runs(fits)) + [
        "", "## In sample: the training keys (winner and drawn rivals)", ""] + whole_rows(
        fits, "train") + [""]
    return "\n".join(lines)
