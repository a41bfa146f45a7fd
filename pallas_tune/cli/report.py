"""``pallas-tune report``: a self-contained HTML page and PNGs of what tuning found.

Per tuned shape of a kernel: the optimization history and parameter importances (Optuna's
plotly visualizations, over a study rebuilt from the trial ledger, so any cache can be
reported, wherever it was tuned), a heatmap of time over two block dimensions, tuned vs the
declared default vs the reference implementation, the outcomes, and the receipts (chip, timer,
versions). PNGs are drawn with matplotlib. Needs the ``report`` extra (plotly, matplotlib).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.shapes import CLIUsageError

if TYPE_CHECKING:
    from pallas_tune.cli.edge import ReportRequest

__all__ = ["add_parser", "cmd_report"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("report", help="HTML page and PNGs of a kernel's tuning (plotly, "
                                      "matplotlib)")
    r.add_argument("--kernel", required=True,
                   help="the kernel's cache name, exactly as pallas-tune show lists it")
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

    trials = [t for t in trials if t.get("duplicate_of") is None]  # One program, one point.
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
        attrs = {"outcome": str(t.get("outcome", "?"))}
        if _finite(t.get("median_ms")):
            trial = optuna.trial.create_trial(params=params, distributions=dists,
                                              value=t["median_ms"], user_attrs=attrs)
        else:  # Did not run: a FAIL trial, as Optuna's plots expect (no value, no warning).
            trial = optuna.trial.create_trial(params=params, distributions=dists,
                                              state=optuna.trial.TrialState.FAIL,
                                              user_attrs=attrs)
        study.add_trial(trial)
    return study


def _png(fig: Any, plt: Any, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


FEW_TRIALS = 20  # Below this, importances are indicative only, and the page says so.


def _figures(plt: Any, optuna: Any, study: Any, trials: list[dict[str, Any]],
             compare: dict[str, float], stem: str, unit: str
             ) -> tuple[list[str], list[str], str]:
    """(PNG paths, plotly HTML fragments, notes) for one tuned shape; duplicates (the same
    program as an earlier trial) are not plotted as trials."""
    import plotly.graph_objects as go

    trials = [t for t in trials if t.get("duplicate_of") is None]
    pngs, frags, notes = [], [], ""
    values = [t.value if t.value is not None else math.inf for t in study.trials]
    done = [v for v in values if math.isfinite(v)]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    xs = [i for i, v in enumerate(values) if math.isfinite(v)]
    ax.plot(xs, done, "o", label="trial", alpha=0.7)
    best, run = [], math.inf
    for v in values:
        run = min(run, v)
        best.append(run)
    ax.step(range(len(best)), best, where="post", label="best so far", color="C3")
    ax.set(xlabel="trial (distinct programs)", ylabel=unit, title="optimization history")
    ax.legend()
    pngs.append(_png(fig, plt, f"{stem}_history.png"))
    history = optuna.visualization.plot_optimization_history(study, target_name=unit)
    frags.append(history)
    finite = optuna.create_study(direction="minimize")
    finite.add_trials([t for t in study.trials if t.value is not None
                       and math.isfinite(t.value)])
    imp: dict[str, float] = {}
    if len(done) >= 2 and study.trials and study.trials[0].params:
        imp = optuna.importance.get_param_importances(finite)
        fig, ax = plt.subplots(figsize=(5, 2.6))
        ax.barh(list(imp)[::-1], list(imp.values())[::-1], color="C0")
        ax.set(xlabel="importance (fANOVA)", title="parameter importances")
        pngs.append(_png(fig, plt, f"{stem}_importances.png"))
        frags.append(optuna.visualization.plot_param_importances(finite))
        if len(done) < FEW_TRIALS:
            notes += (f"<p class=note>importances from {len(done)} timed trials: indicative "
                      "only (fANOVA needs many more to be reliable)</p>")
    heat = _heatmap(trials, list(imp))
    if heat is not None:
        (px, py), xs_, ys_, grid = heat
        from matplotlib.colors import LogNorm

        fig, ax = plt.subplots(figsize=(5.5, 4))
        im = ax.imshow(grid, origin="lower", cmap="viridis_r", aspect="auto", norm=LogNorm())
        ax.set_xticks(range(len(xs_)), [str(v) for v in xs_])
        ax.set_yticks(range(len(ys_)), [str(v) for v in ys_])
        ax.set(xlabel=px, ylabel=py, title="best time over the two most important parameters"
               "\n(blank: not tried)")
        fig.colorbar(im, ax=ax, label=f"{unit} (log scale)")
        pngs.append(_png(fig, plt, f"{stem}_heatmap.png"))
        logz = [[math.log10(v) if _finite(v) and v > 0 else None for v in row] for row in grid]
        frags.append(go.Figure(go.Heatmap(
            z=logz, x=[str(v) for v in xs_], y=[str(v) for v in ys_], colorscale="Viridis_r",
            customdata=grid, hovertemplate="%{customdata:.4g}<extra></extra>",
            colorbar={"title": "log10 ms"}),
            layout={"title": f"Best time over {px} and {py} ({unit}, log colour scale)",
                    "xaxis_title": px, "yaxis_title": py}))
    if compare:
        fig, ax = plt.subplots(figsize=(5, 2.6))
        ax.barh(list(compare)[::-1], list(compare.values())[::-1],
                color=["C2", "C1", "C0", "C3"][:len(compare)][::-1])
        ax.set(xlabel=unit, title="tuned vs default vs XLA / reference")
        pngs.append(_png(fig, plt, f"{stem}_compare.png"))
        frags.append(go.Figure(go.Bar(x=list(compare.values()), y=list(compare),
                                      orientation="h"),
                               layout={"title": f"Tuned vs default vs reference ({unit})"}))
    counts: dict[str, int] = {}
    for t in trials:
        counts[str(t.get("outcome", "?"))] = counts.get(str(t.get("outcome", "?")), 0) + 1
    fig, ax = plt.subplots(figsize=(5, 2.6))
    ax.bar(list(counts), list(counts.values()), color="C4")
    ax.set(ylabel="trials (distinct programs)", title="outcomes")
    pngs.append(_png(fig, plt, f"{stem}_outcomes.png"))
    frags.append(go.Figure(go.Bar(x=list(counts), y=list(counts.values())),
                           layout={"title": "Outcomes"}))
    return pngs, frags, notes


def _heatmap(trials: list[dict[str, Any]], ranked: list[str]) -> Any:
    """The two most important integer parameters (by ``ranked``, else those with most
    values), and the best time at each pair."""
    configs = [t for t in trials if isinstance(t.get("config"), dict)]
    ints: dict[str, set[int]] = {}
    for t in configs:
        for k, v in t["config"].items():
            if isinstance(v, int) and not isinstance(v, bool):
                ints.setdefault(k, set()).add(v)
    varied = [k for k in ints if len(ints[k]) > 1]
    order = {k: i for i, k in enumerate(ranked)}
    dims = sorted(varied, key=lambda k: (order.get(k, len(order)), -len(ints[k]), k))[:2]
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


def _compare(e: Any, prov: dict[str, Any], reference_ms: float | None) -> dict[str, float]:
    """Tuned, default and reference times to compare: the tuned and the default from the same
    final interleaved re-ranking (its row marked ``default``), never a search-phase figure
    against a re-timed one; the reference timed here (wall clock)."""
    out: dict[str, float] = {}
    if e.median_ms is not None:
        out["tuned"] = e.median_ms
    ranking = prov.get("retimed_interleaved")
    for row in ranking if isinstance(ranking, list) else ():
        if isinstance(row, dict) and row.get("default") is True and _finite(row.get("median_ms")):
            out["default"] = float(row["median_ms"])
        if (isinstance(row, dict) and row.get("implementation") == "xla"
                and _finite(row.get("median_ms"))):
            out["xla"] = float(row["median_ms"])  # Timed in the same rounds.
    if reference_ms is not None:
        out["reference"] = reference_ms
    return out


def unit_label(prov: dict[str, Any]) -> str:
    """What a figure's milliseconds are: a compiler estimate or a wall clock, and where."""
    if prov.get("kind") == "estimate" or str(prov.get("timer", "")).startswith("tpu-estimate"):
        chip = str(prov.get("chip", "TPU")).replace("tpu_", "")
        return f"ms, {chip} compiler estimate"
    if prov.get("interpret"):
        return "ms, wall clock (interpret mode)"  # The receipts' timing_note says more.
    return f"ms, {prov.get('timer') or 'wall clock'} on {prov.get('device_kind') or '?'}"


def _summary(rows: list[dict[str, Any]]) -> str:
    """The page's first table: per shape the best config, its time, the default's, the
    speed-up and the reference's, each cell's number also in a data- attribute."""
    head = ("<table class=summary><tr><th>shape</th><th>best config (as it runs)</th>"
            "<th>tuned</th><th>default</th><th>speed-up</th><th>XLA</th><th>calls run</th>"
            "<th>reference</th><th>unit</th></tr>")
    body = []
    for r in rows:
        c = r["compare"]
        speed = (c["default"] / c["tuned"]) if "default" in c and c.get("tuned") else None

        def cell(name: str, value: float | None, fmt: str = "{:.4g}") -> str:
            text = "-" if value is None else fmt.format(value)
            data = "" if value is None else f' data-{name}="{value!r}"'
            return f"<td class={name}{data}>{text}</td>"

        body.append(
            f"<tr><td><code>{html.escape(r['key'])}</code></td><td><code>"
            f"{html.escape(json.dumps(r['config']))}</code></td>{cell('tuned', c.get('tuned'))}"
            f"{cell('default', c.get('default'))}{cell('speedup', speed, '{:.2f}x')}"
            f"{cell('xla', c.get('xla'))}<td class=runs>{html.escape(r['runs'])}</td>"
            f"{cell('reference', c.get('reference'))}<td>{html.escape(r['unit'])}</td></tr>")
    return head + "".join(body) + "</table>"


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


def _slug(key: str) -> str:
    """A file-name-safe short form of a key: ``x=64x256:float32`` → ``x-64x256-float32``."""
    out = "".join(ch if ch.isalnum() else "-" for ch in key)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")[:60] or "key"


def _entries(request: ReportRequest) -> tuple[str, list[tuple[Any, Any]]]:
    """(the kernel's cache name, (file report, entry) of that kernel named exactly, on the chip
    and keys asked for); a short name (``matmul``) is the one kernel whose last part it is."""
    from pallas_tune.cache import default_cache
    from pallas_tune.cache.inventory import inventory

    name = request.kernel
    reports = [r for r in inventory(default_cache(), kernel=name, chip=request.chip)
               if r.error is None]
    exact = [r for r in reports if r.kernel == name]
    if not exact:  # A short name ("matmul") names the one kernel whose last part it is.
        short = {r.kernel for r in reports if r.kernel and r.kernel.split(".")[-1] == name}
        if len(short) == 1:
            name = short.pop()
            print(f"kernel: {name}")
            exact = [r for r in reports if r.kernel == name]
    if not exact:
        near = sorted({r.kernel for r in reports if r.kernel})
        hint = f" Kernels whose names contain it: {', '.join(near)}." if near else ""
        raise CLIUsageError(f"no tuned entries of the kernel {name!r} in the caches; "
                            f"run pallas-tune sweep first (pallas-tune show lists them).{hint}")
    return name, [(r, e) for r in exact for e in r.entries
                  if e.problem is None and not (request.key and request.key not in e.key)]


def cmd_report(request: ReportRequest) -> int:
    plt, optuna = _need()
    from pallas_tune.cache.inventory import trial_history
    from pallas_tune.measure.records import describe_tally, tally

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kernel = None
    if request.reference:
        from pallas_tune.cli.sweep import load_kernel

        kernel = load_kernel(request.reference, request.paths)
    name, found = _entries(request)
    if not found:
        raise CLIUsageError(f"no valid entries of {name!r} match --key {request.key!r}; "
                            "pallas-tune show --kernel NAME lists its keys")
    out = request.out
    os.makedirs(out, exist_ok=True)
    sections, pngs, rows, first = [], [], [], True
    for r, e in found:
        runs, _ = trial_history(r, e.key)
        trials = [t for t in (runs[-1].get("trials") if runs else None) or []
                  if isinstance(t, dict)]
        prov = runs[-1].get("provenance") if runs else None
        prov = prov if isinstance(prov, dict) else {}
        unit = unit_label({"kind": r.kind, **prov})
        compare = _compare(e, prov, _time_reference(kernel, e.key))
        rows.append({"key": e.key, "config": e.effective or e.config, "compare": compare,
                     "unit": unit, "runs": e.implementation})
        stem = os.path.join(out, f"{len(sections):02d}_{_slug(e.key)}")
        p, frags, notes = _figures(plt, optuna, _study(optuna, trials), trials, compare, stem,
                                   unit)
        pngs += p
        parts = []
        for fig in frags:
            fig.update_layout(title_text=f"{fig.layout.title.text or ''}<br><sup>"
                                         f"{html.escape(e.key)}</sup>")
            parts.append(fig.to_html(full_html=False, include_plotlyjs=first))
            first = False
        ms = "-" if e.median_ms is None else f"{e.median_ms:.4g}"
        counted = describe_tally(tally((str(t.get("outcome")), t.get("duplicate_of") is not None)
                                       for t in trials))
        missing = [n for n in ("default", "reference") if n not in compare]
        note = (f"<p class=note>not shown: {', '.join(missing)} (the default when it was "
                "re-timed in the final ranking beside the winner; the reference when "
                "--reference MODULE:NAME names a kernel with a reference=)</p>"
                if missing else "")
        sections.append(
            f"<section><h2>{html.escape(r.kernel or '?')} on {html.escape(r.chip)}: "
            f"<code>{html.escape(e.key)}</code></h2><p>best "
            f"<code>{html.escape(json.dumps(e.config))}</code> at {ms} {html.escape(unit)}"
            f" ({html.escape(counted)})</p>{note}{notes}"
            f"{_receipts(prov)}<div class=plots>" + "".join(parts)
            + "</div><details><summary>PNG figures</summary>"
            + "".join(_img(x) for x in p) + "</details></section>")
    page = os.path.join(out, "index.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(_PAGE.format(title=html.escape(f"pallas-tune report: {name}"),
                             body=_summary(rows) + "".join(sections)))
    print(f"pallas-tune report: {page} ({len(sections)} shape(s)) and {len(pngs)} PNGs in "
          f"{out}")
    return 0


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
.plots{{display:grid;grid-template-columns:1fr 1fr;gap:8px}}
table.receipts th{{text-align:left;padding-right:1em}} img{{max-width:48%}}
table.summary{{border-collapse:collapse;margin-bottom:2em}}
table.summary td,table.summary th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style>
</head><body><h1>{title}</h1>{body}</body></html>"""
