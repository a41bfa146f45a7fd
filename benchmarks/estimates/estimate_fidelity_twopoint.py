"""estimate_fidelity's two-point stand-in (``--two-point``): a capped stand-in keeps a few grid
steps of a large key and scales its figure by steps in the grid / steps kept. That also scales
what a program pays once: the pipeline's first fetch (a weight block that stays resident across
batch blocks is fetched once in the full program) and its last write-back. At v6e (8192, 8192,
1024) the scaled figure of the real winner (512, 8192, 1024), a stand-in of 2 of its 16 steps,
was 0.206 ms; its full compile says 0.115 ms (+80%), and the rival ahead of it was overcounted
by 31%: the scaled figure penalises exactly the configs whose blocks stay resident.

The two-point figure compiles the stand-in again with half the blocks along one cut axis (batch,
the parallel axis, first) and extrapolates the per-step cost: ``f2 + (N - n2) (f2 - f1) / (n2 -
n1)`` for figures ``f1``, ``f2`` of ``n1 < n2`` kept steps and ``N`` steps in the grid, which
counts the once-per-program cost once. Where ``f2 <= f1`` (no per-step cost seen) the scaled
figure is kept and counted.

Full compiles turned out far cheaper than the capped stand-in's cost model assumed (8.8 s for
16 steps of 512 x 8192 x 1024, predicted 110 s), so every cut config whose full compile is
affordable (``affordable``: predicted under ``CHECK_CAP_S`` CPU s and at most ``STEP_CAP`` steps,
which holds the large-block configs that decide a rank) is also compiled in full, and that is
its figure: what a tune's own compile gives. Those full figures check the two-point and the
scaled figures (``checks``), and the report prints both errors.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import estimate_fidelity_complete as ec
import estimate_fidelity_strata as st
from estimate_fidelity_qmm import config, operands, proxy_qmm

Blocks = tuple[int, ...]
Keep = tuple[int, int, int]

# Full compiles made: predicted CPU s (measured on libtpu 0.0.50: about 3.5 s
# and 1e-10 s per multiply-accumulate; 8.8 s for 16 steps of 512 x 8192 x 1024) and grid steps
# (the profile's memory grows with them).
CHECK_CAP_S = 60.0
FULL_FIXED_S, FULL_MAC_S = 3.5, 1.0e-10


def pair(key: Blocks, b: Blocks) -> tuple[Keep, Keep] | None:
    """The two stand-ins (fewer, more kept blocks per axis) for config ``b``: the capped
    stand-in, and the same with half the blocks along the first axis with 2 or more kept
    (batch first). None where nothing was cut (the figure is the full program's)."""
    counts = st.counts(key, b)
    keep2 = st.standin_keep(key, b)
    if tuple(keep2) == tuple(counts):
        return None
    for axis in range(3):
        if keep2[axis] >= 2:
            keep1 = list(keep2)
            keep1[axis] = keep2[axis] // 2
            return (keep1[0], keep1[1], keep1[2]), keep2
    return None


def extrapolate(f1: float, f2: float, n1: int, n2: int, total: int) -> float | None:
    """The full program's figure from two stand-ins' (``n1 < n2`` steps of ``total``); None
    where the larger stand-in is not the slower (no per-step cost to extrapolate)."""
    if not (n2 > n1 and f2 > f1):
        return None
    return f2 + (total - n2) * (f2 - f1) / (n2 - n1)


def full_cost_s(key: Blocks, b: Blocks) -> float:
    counts = st.counts(key, b)
    return FULL_FIXED_S + FULL_MAC_S * math.prod(key) + st.STEP_S * math.prod(counts)


def half_standin(args: Sequence[Any], kwargs: Mapping[str, Any], cfg: Mapping[str, int]
                 ) -> tuple[list[Any], dict[str, Any], float]:
    """pallas-tune's ``standin=`` protocol for the smaller of :func:`pair`'s stand-ins."""
    import jax

    x, w_q, w_scale = args
    key = (x.shape[0], w_q.shape[0], x.shape[1])
    b = (cfg["batch_block"], cfg["out_block"], cfg["in_block"])
    p = pair(key, b)
    keep = p[0] if p else st.counts(key, b)
    rows, outs, ins = (min(n, k * s) for n, k, s in zip(key, keep, b, strict=True))
    return ([jax.ShapeDtypeStruct((rows, ins), x.dtype),
             jax.ShapeDtypeStruct((outs, ins), w_q.dtype),
             jax.ShapeDtypeStruct((outs,), w_scale.dtype)], dict(kwargs),
            math.prod(st.counts(key, b)) / math.prod(keep))


def half_parts() -> Any:
    from pallas_tune.measure.candidate import KernelParts

    return KernelParts(name="tpu_inference.quantized_matmul_kernel (proxy, half stand-in)",
                       fn=proxy_qmm, standin=half_standin)


def refine(est: Any, chip: str, dtype: str, key: Blocks, figures: Mapping[Blocks, float]
           ) -> tuple[dict[Blocks, float], list[list[Any]]]:
    """Two-point figures (ms) of ``figures`` (scaled capped-stand-in figures, ms), and one
    record per cut config: [blocks, keep1, keep2, f1 raw ms or None, f2 raw ms, two-point ms
    or None]. A config whose smaller stand-in gives no figure, or no per-step cost, keeps its
    scaled figure (its record says so)."""
    from pallas_tune.chips import chip_spec

    out, records = dict(figures), []
    cut = {b: p for b, p in sorted(figures.items()) for p in [pair(key, b)] if p is not None}
    if not cut:
        return out, records
    results = est.map(half_parts(), operands(key, dtype), {}, [config(b) for b in cut], chip)
    clock = chip_spec(chip).clock_hz
    for (b, (keep1, keep2)), r in zip(cut.items(), results, strict=True):
        total = math.prod(st.counts(key, b))
        f2 = figures[b] * math.prod(keep2) / total
        f1 = r.standin_cycles / clock * 1e3 if r.ok and r.standin_cycles else None
        two = None if f1 is None else extrapolate(f1, f2, math.prod(keep1), math.prod(keep2),
                                                  total)
        if two is not None:
            out[b] = two
        records.append([list(b), list(keep1), list(keep2), f1, f2, two])
    return out, records


def affordable(key: Blocks, b: Blocks) -> bool:
    """Whether config ``b``'s full compile is predicted under ``CHECK_CAP_S`` CPU s and
    ``STEP_CAP`` grid steps."""
    return full_cost_s(key, b) <= CHECK_CAP_S and math.prod(st.counts(key, b)) <= st.STEP_CAP


def full_figures(est: Any, chip: str, dtype: str, key: Blocks, configs: Sequence[Blocks]
                 ) -> dict[Blocks, float | None]:
    """libtpu's figure (ms) of each config's full compile (None where it gave none)."""
    from pallas_tune.chips import chip_spec

    if not configs:
        return {}
    clock = chip_spec(chip).clock_hz
    results = est.map(proxy_qmm, operands(key, dtype), {}, [config(b) for b in configs], chip,
                      standin=False)
    return {b: r.cycles / clock * 1e3 if r.ok and r.cycles else None
            for b, r in zip(configs, results, strict=True)}


def refine_run(est: Any, plain: Any, run: dict[str, Any]) -> None:
    """``run``'s libtpu figures of cut configs replaced, in place, by the full compile's where
    affordable, else the two-point figure (the scaled ones kept as ``scaled_proxy_ms``, the
    records as ``two_point``): the drawn configs' first (the calibration's), then the whole
    space's contenders, with those the new calibration adds compiled as the others were (those
    it drops keep their figures). The contenders follow from the drawn figures alone, so one
    pass adds them all."""
    t0 = time.perf_counter()
    _, dtypes, chip = st.CHIPS[run["chip"]]
    key = tuple(run["key"])
    rec = run.setdefault("two_point", {"records": [], "full": []})
    done = {tuple(r[0]) for r in (*rec["records"], *rec["full"])}
    whole = run.get("whole")
    for part in [run, whole] if whole else [run]:
        part.setdefault("scaled_proxy_ms", list(part["proxy_ms"]))
    _refined(est, chip, dtypes[1], key, run, rec, done)
    new = missing_contenders(run) if whole else []
    if new:
        more = ec.estimate(est, plain, run, new)
        whole["contenders"] = sorted([*whole["contenders"], *map(list, new)])
        for name in ("proxy_ms", "aborted", "flag_only_oom"):
            whole[name] = sorted([*whole[name], *more[name]])
        whole["scaled_proxy_ms"] = sorted([*whole["scaled_proxy_ms"], *more["proxy_ms"]])
        for kind, n in more["failures"].items():
            whole["failures"][kind] = whole["failures"].get(kind, 0) + n
        rec.setdefault("added_contenders", []).extend(map(list, new))
    if whole:
        _refined(est, chip, dtypes[1], key, whole, rec, done)
    rec["wall_s"] = rec.get("wall_s", 0.0) + time.perf_counter() - t0


def refined(run: Mapping[str, Any]) -> bool:
    """Whether :func:`refine_run` has completed on ``run``."""
    return "wall_s" in run.get("two_point", {})


def missing_contenders(run: Mapping[str, Any]) -> list[Blocks]:
    """The configs the run's figures admit as contenders (its refined figures', and its scaled
    figures', which the report ranks beside them) that were not compiled."""
    public = ec.by_blocks(run["whole"]["public_ms"])
    views = [run, scaled_view(run)] if "scaled_proxy_ms" in run else [run]
    return sorted({b for v in views for b in ec.contenders(v, public)
                   if list(b) not in run["whole"]["contenders"]})


def scaled_view(run: Mapping[str, Any]) -> dict[str, Any]:
    """The run as its scaled stand-ins' figures had it."""
    out = {**run, "proxy_ms": run["scaled_proxy_ms"]}
    if run.get("whole"):
        out["whole"] = {**run["whole"], "proxy_ms": run["whole"]["scaled_proxy_ms"]}
    return out


def _refined(est: Any, chip: str, dtype: str, key: Blocks, part: dict[str, Any],
             rec: dict[str, Any], done: set[Blocks]) -> None:
    """``part``'s cut configs not yet refined: two-point figures, then full compiles where
    affordable, the best of these in ``proxy_ms`` (in place)."""
    scaled = {b: v for b, v in ec.by_blocks(part["scaled_proxy_ms"]).items() if b not in done}
    two, records = refine(est, chip, dtype, key, scaled)
    full = full_figures(est, chip, dtype, key, [b for b in scaled if pair(key, b) is not None
                                                and affordable(key, b)])
    figures = {**ec.by_blocks(part["proxy_ms"]), **two,
               **{b: v for b, v in full.items() if v is not None}}
    part["proxy_ms"] = st.rows(figures)
    rec["records"] += records
    rec["full"] += st.rows(full)
    done.update(scaled)


def checks(run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every config compiled in full, against its scaled and two-point figures."""
    rec = run["two_point"]
    scaled = {b: v for part in (run, run.get("whole") or {})
              for b, v in ec.by_blocks(part.get("scaled_proxy_ms", [])).items()}
    two = {tuple(r[0]): r[5] for r in rec["records"]}
    return [{"config": b, "winner": tuple(b) == tuple(run["winner"]), "full_ms": v,
             "scaled_error": scaled[tuple(b)] / v - 1,
             "two_point_error": None if two.get(tuple(b)) is None
             else two[tuple(b)] / v - 1} for b, v in rec["full"] if v is not None]


def summary(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Over the runs refined: cut configs, their figures' methods, and the full compiles'
    errors (:func:`checks`; ``winner_``: the real winner's only)."""
    out: dict[str, Any] = {"configs": 0, "full": 0, "full_failed": 0, "two_point": 0,
                           "kept_scaled": 0, "keys_checked": 0, "scaled_errors": [],
                           "two_point_errors": [], "winner_scaled_errors": [],
                           "winner_two_point_errors": []}
    for r in runs:
        rec, cs = r["two_point"], checks(r)
        in_full = {tuple(c["config"]) for c in cs}
        rest = [x for x in rec["records"] if tuple(x[0]) not in in_full]
        out["configs"] += len(rec["records"])
        out["full"] += len(cs)
        out["full_failed"] += sum(v is None for _, v in rec["full"])
        out["two_point"] += sum(x[5] is not None for x in rest)
        out["kept_scaled"] += sum(x[5] is None for x in rest)
        out["keys_checked"] += bool(cs)
        for c in cs:
            for who in ("", "winner_") if c["winner"] else ("",):
                out[f"{who}scaled_errors"].append(c["scaled_error"])
                if c["two_point_error"] is not None:
                    out[f"{who}two_point_errors"].append(c["two_point_error"])
    return out


def method_text(meta: Mapping[str, Any]) -> list[str]:
    """How libtpu's figure of a cut config is had, where the run was refined."""
    if not meta.get("two_point_command"):
        return []
    return [
        "- **Full and two-point figures** (`--two-point`: "
        f"`{meta['two_point_command']}`; {meta.get('two_point_run', '')}; "
        f"{meta.get('two_point_s', 0) / 60:.1f} min). Scaling "
        "a stand-in's figure by steps in the grid / steps kept also scales what the program "
        "pays once (the first fetch, among it a weight block that stays resident across "
        "batch blocks, and the last write-back): at v6e (8192, 8192, 1024) the real winner's "
        "scaled figure was 80% above its full compile. So every cut config was compiled "
        "again with half the blocks along one cut axis (batch first), and its figure is "
        "f2 + (N - n2) (f2 - f1) / (n2 - n1) for figures f1, f2 of n1 < n2 kept steps of N "
        "(`estimate_fidelity_twopoint.py`). Full compiles proved far cheaper than the cost "
        "model above assumed (8.8 s, not 110 s, for 16 steps of 512 x 8192 x 1024), so "
        "every cut config whose full compile is affordable was compiled in full, and that "
        "is its figure (what a tune's own compile gives): those are the large-block configs "
        "that decide a rank. The contenders were recomputed from the new calibration and the "
        "added ones compiled the same way. Both stand-ins' errors against the full figures "
        "are below.", *([f"- Models retraced {meta['models_retraced']}."]
                        if meta.get("models_retraced") else [])]


def report_lines(runs: Sequence[Mapping[str, Any]], rate_rows: Any) -> list[str]:
    """The report's section: the full compiles against the scaled and two-point figures, and
    the rates (``rate_rows``: the report's) with the scaled figures instead."""
    done = [r for r in runs if refined(r)]
    if not done:
        return []
    s = summary(done)

    def errs(xs: Sequence[float]) -> str:
        return (f"median {statistics.median(xs):+.1%}, median size "
                f"{statistics.median(abs(x) for x in xs):.1%}, worst {max(xs, key=abs):+.1%}, "
                f"beyond 5% on {sum(abs(x) > 0.05 for x in xs)} of {len(xs)}") if xs else "-"

    return ["### Full compiles against the scaled and two-point figures", "",
            f"{s['configs']} configs of {len(done)} keys were cut: {s['full']} got their full "
            f"compile's figure (on {s['keys_checked']} keys; predicted under "
            f"{CHECK_CAP_S:g} CPU s and {st.STEP_CAP} steps; {s['full_failed']} more "
            f"gave none), {s['two_point']} the two-point figure, {s['kept_scaled']} kept the "
            "scaled one (the smaller stand-in gave no figure or no per-step cost). Each full "
            "figure against what the stand-ins said:", "",
            "| configs | scaled stand-in's error | two-point's error |", "|---|---|---|",
            f"| all compiled in full | {errs(s['scaled_errors'])} | "
            f"{errs(s['two_point_errors'])} |",
            f"| real winners | {errs(s['winner_scaled_errors'])} | "
            f"{errs(s['winner_two_point_errors'])} |", "",
            "The rates with libtpu's scaled figures instead (the same runs, the same exact "
            "ranks: every contender either figure admits was compiled):", "",
            *rate_rows([("all keys, full and two-point", done),
                        ("all keys, scaled", [scaled_view(r) for r in done])]), ""]
