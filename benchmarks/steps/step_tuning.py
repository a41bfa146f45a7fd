"""Tune the step, not the kernel (issue 28): whole layers of real models, v6e compiler estimates.

For each layer below, ``pallas_tune.autotune(layer, ..., timer="tpu-estimate", chip="v6e")``
finds every tunable call (forward, and backward under ``jax.grad``) and tunes those without an
entry in the estimate caches (user cache, then the shipped ``caches/tpu_v6e``; cached calls are
not tuned again), with XLA (the kernel's reference) estimated beside each tuned winner. Then
the layer's time is estimated deviceless three ways: every kernel replaced by XLA (its
reference), every kernel at its default config, and the tuned configs (XLA where XLA's estimate
won). ``--method whole`` compiles the layer whole (``pallas_tune.step.figures.estimates``: every op's
static estimate summed); ``--method composed`` (the default: a whole 8B layer at 2048 tokens
needs more memory than this host has) compiles its glue once and each call alone
(``pallas_tune.step.figures.composed``).

Every figure is a COMPILER ESTIMATE (libtpu's static profile, deviceless), not a measurement.
"partial" marks a lower bound: libtpu gave some ops no estimate, or a kernel has loops or
table-indexed fetches its static profile cannot follow (``pallas_tune.measure.loops``).

``--upstream TRIALS`` adds the upstream-Pallas figures (``steps/upstream.py``): the layer as a
MaxText user runs it (XLA dots and norms, splash attention at MaxText's blocks), and with
splash's blocks tuned in TRIALS trials; splash estimated on its stand-in (``kernels/_splash.py``).
``--check-whole SETTING...`` compiles those settings' layer whole too, to check the composition.

Layers (``steps/layers.py``; --tokens, bf16; RoPE, gating and residuals in plain JAX):
- llama_fwd / llama_fwd_bwd: a Llama-3.1-8B decoder layer (d 4096, 32 query / 8 KV heads of
  128, MLP 14336): rms_norm, fused QKV matmul, causal flash attention (GQA), O matmul, rms_norm,
  gate/up/down matmuls; forward, and jax.grad of its sum over the input and every weight.
- llama70b_fwd_bwd: one chip's shard of a Llama-3.1-70B decoder layer under 8-way tensor
  parallelism (d 8192, 8 of 64 query heads and 1 of 8 KV heads, fused gate|up of 2 x 3584), its
  all-reduces not counted; jax.grad as above.
- mixtral_moe: a Mixtral-8x7B MoE MLP (d 4096, 8 experts of 14336, top-2; the router in plain
  JAX; tokens sorted by expert with fixed group sizes: 2048 tokens x 2 = 4096 rows, 512 each):
  grouped_matmul for gate, up and down.
- mamba2: a Mamba-2 2.7B mixer (d 2560, d_inner 5120, 80 heads of 64, d_state 128, 1 group):
  rms_norm, x/z in-projections (matmul), B/C/dt projections and the short conv in plain JAX,
  mamba2_ssd, gated output, out-projection (matmul).

    python benchmarks/steps/step_tuning.py [--only llama_fwd mamba2 ...] [--trials 4]
        [--tokens 2048]
        [--method composed|whole] [--memory-gb 0] [--rows-out rows.json]
        [--combine a.json b.json] [--out benchmarks/results/step_tuning.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
from steps import layers, upstream  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_tune as pt  # noqa: E402
from pallas_tune.step import figures as step  # noqa: E402
from pallas_tune.kernels.mamba2_ssd import mamba2_ssd  # noqa: E402
from pallas_tune.kernels.matmul import matmul  # noqa: E402
from pallas_tune.kernels.rms_norm import rms_norm  # noqa: E402

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16
T = 2048  # Tokens (--tokens).


def llama_layer(*a):
    return layers.llama8b(*a)


llama_train = layers.train(layers.llama8b)


def llama_args():
    return layers.llama8b_args(T)


llama70b_train = layers.train(layers.llama70b_tp8)


def llama70b_args():
    return layers.llama70b_tp8_args(T)


def moe_layer(*a):
    return layers.moe(*a)


def moe_args():
    return layers.moe_args(T)


def mamba2_layer(x, norm, wx, wz, wbc, wdt, conv, A, D, onorm, wout):
    """A Mamba-2 2.7B mixer on x (T, 2560)."""
    t, heads, hd = x.shape[0], 80, 64
    h = rms_norm(x, norm, eps=1e-5)
    xs, z = matmul(h, wx), matmul(h, wz)
    # Depthwise causal conv (width 4) in plain JAX, then SiLU.
    pad = jnp.pad(xs, ((3, 0), (0, 0)))
    xs = jax.nn.silu(sum(pad[i:i + t] * conv[i] for i in range(4)))
    bc = h @ wbc
    dt = jax.nn.softplus((h @ wdt).astype(jnp.float32))
    y = mamba2_ssd(xs[None], dt[None], A, bc[None, :, :128], bc[None, :, 128:], D)[0]
    del heads, hd
    y = rms_norm(y * jax.nn.silu(z), onorm, eps=1e-5)
    return x + matmul(y, wout)


def mamba2_args():
    d, di, n, nh = 2560, 5120, 128, 80
    f32 = jnp.float32
    return (S((T, d), BF), S((d,), BF), S((d, di), BF), S((d, di), BF), S((d, 2 * n), BF),
            S((d, nh), BF), S((4, di), BF), S((nh,), f32), S((nh,), f32), S((di,), BF),
            S((di, d), BF))


LAYERS = {
    "llama_fwd": ("Llama-3.1-8B decoder layer, forward", llama_layer, llama_args),
    "llama_fwd_bwd": ("Llama-3.1-8B decoder layer, forward+backward (jax.grad)", llama_train,
                      llama_args),
    "llama70b_fwd_bwd": ("Llama-3.1-70B decoder layer, one chip of 8-way tensor parallelism, "
                         "forward+backward (jax.grad)", llama70b_train, llama70b_args),
    "mixtral_moe": ("Mixtral-8x7B MoE MLP, forward", moe_layer, moe_args),
    "mamba2": ("Mamba-2 2.7B mixer, forward", mamba2_layer, mamba2_args),
}


def run(name: str, trials: int, settings: list[str], memory_gb: float, method: str,
        upstream_trials: int | None = None, check_whole: list[str] | None = None) -> dict:
    title, fn, make = LAYERS[name]
    t0 = time.perf_counter()
    result = pt.autotune(fn, *make(), timer="tpu-estimate", chip="v6e", trials=trials,
                         workers=1, write=True, seed=0)
    wall = time.perf_counter() - t0
    # The step's estimates, one compile at a time in a worker capped at --memory-gb. "whole":
    # the layer compiled whole (at default tiles tens of thousands of grid steps, whose LLO
    # profile passed 7.7 GB on this host); "composed": the glue whole, each call alone. What
    # dies there is reported, never guessed.
    how = step.composed if method == "composed" else step.estimates
    t1 = time.perf_counter()
    result.step_ms, result.step_timer, result.step_detail = how(
        fn, make(), {}, result, "v6e", workers=1, only=settings,
        memory_limit_bytes=int(memory_gb * (1 << 30)) if memory_gb else None)
    step_wall = round(time.perf_counter() - t1, 1)
    whole = None
    if check_whole and method == "composed":  # The composition against a whole compile.
        w_ms, _, w_detail = step.estimates(
            fn, make(), {}, result, "v6e", workers=1, only=check_whole,
            memory_limit_bytes=int(memory_gb * (1 << 30)) if memory_gb else None)
        whole = {"ms": w_ms, "detail": w_detail}
    row = {"layer": name, "title": f"{title}, {T} tokens ({method})",
            "tuning_wall_s": round(wall, 1), "method": method, "tokens": T,
            "step_wall_s": step_wall, "whole": whole,
            "step_ms": result.step_ms, "step_timer": result.step_timer,
            "step_detail": result.step_detail,
            "calls": [{"kernel": c.kernel.rsplit(".", 1)[-1], "key": c.key, "source": c.source,
                       "implementation": c.implementation, "config": c.config,
                       "best_ms": c.best_ms, "xla_ms": c.xla_ms, "default_ms": c.default_ms,
                       "xla_partial": c.xla_partial} for c in result.calls]}
    if upstream_trials is not None and name in upstream.LAYERS and method == "composed":
        row["upstream"] = upstream.rows(name, row, T, upstream_trials, memory_gb)
    return row


def _ms(rows_step: dict, detail: dict, k: str) -> str:
    v = rows_step.get(k)
    if k not in detail:
        return "not run"
    if v is None or not math.isfinite(v):
        errors = [c["error"] for c in detail[k].get("calls", []) if "error" in c]
        return "no estimate: " + str(detail[k].get("error") or (errors or ["?"])[0])[:80]
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
           f"({d['glue']['cycles']} cycles, compiled in {d['glue']['compile_s']} s). Each call "
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
    for i, c in enumerate(d["calls"]):
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
                         else f"error: {f['error'][:60]}" if "error" in f else "-")
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
    return f"{v:.3f} (splash {f['splash']['ms']:.3f})"


def _attention_ms(r: dict, setting: str) -> float | None:
    """The step's attention under a setting: its forward call and backward call(s), or the
    forward compiled with XLA's VJP, each times its occurrences."""
    d = r["step_detail"]
    total, seen = 0.0, False
    for c, f in zip(d["calls"], d.get(setting, {}).get("calls", []), strict=False):
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
        vs_xla = f"{s['xla'] / tuned:.2f}x" if tuned and s.get("xla") else "-"
        out.append(f"| {r['title']} | {_ms(s, d, 'xla')} | {_upstream_cell(u, 'maxtext')} | "
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
             f"`{bench.script(__file__)}` on a CPU-only host, {bench.today()}.", "",
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--tokens", type=int, default=T, help="tokens per layer call")
    p.add_argument("--settings", nargs="*", default=list(step.SETTINGS),
                   choices=list(step.SETTINGS), help="whole-layer estimates to make")
    p.add_argument("--memory-gb", type=float, default=6.0,
                   help="address-space cap of the step's compile worker (0: none)")
    p.add_argument("--method", choices=["composed", "whole"], default="composed",
                   help="composed: the glue compiled whole plus each call alone (fits this "
                   "host); whole: the layer compiled whole")
    p.add_argument("--upstream", type=int, default=None, metavar="TRIALS",
                   help="also estimate the layer as MaxText runs it (splash attention, XLA "
                   "dots; whole compile), and with splash's blocks tuned in TRIALS trials "
                   "(0: MaxText's blocks only)")
    p.add_argument("--check-whole", nargs="*", default=None, choices=list(step.SETTINGS),
                   help="also compile these settings' layer whole, to check the composition")
    p.add_argument("--add-upstream", metavar="ROWS_JSON",
                   help="add the --upstream figures to the rows of an earlier --rows-out "
                   "(written back), then render them")
    p.add_argument("--splash-recorded", nargs=2, metavar=("MAXTEXT_JSON", "GRID_JSON"),
                   help="with --add-upstream: splash's costs from splash_grid.py records (MaxText's "
                   "blocks; a grid, its fastest pair as 'tuned') instead of estimating again")
    p.add_argument("--rows-out")
    p.add_argument("--combine", nargs="*")
    p.add_argument("--missing", nargs="*", default=[], help="notes on rows not run")
    p.add_argument("--out", default=bench.result("step_tuning.md"))
    a = p.parse_args()
    globals()["T"] = a.tokens  # The layers' argument shapes read it.
    if a.add_upstream:
        with open(a.add_upstream, encoding="utf-8") as f:
            part = json.load(f)
        for r in part["rows"]:
            if r["layer"] in upstream.LAYERS and r.get("method") == "composed":
                recorded = (dict(zip(("maxtext", "tuned"), a.splash_recorded, strict=True))
                            if a.splash_recorded else None)
                r["upstream"] = upstream.rows(r["layer"], r, r["tokens"], a.upstream or 0,
                                              a.memory_gb, recorded)
        part["command"] += f"; then {bench.command(__file__)}"
        with open(a.add_upstream, "w", encoding="utf-8") as f:
            json.dump(part, f, indent=1, default=str)
        text = render(part["rows"], [part["command"]], a.missing)
    elif a.combine:
        parts = []
        for path in a.combine:
            with open(path, encoding="utf-8") as f:
                parts.append(json.load(f))
        rows = [r for part in parts for r in part["rows"]]
        text = render(rows, [part["command"] for part in parts], a.missing)
    else:
        rows = []
        for name in a.only:
            print(f"== {name}", flush=True)
            rows.append(run(name, a.trials, a.settings, a.memory_gb, a.method, a.upstream,
                            a.check_whole))
            print(json.dumps(rows[-1]["step_ms"]), rows[-1]["tuning_wall_s"], flush=True)
            if a.rows_out:  # Each layer as it finishes.
                with open(a.rows_out, "w", encoding="utf-8") as f:
                    json.dump({"command": bench.command(__file__), "rows": rows}, f,
                              indent=1, default=str)
        text = render(rows, [bench.command(__file__)], a.missing)
    bench.write(a.out, text)


if __name__ == "__main__":
    main()
