"""How the default search's settings were chosen, and how they hold on kernels not used to choose.

Each variant is the default (pallas_tune.search.gp.CandidateBO) with some settings changed; all are
replayed on every landscape (as benchmarks/search/search_efficiency.py replays: noisy repeats, the
mean time of the best-measured config scored). Settings are chosen by the mean of @50 (min(1,
optimum / that mean time) after 50 evaluations) over a set of landscapes:

- Leave one kernel out: for each of the 5 kernels, the variant chosen on the *other* kernels'
  landscapes, and its score on the held-out kernel's landscapes (what a new kernel would see).
- The shipped default: the variant chosen on `gp.TUNING_SET` (declared there) alone; the
  landscapes outside it were not used to choose, and the report says whether the shipped
  constants are that variant.

    nice -n 10 python benchmarks/search/search_settings.py [--seeds 10] [--budget 50] [--jobs 1]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): one seed, two variants, on benchmarks/landscapes (two
kernels, so that leaving one out still leaves one to choose on), not ../shared.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import search_harness as h  # noqa: E402

from pallas_tune.search import gp, replay  # noqa: E402

# The settings compared (each label overrides CandidateBO's defaults).
VARIANTS = [
    h.PREVIOUS_DEFAULT,                                    # the previous default
    "default[cycle='gl',n_startup=5,startup_per_dim=2]",   # 2 initial per varying parameter
    "default[cycle='gl',n_startup=15]",                    # 15 initial
    "default[cycle='glm',n_startup=5]",                    # a multivariate TPE step
    "default[cycle='glm',n_startup=5,startup_per_dim=2]",  # both, 2 per parameter
    "default[cycle='glm',n_startup=15]",                   # both, 15 initial
]


def shipped() -> dict:
    """CandidateBO's defaults for the settings the variants change."""
    keys = ("cycle", "local_radius", "init", "xi", "cap_quantile", "n_startup",
            "startup_per_dim")
    params = inspect.signature(gp.CandidateBO.__init__).parameters
    return {k: params[k].default for k in keys}


def _scores(paths: list[str], variants: list[str], units: list, recs: list
            ) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """Per (landscape id, variant): the mean @50 over seeds, and its standard error."""
    score, se = {}, {}
    for q in paths:
        land = h.load(q)
        for v in variants:
            xs = [h.at(land, r, 50) for u, r in zip(units, recs, strict=True)
                  if u[0] == q and u[1] == v]
            score[(h.landscape_id(q), v)] = statistics.mean(xs)
            se[(h.landscape_id(q), v)] = (statistics.stdev(xs) / len(xs) ** 0.5
                                          if len(xs) > 1 else 0.0)
    return score, se


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, default=bench.smoke(10, 1))
    p.add_argument("--budget", type=int, default=50)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--variants", default=";".join(bench.smoke(VARIANTS, VARIANTS[:2])),
                   help="labels, ';'-separated")
    p.add_argument("--landscapes", default=bench.smoke(None, bench.LANDSCAPES))
    p.add_argument("--out", default=None)
    a = p.parse_args()
    variants = [v.strip() for v in a.variants.split(";") if v.strip()]
    paths = replay.find_landscapes(a.landscapes)
    if not paths:
        sys.exit(f"no landscapes: set --landscapes or ${replay.LANDSCAPES_ENV}")
    units = [(q, v, a.budget, s) for q in paths for v in variants for s in range(a.seeds)]
    score, se = _scores(paths, variants, units, h.replay_many(units, a.jobs))
    ids = [h.landscape_id(q) for q in paths]
    tag = os.environ.get("PT_SEARCH_CACHE_TAG")
    env = f"PT_SEARCH_CACHE_TAG={tag}" if tag else ""
    lines = [f"# $ {bench.command(__file__, env=env)}",
             f"# {bench.today()}; {a.seeds} seeds, budget {a.budget}; cells: mean @50 "
             "(min(1, optimum / mean time of the best-measured config)); a cell's standard error "
             f"over seeds runs from {min(se.values()):.3f} to {max(se.values()):.3f} "
             f"({max(se, key=se.get)[0]}), so many differences between variants here are "
             "within noise."
             + (f" Replays read from the cache tagged {tag!r} (the same code paths for every "
                "variant's settings)." if tag else ""),
             "", "#### Every variant on every landscape (T: in gp.TUNING_SET)",
             "| landscape | " + " | ".join(f"v{i}" for i in range(len(variants))) + " |",
             "|---|" + "---|" * len(variants)]
    for lid in ids:
        mark = " (T)" if lid in gp.TUNING_SET else ""
        lines.append(f"| {lid}{mark} | " + " | ".join(f"{score[(lid, v)]:.3f}"
                                                      for v in variants) + " |")
    lines += [""] + [f"- v{i} = `{v}`" for i, v in enumerate(variants)]

    def choose(on: list[str]) -> str:
        return h.choose(variants, score, on)

    lines += ["", "#### Leave one kernel out: chosen on the other kernels, scored on the held-out",
              "| held-out kernel | chosen on the others | held-out @50 per landscape | mean | "
              "best variant there (mean) |", "|---|---|---|---|---|"]
    loko: dict[str, float] = {}
    for k in sorted({h.kernel_of(q) for q in paths}):
        held = [h.landscape_id(q) for q in paths if h.kernel_of(q) == k]
        others = [lid for lid in ids if lid not in held]
        if not others:
            lines.append(f"| {k} | no other kernel to choose on | | | |")
            continue
        v = choose(others)
        loko.update({lid: score[(lid, v)] for lid in held})
        best = choose(held)
        cells = ", ".join(f"{lid.split('/')[1]} {score[(lid, v)]:.3f}" for lid in held)
        lines.append(f"| {k} | v{variants.index(v)} | {cells} | "
                     f"{statistics.mean(score[(lid, v)] for lid in held):.3f} | "
                     f"v{variants.index(best)} "
                     f"({statistics.mean(score[(lid, best)] for lid in held):.3f}) |")
    if loko:
        lines.append(f"\nHeld-out mean over all {len(loko)} landscapes (each scored by the "
                     f"variant chosen without its kernel): {statistics.mean(loko.values()):.3f}, "
                     f"worst {min(loko.values()):.3f}; the previous default v0 on all: "
                     f"{statistics.mean(score[(lid, variants[0])] for lid in ids):.3f}, worst "
                     f"{min(score[(lid, variants[0])] for lid in ids):.3f}.")
    lines += ["", "#### Leave one device out: the variant chosen on every other landscape, "
              "scored on the device left out"] + h.leave_one_device_out(
        ids, variants, score, {h.landscape_id(q): h.kernel_of(q) for q in paths})
    tuning = [lid for lid in ids if lid in gp.TUNING_SET]
    if tuning:
        v = choose(tuning)
        ok = all(shipped()[k] == x for k, x in h.parse_settings(v).items())
        lines += ["", f"Chosen on gp.TUNING_SET ({', '.join(tuning)}): v{variants.index(v)} "
                  f"`{v}`; the shipped constants {shipped()} "
                  f"{'are' if ok else 'are NOT'} this variant."]
    bench.write(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
