"""Sharded step figures (issue 54 item 4): Llama-3.1 decoder layers, forward+backward, compiled
deviceless WHOLE for an 8-chip v6e slice (``v6e:2x4``) with their collectives, in a TP8
(Megatron) and an FSDP layout (``steps/sharded_layers.py``), under three settings: all-XLA,
upstream Pallas (XLA's dots and norms, JAX's splash attention at MaxText's blocks) and
pallas-tune's kernels (their cached v6e configs, defaults where the cache has none), every
kernel inside ``jax.shard_map`` (check_vma on).

Every compute figure is a v6e compiler ESTIMATE: libtpu's static profile of the compile, every
op's cycles summed at the v6e clock. libtpu gives every collective 0 cycles, so collectives are
a MODEL (``steps/collectives.py``: bytes over the ICI ring bandwidth). Splash's kernels are
read by libtpu as one block (its mask tables), so the upstream setting's splash cycles are
replaced by splash's stand-in estimate at MaxText's blocks (``steps/upstream.py``'s
``splash_cost``). ``--chip`` also compiles each step's per-chip program alone (one chip, no
collective), to check the composition against the whole multi-chip compile.

    python benchmarks/steps/sharded_step.py [--models 8b 70b] [--layouts tp8 fsdp]
        [--tokens 4096 8192] [--settings xla upstream tuned] [--chip] [--unprofiled]
        [--rows-out rows.json] [--render rows.json ...] [--out benchmarks/results/sharded_step.md]

Each compile runs in a child process (``--child``), one at a time; rows accumulate in
``--rows-out`` as they finish (a run resumed with the same file skips rows it holds).
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

SETTINGS = ("xla", "upstream", "tuned")
CLOCK_HZ = 1.75e9  # pallas_tune.chips' v6e clock.


def _mesh_and_args(model, layout: str, tokens: int, chip: bool):
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh
    from steps import sharded_layers as sl

    topo = topologies.get_topology_desc("v6e:1x1" if chip else sl.TOPOLOGY, platform="tpu",
                                        chips_per_host_bounds=[1, 1, 1])
    mesh = Mesh(np.array(topo.devices), (sl.AXIS,))
    return mesh, (sl.chip_args(model, layout, tokens) if chip
                  else sl.global_args(model, layout, tokens, mesh))


def _program(chip: bool, unprofiled: bool) -> str:
    return ("chip" if chip else "mesh") + ("-unprofiled" if unprofiled else "")


def _environment(unprofiled: bool) -> str:
    """Before JAX loads: libtpu's profile dumped to a fresh folder (returned), or, unprofiled,
    only JAX on the CPU and libtpu's logs in a run directory (a fresh folder is returned)."""
    if not unprofiled:
        return bench.static_profile_env("pt-sharded-")
    import atexit

    from pallas_tune.measure.logs import RunLogs

    own = RunLogs()
    os.environ.update(own.env)
    atexit.register(own.close)
    os.environ.update(JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    return bench.scratch("pt-sharded-")


def child(model_name: str, layout: str, tokens: int, setting: str, chip: bool,
          unprofiled: bool = False) -> dict:
    """One compile, in this process (its libtpu profile set before JAX loads), its address
    space capped at $PALLAS_TUNE_SHARDED_MEMORY_GB (default 9: a profiled compile grew past 15
    GB on this 24 GB host), so that it dies alone rather than starve the host."""
    import resource

    cap = int(float(os.environ.get("PALLAS_TUNE_SHARDED_MEMORY_GB", "9")) * (1 << 30))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # libtpu's abort would dump core.
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    dump = _environment(unprofiled)
    receipts = os.path.join(dump, "receipts.jsonl")
    os.environ["PALLAS_TUNE_RECEIPTS"] = receipts
    import warnings

    import jax
    from steps import collectives
    from steps import sharded_layers as sl


    model = (sl.Model("tiny", 1024, 8, 8, 2048, False) if model_name == "tiny"
             else sl.MODELS[model_name])
    mesh, args = _mesh_and_args(model, layout, tokens, chip)
    ops, ctx = sl.setting(setting)
    step = sl.chip_train(model, layout, ops) if chip else sl.sharded_train(model, layout, ops,
                                                                            mesh)
    t0 = time.perf_counter()
    with warnings.catch_warnings(), ctx:
        warnings.simplefilter("ignore")
        if chip:  # Under shard_map on a 1-chip mesh (no collective): Pallas sees the chip.
            from jax.sharding import NamedSharding
            from jax.sharding import PartitionSpec as P

            rep = NamedSharding(mesh, P())
            args = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep) for x in args]
            step = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P())
            compiled = jax.jit(step).lower(*args).compile()
        else:
            compiled = jax.jit(step).lower(*args).compile()
    wall = time.perf_counter() - t0
    out = {"model": model_name, "layout": layout, "tokens": tokens, "setting": setting,
           "program": _program(chip, unprofiled), "compile_s": round(wall, 1),
           **collectives.summary(compiled.as_text(), CLOCK_HZ)}
    if unprofiled:  # No cycles were annotated: the compute fields would read 0, not unknown.
        for k in ("compute_ms", "splash_kernels_ms", "pallas_ms", "top_ops",
                  "ops_without_estimate", "ops_without_estimate_names",
                  "kernels_without_estimate"):
            out.pop(k, None)
    if os.path.exists(receipts):
        with open(receipts, encoding="utf-8") as f:
            out["receipts"] = [{k: r[k] for k in ("kernel", "key", "source", "implementation",
                                                  "config")} for r in map(json.loads, f)]
        os.unlink(receipts)
    return out


def splash_fix(row: dict, memory_gb: float) -> None:
    """The upstream row's splash kernels at their stand-in estimate (MaxText's blocks)."""
    from steps import sharded_layers as sl
    from steps import upstream

    m = sl.MODELS[row["model"]]
    div = sl.CHIPS if row["layout"] == "tp8" else 1
    q = (1, m.q_heads // div, row["tokens"], 128)
    k = (1, m.kv_heads // div, row["tokens"], 128)
    cost = upstream.splash_cost(q, k, True, upstream.MAXTEXT_FWD, upstream.MAXTEXT_BWD,
                                memory_gb)
    row["splash_standin"] = cost
    row["compute_ms_as_compiled"] = row["compute_ms"]
    row["compute_ms"] = row["compute_ms"] - row["splash_kernels_ms"] + cost["ms"]


def run_one(model: str, layout: str, tokens: int, setting: str, chip: bool,
            memory_gb: float, unprofiled: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model, layout, str(tokens),
           setting] + (["--chip"] if chip else []) + (["--unprofiled"] if unprofiled else [])
    t0 = time.perf_counter()
    try:
        row = bench.run_json(cmd, timeout=3 * 3600)
    except RuntimeError as e:
        return {"model": model, "layout": layout, "tokens": tokens, "setting": setting,
                "program": _program(chip, unprofiled), "error": str(e)[-800:]}
    if setting == "upstream" and model != "tiny" and row.get("splash_kernels_ms") is not None:
        try:
            splash_fix(row, memory_gb)
        except RuntimeError as e:
            row["splash_error"] = str(e)[:600]
    row["wall_s"] = round(time.perf_counter() - t0, 1)
    return row


def _key(r: dict) -> tuple:
    return (r["model"], r["layout"], r["tokens"], r["setting"], r["program"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=4, metavar=("MODEL", "LAYOUT", "TOKENS", "SETTING"))
    p.add_argument("--models", nargs="*", default=["8b", "70b"])
    p.add_argument("--layouts", nargs="*", default=["tp8", "fsdp"])
    p.add_argument("--tokens", nargs="*", type=int, default=[4096, 8192])
    p.add_argument("--settings", nargs="*", default=list(SETTINGS), choices=SETTINGS)
    p.add_argument("--chip", action="store_true",
                   help="also (with --child: only) compile the per-chip program alone")
    p.add_argument("--unprofiled", action="store_true",
                   help="compile without libtpu's static profile: the compiler's verdict and "
                   "the collectives as compiled, no compute figure")
    p.add_argument("--memory-gb", type=float, default=12.0,
                   help="address-space cap of splash's stand-in estimate worker")
    p.add_argument("--rows-out", help="rows JSON, added to as rows finish (and resumed)")
    p.add_argument("--render", nargs="*", help="render these rows files only")
    p.add_argument("--notes", help="a Markdown file put under the headline (findings)")
    p.add_argument("--per-chip", help="a JSON of per-chip step figures (step_tuning.md's) to "
                   "compose with the modelled collectives")
    p.add_argument("--command", action="append", default=[],
                   help="with --render: the commands that made the rows (repeatable)")
    p.add_argument("--out", help="the page to write (default: benchmarks/results/"
                   "sharded_step.md, except for a run with --rows-out, which writes none)")
    a = p.parse_args()
    if a.child:
        m, layout, t, setting = a.child
        print(json.dumps(child(m, layout, int(t), setting, a.chip, a.unprofiled)))
        return
    from steps import sharded_render

    if a.render:
        rows = [r for path in a.render for r in json.load(open(path, encoding="utf-8"))["rows"]]
        notes = open(a.notes, encoding="utf-8").read() if a.notes else ""
        per_chip = json.load(open(a.per_chip, encoding="utf-8")) if a.per_chip else None
        argv = sys.argv[1:]  # The render's own command, without the --command texts.
        own = [w for i, w in enumerate(argv) if w != "--command" and (
            i == 0 or argv[i - 1] != "--command")]
        bench.write(a.out or bench.result("sharded_step.md"), sharded_render.render(
            rows, [*a.command, bench.command(__file__, own)], notes, per_chip))
        return
    if not bench.have_libtpu("compile"):
        return
    if bench.SMOKE:  # A tiny layer, both layouts, two settings: four compiles of seconds.
        a.models, a.layouts, a.tokens, a.settings = ["tiny"], ["tp8", "fsdp"], [256], [
            "xla", "tuned"]
        a.chip = False
    rows = []
    path = bench.output(a.rows_out) if a.rows_out else None
    if path and os.path.exists(path):
        rows = json.load(open(path, encoding="utf-8"))["rows"]
    done = {_key(r) for r in rows if "error" not in r}
    for model in a.models:
        for layout in a.layouts:
            for tokens in a.tokens:
                for setting in a.settings:
                    for chip in ([False, True] if a.chip else [False]):
                        k = (model, layout, tokens, setting, _program(chip, a.unprofiled))
                        if k in done or (bench.SMOKE and k[1:4:2] == ("fsdp", "tuned")):
                            continue  # Smoke: tiny FSDP's flash config aborts libtpu's profile.
                        print("==", *k, flush=True)
                        rows = [r for r in rows if _key(r) != k]
                        rows.append(run_one(model, layout, tokens, setting, chip, a.memory_gb,
                                            a.unprofiled))
                        print(json.dumps({x: rows[-1].get(x) for x in (
                            "compute_ms", "collectives_model_ms", "compile_s", "error")}),
                            flush=True)
                        if path:
                            with open(path, "w", encoding="utf-8") as f:
                                json.dump({"command": bench.command(__file__), "rows": rows},
                                          f, indent=1)
    # A run adding to a rows file prints its page and leaves the file to --render.
    bench.write(a.out or (None if a.rows_out else bench.result("sharded_step.md")),
                sharded_render.render(rows, [bench.command(__file__)]))


if __name__ == "__main__":
    main()
