"""How a tune's figure was chosen, on keys no fidelity report scores.

With ``--estimate-fallback model`` a tune ranks each candidate by the larger of libtpu's figure
and the fitted model's calibrated onto it (pallas_tune.measure.scale). That rule was chosen
here, on the 20 v6e int8 quantized-matmul keys of estimate fidelity's two earlier samples (the
seeded one and the correction's fitting sample: ``results/data/estimate_fidelity.json``,
``estimate_fidelity_fit.json``), which a fit or selection may use: every config of each key's
divisor space has a libtpu figure there, so the winner's rank under each rule is exact. It was
decided by this table; the stratified sample that ``estimate_fidelity.md`` reports was scored
with each rule in the same sitting, and is reported as it came. The rule's other part (where
libtpu figured fewer than 3 candidates, the model alone ranks them) has no key here to be
checked on: every key here has libtpu figures for its whole space.

Rules scored: libtpu's figure alone; the fitted model (public fit) calibrated only where libtpu
has no figure (a tune before the rule); the larger of the two (the rule); their geometric mean;
the model alone. The model's figures are traced, never compiled; libtpu's come from the dumps.
Every figure is an estimate; the only measurement is tpu-inference's choice of winner.

    python benchmarks/estimates/scale_rule_selection.py

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 2 keys, 6 configs each.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import fallback_public_report as rep  # noqa: E402

DUMPS = ("estimate_fidelity.json", "estimate_fidelity_fit.json")
RULES = (("libtpu", "libtpu's figure alone"),
         ("calibrated", "libtpu's; the model calibrated onto it where libtpu has none"),
         ("max", "the larger of libtpu's and the calibrated model's (the rule)"),
         ("geomean", "the geometric mean of libtpu's and the calibrated model's"),
         ("model", "the model alone"))

Blocks = tuple[int, int, int]


def rule_figures(rule: str, lib: Mapping[Blocks, float], model: Mapping[Blocks, float]
                 ) -> dict[Blocks, float]:
    """One rule's figure of each config (ms), by the library's own scaling where it has it."""
    from pallas_tune.measure.scale import scale_figures

    if rule == "libtpu":
        return dict(lib)
    if rule == "model":
        return dict(model)
    s = scale_figures(lib, model, bound=rule == "max")
    figs = {b: ms for b, (ms, _) in s.figures.items()}
    if rule == "geomean" and s.ratio is not None:
        figs.update({b: math.sqrt(v * model[b] * s.ratio) for b, v in lib.items()
                     if b in model})
    return figs


def score(runs: Sequence[Mapping[str, Any]], features: str) -> dict[str, list[dict]]:
    """The winner's exact rank under each rule, per key (tracing what the cache lacks)."""
    from estimate_fidelity_qmm import qmm
    from fallback_public_fit import trace_features

    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.fitted import PUBLIC

    qmm()
    spec, cache = chip_spec("v6e"), rep.load_features(features)
    out: dict[str, list[dict]] = {name: [] for name, _ in RULES}
    for r in runs:
        key, w = tuple(r["key"]), tuple(r["winner"])
        lib = {tuple(b): v for b, v in r["proxy_ms"]}
        cfgs = ([w] + sorted(set(lib) - {w}))[:bench.smoke(None, 6)]
        lib = {b: lib[b] for b in cfgs if b in lib}
        feats = rep.features_of(cache, "v6e", key, cfgs, "v6e", "int8", trace_features)
        model = {b: 1e3 * s for b, s in
                 rep.model_times(feats, spec, PUBLIC["tpu_v6e"]).items()}
        for name, _ in RULES:
            out[name].append(rep.exact(rule_figures(name, lib, model), w))
    rep.save_features(features, cache)
    return out


def report(scores: Mapping[str, Sequence[Mapping[str, Any]]], meta: Mapping[str, Any]) -> str:
    keys = len(next(iter(scores.values())))
    lines = ["# How a tune's figure was chosen (keys no fidelity report scores)", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "",
             f"{keys} v6e int8 keys; the winner's exact rank over each key's configs. "
             f"Command: `{meta['command']}` ({meta['date']}, {meta['host']}, "
             f"{meta['wall_s']:.0f} s; {meta['versions']}).", "",
             "| rule | K95 | top 1 / 3 / 8 | pick within 2% | median fig(winner) / fig(pick) |",
             "|---|---|---|---|---|"]
    for name, text in RULES:
        lines.append(f"| {text} | " + " | ".join(rep.rate_cells(scores[name])) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from estimate_fidelity_qmm import TPU_INFERENCE_DIR

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    rep.common_args(p, "scale_rule_selection.md")
    a = p.parse_args(argv)
    if TPU_INFERENCE_DIR is None:
        return rep.no_tpu_inference("score")
    runs = []
    for name in DUMPS:
        with open(os.path.join(bench.result("data"), name)) as f:
            runs += json.load(f)["runs"]
    runs = runs[:bench.smoke(None, 2)]
    a.features = a.features or os.path.join(bench.scratch("pt-scale-rule-"), "features.json")
    t0 = time.time()
    scores = score(runs, a.features)
    meta = {"command": bench.command(__file__, argv), "date": bench.today(),
            "host": bench.host(), "wall_s": time.time() - t0,
            "versions": bench.versions("jax", "tpu-inference", "pallas-tune")}
    bench.write(a.out, report(scores, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
