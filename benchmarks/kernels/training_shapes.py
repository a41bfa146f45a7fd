"""Training shapes, forward and backward: XLA vs upstream vs tuned, v6e compiler ESTIMATES.

Every shipped kernel with a Pallas backward (matmul, grouped matmul, flash attention, HSTU
attention, linear attention) on the training shape sets below (HSTU and linear attention: their
own sets, search_spaces/hstu_attention.toml and linear_attention.toml): per shape a forward row and a backward row, each compiled
deviceless for TPU v6e with libtpu, each program's static cycle estimate converted at the chip
clock (as in benchmarks/kernels/model_shapes.py, whose helpers this reuses):

- XLA: forward, the kernel's plain-JAX ``*_reference``; backward, XLA's gradient: ``jax.vjp`` of
  that reference at the same arguments for the same cotangent (benchmarks/kernels/xla_gradient.py,
  what ``backward="xla"`` runs). "partial": libtpu gave some fusions no estimate (a lower bound).
- upstream default: JAX's own Pallas kernel with its default blocks, where JAX has one. Forward
  as in model_shapes.py; backward, the gradient adapters of pallas_tune/kernels/upstream.py with
  their default (upstream's) backward blocks: flash attention's dK/dV and dQ kernels
  (``upstream.flash_attention_bwd``, K/V passed with every query head: no GQA upstream) and
  megablox's gmm against rhsᵀ plus tgmm (``upstream.megablox_gmm_bwd``). JAX has no Pallas
  matmul.
- tuned: the config in the v6e estimate caches (user cache directory, then the shipped
  ``caches/tpu_v6e``). Backward: the backward kernel's own entry (``matmul_bwd``,
  ``grouped_matmul_bwd``, ``flash_attention_bwd``) for the arguments ``backward_call`` builds
  from the forward shape, the key ``pallas-tune sweep --space SET --grad`` writes. Estimated
  again here, so every column comes from the same run; "not tuned (no cache entry)" otherwise.
- roofline: max(FLOPs / 918 TFLOP/s, bytes / 1.64 TB/s) over the tuned estimate. FLOPs are
  useful ones: a forward's (causal attention counts the lower triangle), for a backward 2x the
  forward's for the matmuls (dX and dW) and 2.5x for attention (dS, dQ, dK, dV and the
  recomputed S). Bytes: a backward reads its arguments (residuals and cotangent) and writes the
  cotangent of each float input, once.
- against XLA: where the tuned kernel stands against XLA on that row, XLA's wins included.

Every figure is a COMPILER ESTIMATE, not a measurement.

    python benchmarks/kernels/training_shapes.py [--only llama3_training_matmul ...]
        [--max-shapes N]
        [--indices I ...] [--passes forward backward] [--skip-xla [SET ...]] [--memory-gb G]
        [--recorded]
        [--rows-out part.json] [--out benchmarks/results/training_shapes.md]
    python benchmarks/kernels/training_shapes.py --combine part1.json part2.json --out ...

``--recorded`` compiles nothing: each row is read from the cache entries (the tuned config's
and XLA's estimates as the tuner recorded them, with the entry's libtpu version; a figure from
an older libtpu than the newest in the table is marked ‡).

``--skip-xla`` with no set skips every XLA program (the 8192-token ones take minutes and
gigabytes each on a CPU host); such cells read "not run (--skip-xla ...)".
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import model_shapes as ms  # noqa: E402  (sets JAX_PLATFORMS=cpu unless set)
from xla_gradient import xla_gradient  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from pallas_tune import cli  # noqa: E402
from pallas_tune._refs import kernel_ref  # noqa: E402
from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.measure.estimate import Estimator  # noqa: E402
from pallas_tune.space import load_space  # noqa: E402
from pallas_tune.tuning.grad import backward_call  # noqa: E402

TITLE = ("Training shapes on TPU v6e, forward and backward: compiler ESTIMATES, not "
         "measurements")
SETS = [("llama3_training_matmul", None), ("mixtral_training_grouped_matmul", None),
        ("llama3_training_attention", None), ("hstu_attention", None),
        ("linear_attention", None)]
# A backward's useful FLOPs per forward FLOP: dX and dW for the matmuls; dS = P∘(dO Vᵀ - δ),
# dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q and S recomputed (5 products to the forward's 2); HSTU's
# the same five (dP = g Vᵀ in place of dO Vᵀ, no δ); linear attention: its recurrence's two
# products per token (kᵀ v, q S), each differentiated (the passes' recomputation not counted).
BACKWARD_FLOPS = {"matmul": 2.0, "grouped_matmul": 2.0, "flash_attention": 2.5,
                  "hstu_attention": 2.5, "linear_attention": 2.0}
PASSES = ("forward", "backward")


def backward_roofline(name, args, kwargs, bwd_args) -> tuple[float, float]:
    """(useful FLOPs, bytes) of the backward of ``name(*args, **kwargs)``, whose backward kernel
    takes ``bwd_args``: it reads those and writes a cotangent per float input of the forward."""
    flops, _ = ms.roofline(name, args, kwargs)
    written = [a for a in args if hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact)]
    return BACKWARD_FLOPS[name] * flops, ms._nbytes(*bwd_args) + ms._nbytes(*written)


def upstream_backward(name, bwd_args, bwd_kwargs):
    """(tunable, args, kwargs, config, label) of JAX's own gradient kernels for this op with
    their default blocks, or None."""
    from pallas_tune.kernels import upstream as up

    if name == "flash_attention":
        q, k, _, o, lse, do = bwd_args
        full = ms.S(q.shape[:2] + k.shape[2:], k.dtype)  # No GQA upstream, as in the forward.
        # Upstream's residuals l and m ((batch, heads, q_len) f32) stand where lse does.
        return (up.flash_attention_bwd, [q, full, full, o, lse, lse, do], bwd_kwargs,
                dict(up.flash_attention_bwd.space.default),
                "jax flash_attention backward (dK/dV and dQ kernels), default blocks")
    if name == "grouped_matmul":
        return (up.megablox_gmm_bwd, bwd_args, bwd_kwargs,
                dict(up.megablox_gmm_bwd.space.default),
                "megablox gmm (against rhsᵀ) + tgmm, default tiling")
    return None


def standing(row) -> str:
    """Where the tuned kernel stands against XLA on this row, in words."""
    x, t = row.get("xla_ms"), row.get("tuned_ms")
    if t is None:
        return "not tuned" if row.get("config") is None else "no tuned estimate"
    if x is None:
        return "XLA not estimated"
    if row.get("xla_partial"):  # XLA's figure is a lower bound on its time.
        return (f"tuned ≥{x / t:.2f}x faster (XLA partial)" if x >= t
                else "undecided (XLA partial, below tuned)")
    if abs(x / t - 1) < 0.01:
        return "on par with XLA (within 1%)"
    return f"tuned {x / t:.2f}x faster" if x > t else f"XLA {t / x:.2f}x faster"


def recorded_xla(kernel, key, clock, fresh):
    """``fresh`` (this run's XLA estimate), or, where its compile failed in this host's worker,
    the XLA estimate the tuner recorded in the cache entry for ``key`` when both came from the
    libtpu now installed (the same compiler's figure for the same program: tuning estimates
    the reference, and for a backward ``jax.vjp`` of it, in a 12 GB worker); else ``fresh``."""
    from importlib import metadata

    from pallas_tune.measure.estimate import EstimateResult

    if fresh is None or fresh.ok:
        return fresh, ""
    found = kernel.cache.lookup("tpu_v6e", kernel.name, key)
    entry = found[0] if found else {}
    versions = entry.get("provenance", {}).get("versions", {})
    libtpu = versions.get("libtpu") if isinstance(versions, dict) else None
    if not entry.get("xla_ms") or libtpu != metadata.version("libtpu"):
        return fresh, ""
    cycles = round(entry["xla_ms"] * clock / 1e3)
    return EstimateResult(ok=True, kind="ok", cycles=cycles,
                          ops_without_estimate=int(entry.get("xla_partial", 0))), (
        f"XLA: the tuner's estimate recorded in the entry (this run's compile: {fresh.kind})")


def backward_row(est, name, kernel, args, kwargs, clock, skip_xla=False):
    bwd = kernel.backward
    bwd_args, bwd_kwargs = backward_call(kernel, args, kwargs, 0)  # As `sweep --grad` makes them.
    key = bwd.cache_key(*bwd_args, **bwd_kwargs)
    tuned_cfg = ms.cached_config(bwd, key)
    g = bwd_args[-1]  # Each backward kernel takes the output's cotangent last.
    xla = None if skip_xla else est.map(
        xla_gradient, [*args, g], {**kwargs, "forward": kernel_ref(kernel.reference)}, [{}],
        "tpu_v6e", standin=False)[0]
    up = upstream_backward(name, bwd_args, bwd_kwargs)
    up_r = est.map(up[0], up[1], up[2], [up[3]], "tpu_v6e")[0] if up else None
    tuned = est.map(bwd, bwd_args, bwd_kwargs, [tuned_cfg], "tpu_v6e")[0] if tuned_cfg else None
    xla, note = recorded_xla(bwd, key, clock, xla)
    row = ms.make_row(name, kernel.cache_key(*args, **kwargs), clock, xla=xla, up=up_r,
                      up_label=up[4] if up else "—", tuned=tuned, tuned_cfg=tuned_cfg,
                      roof=backward_roofline(name, args, kwargs, bwd_args), skip_xla=skip_xla)
    if note:
        row["xla"] += " (recorded)"
        row["notes"] = "; ".join(filter(None, [note, row["notes"]]))
    return {**row, "backward_kernel": bwd.name, "backward_key": key}


def _xla_failure(path, key):
    """Why an entry has no XLA figure, from its ledger record (the tuner moves a long XLA row
    there): the compile's failure, or that XLA was not estimated when it was tuned."""
    import json
    import os

    ledger = os.fspath(path).removesuffix(".json") + ".trials.jsonl"
    xla = None
    try:
        with open(ledger, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                if record.get("key") == key:
                    xla = record.get("provenance", {}).get("xla")
    except (OSError, ValueError):
        pass
    if not isinstance(xla, dict) or "error" not in xla:
        return "not estimated when tuned"
    error = str(xla["error"])
    why = ("the worker's memory cap" if "mmap error" in error or "SIGSEGV" in error
           else "HBM" if "HbmOom" in error
           else "the worker died: a libtpu abort" if "the worker died" in error
           else error.splitlines()[0][:40])
    return f"compile fails ({why})"


def recorded_row(name, kernel, args, kwargs, clock, backward):
    """A row from the v6e estimate cache entries alone, no compile (``--recorded``): the tuned
    config's and XLA's estimates as the tuner recorded them beside the winner (the same
    timer, the same programs as the columns above, made when the entry was tuned). A figure
    recorded with another libtpu than the newest in the rows is marked ‡ (see render)."""
    import math

    from pallas_tune.measure.estimate import EstimateResult

    k, a, kw = kernel, args, kwargs
    if backward:
        k = kernel.backward
        a, kw = backward_call(kernel, args, kwargs, 0)
    found = k.cache.lookup("tpu_v6e", k.name, k.cache_key(*a, **kw))
    entry = found[0] if found else {}

    def figure(value, partial=0):
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return EstimateResult(ok=True, kind="ok", cycles=round(value * clock / 1e3),
                              ops_without_estimate=int(partial or 0))

    roof = backward_roofline(name, args, kwargs, a) if backward else ms.roofline(name, args,
                                                                                 kwargs)
    xla = figure(entry.get("xla_ms"), entry.get("xla_partial"))
    row = ms.make_row(name, kernel.cache_key(*args, **kwargs), clock, xla=xla, up=None,
                      up_label="not run (--recorded)", tuned=figure(entry.get("median_ms")),
                      tuned_cfg=dict(entry["config"]) if entry else None, roof=roof)
    versions = entry.get("provenance", {}).get("versions", {})
    row.update(upstream="not run (--recorded)", implementation=entry.get("implementation"),
               libtpu=versions.get("libtpu") if isinstance(versions, dict) else None,
               date=str(entry.get("provenance", {}).get("date", ""))[:10])
    if entry and xla is None:
        row["xla"] = _xla_failure(found[1], k.cache_key(*a, **kw))
    if backward:
        row.update(backward_kernel=k.name, backward_key=k.cache_key(*a, **kw))
    return row


def render(rows, header: str) -> str:
    versions = sorted({r["libtpu"] for r in rows if r.get("libtpu")})
    newest = versions[-1] if versions else None

    def tuned(r):  # ‡: a recorded figure from an older libtpu than the newest in the table.
        return r["tuned"] + (" ‡" if r.get("libtpu") not in (None, newest) else "")

    lines = [header, ""] + bench.table(
        ["kernel", "pass", "shape (forward's cache key)", "XLA ms", "upstream default ms",
         "tuned ms", "XLA/tuned", "upstream/tuned", "roofline (tuned)", "bound", "against XLA",
         "tuned config"], rows,
        lambda r: [r["kernel"], r["pass"], ms._short(r["shape"]), r["xla"], r["upstream"],
                   tuned(r), r["xla_ratio"], r["up_ratio"], r["roofline"], r["bound"],
                   standing(r), ms.config_cell(r)])
    lines += ["", "Upstream default per kernel and pass:"]
    for (name, p), label in dict(((r["kernel"], r["pass"]), r["upstream_label"])
                                 for r in rows).items():
        lines.append(f"- {name} {p}: " + (label if label != "—" else "none (JAX ships no "
                                                                     "Pallas kernel for it)"))
    backward = sorted({f"{r['kernel']} → {r['backward_kernel']}" for r in rows
                       if r.get("backward_kernel")})
    if backward:
        lines += ["", "Tuned backward kernels (each with its own cache entries): "
                  + ", ".join(backward) + "."]
    if versions:
        older = sorted({f"libtpu {r['libtpu']} ({r['date']})" for r in rows
                        if r.get("libtpu") not in (None, newest)})
        lines += ["", "Recorded rows (`--recorded`): the tuned config's and XLA's estimates as "
                  f"the tuner wrote them into each entry, libtpu {newest}"
                  + (f"; ‡: recorded with {', '.join(older)}" if older else "") + "."]
    notes = [f"- {r['kernel']} {r['pass']} {ms._short(r['shape'])}: "
             + " ".join(r["notes"].split()) for r in rows if r["notes"]]
    if notes:
        lines += ["", "Figures the compiler did not give (messages shortened):", *notes]
    return "\n".join(lines) + "\n"


def _shapes(space_name, loaded, a):
    shapes = loaded["shapes"]
    if a.indices:
        shapes = [shapes[i] for i in a.indices if i < len(shapes)]
    return ms.smoke_shapes(space_name, shapes[: a.max_shapes])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    ms.add_run_arguments(p, "shape sets of SETS (e.g. llama3_training_matmul)",
                         ["llama3_training_matmul"])
    p.add_argument("--indices", nargs="+", type=int,
                   help="only these shapes (0-based, in each set's file order)")
    p.add_argument("--passes", nargs="+", choices=PASSES, default=list(PASSES))
    p.add_argument("--memory-gb", type=float, default=0,
                   help="cap each compile worker's memory (GB; 0: host memory less a reserve)")
    p.add_argument("--recorded", action="store_true",
                   help="rows from the cache entries' recorded estimates, no compile")
    a = p.parse_args()
    if a.combine:
        ms.combine(a.combine, a.out, title=TITLE, sets=SETS, render_fn=render)
        return
    if not bench.have_libtpu():
        return
    skip_all = a.skip_xla == []  # A bare --skip-xla: every set.
    extra = ((" --indices " + " ".join(map(str, a.indices)) if a.indices else "")
             + (" --passes " + " ".join(a.passes) if a.passes != list(PASSES) else "")
             + (" --skip-xla" if skip_all else "") + (" --recorded" if a.recorded else ""))
    command = ms.run_command(__file__, a, extra)
    clock = chip_spec("v6e").clock_hz
    t0 = time.perf_counter()
    rows = []
    cap = int(a.memory_gb * (1 << 30)) if a.memory_gb else -1
    with Estimator(a.workers, memory_limit_bytes=cap) as est:
        for space_name, _ in SETS:
            if a.only and space_name not in a.only:
                continue
            loaded = load_space(space_name)
            kernel = cli._load_kernel(loaded["kernel"])
            name = kernel.fn.__name__
            skip = skip_all or space_name in a.skip_xla
            for shape in _shapes(space_name, loaded, a):
                spec = cli._spec_items(shape)
                for pass_ in a.passes:
                    if a.recorded:
                        args, kwargs = cli.build_call(kernel, spec)
                        row = recorded_row(name, kernel, args, kwargs, clock,
                                           pass_ == "backward")
                    elif pass_ == "forward":
                        row = ms._row(est, name, kernel, spec, clock, skip_xla=skip)
                    else:
                        args, kwargs = cli.build_call(kernel, spec)
                        row = backward_row(est, name, kernel, args, kwargs, clock, skip)
                    row.update({"set": space_name, "pass": pass_})
                    rows.append(row)
                    if a.rows_out:  # After every row: a run cut short keeps what it did.
                        ms.save_rows(a.rows_out, rows, command, t0)
                    print(f"{name:16s} {pass_:8s} {ms._short(row['shape'])[:60]:60s} XLA "
                          f"{row['xla'][:24]:>24s} upstream {row['upstream']:>16s} tuned "
                          f"{row['tuned'][:26]:>26s} roofline {row['roofline']}; "
                          f"{standing(row)}", flush=True)
    ms.finish(rows, a, command, t0, TITLE, render)


if __name__ == "__main__":
    main()
