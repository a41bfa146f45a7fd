"""Pallas vs XLA on one footing: how each figure pallas-tune could decide with relates to the chip.

Tokamax 0.0.12 ships autotuning caches measured on real TPU 7x: per attention key, the run time
of XLA's attention (``dot_product_attention.json``, config ``{}``) and of its Pallas flash
attention at each block config tried (``pallas_mosaic_tpu_flash_attention.json``). For a sample of
the keys both hold, this benchmark computes, deviceless for 7x on this CPU host:

- **xla libtpu**: libtpu's static estimate of XLA's attention (pallas-tune's
  ``flash_attention_reference``: scores, f32 softmax, weighted sum), summed over its ops, and how
  many ops report 0 cycles (``partial``: then it is a lower bound);
- **xla model**: XLA's own cost model of the same program (its per-fusion ``estimated_cycles``);
- **pallas**: libtpu's static estimate of pallas-tune's flash attention, the best of a few block
  configs (the kernel Tokamax timed is Tokamax's, not ours: its estimate aborts libtpu's
  profiler, ``use_base2_exp``).

Each figure's ratio to the chip's time of its implementation is its bias; the XLA-vs-Pallas
decision is sound only when the two figures it compares have a known relative bias. Reported per
key, then the median and spread of each bias, and how often each decision rule (XLA runs where
its figure, over the relative bias and a margin, is below the Pallas figure) agrees with the
chip's direction. Every figure is an ESTIMATE or a model; the real times are Tokamax's.

Reads Tokamax's cache JSON straight from its wheel (``pip download --no-deps tokamax==0.0.12``;
``--tokamax PATH`` to the wheel or an unpacked tree); imports none of its code. Needs libtpu.

    PALLAS_TUNE_TPU_LOGS=off python benchmarks/estimates/xla_footing.py [--tokamax WHEEL]
        [--keys 10]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): one key; the report and its JSON go to the smoke folder
(the smoke test re-renders the committed JSON with ``--from-json``: Tokamax's wheel is not
there).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import statistics
import sys
import time
import zipfile
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

RESULTS = bench.result("xla_footing.md")
CHIP = "7x"
DATA = "tokamax/data/autotuning/tpu7x/"
XLA_FILE, PALLAS_FILE = "dot_product_attention.json", "pallas_mosaic_tpu_flash_attention.json"
PALLAS_CONFIGS = ((512, 512), (1024, 512), (1024, 1024), (2048, 1024))  # (bq, bkv), clamped.


def tokamax_files(path: str | None) -> dict[str, Any]:
    """The two cache files, parsed, from a wheel or an unpacked tree (None: look in the usual
    download places)."""
    candidates = [path] if path else sorted(
        glob.glob(os.path.join(bench.REPO, "tokamax-*.whl"))
        + glob.glob("/tmp/**/tokamax-0.0.12*.whl", recursive=True))
    for c in candidates:
        if c and os.path.isfile(c):
            with zipfile.ZipFile(c) as z:
                return {n: json.loads(z.read(DATA + n) or b"{}") for n in (XLA_FILE, PALLAS_FILE)}
        if c and os.path.isdir(c):
            root = os.path.join(c, DATA) if os.path.isdir(os.path.join(c, DATA)) else c
            return {n: json.load(open(os.path.join(root, n), encoding="utf-8"))
                    for n in (XLA_FILE, PALLAS_FILE)}
    raise SystemExit("Tokamax's wheel was not found: pip download --no-deps tokamax==0.0.12 "
                     "-d /tmp/tokamax, then --tokamax /tmp/tokamax/tokamax-0.0.12-py3-none-any.whl")


def _shape(s: str) -> tuple[int, ...]:
    return tuple(int(d) for d in s[s.index("[") + 1:-1].split(","))


def paired_keys(files: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Keys with a real XLA time and a real Pallas time, plain attention only (no bias, soft cap,
    paging, residuals; q, k, v of one shape), as (batch, seq, heads, head_dim, causal) with
    the medians of Tokamax's evaluation times (the Pallas one: its best config)."""
    out = []
    for key, xla in files[XLA_FILE].items():
        d = json.loads(key)
        pallas = files[PALLAS_FILE].get(key, {})
        if (d["return_residuals"] or d["bias"] is not None or d["logits_soft_cap"] is not None
                or d["paging_info"] is not None or not (d["q"] == d["k"] == d["v"])):
            continue
        xt = [statistics.median(v["evaluation_times_ms"]) for v in xla.values()
              if v.get("evaluation_times_ms")]
        pt = {c: statistics.median(v["evaluation_times_ms"]) for c, v in pallas.items()
              if v.get("evaluation_times_ms")}
        if not xt or not pt:
            continue
        b, s, h, dim = _shape(d["q"])
        best = min(pt, key=pt.get)
        out.append({"batch": b, "seq": s, "heads": h, "head_dim": dim,
                    "causal": bool(d["mask"]["is_causal"]), "xla_real_ms": min(xt),
                    "pallas_real_ms": pt[best], "pallas_real_config": json.loads(best)})
    return sorted(out, key=lambda k: (k["seq"], k["head_dim"], k["causal"]))


def sample(keys: Sequence[dict[str, Any]], count: int, head_dim: int, max_seq: int
           ) -> list[dict[str, Any]]:
    """Every key of one head_dim up to ``max_seq``, causal and not (the compile budget)."""
    chosen = [k for k in keys if k["head_dim"] == head_dim and k["seq"] <= max_seq]
    return chosen[:count]


def estimates(est: Any, key: Mapping[str, Any]) -> dict[str, Any]:
    """The three figures (ms) for one key on 7x."""
    import jax
    import jax.numpy as jnp

    from pallas_tune.chips import chip_spec
    from pallas_tune.kernels.flash_attention import flash_attention, flash_attention_reference

    clock = chip_spec(CHIP).clock_hz
    x = jax.ShapeDtypeStruct((key["batch"], key["heads"], key["seq"], key["head_dim"]),
                             jnp.bfloat16)
    kw = {"causal": key["causal"]}
    (ref,) = est.map(flash_attention_reference, [x, x, x], kw, [{}], CHIP, standin=False)
    configs = list(dict.fromkeys((min(q, key["seq"]), min(k, key["seq"]))
                                 for q, k in PALLAS_CONFIGS))
    results = est.map(flash_attention, [x, x, x], kw,  # The tunable: its stand-in too.
                      [{"bq": q, "bkv": k} for q, k in configs], CHIP)
    ok = {c: r.cycles / clock * 1e3 for c, r in zip(configs, results, strict=True)
          if r.ok and r.cycles}
    best = min(ok, key=ok.get) if ok else None
    return {
        "xla_libtpu_ms": ref.cycles / clock * 1e3 if ref.ok and ref.cycles else math.nan,
        "xla_partial": ref.ops_without_estimate if ref.ok else -1,
        "xla_model_ms": (ref.model_cycles / clock * 1e3 if ref.ok and ref.model_cycles
                         else math.nan),
        "xla_error": "" if ref.ok else f"{ref.kind}: {ref.message[:120]}",
        "pallas_ms": ok[best] if best else math.nan, "pallas_config": best,
        "pallas_failed": {f"{c}": r.kind for c, r in zip(configs, results, strict=True)
                          if not (r.ok and r.cycles)}}


def _median_spread(values: Sequence[float]) -> tuple[float, float, float]:
    v = sorted(x for x in values if math.isfinite(x))
    return (statistics.median(v), v[0], v[-1]) if v else (math.nan, math.nan, math.nan)


def decisions(rows: Sequence[Mapping[str, Any]], xla_key: str, relative: float, margin: float
              ) -> tuple[int, int, int]:
    """(agrees, picks XLA wrongly, keys judged) for: XLA runs iff fig_xla / relative * margin
    < fig_pallas; the chip's direction is XLA's real time below Pallas's. Keys whose real
    times are within 10% of each other count as agreeing either way (a tie)."""
    agree = wrong = judged = 0
    for r in rows:
        x, p = r[xla_key], r["pallas_ms"]
        if not (math.isfinite(x) and math.isfinite(p)):
            continue
        judged += 1
        xla_runs = x / relative * margin < p
        real_xla = r["xla_real_ms"] < r["pallas_real_ms"]
        tie = abs(r["xla_real_ms"] / r["pallas_real_ms"] - 1) <= 0.10
        agree += tie or xla_runs == real_xla
        wrong += xla_runs and not real_xla and not tie
    return agree, wrong, judged


def footing(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The constants of ``pallas_tune.tuning.footing`` these rows give: each bias's median (2
    decimals), and the margin: how far the relative bias (XLA's cost model's over the Pallas
    estimate's) strays from its median on any key, rounded up to 0.05."""
    ok = [r for r in rows if all(math.isfinite(r[c]) for c in ("xla_model_ms", "pallas_ms"))]
    pallas = statistics.median(r["pallas_ms"] / r["pallas_real_ms"] for r in ok)
    model = statistics.median(r["xla_model_ms"] / r["xla_real_ms"] for r in ok)
    rel = [(r["xla_model_ms"] / r["xla_real_ms"]) / (r["pallas_ms"] / r["pallas_real_ms"])
           for r in ok]
    mid = statistics.median(rel)
    stray = max(max(rel) / mid, mid / min(rel))
    return {"pallas_bias": round(pallas, 2), "xla_model_bias": round(model, 2),
            "margin": math.ceil(stray * 20 - 1e-9) / 20}


def report(rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> str:
    lines = [
        "# Pallas vs XLA on one footing (TPU 7x, Tokamax's real times)", "",
        (f"Generated by `{bench.script(__file__)}`. Real times: Tokamax 0.0.12's autotuning "
         "caches measured on a real TPU 7x (`dot_product_attention.json`: XLA's attention; "
         "`pallas_mosaic_tpu_flash_attention.json`: Tokamax's Pallas flash attention, its best "
         "config), Apache-2.0; only the sampled keys' times are reproduced. Every other figure "
         "is deviceless for 7x on a CPU host: libtpu's static ESTIMATES (converted at 2.2 GHz, "
         "itself a calibration) or XLA's cost MODEL. No figure here is a measurement of ours."),
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; wall time {meta['total_s'] / 60:.1f} min",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"- host: {bench.host()}", "",
        ("Columns: real ms (XLA / Pallas, Tokamax on 7x); `xla libtpu` = libtpu's sum over XLA's "
         "ops (`partial` ops report 0, so a lower bound); `xla model` = XLA's cost model; "
         "`pallas` = libtpu's estimate of pallas-tune's flash attention, best of "
         f"{len(PALLAS_CONFIGS)} block configs; bias = figure / real time of its "
         "implementation (the Pallas bias compares our kernel's estimate with Tokamax's "
         "kernel's time)."), "",
        "| key (b, s, h, d, mask) | real XLA | real Pallas | xla libtpu (partial) | xla model | "
        "pallas (config) | bias xla libtpu | bias xla model | bias pallas |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        key = (f"({r['batch']}, {r['seq']}, {r['heads']}, {r['head_dim']}, "
               f"{'causal' if r['causal'] else 'full'})")
        lines.append(
            f"| {key} | {r['xla_real_ms']:.3f} | {r['pallas_real_ms']:.3f} | "
            f"{r['xla_libtpu_ms']:.3f} ({r['xla_partial']}) | {r['xla_model_ms']:.3f} | "
            f"{r['pallas_ms']:.3f} {tuple(r['pallas_config'] or ())} | "
            f"{r['xla_libtpu_ms'] / r['xla_real_ms']:.2f} | "
            f"{r['xla_model_ms'] / r['xla_real_ms']:.2f} | "
            f"{r['pallas_ms'] / r['pallas_real_ms']:.2f} |")
    failed = [r for r in rows if r.get("xla_error")]
    if failed:
        lines += ["", "XLA's program gave no figure (its deviceless compile died in the worker, "
                  "whose memory is capped at the host's less a reserve) at: " + "; ".join(
                      f"({r['batch']}, {r['seq']}, {'causal' if r['causal'] else 'full'}): "
                      + r["xla_error"].split("(the worker died from ")[-1].split(" during")[0]
                      for r in failed) + ". Those keys count in the Pallas bias only."]
    biases = {name: _median_spread([r[col] / r[real] for r in rows])
              for name, col, real in (("xla libtpu", "xla_libtpu_ms", "xla_real_ms"),
                                      ("xla model", "xla_model_ms", "xla_real_ms"),
                                      ("pallas", "pallas_ms", "pallas_real_ms"))}
    lines += ["", "## Biases (figure / real time): median [min, max]", ""]
    lines += [f"- {n}: {m:.2f} [{lo:.2f}, {hi:.2f}]" for n, (m, lo, hi) in biases.items()]
    rel = {n: biases[n][0] / biases["pallas"][0] for n in ("xla libtpu", "xla model")}
    f = footing(rows)
    shipped = f["xla_model_bias"] / f["pallas_bias"]
    lines += ["", "## Decision rules against the chip's direction", "",
              ("XLA runs where fig_xla / relative bias x margin < fig_pallas. `relative` = "
               "median bias of the XLA figure / median bias of the Pallas figure (above). A key "
               "whose real times are within 10% is a tie: either decision agrees."), "",
              "| rule | relative | margin | agrees | XLA picked where the chip has Pallas "
              "faster |", "|---|---|---|---|---|"]
    for name, col, relative in (
            ("xla libtpu as is (raw figures)", "xla_libtpu_ms", 1.0),
            ("xla model as is (raw figures)", "xla_model_ms", 1.0),
            ("xla libtpu, bias-matched", "xla_libtpu_ms", rel["xla libtpu"]),
            ("xla model, bias-matched", "xla_model_ms", rel["xla model"]),
            ("pallas-tune's rule: xla model at the footing, with its margin", "xla_model_ms",
             shipped)):
        margin = f["margin"] if "margin" in name else 1.0
        a, w, n = decisions(rows, col, relative, margin)
        lines.append(f"| {name} | {relative:.2f} | {margin:g} | {a}/{n} | {w} |")
    lines += ["", "## The footing pallas-tune decides on (`pallas_tune.tuning.footing`)", "",
              (f"- PALLAS_BIAS = {f['pallas_bias']:g} (median bias of libtpu's estimate of the "
               "Pallas kernel), XLA_MODEL_BIAS = {0:g} (of XLA's cost model): a partial "
               "libtpu sum is replaced by XLA's cost model x {1:.3g}.").format(
                  f["xla_model_bias"], f["pallas_bias"] / f["xla_model_bias"]),
              (f"- MARGIN = {f['margin']:g}: the most the relative bias strays from its median "
               "on any key, rounded up to 0.05; XLA runs only where its figure times the margin "
               "is below the best config's."),
              ("- Measured on 7x attention only: the public data with both implementations' "
               "real times. Elsewhere (other chips, kernels) these are assumptions."), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokamax", help="Tokamax 0.0.12's wheel or an unpacked tree")
    p.add_argument("--keys", type=int, default=bench.smoke(10, 1))
    p.add_argument("--workers", type=int, default=1,
                   help="compile workers (each gets the host's memory over this many; large "
                        "keys' compiles died from SIGSEGV at 2)")
    p.add_argument("--resume", action="store_true",
                   help="keep the rows of --out's JSON whose XLA and Pallas figures both came "
                        "out, estimate the other keys")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-seq", type=int, default=8192)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--from-json", metavar="JSON",
                   help="re-render the report from a run's JSON (compiles nothing)")
    a = p.parse_args(argv)
    if a.from_json:
        with open(a.from_json, encoding="utf-8") as f:
            data = json.load(f)
        _write(a.out, data["rows"], data["meta"])
        return 0
    if not bench.have_libtpu(stream=sys.stderr):
        return 2
    import jax

    from pallas_tune.measure.estimate import Estimator

    keys = sample(paired_keys(tokamax_files(a.tokamax)), a.keys, a.head_dim, a.max_seq)
    kept: dict[tuple[Any, ...], dict[str, Any]] = {}
    saved = os.path.splitext(a.out)[0] + ".json"
    if a.resume and os.path.exists(saved):
        with open(saved, encoding="utf-8") as f:
            for r in json.load(f)["rows"]:
                if math.isfinite(r["xla_model_ms"]) and math.isfinite(r["pallas_ms"]):
                    kept[_ident(r)] = r
    rows = []
    t0 = time.perf_counter()
    with Estimator(a.workers, timeout_s=600) as est:
        for k in keys:
            r = kept.get(_ident(k)) or {**k, **estimates(est, k)}
            rows.append(r)
            print({n: v for n, v in r.items() if n != "pallas_real_config"}, flush=True)
            _write(a.out, rows, {"command": "partial", "date": "", "total_s": 0.0,
                                 "versions": {}}, quiet=True)
    meta = {"command": bench.command(__file__, argv, env="PALLAS_TUNE_TPU_LOGS=off"),
        "date": bench.today(), "total_s": time.perf_counter() - t0,
        "versions": {"libtpu": bench.version("libtpu"), "jax": jax.__version__,
                     "tokamax data": "0.0.12"}}
    _write(a.out, rows, meta)
    return 0


def _ident(k: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(k[n] for n in ("batch", "seq", "heads", "head_dim", "causal"))


def _write(out: str, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any],
           quiet: bool = False) -> None:
    """The report (Markdown) and its data (JSON, beside it); after each key too (``quiet``),
    so that ``--resume`` keeps what was done."""
    bench.write(out, report(rows, meta) if rows else "", echo=not quiet)
    with open(bench.output(os.path.splitext(out)[0] + ".json"), "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "footing": _footing_or_none(rows), "rows": list(rows)}, f,
                  indent=1, default=str)


def _footing_or_none(rows: Sequence[Mapping[str, Any]]) -> dict[str, float] | None:
    try:
        return footing(rows)
    except (statistics.StatisticsError, ValueError, ZeroDivisionError):
        return None


if __name__ == "__main__":
    sys.exit(main())
