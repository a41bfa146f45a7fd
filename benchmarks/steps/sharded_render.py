"""The Markdown of ``sharded_step.py``'s rows: per layer, layout and tokens, each setting's
compute (ESTIMATE), collectives (MODEL) and their sum; the collectives libtpu reported; the
per-chip composition against the whole multi-chip compile; what the tuned setting ran."""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

SETTING_NAMES = {"xla": "all-XLA", "upstream": "upstream Pallas (MaxText's splash)",
                 "tuned": "pallas-tune (cached configs)"}
MODEL_NAMES = {"8b": "Llama-3.1-8B", "70b": "Llama-3.1-70B", "tiny": "tiny (smoke)"}
LAYOUT_NAMES = {"tp8": "TP8 (Megatron), 1 sequence", "fsdp": "FSDP, 8 sequences (1 a chip)"}


def _f(x: Any, nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


_COLLECTIVE_FIELDS = ("collectives", "collectives_model_ms", "collective_ops",
                      "collective_profile_cycles")


def _groups(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Rows by (model, layout, tokens), then (setting, program). A profiled 8-chip row whose
    program was also compiled without the profile takes that compile's collectives (the same
    program: the profile adds annotations, not collectives), read by the current
    ``collectives`` module; ``collectives_from`` says so."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["model"], r["layout"], r["tokens"])
        out.setdefault(key, {})[(r["setting"], r["program"])] = r
    for g in out.values():
        for (setting, program), r in list(g.items()):
            plain = g.get((setting, program + "-unprofiled"))
            if "unprofiled" in program or "error" in r or not plain or "error" in plain:
                continue
            g[(setting, program)] = {**r, **{k: plain[k] for k in _COLLECTIVE_FIELDS
                                             if k in plain},
                                     "collectives_from": "its unprofiled compile"}
    return out


def total(r: dict | None) -> float | None:
    """A mesh row's step: compute ESTIMATE plus collectives MODEL, serial (no overlap)."""
    if not r or r.get("compute_ms") is None or "error" in r:
        return None
    return r["compute_ms"] + r["collectives_model_ms"]


def _share(r: dict | None) -> str:
    t = total(r)
    return f"{100 * r['collectives_model_ms'] / t:.1f}%" if t else "-"


def _compute_cell(r: dict | None) -> str:
    if r is None:
        return "not run"
    if "error" in r:
        import re

        why = re.search(r"Ran out of memory in memory space \w+\. Used [\d.]+\w of [\d.]+\w",
                        r["error"])
        label = re.search(r"XLA label: (\S+)", r["error"])
        abort = re.search(r"Static LLO profiling of (\S+) failed: \w+: ([^.%]*)", r["error"])
        text = (f"{why.group(0)} ({label.group(1) if label else '?'})" if why
                else f"libtpu's profile aborted on {abort.group(1)}: {abort.group(2)}" if abort
                else r["error"].strip().splitlines()[-1][:140])
        return "failed: " + text.replace("|", "/")
    cell = _f(r["compute_ms"])
    if r.get("splash_standin"):
        cell += f" (splash {_f(r['splash_standin']['ms'])}, stand-in)"
    elif r.get("splash_error"):
        cell += " (splash: no stand-in figure)"
    splash = sum("splash" in k for k in r.get("ops_without_estimate_names", []))
    if r.get("splash_standin") and "ops_without_estimate_names" not in r:
        splash = len(r.get("kernels_without_estimate", []))  # Rows made before the names.
    zero = r.get("ops_without_estimate", 0) - splash
    if zero > 0:
        cell += f" partial ({zero} ops without an estimate)"
    return cell


def main_table(groups: dict) -> list[str]:
    lines = bench.table(
        ["layer", "layout", "tokens", "setting", "compute ms (ESTIMATE)",
         "collectives ms (MODEL)", "step ms (estimate + model)", "collectives' share",
         "vs all-XLA"], _main_rows(groups))
    return lines


def _main_rows(groups: dict):
    for (model, layout, tokens), g in sorted(groups.items()):
        xla = total(g.get(("xla", "mesh")))
        for s in ("xla", "upstream", "tuned"):
            r = g.get((s, "mesh"))
            if r is None:
                continue
            t = total(r)
            yield [MODEL_NAMES.get(model, model), LAYOUT_NAMES.get(layout, layout), tokens,
                   SETTING_NAMES[s], _compute_cell(r),
                   _f(r.get("collectives_model_ms")), _f(t), _share(r),
                   f"{xla / t:.2f}x" if xla and t else "-"]


def collectives_table(groups: dict) -> list[str]:
    rows = []
    for (model, layout, tokens), g in sorted(groups.items()):
        for s in ("xla", "upstream", "tuned"):
            r = g.get((s, "mesh"))
            if not r or "collectives" not in r:
                continue
            kinds = "; ".join(f"{k} x{v['count']}: {v['bytes'] / 2**20:.1f} MiB, profile "
                              f"{v['profile_cycles']} cycles, model {_f(v['model_ms'])} ms"
                              for k, v in sorted(r["collectives"].items()))
            algos = sorted({o.get("algorithm", "") for o in r.get("collective_ops", [])} - {""})
            rows.append([MODEL_NAMES.get(model, model), layout, tokens, s, kinds or "none",
                         ", ".join(algos) or "-"])
    return bench.table(["layer", "layout", "tokens", "setting",
                        "collectives in the compiled program (bytes: the full array)",
                        "libtpu's algorithm (emitter/strategy)"], rows)


def composition_table(groups: dict) -> list[str]:
    rows = []
    for (model, layout, tokens), g in sorted(groups.items()):
        for s in ("xla", "upstream", "tuned"):
            mesh, chip = g.get((s, "mesh")), g.get((s, "chip"))
            if not chip or not mesh or "error" in mesh:
                continue
            if "error" in chip:
                rows.append([MODEL_NAMES.get(model, model), layout, tokens, s,
                             _f(mesh["compute_ms"]), _compute_cell(chip), "-", "-", "-"])
                continue
            composed = chip["compute_ms"] + mesh["collectives_model_ms"]
            rows.append([MODEL_NAMES.get(model, model), layout, tokens, s,
                         _f(mesh["compute_ms"]), _f(chip["compute_ms"]),
                         f"{100 * (mesh['compute_ms'] / chip['compute_ms'] - 1):+.1f}%",
                         _f(composed), _f(total(mesh))])
    return bench.table(["layer", "layout", "tokens", "setting",
                        "8-chip compile: compute ms", "per-chip program alone: compute ms",
                        "8-chip vs per-chip", "per-chip + collectives (composed)",
                        "8-chip compile + collectives"], rows)


def unprofiled_table(groups: dict) -> list[str]:
    """The whole 8-chip programs compiled without libtpu's profile: the compiler's verdict,
    the collectives as compiled (MODEL), and where the tuned calls' configs came from."""
    rows = []
    for (model, layout, tokens), g in sorted(groups.items()):
        for s in ("xla", "upstream", "tuned"):
            r = g.get((s, "mesh-unprofiled"))
            if r is None:
                continue
            verdict = _compute_cell(r) if "error" in r else f"compiled in {r['compile_s']:.0f} s"
            sources: dict[str, int] = {}
            for rec in r.get("receipts", []):
                sources[rec["source"]] = sources.get(rec["source"], 0) + 1
            rows.append([MODEL_NAMES.get(model, model), layout, tokens, SETTING_NAMES[s],
                         verdict, _f(r.get("collectives_model_ms")),
                         ", ".join(f"{k} {v}" for k, v in sorted(sources.items())) or "-"])
    return bench.table(["layer", "layout", "tokens", "setting",
                        "v6e:2x4 compile without the profile", "collectives ms (MODEL)",
                        "kernel calls by config source"], rows)


def receipts_table(groups: dict) -> list[str]:
    rows = []
    for (model, layout, tokens), g in sorted(groups.items()):
        r = next((x for x in (g.get(("tuned", p)) for p in ("mesh", "mesh-unprofiled"))
                  if x and x.get("receipts")), None)
        if r is None:
            continue
        by: dict[str, list[str]] = {}
        for rec in r["receipts"]:
            name = rec["kernel"].rsplit(".", 1)[-1]
            if rec["source"] != "cache":  # Which shapes were not tuned: their keys' shapes.
                name += " " + ",".join(p.split(":")[0] for p in rec["key"].split(",")[:2])
            by.setdefault(rec["source"], []).append(name)
        rows.append([MODEL_NAMES.get(model, model), layout, tokens,
                     "; ".join(f"{src}: {len(v)} ({', '.join(sorted(set(v)))})"
                               for src, v in sorted(by.items()))])
    return bench.table(["layer", "layout", "tokens", "the tuned setting's calls, by where "
                        "their config came from (per-shard keys)"], rows)


def _headline_rows(groups: dict, goal: float):
    for (model, layout, tokens), g in sorted(groups.items()):
        xla, tuned = g.get(("xla", "mesh")), g.get(("tuned", "mesh"))
        up = g.get(("upstream", "mesh"))
        tx, tt, tu = total(xla), total(tuned), total(up)
        if not tx:
            continue
        if not tt:  # No tuned figure (its compile failed, or it was not run): say so.
            why = _compute_cell(tuned) if tuned else "not run"
            yield [MODEL_NAMES.get(model, model), layout, tokens, _f(tx), _f(tu), "-",
                   "-", "-", "-", f"{_share(xla)} / -", f"no tuned figure: {why}"]
            continue
        short, coll = tt - tx / goal, _f(tuned["collectives_model_ms"])
        yield [MODEL_NAMES.get(model, model), layout, tokens, _f(tx), _f(tu), _f(tt),
               f"{tx / tt:.2f}x", f"{tu / tt:.2f}x" if tu else "-",
               f"{xla['compute_ms'] / tuned['compute_ms']:.2f}x",
               f"{_share(xla)} / {_share(tuned)}",
               "met" if short <= 0 else f"{short:.3f} ms short; collectives {coll} ms of "
               "the tuned step"]


def headline(groups: dict, goal: float = 1.2) -> list[str]:
    """Tuned (with collectives) against all-XLA and upstream; the collectives' share."""
    return bench.table(["layer", "layout", "tokens", "all-XLA ms", "upstream ms", "tuned ms",
                        "tuned vs all-XLA (with collectives)", "tuned vs upstream",
                        "tuned vs all-XLA, compute only", "collectives' share: all-XLA / tuned",
                        f"goal {goal}x vs all-XLA"], _headline_rows(groups, goal))


D_MODEL = {"8b": 4096, "70b": 8192}


def collectives_for(groups: dict, model: str, layout: str, tokens: int, setting: str
                    ) -> tuple[float | None, str]:
    """The collectives MODEL (ms) of a step, from its own 8-chip compile, else from the
    nearest one: FSDP's move weights (the same at any token count), TP8's activations (scaled
    by tokens and by d_model); the upstream setting's dots are XLA's, so all-XLA's stand in."""
    own = groups.get((model, layout, tokens), {})
    for program, what in (("mesh", "its own"), ("mesh-unprofiled", "its own, unprofiled")):
        r = own.get((setting, program))
        if r and "error" not in r and "collectives_model_ms" in r:
            return r["collectives_model_ms"], what
    tries = [(setting, "")] + ([("xla", "all-XLA's")] if setting != "xla" else [])
    for s, label in tries:
        for (m, lay, t), g in sorted(groups.items(),
                                     key=lambda kv: (kv[0][0] != model, kv[0][2] != tokens)):
            r = next((x for x in (g.get((s, "mesh")), g.get((s, "mesh-unprofiled")))
                      if x and "error" not in x), None)
            if lay != layout or not r or "collectives_model_ms" not in r:
                continue
            if m != model and layout != "tp8":
                continue
            scale = 1.0 if layout == "fsdp" else tokens / t * D_MODEL.get(model, 1) / D_MODEL.get(
                m, 1)
            if (m, t) == (model, tokens) and not label:
                return r["collectives_model_ms"], "its own"
            what = ", ".join(x for x in (label, f"{MODEL_NAMES.get(m, m)} {t} tokens",
                                         f"x{scale:g}" if scale != 1 else "") if x)
            return r["collectives_model_ms"] * scale, what
    return None, "none"


def composed_table(groups: dict, per_chip: dict) -> list[str]:
    rows = []
    for pc in per_chip.get("rows", []):
        key = (pc["model"], pc["layout"], pc["tokens"])
        g = groups.get(key, {})
        figures = {}
        for s in ("xla", "upstream", "tuned"):
            if pc.get(s) is None:
                continue
            coll, src = collectives_for(groups, *key, s)
            whole = g.get((s, "mesh"))
            step = pc[s] + coll if coll is not None else None
            figures[s] = step
            rows.append([MODEL_NAMES.get(pc["model"]), pc["layout"], pc["tokens"],
                         SETTING_NAMES[s], _f(pc[s]), f"{_f(coll)} ({src})", _f(step),
                         f"{100 * coll / step:.1f}%" if step else "-",
                         _f(whole["compute_ms"]) if whole and "error" not in whole else "-",
                         f"{figures['xla'] / step:.2f}x" if step and figures.get("xla")
                         else "-"])
    return bench.table(["layer", "layout", "tokens", "setting",
                        "per-chip program ms (ESTIMATE, step_tuning.md)",
                        "collectives ms (MODEL; from which 8-chip compile)",
                        "composed step ms", "collectives' share",
                        "8-chip whole compile: compute ms (ESTIMATE)", "vs all-XLA"], rows)


def render(rows: list[dict], commands: list[str], notes: str = "",
           per_chip: dict | None = None) -> str:
    groups = _groups(rows)
    out = ["# Sharded step figures: 8-chip v6e, with collectives (issue 54 item 4)", "",
           "Every compute figure is a v6e compiler ESTIMATE (libtpu's static profile of a "
           "deviceless compile); every collective figure is a MODEL (bytes over ICI "
           "bandwidth, `benchmarks/steps/collectives.py`). Neither is a measurement. "
           f"Generated {bench.today()} on {bench.host()}; "
           f"{bench.versions('jax', 'jaxlib', 'libtpu')}.", "", "Commands:", ""]
    out += [f"    {c}" for c in commands] + ["", "## Headline", "",
                                               "The whole 8-chip compiles of this run (compute "
                                               "ESTIMATE + collectives MODEL, ms); the composed "
                                               "figures, 8192 tokens among them, are further "
                                               "down.", ""] + headline(groups)
    out += ["", notes.strip(), ""] if notes.strip() else []
    out += ["", "## Steps", ""] + main_table(groups)
    out += ["", "## Collectives", ""] + collectives_table(groups)
    out += ["", "## Composition: the per-chip program alone against the 8-chip compile", ""]
    out += composition_table(groups)
    if per_chip:
        out += ["", "## Composed: step_tuning.md's per-chip figures plus modelled collectives",
                "", per_chip.get("source", ""), per_chip.get("note", ""), ""]
        out += composed_table(groups, per_chip)
    if any(p == "mesh-unprofiled" for g in groups.values() for _, p in g):
        out += ["", "## Every whole program, compiled without the profile", "",
                "The same 8-chip programs compiled by the real compiler without libtpu's "
                "static profile (`--unprofiled`): whether each fits the chips and compiles, "
                "with the configs its calls resolve to, and its collectives as compiled. No "
                "compute figure (the profile is what estimates cycles). The composed table "
                "takes each step's collectives from these compiles where the profiled one is "
                "missing.", ""]
        out += unprofiled_table(groups)
    out += ["", "## What the tuned setting ran", ""]
    out += receipts_table(groups)
    return "\n".join(out) + "\n"


__all__ = ["render", "total"]
