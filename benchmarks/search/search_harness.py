"""Shared machinery of the search benchmarks: strategies by label, replays cached on disk, scores.

A unit of work is one (landscape, strategy label, seed, budget) replay; its trace (the configs
measured, as indices into the landscape's configs, the values drawn, the strategy's seconds) is
stored as JSON under the cache folder, so an interrupted benchmark resumes where it stopped.
pallas-tune's own strategies are keyed by a hash of `pallas_tune/search/*.py` as well, so a
changed default is replayed again (or by $PT_SEARCH_CACHE_TAG, for studies of settings while the
code behind them stays the same).

Labels: a name of `pallas_tune.search.replay.STRATEGIES`; `KT:<name>` (Kernel Tuner 1.5 in
its simulation mode, fed a per-seed file in which every config's time is one recorded repeat
drawn at random, the same noise model as ours); `default[key=value,...]` (the default with some
`CandidateBO` settings changed, for studies of those settings).
"""

from __future__ import annotations

import ast
import functools
import glob
import gzip
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

from pallas_tune.search import replay  # noqa: E402

CACHE = bench.output(bench.result("cache", "search"))  # Smoke runs: a fresh folder.
# The default before its initial design of 15 and its multivariate TPE step: the baseline both
# search_settings.py and search_efficiency.py replay it as.
PREVIOUS_DEFAULT = "default[cycle='gl',n_startup=5]"


def landscape_id(path: str) -> str:
    """`kernel/device` from `.../kernel/device.json.gz`."""
    base = os.path.basename(path).removesuffix(".gz").removesuffix(".json")
    return f"{os.path.basename(os.path.dirname(path))}/{base}"


def kernel_of(path: str) -> str:
    """The kernel a landscape times: its folder's name for Kernel Tuner files, the shipped
    kernel's for the v6e estimate landscapes (benchmarks/landscapes, one folder for all)."""
    name = os.path.basename(path).removesuffix(".gz").removesuffix(".json")
    if name in ESTIMATE_PRIORS:
        return ESTIMATE_PRIORS[name][0].rsplit(".", 1)[-1]
    return landscape_id(path).split("/")[0]


@functools.lru_cache(maxsize=4)
def load(path: str) -> replay.Landscape:
    return replay.load(path)


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """A hash of the search package's code: its syntax trees without docstrings, so that
    comments and documentation do not invalidate cached replays."""
    folder = os.path.dirname(os.path.abspath(replay.__file__))
    h = hashlib.sha1()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                        and isinstance(body[0].value, ast.Constant)
                        and isinstance(body[0].value.value, str)):
                    node.body = body[1:] or [ast.Pass()]
            h.update(name.encode() + ast.dump(tree).encode())
    return h.hexdigest()[:10]


def parse_settings(label: str) -> dict[str, Any]:
    """`default[xi=0.1,local_every=2]` → {'xi': 0.1, 'local_every': 2}."""
    inner = label[label.index("[") + 1:label.rindex("]")]
    out = {}
    for item in filter(None, inner.split(",")):
        k, v = item.split("=", 1)
        out[k.strip()] = ast.literal_eval(v.strip())
    return out


def _cache_path(cache: str, path: str, label: str, budget: int, seed: int) -> str:
    tag = label
    if label.startswith("default"):
        tag = f"{label}@{os.environ.get('PT_SEARCH_CACHE_TAG') or _source_hash()}"
    safe = "".join(ch if ch.isalnum() or ch in "-_.=@" else "_" for ch in tag)
    return os.path.join(cache, landscape_id(path).replace("/", "__"), safe,
                        f"b{budget}_s{seed}.json")


def _noisy_copy(path: str, seed: int) -> str:
    """The file with each config's time replaced by one of its repeats drawn for this seed
    (written once per landscape and seed, shared by every Kernel Tuner strategy)."""
    folder = os.path.join(tempfile.gettempdir(), "pt-kt-noisy")
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, f"{landscape_id(path).replace('/', '__')}__s{seed}.json")
    if os.path.exists(out):
        return out
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(seed * 7919 + 1)
    for rec in data["cache"].values():
        reps = [x for x in rec.get("times") or [] if isinstance(x, int | float)]
        if isinstance(rec.get("time"), int | float) and reps:
            rec["time"] = rng.choice(reps)
    tmp = f"{out}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, out)
    return out


def _kt_trace(path: str, land: replay.Landscape, name: str, budget: int, seed: int
              ) -> replay.Trace:
    """Kernel Tuner's strategy `name` in simulation mode on a per-seed noisy copy of the file."""
    import kernel_tuner

    noisy = _noisy_copy(path, seed)
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    res, _ = kernel_tuner.tune_cache(noisy, strategy=name, quiet=True, seed=seed,
                                     strategy_options={"max_fevals": budget})
    seconds = time.perf_counter() - t0
    configs, values = [], []
    for r in res:
        c = replay._as_tuple(land, {k: r.get(k) for k in land.keys})
        if c in configs or c not in land.times:
            continue
        t = r.get("time")
        configs.append(c)
        values.append(float(t) if isinstance(t, int | float) and math.isfinite(t) else math.inf)
        if len(configs) == budget:
            break
    return replay.Trace(configs=configs, values=values, seconds=seconds)


def split_labels(text: str) -> list[str]:
    """Comma-separated labels; commas inside [...] belong to the label."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [x.strip() for x in [*out, cur] if x.strip()]


PRIOR = "+prior"


# The v6e estimate landscapes (benchmarks/landscapes): their prior is the shipped estimate
# ledger's trials of the same kernel at the other shapes (the landscape's own shape left out).
ESTIMATE_PRIORS = {
    "matmul_2048_bf16_v6e_estimate": (
        "pallas_tune.kernels.matmul.matmul", "x=2048x2048:bfloat16,y=2048x2048:bfloat16"),
    "flash_attention_llama8b_s2048_causal_v6e_estimate": (
        "pallas_tune.kernels.flash_attention.flash_attention",
        "q=1x32x2048x128:bfloat16,k=1x8x2048x128:bfloat16,v=1x8x2048x128:bfloat16,causal=true"),
}


@functools.lru_cache(maxsize=4)
def lodo_prior(path: str) -> Any:
    """The prior for replaying ``path`` with ``+prior``: for a GPU landscape, the other
    devices' landscapes of the same kernel (the files beside it with the same parameters:
    leave-one-device-out); for a v6e estimate landscape, the shipped ledger's trials of its
    kernel at other shapes. None where there are none."""
    land = load(path)
    name = os.path.basename(path).removesuffix(".gz").removesuffix(".json")
    if name in ESTIMATE_PRIORS:
        from pallas_tune.cache import ledger

        stem, own_key = ESTIMATE_PRIORS[name]
        records, _ = ledger.read(os.path.join(bench.CACHES, "tpu_v6e",
                                              f"{stem}.estimate.trials.jsonl"))
        latest = {r["key"]: r["trials"] for r in records if r.get("key") != own_key}
        tasks = [[(t["config"], t["median_ms"]) for t in trials if t.get("outcome") == "ok"]
                 for trials in latest.values()]
        prior = replay.make_prior(land, tasks)
        return prior if prior else None
    others = sorted(q for q in glob.glob(os.path.join(os.path.dirname(path), "*.json*"))
                    if os.path.abspath(q) != os.path.abspath(path)
                    and load(q).keys == land.keys)
    return replay.make_prior(land, others) if others else None


def strategy_for(label: str) -> Any:
    label = label.removesuffix(PRIOR)
    if label.startswith("default["):
        return replay.default_with(**parse_settings(label))
    if label in replay.STRATEGIES:
        return label
    raise ValueError(f"unknown strategy label {label!r}")


def replay_unit(path: str, label: str, budget: int, seed: int, cache: str = CACHE
                ) -> dict[str, Any]:
    """One replay, from the cache folder when it was run before."""
    out = _cache_path(cache, path, label, budget, seed)
    if os.path.exists(out):
        try:
            with open(out) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass  # A torn write: replay again.
    land = load(path)
    warnings.filterwarnings("ignore")
    try:
        if label.startswith("KT:"):
            tr = _kt_trace(path, land, label[3:], budget, seed)
        else:
            prior = lodo_prior(path) if label.endswith(PRIOR) else None
            if label.endswith(PRIOR) and prior is None:
                return {"error": "no other device's landscape of this kernel to learn from"}
            tr = replay.trace(land, strategy_for(label), budget=budget, seed=seed, prior=prior)
    except Exception as e:  # noqa: BLE001 - a peer that crashes is reported, not fatal.
        if not label.startswith("KT:"):
            raise
        rec: dict[str, Any] = {"error": f"{type(e).__name__}: {str(e)[:80]}"}
    else:
        index = {c: i for i, c in enumerate(land.configs)}
        rec = {"configs": [index[c] for c in tr.configs],
               "values": [v if math.isfinite(v) else None for v in tr.values],
               "seconds": tr.seconds}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = out + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, out)
    return rec


def replay_many(units: Sequence[tuple[str, str, int, int]], jobs: int, cache: str = CACHE
                ) -> list[dict[str, Any]]:
    """Replays (path, label, budget, seed) units, `jobs` processes at once."""
    if jobs > 1 and len(units) > 1:
        from joblib import Parallel, delayed

        return Parallel(n_jobs=jobs, batch_size=1)(
            delayed(replay_unit)(*u, cache=cache) for u in units)
    return [replay_unit(*u, cache=cache) for u in units]


def choose(variants: Sequence[str], score: dict[tuple[str, str], float],
           on: Sequence[str]) -> str:
    """The variant of best mean ``score`` over the landscape ids ``on``."""
    return max(variants, key=lambda v: statistics.mean(score[(lid, v)] for lid in on))


def leave_one_device_out(ids: Sequence[str], variants: Sequence[str],
                         score: dict[tuple[str, str], float],
                         kernels: dict[str, str] | None = None) -> list[str]:
    """Report lines: per landscape of a kernel measured on several devices, the variant whose
    mean ``score`` over every *other* landscape is best (that device left out of the choice),
    and its score on the one left out. ``score[(landscape id, variant)]``: e.g. mean @50;
    ``kernels``: each id's kernel (default: the id's folder)."""
    kernels = kernels or {lid: lid.split("/")[0] for lid in ids}
    lines = ["| landscape left out | chosen without it | its score there | best variant "
             "there |", "|---|---|---|---|"]
    held: dict[str, float] = {}
    for lid in ids:
        if sum(kernels[x] == kernels[lid] for x in ids) < 2:
            continue
        v = choose(variants, score, [x for x in ids if x != lid])
        best = choose(variants, score, [lid])
        held[lid] = score[(lid, v)]
        lines.append(f"| {lid} | `{v}` | {held[lid]:.3f} | `{best}` "
                     f"({score[(lid, best)]:.3f}) |")
    if not held:
        return ["No kernel here was measured on two devices: nothing to leave out."]
    if held:
        lines.append(f"\nHeld-out mean {statistics.mean(held.values()):.3f}, worst "
                     f"{min(held.values()):.3f} over {len(held)} landscapes.")
    return lines


# --- Scores -------------------------------------------------------------------------------------

def incumbent_means(land: replay.Landscape, rec: dict[str, Any], n: int) -> np.ndarray:
    """After each of the first n evaluations, the mean time of the config that measured best so
    far (what the user would get); inf before any success. Padded with the last value."""
    means = land.means
    out = np.full(n, math.inf)
    best_v, best_m = math.inf, math.inf
    for i, (ci, v) in enumerate(zip(rec["configs"][:n], rec["values"][:n], strict=True)):
        if v is not None and v < best_v:
            best_v, best_m = v, means[land.configs[ci]]
        out[i] = best_m
    k = min(n, len(rec["configs"]))
    if 0 < k < n:
        out[k:] = out[k - 1]
    return out


def at(land: replay.Landscape, rec: dict[str, Any], n: int) -> float:
    """min(1, optimum / mean time of the best-measured config) after n evaluations."""
    m = incumbent_means(land, rec, n)[-1]
    return min(1.0, land.optimum / m) if math.isfinite(m) else 0.0


def evals_to(land: replay.Landscape, rec: dict[str, Any], tol: float, n: int) -> float:
    """Evaluations until the best-measured config is within `tol` of the optimum (inf if never
    within n)."""
    inc = incumbent_means(land, rec, n)
    hit = np.flatnonzero(inc <= land.optimum * (1 + tol))
    return float(hit[0] + 1) if hit.size else math.inf


def median_reach(land, recs, tol: float, n: int) -> tuple[float, float]:
    r = [evals_to(land, rec, tol, n) for rec in recs]
    return statistics.median(r), sum(math.isfinite(x) for x in r) / len(r)


class _Stats:
    """What autotuning-methodology's calculated random baseline reads of a search space."""

    def __init__(self, land: replay.Landscape):
        finite = np.sort([m for m in land.means.values() if math.isfinite(m)])
        self.minimization = True
        self.objective_performances_total_sorted = finite
        nan = sum(1 for m in land.means.values() if not math.isfinite(m))
        self.objective_performances_total_sorted_nan = np.concatenate([finite, [np.nan] * nan])

    def total_performance_absolute_optimum(self) -> float:
        return float(self.objective_performances_total_sorted[0])


def methodology_score(land: replay.Landscape, recs: Sequence[dict[str, Any]], n: int) -> float:
    """autotuning-methodology's performance score over evaluations 1..n: the mean of its
    standardised curve, (strategy − random) / (optimum − random), against its calculated
    random-search baseline; the strategy curve is the seeds' mean incumbent mean time. 0 is
    random search, 1 the optimum from the first evaluation. None without the package."""
    try:
        from autotuning_methodology.baseline import RandomSearchCalculatedBaseline
    except ImportError:
        return math.nan
    base = RandomSearchCalculatedBaseline(_Stats(land))
    fevals = np.arange(1, n + 1)
    curves = np.array([incumbent_means(land, rec, n) for rec in recs])
    worst = base.dist_descending[0]
    curve = np.where(np.isfinite(curves), curves, worst).mean(0)
    try:
        std = base.get_standardised_curve(fevals, curve, x_type="fevals")
    except ValueError:  # Random search itself at the optimum somewhere in 1..n: no score.
        return math.nan
    return float(np.mean(std))
