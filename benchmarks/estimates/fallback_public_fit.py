"""The fallback model fitted on public tables: real-hardware winners, not libtpu's estimates.

Where libtpu's static profile aborts (the kernel as tpu-inference ships it on v6e, float8 on 7x)
a tune ranks configs by pallas-tune's fitted model (:mod:`pallas_tune.feasibility.fitted`),
whose constants were fitted to libtpu's own v6e estimates. This script fits the same model's
four constants (MXU rate, HBM bandwidth, cost of a grid step, cost of a vector element) per chip
to the block sizes tpu-inference publishes as measured best on real TPUs
(``kernels/quantized_matmul/tuned_block_sizes.py``: v6e int8, v7 float8), so that each key's
published winner ranks first among its space: a softmax (listwise) loss on log time, with
temperature ``--tau``. It never fits on a key that a report scores: the keys of estimate
fidelity's stratified sample, of its earlier seeded sample and of the correction's fitting sample
are left out, and the fit is judged on the stratified sample's keys alone, beside libtpu's
figures for the same configs (``results/data/estimate_fidelity_strata.json``).

Configs are only traced (never compiled), so the model's rank of the winner is exact over each
key's whole space; on the configs the stratified run drew it is put beside libtpu's and a
tune's, with the winner's rank in the space estimated the same way. The table's other keys
(neither trained on nor reported) are ranked the same way as a validation set, larger than the
held-out sample. Every figure is a model's or libtpu's estimate; the only measurement is
tpu-inference's choice of winner.

    python benchmarks/estimates/fallback_public_fit.py

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): 3 training and 2 held-out keys a chip, 6 configs each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import fallback_public_report as rep  # noqa: E402

# A ranking loss fixes the constants only up to a common scale (times all 2x: the same order),
# and a tune calibrates the fallback onto libtpu's figures per key, so the MXU's rate is held at
# the chip's peak and the other three are fitted against it, in log space.
PARAMS = ("bw_eff", "step_s", "vec_s")
FIXED = {"mxu_eff": 1.0}
BOUNDS = {"mxu_eff": (0.05, 1.0), "bw_eff": (0.1, 5.0), "step_s": (1e-9, 1e-5),
          "vec_s": (1e-17, 1e-10)}
TAU = 0.05  # Softmax temperature on log time: configs within ~5% of the best compete.
TRAIN_KEYS = 80  # Training keys per chip (at random among those no report scores).
TRAIN_RIVALS = 24  # Configs per training key beside the winner (at random).
DATA = bench.result("data")
FIDELITY_DUMPS = ("estimate_fidelity_strata.json", "estimate_fidelity.json",
                  "estimate_fidelity_fit.json")

Key = tuple[int, int, int]
Blocks = tuple[int, int, int]


def reported_keys(data_dir: str, planned: Sequence[Any]) -> set[tuple[str, Key]]:
    """(chip, key) of every key a fidelity report scores or a fit used: never trained on."""
    out = {(e.chip, tuple(e.key)) for e in planned}
    for name in FIDELITY_DUMPS:
        path = os.path.join(data_dir, name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            d = json.load(f)
        for r in d.get("runs", ()):
            out.add((r.get("chip", "v6e"), tuple(r["key"])))
    return out


def trace_features(key: Key, blocks: Sequence[Blocks], chip: str, w_dtype: str
                   ) -> dict[Blocks, Any]:
    """Per config: the fitted model's features of its traced pallas_calls (as dicts: the
    features file's form) and the roofline's time, or None where the block rules or the VMEM
    model refuse it (no figure)."""
    from estimate_fidelity_qmm import accepted_calls

    from pallas_tune.chips import chip_spec
    from pallas_tune.feasibility.fitted import call_features
    from pallas_tune.feasibility.roofline import roofline_calls

    spec = chip_spec(chip)
    return {b: None if calls is None else {
        "features": [dataclasses.asdict(call_features(c)) for c in calls],
        "roofline_s": roofline_calls(calls, spec).time_s}
        for b, calls in accepted_calls(key, blocks, chip, w_dtype).items()}


def constants(theta: Sequence[float]) -> Any:
    from pallas_tune.feasibility.fitted import Constants

    vals = dict(FIXED)
    for p, t in zip(PARAMS, theta, strict=True):
        lo, hi = BOUNDS[p]
        vals[p] = min(max(math.exp(t), lo), hi)
    return Constants(**vals)


def loss(theta: Sequence[float], keys: Sequence[tuple[Blocks, Mapping[Blocks, Any]]],
         spec: Any, tau: float) -> float:
    """Mean softmax cross-entropy of each key's winner over its configs, on log time / tau."""
    c = constants(theta)
    total = 0.0
    for winner, feats in keys:
        t = rep.model_times(feats, spec, c)
        logs = [-math.log(v) / tau for v in t.values()]
        top = max(logs)
        lse = top + math.log(sum(math.exp(v - top) for v in logs))
        total += lse + math.log(t[winner]) / tau
    return total / max(len(keys), 1)


def fit(keys: Sequence[tuple[Blocks, Mapping[Blocks, Any]]], spec: Any, tau: float
        ) -> tuple[Any, float]:
    """The constants of least loss: Nelder-Mead in log space from libtpu's fit and from the
    middle of the bounds."""
    from scipy.optimize import minimize

    from pallas_tune.feasibility.fitted import V6E

    starts = [[math.log(getattr(V6E, p)) for p in PARAMS],
              [0.5 * (math.log(BOUNDS[p][0]) + math.log(BOUNDS[p][1])) for p in PARAMS]]
    best = None
    for x0 in starts:
        r = minimize(loss, x0, args=(keys, spec, tau), method="Nelder-Mead",
                     options={"maxiter": bench.smoke(800, 40), "xatol": 1e-3, "fatol": 1e-5})
        if best is None or r.fun < best.fun:
            best = r
    return constants(best.x), float(best.fun)


def main(argv: Sequence[str] | None = None) -> int:
    import estimate_fidelity_stratified as strat
    from estimate_fidelity_qmm import TPU_INFERENCE_DIR, qmm
    from estimate_fidelity_strata import CHIPS, strata_space

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--train-keys", type=int, default=bench.smoke(TRAIN_KEYS, 3))
    p.add_argument("--rivals", type=int, default=bench.smoke(TRAIN_RIVALS, 5))
    p.add_argument("--tau", type=float, default=TAU)
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--fidelity", default=os.path.join(DATA, FIDELITY_DUMPS[0]),
                   help="the stratified fidelity run's dump: its keys are the held-out set")
    rep.common_args(p, "fallback_public_fit.md")
    a = p.parse_args(argv)
    if TPU_INFERENCE_DIR is None:
        return rep.no_tpu_inference("fit on")
    qmm()
    tabs = strat.tables(TPU_INFERENCE_DIR)
    with open(a.fidelity) as f:
        held_runs = json.load(f)["runs"]
    planned = strat.plan(tabs, strat.PER_STRATUM, strat.SEED, None)
    never = reported_keys(DATA, planned)
    a.features = a.features or os.path.join(bench.scratch("pt-public-fit-"), "features.json")
    cache = rep.load_features(a.features)
    t0 = time.time()
    fits = {}
    for chip, (_, dtypes, name) in CHIPS.items():
        from pallas_tune.chips import chip_spec

        spec, table = chip_spec(name), tabs[chip]
        rng = random.Random(f"{a.seed}:{chip}")
        pool = sorted(k for k in table if (chip, k) not in never)
        train = sorted(rng.sample(pool, min(a.train_keys, len(pool))))
        held = [r for r in held_runs if r["chip"] == chip][:bench.smoke(None, 2)]
        trained = set(train)
        rest = [k for k in pool if k not in trained][:bench.smoke(None, 2)]
        train_sets, held_sets, valid_sets, valid_keys = [], [], [], []
        for k in train:
            full, _ = strata_space(k, table)
            others = [b for b in full if b != table[k]]
            cfgs = [table[k]] + rng.sample(others, min(a.rivals, len(others)))
            feats = rep.features_of(cache, chip, k, cfgs, name, dtypes[1], trace_features)
            if feats.get(table[k]) is not None:
                train_sets.append((table[k], feats))
        for r in held:
            k = tuple(r["key"])
            full, _ = strata_space(k, table)
            cfgs = [table[k]] + sorted((set(full) | {tuple(b) for b, _ in r["proxy_ms"]})
                                       - {table[k]})
            held_sets.append((r, rep.features_of(cache, chip, k, cfgs[:bench.smoke(None, 6)],
                                                 name, dtypes[1], trace_features)))
        for k in rest:
            full, _ = strata_space(k, table)
            cfgs = [table[k]] + sorted(set(full) - {table[k]})
            feats = rep.features_of(cache, chip, k, cfgs[:bench.smoke(None, 6)], name,
                                    dtypes[1], trace_features)
            if feats.get(table[k]) is not None:
                valid_sets.append((table[k], feats))
                valid_keys.append(k)
        rep.save_features(a.features, cache)
        c, fun = fit(train_sets, spec, a.tau)
        fits[chip] = {"constants": c, "loss": fun, "train": train_sets, "held": held_sets,
                      "valid": valid_sets, "valid_keys": valid_keys,
                      "spec": spec, "skipped": len(train) - len(train_sets)}
        print(f"{chip}: fitted on {len(train_sets)} keys: {c} (loss {fun:.3f})", flush=True)
    meta = {"command": bench.command(__file__, argv), "date": bench.today(),
            "host": bench.host(), "wall_s": time.time() - t0, "tau": a.tau,
            "versions": bench.versions("jax", "tpu-inference", "scipy", "pallas-tune")}
    bench.write(a.out, rep.report(fits, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
