"""The kernels the field tunes, on the shapes of real models: XLA vs upstream vs tuned, v6e.

For every kernel and model shape in the shape sets below, one run compiles deviceless for TPU
v6e with libtpu and converts each program's static cycle estimate at the chip clock:

- XLA: the kernel's plain-JAX ``*_reference`` (what XLA makes of the same math). "partial"
  marks programs where libtpu gave some fusions no LLO estimate (a lower bound).
- upstream default: JAX's own Pallas kernel for the op, with its default blocks, where JAX has
  one (flash attention: K/V passed with every query head, as it has no GQA; grouped matmul:
  megablox; the decode kernels: their adapters' upstream defaults).
- tuned: the config in the estimate caches (user, then shipped ``caches/tpu_v6e``), estimated
  again here, so every column comes from the same run.
- roofline: max(FLOPs / 918 TFLOP/s, bytes / 1.64 TB/s) for the problem itself (useful FLOPs:
  causal attention counts the lower triangle; bytes: each operand read and the output written
  once), divided by the tuned estimate.

Every figure is a COMPILER ESTIMATE, not a measurement. "no estimate" is printed where libtpu
gives none, or where the kernel loops over run-time lengths (see measure/estimate.py), and a
compile failure is printed as such.

    python benchmarks/kernels/model_shapes.py [--only mamba2_ssd hstu_attention ...] [--workers 1]
        [--max-shapes N] [--rows-out part.json] [--out benchmarks/results/model_shapes.md]
    python benchmarks/kernels/model_shapes.py --combine part1.json part2.json --out ...

``--rows-out`` saves the rows of a run (several runs over disjoint sets may then go in
parallel); ``--combine`` renders saved rows into one table, each part's command in the header.
Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the ``matmul`` set at one small shape (SMOKE_SHAPES);
the table printed.
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_tune import cli  # noqa: E402
from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402
from pallas_tune.space import load_space  # noqa: E402

PEAK_FLOPS, PEAK_BYTES = 918e12, 1.64e12  # v6e bf16, HBM.
S = jax.ShapeDtypeStruct

# (space file, indices of its [[shapes]] to include (None: all)).
SETS = [
    # 2048-token rows only for the matmuls: XLA's own 8192-token programs take minutes and
    # gigabytes each to estimate on the CPU host (the shipped caches hold the tuned ones).
    ("matmul", [5, 6]), ("llama3_matmul", [0, 1, 2, 3]),
    ("flash_attention", [1, 2, 3]), ("llama3_flash_attention", None),
    ("grouped_matmul", None), ("mixtral_grouped_matmul", None),
    ("paged_attention", None), ("ragged_paged_attention", [0]),
    ("mamba2_ssd", None), ("hstu_attention", None),
]
# Smoke runs: a set's shapes replaced by one tiny shape (a set not here keeps its first shape).
SMOKE_SHAPES = {"matmul": {"x": "1024x1024:bfloat16", "y": "1024x1024:bfloat16"},  # Tuned.
                "llama3_training_matmul": {"x": "256x256:bfloat16", "y": "256x256:bfloat16"},
                "mixtral_training_grouped_matmul": {"lhs": "512x256:bfloat16",
                                                    "rhs": "4x256x256:bfloat16",
                                                    "group_sizes": "4:int32"}}


def smoke_shapes(space_name: str, shapes: list) -> list:
    """``shapes``, or in a smoke run the set's tiny shape where it has one."""
    tiny = SMOKE_SHAPES.get(space_name)
    return [tiny] if bench.SMOKE and tiny else shapes


SEEDS = {
    "flash_attention": "flash attention 1.41x (Autocomp); splash 1.15-1.38x (Medusa)",
    "ragged_paged_attention": "1.10x (Autocomp)",
    "mamba2_ssd": "4.37x (Autocomp)",
    "hstu_attention": "1.16-1.69x (Medusa)",
}


def _nbytes(*arrays) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def _attention(b, hq, sq, sk, d, causal):
    pairs = sq * (sq + 1) / 2 if causal else sq * sk
    return 4.0 * b * hq * pairs * d


def roofline(name, args, kwargs) -> tuple[float, float]:
    """(useful FLOPs, bytes) of the problem, independent of any tiling."""
    if name == "matmul":
        x, y = args
        return 2.0 * x.shape[0] * x.shape[1] * y.shape[1], _nbytes(x, y, S((x.shape[0],
                                                                           y.shape[1]), x.dtype))
    if name in ("flash_attention", "hstu_attention"):
        q, k, v = args[:3]
        causal = kwargs.get("causal", True) if name == "flash_attention" else True
        return (_attention(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], causal),
                _nbytes(*args) + _nbytes(q))
    if name == "grouped_matmul":
        lhs, rhs, _ = args
        out = S((lhs.shape[0], rhs.shape[2]), lhs.dtype)
        return 2.0 * lhs.shape[0] * lhs.shape[1] * rhs.shape[2], _nbytes(lhs, rhs, out)
    if name == "paged_attention":
        q, k_pages, _, _, pages = args
        ctx = pages.shape[1] * k_pages.shape[2]
        kv = 2 * q.shape[0] * k_pages.shape[0] * ctx * q.shape[2] * k_pages.dtype.itemsize
        return 4.0 * q.shape[0] * q.shape[1] * ctx * q.shape[2], kv + 2 * _nbytes(q)
    if name == "ragged_paged_attention":  # The tuning batch: decodes, then prefill chunks.
        q, kv_pages, _, pages, _, _ = args
        ctx = pages.shape[1] * kv_pages.shape[1]
        seqs = min(pages.shape[0], q.shape[0])
        kv = seqs * ctx * kv_pages.shape[2] * q.shape[2] * kv_pages.dtype.itemsize
        return 4.0 * q.shape[0] * q.shape[1] * ctx * q.shape[2], kv + 2 * _nbytes(q)
    if name == "linear_attention":  # The recurrence: per token and head, S += kᵀ v, o = q S.
        q, k, v = args
        b, h, t, d = q.shape
        return 4.0 * b * h * t * d * v.shape[3], _nbytes(*args) + _nbytes(v)
    if name == "mamba2_ssd":  # The recurrence: per token and head, dt B xᵀ, decay, C S.
        x, dt, A, B, C, D = args
        b, t = x.shape[:2]
        h = A.shape[0]
        n = B.shape[2] // kwargs.get("groups", 1)
        return 6.0 * b * t * h * n * (x.shape[2] // h), _nbytes(*args) + _nbytes(x)
    raise KeyError(name)


def upstream(name, kernel, args, kwargs):
    """(tunable, args, kwargs, config, label) of JAX's own kernel for this op, or None."""
    from pallas_tune.kernels import upstream as up
    from pallas_tune.kernels import upstream_decode as ud

    if name == "flash_attention":
        q, k, v = args
        full = S(q.shape[:2] + k.shape[2:], k.dtype)  # No GQA upstream: one KV head per q head.
        return (up.flash_attention, [q, full, full], kwargs,
                dict(up.flash_attention.space.default), "jax flash_attention, default blocks")
    if name == "grouped_matmul":
        return (up.megablox_gmm, args, kwargs, dict(up.megablox_gmm.space.default),
                "megablox gmm, default tiling")
    if name == "paged_attention":
        cfg = dict(kernel.space.default, inline_seq_dim=True)
        return kernel, args, kwargs, cfg, "16 pages/block (vLLM), inline_seq_dim=True (JAX)"
    if name == "ragged_paged_attention":
        bkv, bq = ud.rpa_default_blocks(args[0], args[1], args[3])
        cfg = dict(num_kv_pages_per_block=bkv, num_queries_per_block=bq, vmem_limit_bytes=None)
        return kernel, args, kwargs, cfg, f"({bkv}, {bq}) from JAX's table/default"
    return None


def _fmt_ms(r, clock) -> str:
    if r is None:
        return "—"
    if not r.ok:
        if r.kind == "no_estimate":
            return "no estimate"
        return f"compile fails ({r.kind})"
    ms = cycles_to_ms(r.cycles, clock)
    return f"{ms:.4f}" + (" partial" if r.ops_without_estimate else "")


def _ms(r, clock):
    return cycles_to_ms(r.cycles, clock) if r is not None and r.ok else None


def cached_config(kernel, key):
    """The config of ``kernel``'s v6e estimate cache entry for ``key`` (user cache directory,
    then the shipped caches/tpu_v6e), or None."""
    found = kernel.cache.lookup("tpu_v6e", kernel.name, key)
    return dict(found[0]["config"]) if found else None


SKIPPED_XLA = "not run (--skip-xla: its compile is too slow or too big for the CPU host)"


def _row(est, name, kernel, spec_str, clock, skip_xla=False):
    args, kwargs = cli.build_call(kernel, spec_str)
    key = kernel.cache_key(*args, **kwargs)
    tuned_cfg = cached_config(kernel, key)
    xla = None if skip_xla else est.map(kernel.reference, args, kwargs, [{}], "tpu_v6e",
                                        standin=False)[0]
    up = upstream(name, kernel, args, kwargs)
    up_r = est.map(up[0], up[1], up[2], [up[3]], "tpu_v6e")[0] if up else None
    tuned = est.map(kernel, args, kwargs, [tuned_cfg], "tpu_v6e")[0] if tuned_cfg else None
    return make_row(name, key, clock, xla=xla, up=up_r, up_label=up[4] if up else "—",
                    tuned=tuned, tuned_cfg=tuned_cfg, roof=roofline(name, args, kwargs),
                    skip_xla=skip_xla)


def make_row(name, key, clock, *, xla, up, up_label, tuned, tuned_cfg, roof, skip_xla=False):
    """One table row from the three estimates (None: not run) and the problem's (FLOPs,
    bytes); the times in ms are kept beside their printed forms."""
    flops, nbytes = roof
    floor_ms = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES) * 1e3
    t_ms, x_ms, u_ms = _ms(tuned, clock), _ms(xla, clock), _ms(up, clock)

    def ratio(a, lower_bound=False):
        return ("≥" if lower_bound else "") + (f"{a / t_ms:.2f}x" if a and t_ms else "—")

    return {
        "kernel": name, "shape": key,
        "xla": SKIPPED_XLA if skip_xla else _fmt_ms(xla, clock), "upstream": _fmt_ms(up, clock),
        "upstream_label": up_label,
        "tuned": _fmt_ms(tuned, clock) if tuned_cfg else "not tuned (no cache entry)",
        "config": tuned_cfg, "xla_ratio": ratio(x_ms, bool(xla and xla.ops_without_estimate)),
        "up_ratio": ratio(u_ms),
        "roofline": (f"{floor_ms / t_ms:.1%}" + (" †" if floor_ms > t_ms else "")) if t_ms
        else "—",
        "bound": "compute" if flops / PEAK_FLOPS > nbytes / PEAK_BYTES else "memory",
        "seed": SEEDS.get(name, "—"),
        "notes": "; ".join(f"{k}: {r.message[:160]}" for k, r in (("XLA", xla), ("upstream", up),
                           ("tuned", tuned)) if r is not None and not r.ok),
        "xla_ms": x_ms, "upstream_ms": u_ms, "tuned_ms": t_ms,
        "xla_partial": bool(xla and xla.ok and xla.ops_without_estimate),
    }


def _short(key: str) -> str:
    parts = [p for p in key.split(",") if "=null" not in p]
    return ", ".join(parts)


def config_cell(r) -> str:
    return ", ".join(f"{k}={v}" for k, v in r["config"].items()) if r["config"] else "—"


def render(rows, header: str) -> str:
    lines = [header, ""] + bench.table(
        ["kernel", "shape (cache key)", "XLA ms", "upstream default ms", "tuned ms", "XLA/tuned",
         "upstream/tuned", "roofline (tuned)", "bound", "seeds' speedup", "tuned config"], rows,
        lambda r: [r["kernel"], _short(r["shape"]), r["xla"], r["upstream"], r["tuned"],
                   r["xla_ratio"], r["up_ratio"], r["roofline"], r["bound"], r["seed"],
                   config_cell(r)])
    lines += ["", "Upstream default per kernel:"]
    for name, label in dict((r["kernel"], r["upstream_label"]) for r in rows).items():
        lines.append(f"- {name}: {label}")
    notes = [f"- {r['kernel']} {_short(r['shape'])}: " + " ".join(r["notes"].split())
             for r in rows if r["notes"]]
    if notes:
        lines += ["", "Figures the compiler did not give (messages shortened):", *notes]
    return "\n".join(lines) + "\n"


TITLE = "Model shapes on TPU v6e: compiler ESTIMATES, not measurements"
_UNITS = ("Times are libtpu's static cycle estimates at 1.75 GHz; roofline: 918 TFLOP/s bf16, "
          "1.64 TB/s HBM; † marks a tuned estimate faster than the HBM roofline (the compiler's "
          "HBM model is optimistic: see notes/libtpu-static-cost.md, 2.3-3.4 TB/s in its copy "
          "estimates). See the module docstring for each column.")


def add_run_arguments(p: argparse.ArgumentParser, sets_help: str, smoke_only: list[str]) -> None:
    """The options every estimate table's script takes (this one's and training_shapes');
    ``smoke_only``: the sets a smoke run (``PALLAS_TUNE_BENCH_SMOKE=1``) takes, one shape each."""
    p.add_argument("--only", nargs="+", help=sets_help, default=bench.smoke(None, smoke_only))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--max-shapes", type=int, default=bench.smoke(None, 1),
                   help="the first N shapes of each set")
    p.add_argument("--out", default=None, help="also write the table (markdown) here")
    p.add_argument("--rows-out", default=None, help="save this run's rows (JSON) here")
    p.add_argument("--skip-xla", nargs="*", default=(),
                   help="space files whose XLA reference is not compiled (too big for the host)")
    p.add_argument("--combine", nargs="+", help="render rows saved by --rows-out runs")


def run_command(script: str, a: argparse.Namespace, extra: str = "") -> str:
    """The command line of this run of the script ``script`` (a path), as the table's header
    and the saved rows give it."""
    return (bench.command(script, [], env="JAX_PLATFORMS=cpu")
            + (" --only " + " ".join(a.only) if a.only else "")
            + (f" --max-shapes {a.max_shapes}" if a.max_shapes else "") + extra
            + (f" --rows-out {a.rows_out}" if a.rows_out else "")
            + (" --skip-xla " + " ".join(a.skip_xla) if a.skip_xla else ""))


def run_header(title: str, command: str, elapsed: float) -> str:
    return (f"# {title}\n\n`$ {command}` — {bench.today()}, jax {jax.__version__}, libtpu "
            f"{bench.version('libtpu', '?')}, {elapsed:.0f} s on a shared {os.cpu_count()}-core "
            f"CPU host (no TPU). {_UNITS}")


def finish(rows, a: argparse.Namespace, command: str, t0: float, title: str = TITLE,
           render_fn=render) -> None:
    """Saves the rows (``--rows-out``), renders the table, writes it (``--out``)."""
    elapsed = time.perf_counter() - t0
    if a.rows_out:
        save_rows(a.rows_out, rows, command, t0)
    bench.write(a.out, render_fn(rows, run_header(title, command, elapsed)), echo=bench.SMOKE)
    print(f"\n{elapsed:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_run_arguments(p, "space files of SETS (e.g. mamba2_ssd llama3_matmul)", ["matmul"])
    p.add_argument("--all-shapes", action="store_true",
                   help="every shape of each set, not only the picks of SETS (e.g. the 8192-token "
                        "matmuls, with --skip-xla for them)")
    a = p.parse_args()
    if a.combine:
        combine(a.combine, a.out)
        return
    if not bench.have_libtpu():
        return
    clock = chip_spec("v6e").clock_hz
    t0 = time.perf_counter()
    command = run_command(__file__, a, " --all-shapes" if a.all_shapes else "")
    rows = []
    with Estimator(a.workers) as est:
        for space_name, picks in SETS:
            loaded = load_space(space_name)
            kernel = cli._load_kernel(loaded["kernel"])
            name = kernel.fn.__name__
            if a.only and space_name not in a.only:
                continue
            shapes = (loaded["shapes"] if picks is None or a.all_shapes
                      else [loaded["shapes"][i] for i in picks])
            for shape in smoke_shapes(space_name, shapes[: a.max_shapes]):
                row = _row(est, name, kernel, cli._spec_items(shape), clock,
                           skip_xla=space_name in a.skip_xla)
                row["set"] = space_name
                rows.append(row)
                if a.rows_out:  # After every row: a run cut short keeps what it did.
                    save_rows(a.rows_out, rows, command, t0)
                print(f"{name:24s} {_short(row['shape'])[:70]:70s} XLA {row['xla']:>16s} "
                      f"upstream {row['upstream']:>16s} tuned {row['tuned']:>10s} "
                      f"roofline {row['roofline']}", flush=True)
    finish(rows, a, command, t0)


def save_rows(path, rows, command, t0) -> None:
    path = bench.output(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"command": command, "date": bench.today(),
                   "seconds": round(time.perf_counter() - t0), "jax": jax.__version__,
                   "libtpu": bench.version("libtpu", "?"), "rows": rows}, f, indent=1)


def combine(paths, out, *, title=TITLE, sets=SETS, render_fn=render) -> None:
    """Renders the rows of several ``--rows-out`` runs as one table (a row in several runs: the
    first run's), ordered as ``sets``."""
    parts = [json.load(open(p, encoding="utf-8")) for p in paths]
    runs = "; ".join(f"`$ {p['command']}` ({p['seconds']} s)" for p in parts)
    first = parts[0]
    header = (f"# {title}\n\n"
              f"{first['date']}, jax {first['jax']}, libtpu {first['libtpu']}, on a shared "
              f"{os.cpu_count()}-core CPU host (no TPU), in {len(parts)} runs of the same code: "
              f"{runs}; combined with `--combine` (a shape in several runs: the first run's "
              f"row). {_UNITS}")
    rows, seen = [], set()
    for r in (r for p in parts for r in p["rows"]):
        if (r.get("set"), r["shape"], r.get("pass")) not in seen:
            seen.add((r.get("set"), r["shape"], r.get("pass")))
            rows.append(r)
    order = {name: i for i, (name, _) in enumerate(sets)}
    rows.sort(key=lambda r: order.get(r.get("set", ""), 99))
    bench.write(out, render_fn(rows, header))


if __name__ == "__main__":
    main()
