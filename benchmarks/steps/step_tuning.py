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
  gate/up/down matmuls; forward, and jax.grad of its sum over the input and every weight
  (no jax.checkpoint unless --remat names a policy: the row's title says which).
- llama70b_fwd_bwd: one chip's shard of a Llama-3.1-70B decoder layer under 8-way tensor
  parallelism (d 8192, 8 of 64 query heads and 1 of 8 KV heads, fused gate|up of 2 x 3584), its
  all-reduces not counted; jax.grad as above.
- llama8b_tp8_fwd_bwd, llama70b_fsdp_fwd_bwd: one chip's program of sharded_step.py's TP8
  8B and FSDP 70B layers (``steps/sharded_layers.py``), its collectives left out; jax.grad.
- mixtral_fwd_bwd: one chip's shard of a Mixtral-8x7B decoder layer under 8-way tensor
  parallelism (d 4096, 4 of 32 query heads and 1 of 8 KV heads, every expert's 14336 columns
  split 8 ways: grouped_matmul for the fused w1|w3 and for w2, top-2 routing of T tokens into
  2T rows); jax.grad as above.
- mixtral_moe: a Mixtral-8x7B MoE MLP (d 4096, 8 experts of 14336, top-2; the router in plain
  JAX; tokens sorted by expert with fixed group sizes: 2048 tokens x 2 = 4096 rows, 512 each):
  grouped_matmul for gate, up and down.
- mamba2: a Mamba-2 2.7B mixer (d 2560, d_inner 5120, 80 heads of 64, d_state 128, 1 group):
  rms_norm, x/z in-projections (matmul), B/C/dt projections and the short conv in plain JAX,
  mamba2_ssd, gated output, out-projection (matmul).

    python benchmarks/steps/step_tuning.py [--only llama_fwd mamba2 ...] [--trials 4]
        [--tokens 2048] [--remat none|nothing_saveable|dots_saveable]
        [--method composed|whole] [--memory-gb 0] [--rows-out rows.json]
        [--combine a.json b.json] [--out benchmarks/results/step_tuning.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
from steps import layers, render, upstream  # noqa: E402

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


REMAT = "none"  # --remat: the jax.checkpoint policy of the training steps.


def llama_train(*a):
    return layers.train(layers.llama8b, remat=REMAT)(*a)


def llama_args():
    return layers.llama8b_args(T)


def llama70b_train(*a):
    return layers.train(layers.llama70b_tp8, remat=REMAT)(*a)


def llama70b_args():
    return layers.llama70b_tp8_args(T)


def _chip(model: str, layout: str):
    """One chip's program of a sharded layer (``steps/sharded_layers.py``) with its collectives
    left out: what ``sharded_step.py``'s 8-chip compile runs on each chip between them."""
    import functools

    from steps import sharded_layers as sl

    m = sl.MODELS[model]
    div = sl.CHIPS if layout == "tp8" else 1
    layer = functools.partial(sl.chip_layer, q_heads=m.q_heads // div,
                              kv_heads=m.kv_heads // div, reduce=lambda y: y)
    return (lambda *a: layers.train(layer, remat=REMAT)(*a),
            lambda: tuple(sl.chip_args(m, layout, T)))


def mixtral_train(*a):
    return layers.train(layers.mixtral_tp8, remat=REMAT)(*a)


def mixtral_args():
    return layers.mixtral_tp8_args(T)


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
    "llama8b_tp8_fwd_bwd": ("Llama-3.1-8B decoder layer, one chip of 8-way tensor parallelism "
                            "(steps/sharded_layers.py), forward+backward (jax.grad)",
                            *_chip("8b", "tp8")),
    "llama70b_fsdp_fwd_bwd": ("Llama-3.1-70B decoder layer, one chip's whole layer as under FSDP "
                              "(steps/sharded_layers.py), forward+backward (jax.grad)",
                              *_chip("70b", "fsdp")),
    "mixtral_fwd_bwd": ("Mixtral-8x7B decoder layer, one chip of 8-way tensor parallelism, "
                        "forward+backward (jax.grad)", mixtral_train, mixtral_args),
    "mixtral_moe": ("Mixtral-8x7B MoE MLP, forward", moe_layer, moe_args),
    "mamba2": ("Mamba-2 2.7B mixer, forward", mamba2_layer, mamba2_args),
}


def run(name: str, trials: int, settings: list[str], memory_gb: float, method: str,
        upstream_trials: int | None = None, check_whole: list[str] | None = None,
        save=lambda row: None) -> dict:
    """One layer's row; ``save(row)`` once its own figures exist, before the upstream ones
    (a failure there, after an hour of compiles, must not lose them)."""
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
    grad = name.endswith("_bwd")
    remat = f", jax.checkpoint({REMAT})" if grad and REMAT != "none" else (
        ", no rematerialization" if grad else "")
    row = {"layer": name, "title": f"{title}, {T} tokens{remat} ({method})", "remat": REMAT,
            "tuning_wall_s": round(wall, 1), "method": method, "tokens": T,
            "step_wall_s": step_wall, "whole": whole,
            "step_ms": result.step_ms, "step_timer": result.step_timer,
            "step_detail": result.step_detail,
            "calls": [{"kernel": c.kernel.rsplit(".", 1)[-1], "key": c.key, "source": c.source,
                       "implementation": c.implementation, "config": c.config,
                       "best_ms": c.best_ms, "xla_ms": c.xla_ms, "default_ms": c.default_ms,
                       "xla_partial": c.xla_partial} for c in result.calls]}
    if upstream_trials is not None and name in upstream.LAYERS and method == "composed":
        save(row)
        try:
            row["upstream"] = upstream.rows(name, row, T, upstream_trials, memory_gb)
        except (pt.PallasTuneError, RuntimeError) as e:  # Seen: splash's backward at 32768
            why = f"{type(e).__name__}: {str(e)[:600]}"  # tokens, no config estimable here.
            row["upstream"] = {k: {"ms": None, "detail": {"error": why}}
                               for k in ("maxtext", "tuned")}
    return row


def _read_all(paths: list[str]) -> list[dict]:
    parts = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            parts.append(json.load(f))
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="*", default=list(LAYERS), choices=list(LAYERS))
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--remat", choices=list(layers.REMAT), default="none",
                   help="the training steps under jax.checkpoint with this policy (none: every "
                   "residual kept)")
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
    p.add_argument("--merge-settings", nargs="*", metavar="ROWS_JSON",
                   help="merge runs of the same layers under different --settings into one "
                   "row each (written to --rows-out), then render them")
    p.add_argument("--missing", nargs="*", default=[], help="notes on rows not run")
    p.add_argument("--out", default=bench.result("step_tuning.md"))
    a = p.parse_args()
    globals()["T"] = a.tokens  # The layers' argument shapes read it.
    globals()["REMAT"] = a.remat
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
        text = render.render(part["rows"], [part["command"]], a.missing)
    elif a.merge_settings:
        merged = render.merge_settings(_read_all(a.merge_settings))
        if a.rows_out:
            with open(a.rows_out, "w", encoding="utf-8") as f:
                json.dump(merged, f, indent=1, default=str)
        text = render.render(merged["rows"], [merged["command"]], a.missing)
    elif a.combine:
        parts = _read_all(a.combine)
        rows = [r for part in parts for r in part["rows"]]
        text = render.render(rows, [part["command"] for part in parts], a.missing)
    else:
        rows = []

        def save(row: dict | None = None) -> None:  # Each layer as it finishes, or sooner.
            if a.rows_out:
                with open(a.rows_out, "w", encoding="utf-8") as f:
                    json.dump({"command": bench.command(__file__),
                               "rows": rows + ([row] if row else [])}, f, indent=1, default=str)

        for name in a.only:
            print(f"== {name}", flush=True)
            rows.append(run(name, a.trials, a.settings, a.memory_gb, a.method, a.upstream,
                            a.check_whole, save))
            print(json.dumps(rows[-1]["step_ms"]), rows[-1]["tuning_wall_s"], flush=True)
            save()
        text = render.render(rows, [bench.command(__file__)], a.missing)
    bench.write(a.out, text)


if __name__ == "__main__":
    main()
