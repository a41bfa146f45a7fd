"""``pallas-tune report``: a self-contained HTML page and PNGs of what tuning found.

Per tuned shape of a kernel in the user's cache (``--shipped``: the entries shipped with
installed libraries too): the optimization history and parameter importances (Optuna's plotly
visualizations, over a study rebuilt from the trial ledger, so any cache can be reported,
wherever it was tuned), a heatmap of time over two block dimensions, tuned vs the declared
default vs the reference implementation, the outcomes, and the receipts (chip, timer,
versions); ``--png`` also draws each as a PNG (matplotlib). Needs the ``report`` extra.
"""

from __future__ import annotations

import base64
import html
import itertools
import json
import math
import os
import re
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.shapes import CLIUsageError

if TYPE_CHECKING:
    from pallas_tune.cli.edge import ReportRequest

__all__ = ["add_parser", "cmd_report"]


def add_parser(sub: Any) -> None:
    r = sub.add_parser("report", help="HTML page of a kernel's tuning in your cache (plotly; "
                                      "--png: PNGs too, matplotlib)")
    r.add_argument("--kernel", required=True,
                   help="the kernel's cache name, exactly as pallas-tune show lists it")
    r.add_argument("--chip", help="only this chip")
    r.add_argument("--key", help="only keys containing this")
    r.add_argument("--out", default="pallas-tune-report", help="output directory")
    r.add_argument("--reference", metavar="MODULE:NAME",
                   help="the @tunable kernel (MODULE:NAME) whose reference= implementation to "
                        "time here (wall clock, jitted, random inputs of each key's shapes)")
    r.add_argument("--path", action="append", metavar="DIR", help="import kernels from DIR")
    r.add_argument("--shipped", action="store_true",
                   help="also the entries shipped with installed libraries (default: only "
                        "your own cache's)")
    r.add_argument("--png", action="store_true",
                   help="also draw each figure as a PNG file (matplotlib; about 0.6 s a shape)")
    r.set_defaults(func=cmd_report)


def _need(png: bool) -> tuple[Any, Any]:
    """(matplotlib's pyplot, or None without ``png``; optuna)."""
    plt = None
    try:
        import plotly  # noqa: F401

        if png:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
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


def _figures(optuna: Any, study: Any, trials: list[dict[str, Any]], compare: dict[str, float],
             unit: str) -> tuple[list[Any], str, dict[str, Any]]:
    """(plotly figures, notes, what they show: for :func:`_pngs`) for one tuned shape;
    duplicates (the same program as an earlier trial) are not plotted as trials."""
    import plotly.graph_objects as go

    trials = [t for t in trials if t.get("duplicate_of") is None]
    frags, notes = [], ""
    values = [t.value if t.value is not None else math.inf for t in study.trials]
    done = [v for v in values if math.isfinite(v)]
    frags.append(optuna.visualization.plot_optimization_history(study, target_name=unit))
    finite = optuna.create_study(direction="minimize")
    finite.add_trials([t for t in study.trials if t.value is not None
                       and math.isfinite(t.value)])
    imp: dict[str, float] = {}
    if len(done) >= 2 and study.trials and study.trials[0].params:
        imp = optuna.importance.get_param_importances(finite)
        frags.append(optuna.visualization.plot_param_importances(finite))
        if len(done) < FEW_TRIALS:
            notes += (f"<p class=note>importances from {len(done)} timed trials: indicative "
                      "only (fANOVA needs many more to be reliable)</p>")
    heat = _heatmap(trials, list(imp))
    if heat is not None:
        (px, py), xs_, ys_, grid = heat
        logz = [[math.log10(v) if _finite(v) and v > 0 else None for v in row] for row in grid]
        frags.append(go.Figure(go.Heatmap(
            z=logz, x=[str(v) for v in xs_], y=[str(v) for v in ys_], colorscale="Viridis_r",
            customdata=grid, hovertemplate="%{customdata:.4g}<extra></extra>",
            colorbar={"title": "log10 ms"}),
            layout={"title": f"Best time over {px} and {py} ({unit}, log colour scale)",
                    "xaxis_title": px, "yaxis_title": py}))
    if compare:
        frags.append(go.Figure(go.Bar(x=list(compare.values()), y=list(compare),
                                      orientation="h"),
                               layout={"title": f"Tuned vs default vs reference ({unit})"}))
    counts: dict[str, int] = {}
    for t in trials:
        counts[str(t.get("outcome", "?"))] = counts.get(str(t.get("outcome", "?")), 0) + 1
    frags.append(go.Figure(go.Bar(x=list(counts), y=list(counts.values())),
                           layout={"title": "Outcomes"}))
    return frags, notes, {"values": values, "imp": imp, "heat": heat, "compare": compare,
                          "counts": counts}


def _pngs(plt: Any, shown: dict[str, Any], stem: str, unit: str) -> list[str]:
    """The figures of :func:`_figures` drawn with matplotlib, as PNG files ``stem_NAME.png``."""
    values, imp, heat, compare = shown["values"], shown["imp"], shown["heat"], shown["compare"]
    pngs = []
    fig, ax = plt.subplots(figsize=(6, 3.4))
    xs = [i for i, v in enumerate(values) if math.isfinite(v)]
    ax.plot(xs, [values[i] for i in xs], "o", label="trial", alpha=0.7)
    best = list(itertools.accumulate(values, min))
    ax.step(range(len(best)), best, where="post", label="best so far", color="C3")
    ax.set(xlabel="trial (distinct programs)", ylabel=unit, title="optimization history")
    ax.legend()
    pngs.append(_png(fig, plt, f"{stem}_history.png"))
    if imp:
        fig, ax = plt.subplots(figsize=(5, 2.6))
        ax.barh(list(imp)[::-1], list(imp.values())[::-1], color="C0")
        ax.set(xlabel="importance (fANOVA)", title="parameter importances")
        pngs.append(_png(fig, plt, f"{stem}_importances.png"))
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
    if compare:
        fig, ax = plt.subplots(figsize=(5, 2.6))
        ax.barh(list(compare)[::-1], list(compare.values())[::-1],
                color=["C2", "C1", "C0", "C3"][:len(compare)][::-1])
        ax.set(xlabel=unit, title="tuned vs default vs XLA / reference")
        pngs.append(_png(fig, plt, f"{stem}_compare.png"))
    fig, ax = plt.subplots(figsize=(5, 2.6))
    ax.bar(list(shown["counts"]), list(shown["counts"].values()), color="C4")
    ax.set(ylabel="trials (distinct programs)", title="outcomes")
    pngs.append(_png(fig, plt, f"{stem}_outcomes.png"))
    return pngs


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
    against a re-timed one; without such a row (estimates are not re-ranked), the entry's own
    ``default_ms`` and ``xla_ms``, the figures its sweep printed; the reference timed here."""
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
    out.update({n: v for n, v in (("default", e.default_ms), ("xla", e.xla_ms))
                if n not in out and v is not None})
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
    """The page's first table: per shape its chip and source, the best config, its time, the
    default's, the speed-up and the reference's, each number also in a data- attribute."""
    head = ("<table class=summary><tr><th>chip</th><th>source</th><th>shape</th>"
            "<th>best config (as it runs)</th>"
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
            f"<tr><td class=chip>{html.escape(r['chip'])}</td><td class=source>"
            f"{html.escape(r['source'])}</td><td class=key><code>{html.escape(r['key'])}</code>"
            f"</td><td class=config><code>{html.escape(json.dumps(r['config']))}</code></td>"
            f"{cell('tuned', c.get('tuned'))}"
            f"{cell('default', c.get('default'))}{cell('speedup', speed, '{:.2f}x')}"
            f"{cell('xla', c.get('xla'))}<td class=runs>{html.escape(r['runs'])}</td>"
            f"{cell('reference', c.get('reference'))}<td>{html.escape(r['unit'])}</td></tr>")
    return head + "".join(body) + "</table>"


def _time_reference(kernel: Any, key: str) -> float | None:
    """Wall-clock median of the jitted reference on random inputs of the key's shapes."""
    if kernel is None or kernel.reference is None:
        return None  # Before importing JAX: a report without --reference never needs it.
    import time

    import jax

    from pallas_tune.cli.shapes import build_call

    try:
        args, kwargs = build_call(kernel, key)
    except CLIUsageError:
        return None
    real = [jax.random.normal(jax.random.PRNGKey(0), a.shape, a.dtype) if hasattr(a, "shape")
            else a for a in args]
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
    pairs = [(k, prov[k]) for k in ("chip", "device_kind", "timer", "evaluator", "interpret",
                                    "timing_note", "date", "strategy", "seed", "repeats",
                                    "tuning_s", "kernel_fingerprint", "kernel_version")
             if k in prov]
    pairs += (prov["versions"].items() if isinstance(prov.get("versions"), dict) else [])
    return "<table class=receipts>" + "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in pairs
    ) + "</table>"


def _slug(key: str) -> str:
    """A file-name-safe short form of a key: ``x=64x256:float32`` → ``x-64x256-float32``."""
    return re.sub(r"[\W_]+", "-", key).strip("-")[:60] or "key"


def _entries(request: ReportRequest) -> tuple[str, list[tuple[Any, Any]], int]:
    """(the kernel's cache name, (file report, entry) of that kernel named exactly, on the chip
    and keys asked for, how many shipped entries of it were left out); a short name
    (``matmul``) is the one kernel whose last part it is. Only the user's cache's entries
    unless ``request.shipped``."""
    from pallas_tune.cache import default_cache
    from pallas_tune.cache.inventory import inventory

    every = [r for r in inventory(default_cache(), kernel=request.kernel, chip=request.chip)
             if r.error is None]
    reports = every if request.shipped else [r for r in every if not r.shipped]
    name = request.kernel
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
        shipped = sorted({r.kernel for r in every if r.shipped and r.kernel} - set(near))
        if shipped:
            hint += (f" Shipped with installed libraries: {', '.join(shipped)}; --shipped "
                     "reports those too.")
        raise CLIUsageError(f"no tuned entries of the kernel {name!r} in your cache; "
                            f"run pallas-tune sweep first (pallas-tune show lists them).{hint}")
    left_out = sum(len(r.entries) for r in every if r.shipped and r.kernel == name
                   and not request.shipped)
    return name, [(r, e) for r in exact for e in r.entries
                  if e.problem is None and not (request.key and request.key not in e.key)
                  ], left_out


def cmd_report(request: ReportRequest) -> int:
    plt, optuna = _need(request.png)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    kernel = None
    if request.reference:
        from pallas_tune.cli.sweep import load_kernel

        kernel = load_kernel(request.reference, request.paths)
    name, found, left_out = _entries(request)
    if not found:
        raise CLIUsageError(f"no valid entries of {name!r} match --key {request.key!r}; "
                            "pallas-tune show --kernel NAME lists its keys")
    out = request.out
    os.makedirs(out, exist_ok=True)
    sections, pngs, rows = [], [], []
    for r, e in found:
        stem = os.path.join(out, f"{len(sections):02d}_{_slug(e.key)}")
        section, row, p = _section(r, e, optuna, plt, kernel, stem, first=not sections)
        sections.append(section)
        rows.append(row)
        pngs += p
    page = os.path.join(out, "index.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(_PAGE.format(title=html.escape(f"pallas-tune report: {name}"),
                             body=_summary(rows) + "".join(sections)))
    drawn = f" and {len(pngs)} PNGs" if request.png else " (--png also draws PNGs)"
    print(f"pallas-tune report: {page} ({len(sections)} shape(s)){drawn} in {out}")
    if left_out:
        print(f"left out: {left_out} entries of {name} shipped with installed libraries "
              "(--shipped reports them too)")
    return 0


def _section(r: Any, e: Any, optuna: Any, plt: Any, kernel: Any, stem: str, *, first: bool
             ) -> tuple[str, dict[str, Any], list[str]]:
    """One entry's section of the page, its summary row and its PNGs (none without ``plt``)."""
    from pallas_tune.cache.inventory import trial_history
    from pallas_tune.measure.records import describe_tally, tally

    runs, _ = trial_history(r, e.key)
    trials = [t for t in (runs[-1].get("trials") if runs else None) or [] if isinstance(t, dict)]
    prov = runs[-1].get("provenance") if runs else None
    prov = prov if isinstance(prov, dict) else {}
    unit = unit_label({"kind": r.kind, **prov})
    compare = _compare(e, prov, _time_reference(kernel, e.key))
    source = ("shipped" if r.shipped else "user") + f", {r.kind}" + (
        " (recovered)" if r.role == "recovered" else "")
    row = {"chip": r.chip, "source": source, "key": e.key, "config": e.effective or e.config,
           "compare": compare, "unit": unit, "runs": e.implementation}
    frags, notes, shown = _figures(optuna, _study(optuna, trials), trials, compare, unit)
    pngs = _pngs(plt, shown, stem, unit) if plt is not None else []
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
    note = (f"<p class=note>not shown: {', '.join(missing)} (the default where the entry or "
            "its final ranking has its figure; the reference when --reference MODULE:NAME "
            "names a kernel with a reference=)</p>" if missing else "")
    images = ("<details><summary>PNG figures</summary>" + "".join(_img(x) for x in pngs)
              + "</details>") if pngs else ""
    section = (f"<section><h2>{html.escape(r.kernel or '?')} on {html.escape(r.chip)} "
               f"({html.escape(source)}): <code>{html.escape(e.key)}</code></h2><p>best "
               f"<code>{html.escape(json.dumps(e.config))}</code> at {ms} {html.escape(unit)}"
               f" ({html.escape(counted)})</p>{note}{notes}{_receipts(prov)}<div class=plots>"
               + "".join(parts) + f"</div>{images}</section>")
    return section, row, pngs


_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}
.plots{{display:grid;grid-template-columns:1fr 1fr;gap:8px}}
table.receipts th{{text-align:left;padding-right:1em}} img{{max-width:48%}}
table.summary{{border-collapse:collapse;margin-bottom:2em}}
table.summary td,table.summary th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style>
</head><body><h1>{title}</h1>{body}</body></html>"""
