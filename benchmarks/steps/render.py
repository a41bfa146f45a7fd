"""The tables of ``step_tuning.py``'s results file: the headline (tuned against all-XLA and
against upstream Pallas), attention's share, the composition checked against whole compiles,
one row per layer and each composed layer's calls; and the merge of one layer's settings run
apart (``--merge-settings``)."""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "step_tuning.py")

def _ms(rows_step: dict, detail: dict, k: str) -> str:
    v = rows_step.get(k)
    if k not in detail:
        return "not run"
    if v is None or not math.isfinite(v):
        errors = [c["error"] for c in detail[k].get("calls", []) if "error" in c]
        why = str(detail[k].get("error") or (errors or ["?"])[0])
        return "no estimate: " + " ".join(why.split())[:80]  # One table cell: one line.
    n, scaled = detail.get(k, {}).get("standalone", 0), detail.get(k, {}).get("standin", 0)
    footing = detail.get(k, {}).get("footing", 0)
    return (f"{v:.3f}" + (" partial" if detail.get(k, {}).get("partial") else "")
            + (f" ({footing} call(s) on XLA's cost model at the footing)" if footing else "")
            + (f" ({n} call(s) standalone)" if n else "")
            + (f" ({scaled} of them on the kernel's stand-in, scaled)" if scaled else ""))


def _num(v) -> str:
    return f"{v:.4f}" if isinstance(v, float) and math.isfinite(v) else "-"


def _composed(r: dict) -> list[str]:
    """A composed layer's calls: what each adds to the glue under each setting."""
    d, by = r["step_detail"], {(c["kernel"], c["key"]): c for c in r["calls"]}
    if "ms" not in d.get("glue", {}):  # No glue figure: nothing composed.
        return ["", f"## {r['title']}", "", "No composed figure: the glue's compile gave none ("
                + str(d.get("glue", {}).get("error", "?"))[:300].replace("\n", " ") + ")."]
    out = ["", f"## {r['title']}", "", f"Step timer: {r['step_timer']}.", "",
           f"Glue (every tunable call stubbed): {_num(d['glue']['ms'])} ms ESTIMATE "
           f"({d['glue']['cycles']} cycles, compiled in {d['glue']['compile_s']} s"
           + ("; libtpu's profile of it died, so XLA's cost model at the footing: "
              + " ".join(str(d["glue"].get("profile_error", "")).split())[:80]
              if d["glue"].get("model_only") else "") + "). Each call "
           "below: what one occurrence adds when put back into the glue (ms per call, "
           "ESTIMATE; the layer's figure counts it 'calls' times); "
           "'in the one above' = it vanished when that call ran as XLA (XLA's autodiff "
           "replaced it); 'standalone' = its in-step program failed to compile, so it was "
           "estimated as a program of its own (inputs as parameters); 'stand-in xS' = that "
           "program's profile died too, so the kernel's own stand-in (fewer parallel tiles, "
           "the same tiles) was estimated and scaled by S, as the tuner does. Step figures "
           f"estimated in {r.get('step_wall_s', '?')} s.", "",
           "| kernel | key | calls | source | tuned runs | tuned config | default | tuned | "
           "all-XLA |", "|---|---|---|---|---|---|---|---|---|"]
    for i, c in enumerate(d.get("calls", [])):
        t = by.get((c["kernel"].rsplit(".", 1)[-1], c["key"]), {})
        cells = []
        for name in ("default", "tuned", "xla"):
            f = d.get(name, {}).get("calls", [])
            f = f[i] if i < len(f) else {}
            cells.append(_num(f["ms"]) + (" partial" if f.get("partial") else "")
                         + (" footing (XLA's cost model: its profiled compile died"
                            + ("; raised to its dots' MXU floor)" if f.get("floored") else ")")
                            if f.get("model_only") else
                            f" footing (libtpu {f['libtpu_ms']:.4f} partial)"
                            if f.get("footing") else "")
                         + (" standalone" if f.get("standalone") else "")
                         + (f" stand-in x{f['standin_scale']:g}" if f.get("standin_scale")
                            else "") if "ms" in f
                         else "in the one above" if f.get("absorbed")
                         else f"error: {' '.join(f['error'].split())[:60]}" if "error" in f
                         else "-")
        out.append(f"| {c['kernel'].rsplit('.', 1)[-1]} | `{c['key']}` | {c['count']} | "
                   f"{t.get('source', '?')} | {t.get('implementation', '?')} | "
                   f"`{t.get('config', '?')}` | {' | '.join(cells)} |")
    return out


def _upstream_ms(u: dict | None, k: str) -> float | None:
    v = ((u or {}).get(k) or {}).get("ms")
    return v if isinstance(v, float) and math.isfinite(v) else None


def _upstream_cell(u: dict | None, k: str) -> str:
    f = (u or {}).get(k)
    if f is None:
        return "not run"
    v = _upstream_ms(u, k)
    if v is None:
        return "no estimate: " + str(f.get("detail", {}).get("error", "?"))[:80]
    gmm = [m["ms"] for m in (f.get("megablox") or {}).values() if "ms" in m]
    return f"{v:.3f} (splash {f['splash']['ms']:.3f}" + (
        f"; megablox {' + '.join(f'{m:.3f}' for m in gmm)} per call)" if gmm else ")")


def _xla_cell(s: dict, d: dict, u: dict) -> tuple[str, float | None]:
    """The all-XLA cell and figure; where the all-XLA setting has none and the layer's grouped
    matmuls were put at their MXU floor, that lower bound (marked '>=')."""
    if s.get("xla") or not _upstream_ms(u, "xla_floor"):
        return _ms(s, d, "xla"), s.get("xla")
    v = _upstream_ms(u, "xla_floor")
    return (f">= {v:.3f} (grouped matmuls at their MXU floor; the all-XLA setting: "
            f"{_ms(s, d, 'xla')[:70]})"), v


def _attention_ms(r: dict, setting: str) -> float | None:
    """The step's attention under a setting: its forward call and backward call(s), or the
    forward compiled with XLA's VJP, each times its occurrences."""
    d = r["step_detail"]
    total, seen = 0.0, False
    for c, f in zip(d.get("calls", []), d.get(setting, {}).get("calls", []), strict=False):
        if "flash_attention" in c["kernel"] and "ms" in f:
            total, seen = total + f["live"] * f["ms"], True
    return total if seen else None


def attention_table(rows: list[dict]) -> list[str]:
    """Attention's share of each upstream row: ours tuned, XLA's, splash's two."""
    rows = [r for r in rows if r.get("upstream")]
    if not rows:
        return []
    out = ["", "Attention alone in each step (forward and backward, ms, ESTIMATES; splash on its "
           "stand-in, XLA on the footing where libtpu's sum is partial):", "",
           "| layer | pallas-tune flash, tuned | XLA | splash, MaxText's blocks | splash, tuned "
           "| splash's tuned blocks |", "|---|---|---|---|---|---|"]
    for r in rows:
        u = r["upstream"]
        sp = [((u.get(k) or {}).get("splash") or {}) for k in ("maxtext", "tuned")]
        blocks = {**(sp[1].get("forward_blocks") or {}), **(sp[1].get("backward_blocks") or {})}
        out.append(f"| {r['title']} | {_num(_attention_ms(r, 'tuned'))} | "
                   f"{_num(_attention_ms(r, 'xla'))} | {_num(sp[0].get('ms'))} | "
                   f"{_num(sp[1].get('ms'))} | `{blocks or '-'}` |")
    return out


def headline(rows: list[dict]) -> list[str]:
    """Tuned against all-XLA and against upstream Pallas (the faster of MaxText's splash blocks
    and splash tuned by pallas-tune), for the rows that have an upstream figure."""
    rows = [r for r in rows if r.get("upstream")]
    if not rows:
        return []
    out = ["", "| layer | all-XLA | upstream: MaxText's splash | upstream: splash tuned | "
           "default configs | tuned | tuned vs all-XLA | tuned vs upstream (its faster) |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, d, u = r["step_ms"], r["step_detail"], r["upstream"]
        ups = [v for v in (_upstream_ms(u, "maxtext"), _upstream_ms(u, "tuned")) if v]
        tuned = s.get("tuned")
        vs_up = f"{min(ups) / tuned:.2f}x" if ups and tuned else "-"
        xla_cell, xla = _xla_cell(s, d, u)
        vs_xla = (f"{'>= ' if not s.get('xla') else ''}{xla / tuned:.2f}x" if tuned and xla
                  else "-")
        out.append(f"| {r['title']} | {xla_cell} | {_upstream_cell(u, 'maxtext')} | "
                   f"{_upstream_cell(u, 'tuned')} | {_ms(s, d, 'default')} | "
                   f"{_ms(s, d, 'tuned')} | {vs_xla} | {vs_up} |")
    return out


def whole_check(rows: list[dict]) -> list[str]:
    """Composed figures against the same layer compiled whole, where that was run."""
    rows = [r for r in rows if r.get("whole")]
    if not rows:
        return []
    out = ["", "Composition checked against a whole compile (both ESTIMATES):", "",
           "| layer | setting | composed ms | whole ms | composed / whole |", "|---|---|---|---|---|"]
    for r in rows:
        for k, detail in r["whole"]["detail"].items():
            c, w = r["step_ms"].get(k), r["whole"]["ms"].get(k)
            cell = (f"{w:.3f}" + (" partial" if detail.get("partial") else "") if w
                    else "no estimate: " + str(detail.get("error", "?"))[:80])
            ratio = f"{c / w:.2f}" if c and w else "-"
            out.append(f"| {r['title']} | {k} | {_num(c)} | {cell} | {ratio} |")
    return out


def render(rows: list[dict], commands: list[str], missing: list[str]) -> str:
    lines = ["# Step tuning: whole layers, v6e compiler ESTIMATES (issue 28)", "",
             "Every figure below is an ESTIMATE: libtpu's static cycle profile of deviceless "
             "v6e compiles, summed over every op (Pallas kernels and XLA fusions) and converted "
             "at the v6e clock. Not a measurement; \"partial\" marks a lower bound (ops without "
             "an estimate). Composed figures (`--method composed`, "
             "`pallas_tune.step.figures.composed`): the layer's glue (every tunable call stubbed by an "
             "empty kernel) compiled whole, plus what each call adds when put back, one call per "
             "compile; on layers small enough to compile whole they match the whole-layer "
             "figure within 0.1% for Pallas settings and exceed it by up to 8% for all-XLA "
             "(fusion across calls is not composed): `tests/test_glue.py`. Generated by "
             f"`{bench.script(SCRIPT)}` on a CPU-only host, {bench.today()}.", "",
             "Commands:", ""]
    lines += [f"    {c}" for c in commands]
    lines += headline(rows)
    lines += attention_table(rows)
    lines += whole_check(rows)
    lines += ["", "| layer | all-XLA ms (ESTIMATE) | default configs ms (ESTIMATE) | tuned ms "
              "(ESTIMATE) | tuned vs XLA | tuned vs default | calls (tuned here / cached) | "
              "calls running XLA | tuning wall time |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        s, d = r["step_ms"], r["step_detail"]
        def ratio(a: str, b: str, s: dict = s) -> str:
            return f"{s[a] / s[b]:.2f}x" if a in s and b in s else "-"

        calls = r["calls"]
        xla = [f"{c['kernel']} {c['key']}" for c in calls if c["implementation"] == "xla"]
        lines.append(
            f"| {r['title']} | {_ms(s, d, 'xla')} | {_ms(s, d, 'default')} | "
            f"{_ms(s, d, 'tuned')} | {ratio('xla', 'tuned')} | {ratio('default', 'tuned')} | "
            f"{sum(c['source'] == 'tuned' for c in calls)} / "
            f"{sum(c['source'] == 'cache' for c in calls)} | "
            f"{'; '.join(xla) if xla else 'none'} | {r['tuning_wall_s']:.0f} s |")
    for r in rows:
        if r.get("method") == "composed":
            lines += _composed(r)
            continue
        lines += ["", f"## {r['title']}", "", f"Step timer: {r['step_timer']}.", "",
                  "| kernel | key | source | runs | config | tuned ms (EST.) | XLA ms (EST.) |",
                  "|---|---|---|---|---|---|---|"]
        for c in r["calls"]:
            xla = _num(c["xla_ms"]) + (" partial" if c.get("xla_partial") else "")
            lines.append(f"| {c['kernel']} | `{c['key']}` | {c['source']} | "
                         f"{c['implementation']} | `{c['config']}` | {_num(c['best_ms'])} | "
                         f"{xla} |")
        lines += ["", "Whole-layer compile detail per setting: "
                  + "; ".join(f"{k}: {v}" for k, v in r["step_detail"].items())]
    if missing:
        lines += ["", "## Missing rows", ""] + [f"- {m}" for m in missing]
    lines += ["", "Tuned and XLA per-call figures are NaN (`-`) for cached calls: the cache "
              "entry was used without re-tuning; cached entries hold their own xla_ms where "
              "they were tuned with XLA beside them."]
    return "\n".join(lines) + "\n"


def merge_settings(parts: list[dict]) -> dict:
    """One rows file from runs of the same layers under different ``--settings`` (a long
    layer's settings run apart): each (layer, tokens, method, remat policy) row takes every
    run's settings (and the title of a run that names its policy); the glue's figure must agree
    (the same compile), else the runs are not of one program."""
    rows: dict[tuple, dict] = {}
    for part in parts:
        for r in part["rows"]:
            k = (r["layer"], r["tokens"], r.get("method"), r.get("remat", "none"))
            if k not in rows:
                rows[k] = json.loads(json.dumps(r))
                continue
            m = rows[k]
            if "remat" in r:
                m["title"], m["remat"] = r["title"], r["remat"]
            if m["step_detail"]["glue"].get("cycles") != r["step_detail"]["glue"].get("cycles"):
                raise SystemExit(f"{r['title']}: the runs' glue figures differ; not merged")
            for name, ms in r["step_ms"].items():
                m["step_ms"][name] = ms
            for name, detail in r["step_detail"].items():
                if name not in ("glue", "calls"):
                    m["step_detail"][name] = detail
            m["calls"] = [c if c["source"] != "?" else o for c, o in
                          zip(r["calls"], m["calls"], strict=False)] or m["calls"]
            m["step_wall_s"] = round(m.get("step_wall_s", 0) + r.get("step_wall_s", 0), 1)
    return {"command": "; ".join(p["command"] for p in parts), "rows": list(rows.values())}
