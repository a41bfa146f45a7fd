"""``pallas-tune report``: a self-contained HTML page and PNGs of what tuning found.

Per tuned shape of a kernel: the optimization history and parameter importances (Optuna's
plotly visualizations, over a study rebuilt from the trial ledger, so any cache can be
reported, wherever it was tuned), a heatmap of time over two block dimensions, tuned vs the
declared default vs the reference implementation, the outcomes, and the receipts (chip, timer,
versions). PNGs are drawn with matplotlib. Needs the ``report`` extra (plotly, matplotlib).
"""

from __future__ import annotations

import argparse
import base64
import html
import io
import json
import math
import os
from typing import Any

from pallas_tune.cli.shapes import CLIUsageError

__all__ = ["add_parser", "cmd_report"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("report", help="HTML page and PNGs of a kernel's tuning (plotly, "
                                      "matplotlib)")
    r.add_argument("--kernel", required=True, help="kernel name (or part of it), as in show")
    r.add_argument("--chip", help="only this chip")
    r.add_argument("--key", help="only keys containing this")
    r.add_argument("--out", default="pallas-tune-report", help="output directory")
    r.add_argument("--reference", metavar="MODULE:NAME",
                   help="the @tunable kernel (MODULE:NAME) whose reference= implementation to "
                        "time here (wall clock, jitted, random inputs of each key's shapes)")
    r.add_argument("--path", action="append", metavar="DIR", help="import kernels from DIR")
    r.set_defaults(func=cmd_report)


def _need() -> tuple[Any, Any]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import plotly  # noqa: F401
    except ImportError as e:
        raise CLIUsageError(f"report needs plotly and matplotlib ({e}): pip install "
                            "'pallas-tune[report]'") from None
    import optuna

    return plt, optuna


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _study(optuna: Any, trials: list[dict[str, Any]]) -> Any:
    """An in-memory Optuna study of the ledger's trials (real values; failures as +inf)."""
    from optuna.distributions import CategoricalDistribution

    configs = [t["config"] for t in trials if isinstance(t.get("config"), dict)]
    names = sorted({k for c in configs for k in c})
    choices = {n: sorted({json.dumps(c.get(n)) for c in configs}) for n in names}
    varied = [n for n in names if len(choices[n]) > 1]
    dists = {n: CategoricalDistribution([json.loads(v) if isinstance(json.loads(v), int | float |
                                         str | bool) else v for v in choices[n]])
             for n in varied}
    study = optuna.create_study(direction="minimize")
    for t in trials:
        c = t.get("config")
        if not isinstance(c, dict):
            continue
        params = {}
        for n in varied:
            v = c.get(n)
            params[n] = v if isinstance(v, int | float | str | bool) else json.dumps(v)
        value = t.get("median_ms") if _finite(t.get("median_ms")) else math.inf
        study.add_trial(optuna.trial.create_trial(
            params=params, distributions=dists, value=value,
            user_attrs={"outcome": str(t.get("outcome", "?"))}))
    return study


def _png(fig: Any, plt: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _figures(plt: Any, optuna: Any, study: Any, trials: list[dict[str, Any]],
             compare: dict[str, float], stem: str) -> tuple[list[str], list[str]]:
    """(PNG paths, plotly HTML fragments) for one tuned shape."""
    import plotly.graph_objects as go

    pngs, frags = [], []
    values = [t.value for t in study.trials]
    done = [v for v in values if math.isfinite(v)]
    # History.
    fig, ax = plt.subplots(figsize=(6, 3.4))
    xs = [i for i, v in enumerate(values) if math.isfinite(v)]
    ax.plot(xs, done, "o", label="trial", alpha=0.7)
    best, run = [], math.inf
    for v in values:
        run = min(run, v)
        best.append(run)
    ax.step(range(len(best)), best, where="post", label="best so far", color="C3")
    ax.set(xlabel="trial", ylabel="median ms", title="optimization history")
    ax.legend()
    pngs.append(_png(fig, plt, f"{stem}_history.png"))
    frags.append(optuna.visualization.plot_optimization_history(study))
    # Importances (fANOVA needs two finite trials and a varied parameter).
    finite = optuna.create_study(direction="minimize")
    finite.add_trials([t for t in study.trials if math.isfinite(t.value)])
    if len(done) >= 2 and study.trials and study.trials[0].params:
        imp = optuna.importance.get_param_importances(finite)
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.barh(list(imp)[::-1], list(imp.values())[::-1], color="C0")
        ax.set(xlabel="importance (fANOVA)", title="parameter importances")
        pngs.append(_png(fig, plt, f"{stem}_importances.png"))
        frags.append(optuna.visualization.plot_param_importances(finite))
    heat = _heatmap(trials)
    if heat is not None:
        (px, py), xs_, ys_, grid = heat
        fig, ax = plt.subplots(figsize=(5.5, 4))
        im = ax.imshow(grid, origin="lower", cmap="viridis_r", aspect="auto")
        ax.set_xticks(range(len(xs_)), [str(v) for v in xs_])
        ax.set_yticks(range(len(ys_)), [str(v) for v in ys_])
        ax.set(xlabel=px, ylabel=py, title="best median ms over two block dims (blank: not tried)")
        fig.colorbar(im, ax=ax, label="ms")
        pngs.append(_png(fig, plt, f"{stem}_heatmap.png"))
        frags.append(go.Figure(go.Heatmap(z=grid, x=[str(v) for v in xs_],
                                          y=[str(v) for v in ys_], colorscale="Viridis_r",
                                          colorbar={"title": "ms"}),
                               layout={"title": "Best median ms over two block dims",
                                       "xaxis_title": px, "yaxis_title": py}))
    if compare:
        fig, ax = plt.subplots(figsize=(5, 2.6))
        ax.barh(list(compare)[::-1], list(compare.values())[::-1], color=["C2", "C1", "C0"][
            :len(compare)][::-1])
        ax.set(xlabel="median ms", title="tuned vs default vs reference")
        pngs.append(_png(fig, plt, f"{stem}_compare.png"))
        frags.append(go.Figure(go.Bar(x=list(compare.values()), y=list(compare),
                                      orientation="h"),
                               layout={"title": "Tuned vs default vs reference (median ms)"}))
    counts: dict[str, int] = {}
    for t in trials:
        counts[str(t.get("outcome", "?"))] = counts.get(str(t.get("outcome", "?")), 0) + 1
    fig, ax = plt.subplots(figsize=(5, 2.6))
    ax.bar(list(counts), list(counts.values()), color="C4")
    ax.set(ylabel="trials", title="outcomes")
    pngs.append(_png(fig, plt, f"{stem}_outcomes.png"))
    frags.append(go.Figure(go.Bar(x=list(counts), y=list(counts.values())),
                           layout={"title": "Outcomes"}))
    return pngs, frags


def _heatmap(trials: list[dict[str, Any]]) -> Any:
    """The two integer parameters with most values, and the best time at each pair."""
    configs = [t for t in trials if isinstance(t.get("config"), dict)]
    ints: dict[str, set[int]] = {}
    for t in configs:
        for k, v in t["config"].items():
            if isinstance(v, int) and not isinstance(v, bool):
                ints.setdefault(k, set()).add(v)
    dims = sorted((k for k in ints if len(ints[k]) > 1), key=lambda k: -len(ints[k]))[:2]
    if len(dims) < 2:
        return None
    xs, ys = sorted(ints[dims[0]]), sorted(ints[dims[1]])
    grid = [[math.nan] * len(xs) for _ in ys]
    for t in configs:
        c, ms = t["config"], t.get("median_ms")
        if not _finite(ms) or c.get(dims[0]) not in xs or c.get(dims[1]) not in ys:
            continue
        i, j = ys.index(c[dims[1]]), xs.index(c[dims[0]])
        grid[i][j] = ms if math.isnan(grid[i][j]) else min(grid[i][j], ms)
    return (dims[0], dims[1]), xs, ys, grid


def _compare(entry: Any, trials: list[dict[str, Any]], default: dict[str, Any] | None,
             reference_ms: float | None) -> dict[str, float]:
    out: dict[str, float] = {}
    if entry.median_ms is not None:
        out["tuned"] = entry.median_ms
    if default is not None:
        for t in trials:
            if t.get("config") == default and _finite(t.get("median_ms")):
                out["default"] = float(t["median_ms"])
                break
    if reference_ms is not None:
        out["reference"] = reference_ms
    return out


def _time_reference(kernel: Any, key: str) -> float | None:
    """Wall-clock median of the jitted reference on random inputs of the key's shapes."""
    import time

    import jax

    from pallas_tune.cli.shapes import build_call

    if kernel is None or kernel.reference is None:
        return None
    try:
        args, kwargs = build_call(kernel, key)
    except CLIUsageError:
        return None
    keyrng = jax.random.PRNGKey(0)
    real = [jax.random.normal(keyrng, a.shape, a.dtype) if hasattr(a, "shape") else a
            for a in args]
    fn = jax.jit(lambda *a: kernel.reference(*a, **kwargs))
    jax.block_until_ready(fn(*real))
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*real))
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _img(path: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f'<img alt="{html.escape(os.path.basename(path))}" src="data:image/png;base64,{data}">'


def _receipts(prov: dict[str, Any]) -> str:
    rows = []
    for k in ("chip", "device_kind", "timer", "evaluator", "interpret", "timing_note", "date",
              "strategy", "seed", "repeats", "tuning_s", "kernel_fingerprint",
              "kernel_version"):
        if k in prov:
            rows.append(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(prov[k]))}</td></tr>")
    versions = prov.get("versions") if isinstance(prov.get("versions"), dict) else {}
    rows += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>"
             for k, v in versions.items()]
    return "<table class=receipts>" + "".join(rows) + "</table>"


def cmd_report(args: argparse.Namespace) -> int:
    plt, optuna = _need()
    from pallas_tune import chips
    from pallas_tune.cache import default_cache
    from pallas_tune.cache.inventory import inventory, trial_history

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    chip = chips.normalize_chip(args.chip) if args.chip else None
    reports = [r for r in inventory(default_cache(), kernel=args.kernel, chip=chip)
               if r.error is None]
    kernel = None
    if args.reference:
        from pallas_tune.cli.sweep import load_kernel

        kernel = load_kernel(args.reference, args.path or ())
    os.makedirs(args.out, exist_ok=True)
    sections, pngs, first = [], [], True
    for r in reports:
        for e in r.entries:
            if e.problem is not None or (args.key and args.key not in e.key):
                continue
            runs, _ = trial_history(r, e.key)
            trials = [t for t in (runs[-1].get("trials") if runs else None) or []
                      if isinstance(t, dict)]
            prov = runs[-1].get("provenance") if runs else None
            prov = prov if isinstance(prov, dict) else {}
            default = (dict(kernel.space.default) if kernel is not None
                       and kernel.space.default else (trials[0].get("config") if trials
                                                      else None))
            compare = _compare(e, trials, default, _time_reference(kernel, e.key))
            stem = os.path.join(args.out, f"{len(sections):02d}")
            p, frags = _figures(plt, optuna, _study(optuna, trials), trials, compare, stem)
            pngs += p
            parts = []
            for fig in frags:
                parts.append(fig.to_html(full_html=False, include_plotlyjs=first))
                first = False
            label = " (compiler estimate)" if r.kind == "estimate" else ""
            ms = "-" if e.median_ms is None else f"{e.median_ms:.4g}"
            missing = [n for n in ("default", "reference") if n not in compare]
            note = (f"<p class=note>not shown: {', '.join(missing)} (the default is shown when "
                    "it was among the trials; the reference when --reference MODULE:NAME names "
                    "a kernel with a reference=)</p>" if missing else "")
            sections.append(
                f"<section><h2>{html.escape(r.kernel or '?')} on {html.escape(r.chip)}: "
                f"<code>{html.escape(e.key)}</code></h2><p>best "
                f"<code>{html.escape(json.dumps(e.config))}</code> at {ms} ms{label}"
                f" from {len(trials)} trials</p>{note}{_receipts(prov)}<div class=plots>"
                + "".join(parts) + "</div><details><summary>PNG figures</summary>"
                + "".join(_img(x) for x in p) + "</details></section>")
    if not sections:
        raise CLIUsageError(f"no tuned entries of a kernel matching {args.kernel!r} in the "
                            "caches; run pallas-tune sweep first (pallas-tune show lists them)")
    page = os.path.join(args.out, "index.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(_PAGE.format(title=html.escape(f"pallas-tune report: {args.kernel}"),
                             body="".join(sections)))
    print(f"pallas-tune report: {page} ({len(sections)} shape(s)) and {len(pngs)} PNGs in "
          f"{args.out}")
    return 0


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
.plots{{display:grid;grid-template-columns:1fr 1fr;gap:8px}}
table.receipts th{{text-align:left;padding-right:1em}} img{{max-width:48%}}</style>
</head><body><h1>{title}</h1>{body}</body></html>"""
