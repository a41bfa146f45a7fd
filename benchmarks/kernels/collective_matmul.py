"""The collective matmul (kernels/collective_matmul.py) against XLA's own, compiled deviceless
for an 8-chip v6e slice (``v6e:2x4``, tp = 8) at tpu-inference's all-gather-matmul keys.

For each key (m, n, k global; x sharded along rows, y along columns over the 8 chips), in one
``shard_map`` program each:

- our kernel at each config of its space that fits the shard (or those named), ranked by
  libtpu's static-profile ESTIMATE of the kernel's cycles (the profile simulates one chip's
  bundles: the remote DMAs' time is not in it), next to a MODEL of the ring (each chip receives
  (tp-1)/tp of x; 200 GB/s a chip over a bidirectional ring, steps/collectives.py), and where
  tpu-inference's published winner lands in that ranking;
- XLA's all-gather then dot (the reference), its dot's ESTIMATE plus the all-gather's MODEL
  (libtpu gives collectives 0 cycles);
- XLA's collective matmul (``xla_tpu_all_gather_collective_matmul_mode=post_spmd``, a compile
  option of libtpu 0.0.50.1: the all-gather+dot decomposed into a loop of collective-permutes
  and partial dots), its ops' ESTIMATE with the loop's body counted once per iteration (the
  iterations: the gathered rows over the rows the body's dots produce), and the permutes'
  MODEL.

Every figure is labelled: ``estimate`` (libtpu's static profile) or ``model`` (bytes over
bandwidth); a ``total`` is max(compute estimate, ring model) where the kernel overlaps them
and their sum where XLA runs them one after the other.

    python benchmarks/kernels/collective_matmul.py [--keys all] [--configs bn:bk:r,...|space]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

OUT = bench.result("collective_matmul.md")
TP = 8
# tpu-inference 0.32.0, tpu_inference/kernels/collectives/all_gather_matmul_tuned_block_sizes.py
# (Apache-2.0, (c) the vLLM/tpu-inference authors): (tpu_version, m, n, k, dtype, tp_size) ->
# (bn, bk), measured on real v6e chips. Reproduced as reference data.
TPU_INFERENCE = {
    (6, 1024, 51200, 5120, "bfloat16", 8): (6400, 2560),
    (6, 1024, 57344, 8192, "bfloat16", 8): (7168, 8192),
    (6, 2048, 51200, 5120, "bfloat16", 8): (1280, 5120),
    (6, 2048, 57344, 8192, "bfloat16", 8): (1024, 8192),
    (6, 4096, 51200, 5120, "bfloat16", 8): (3200, 5120),
    (6, 8192, 51200, 5120, "bfloat16", 8): (1280, 5120),
}
XLA_CM = {"xla_tpu_all_gather_collective_matmul_mode": "post_spmd"}
USABLE_VMEM = 100 * 1024 * 1024
# The default configs (a subset of the space, for time: a compile takes 1 to 3 minutes on this
# host): tpu-inference's winners at the 51200-column keys, each streamed too, and narrower ones.
SUBSET = ("3200:5120:1", "3200:5120:0", "1280:5120:1", "1280:5120:0", "1280:1280:1",
          "1280:1280:0", "640:2560:1", "640:2560:0", "6400:1280:0")
CHILD_TIMEOUT_S = 600  # The default --timeout: configs whose compile takes longer get no figure.


def _configs(m, n, k, named):
    from pallas_tune import load_space
    from pallas_tune.kernels.collective_matmul import vmem_bytes

    if named:
        return named
    choices = {p.name: p.choices for p in load_space("collective_matmul")["space"].params}
    out = []
    for bn in choices["bn"]:
        for bk in choices["bk"]:
            for resident in choices["y_resident"]:
                if bn <= n // TP and bk <= k and (n // TP) % bn == 0 and k % bk == 0 and \
                        vmem_bytes(m // TP, n // TP, k, 2, bn=bn, bk=bk,
                                   y_resident=resident) <= USABLE_VMEM:
                    out.append((bn, bk, resident))
    return out


def _compile(fn, x, y, options=None):
    import jax

    t = time.perf_counter()
    text = jax.jit(fn).lower(x, y).compile(compiler_options=options or {}).as_text()
    return text, time.perf_counter() - t


def _loop_ms(text, rows, clock):
    """The compute ESTIMATE of XLA's decomposed program: entry ops once, the while body's
    once per iteration (the gathered rows over the rows its dots produce)."""
    from steps import collectives

    body, entry, produced, current = 0, 0, 0, None
    for line in text.splitlines():
        if line.startswith("%") or line.startswith("ENTRY"):
            current = "body" if "_body" in line else ("entry" if line.startswith("ENTRY")
                                                       else "other")
        m = collectives.CYCLES.search(line)  # Not window_config's own estimated_cycles.
        if not m or current == "other":
            continue
        if current == "body":
            body += int(m.group(1))
            dot = re.search(r"= bf16\[(\d+),(\d+),\d+\]\{[^}]*\} fusion", line)
            if dot and "dot_general" in line:
                produced += int(dot.group(1)) * int(dot.group(2))
        else:
            entry += int(m.group(1))
    trips = rows / produced if produced else 1
    return (entry + body * trips) / clock * 1e3, trips


def child(what, m, n, k, bn=0, bk=0, resident=False):
    """One compile in this process (libtpu's profiler may abort it): its figures."""
    if "jax" not in sys.modules:
        bench.static_profile_env("pt-cmm-")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P
    from steps import collectives

    from pallas_tune import chips
    from pallas_tune.kernels import collective_matmul as cm

    clock = chips.chip_spec("v6e").clock_hz
    topo = topologies.get_topology_desc("v6e:2x4", platform="tpu", chips_per_host_bounds=[2, 4, 1])
    mesh = Mesh(np.array(topo.devices), ("tp",))
    specs = dict(mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    y = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "tp")))
    config = dict(axis_name="tp", axis_size=TP, bn=bn, bk=bk, y_resident=resident)

    def ref(x, y):
        g = jax.lax.all_gather(x, "tp", tiled=True)
        return jnp.dot(g, y, preferred_element_type=jnp.float32).astype(x.dtype)

    if what == "standin":  # Not a tunable call: nothing types it for the varying-axes check.
        text, secs = _compile(jax.shard_map(lambda x, y: cm.ring_free_standin(x, y, **config),
                                            check_vma=False, **specs), x, y)
    elif what == "kernel":
        text, secs = _compile(jax.shard_map(lambda x, y: cm.collective_matmul(x, y, **config),
                                            **specs), x, y)
    else:
        text, secs = _compile(jax.shard_map(ref, **specs), x, y,
                              XLA_CM if what == "xla_cm" else None)
    out = {"secs": secs}
    if what in ("standin", "kernel"):
        out["cycles"] = sum(o["cycles"] or 0 for o in collectives.ops(text) if "kernel" in o)
        out["ms"] = out["cycles"] / clock * 1e3
    elif what == "xla":
        s = collectives.summary(text, clock)
        out.update(ms=s["compute_ms"], collective_ms=s["collectives_model_ms"],
                   collectives=sorted(s["collectives"]))
    else:
        out["ms"], out["trips"] = _loop_ms(text, m, clock)
        out["permutes"] = sum(o.get("collective") == "collective-permute"
                              for o in collectives.ops(text))
    return out


def _run_child(*args, stream, timeout=CHILD_TIMEOUT_S):
    if bench.SMOKE:  # Its configs profile; one process, for time.
        return child(*args[:4], *args[4:6], *(bool(v) for v in args[6:]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           check=False)
    except subprocess.TimeoutExpired:
        print(f"  {args}: no answer in {timeout} s", file=stream, flush=True)
        return {"error": f"the compile ran past {timeout} s"}
    if r.returncode == 0:
        return json.loads(r.stdout.strip().splitlines()[-1])
    why = next((ln for ln in r.stderr.splitlines() if "failed:" in ln or "Error" in ln),
               r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "")
    why = re.sub(r"^.*?\] ", "", why)[:160]
    print(f"  {args}: exit {r.returncode}: {why}", file=stream, flush=True)
    return {"error": why}


def run(keys, named, stream=sys.stdout, timeout=CHILD_TIMEOUT_S):
    from steps import collectives

    sections = []
    for m, n, k in keys:
        ring_ms = (TP - 1) / TP * m * k * 2 / collectives.RING_BYTES_PER_S * 1e3
        rows, failed = [], []
        for bn, bk, resident in _configs(m, n, k, named):
            r = _run_child("standin", m, n, k, bn, bk, int(resident), stream=stream,
                           timeout=timeout)
            if "error" in r:
                failed.append((bn, bk, resident, r["error"]))
                continue
            rows.append((bn, bk, resident, r["ms"], r["secs"]))
            print(f"  {m}x{n}x{k} bn={bn} bk={bk} resident={resident}: {r['ms']:.4f} ms "
                  f"estimate ({r['secs']:.0f} s)", file=stream, flush=True)
        rows.sort(key=lambda r: r[3])
        compiled = []  # The kernel itself (ring and all) at the best config and theirs.
        winner = TPU_INFERENCE.get((6, m, n, k, "bfloat16", TP))
        checked = {r[:3] for r in rows[:1]} | ({(*winner, True)} if winner else set())
        for bn, bk, resident in sorted(checked):
            r = _run_child("kernel", m, n, k, bn, bk, int(resident), stream=stream,
                           timeout=timeout)
            compiled.append(f"bn={bn} bk={bk} {'resident' if resident else 'streamed'}: " + (
                f"compiles in {r['secs']:.0f} s, profile cycles {r['cycles']}" if "error" not in r
                else f"does not compile here: {r['error']}"))
        xla = _run_child("xla", m, n, k, stream=stream, timeout=timeout)
        xla_cm = _run_child("xla_cm", m, n, k, stream=stream, timeout=timeout)
        sections.append(_section((m, n, k), rows, failed, ring_ms, xla, xla_cm, compiled))
    return sections


def _section(key, rows, failed, ring_ms, xla, cm, compiled):
    m, n, k = key
    winner = TPU_INFERENCE.get((6, m, n, k, "bfloat16", TP))
    lines = [f"## m={m} n={n} k={k} (bf16, tp={TP}: x shard {m // TP}x{k}, y shard "
             f"{k}x{n // TP})", ""]
    table = []
    for i, (bn, bk, resident, est, secs) in enumerate(rows, start=1):
        mark = " (tpu-inference's winner)" if winner == (bn, bk) and resident else ""
        table.append((i, f"bn={bn} bk={bk} {'resident' if resident else 'streamed'}{mark}",
                      f"{est:.4f}", f"{max(est, ring_ms):.4f}", f"{secs:.0f}"))
    lines += bench.table(("rank", "our kernel's config", "kernel less ring ms (estimate)",
                          "total ms (max with ring model)", "compile s"), table)
    place = next((i for i, r in enumerate(rows, start=1)
                  if winner == (r[0], r[1]) and r[2]), None)
    theirs = next((f for f in failed if winner == f[:2] and f[2]), None)
    if not winner:
        where = "- No tpu-inference entry at this key."
    elif place:
        where = (f"- tpu-inference's published v6e winner (bn, bk) = {winner}, y resident as "
                 f"theirs: rank {place}/{len(rows)} by the estimate.")
    else:
        where = (f"- tpu-inference's published v6e winner (bn, bk) = {winner}: no estimate "
                 f"({theirs[3] if theirs else 'not in the space here'}).")
    lines += ["", where]
    if failed:
        lines.append(f"- {len(failed)} configs got no estimate (libtpu's profiler aborted or "
                     "the compile failed): " + "; ".join(
                         f"bn={f[0]} bk={f[1]} {'resident' if f[2] else 'streamed'}"
                         for f in failed) + f". First reason: {failed[0][3]}")
    lines += [f"- Ring MODEL: {ring_ms:.4f} ms ((tp-1)/tp of x's {m * k * 2 / 2**20:.1f} MiB "
              "at 200 GB/s a chip, bidirectional)."]
    if "error" not in xla:
        lines.append(f"- XLA all-gather then dot: dot {xla['ms']:.4f} ms (estimate) + "
                     f"all-gather {xla['collective_ms']:.4f} ms (model) = "
                     f"{xla['ms'] + xla['collective_ms']:.4f} ms, one after the other.")
    if "error" not in cm:
        lines.append(f"- XLA collective matmul (post_spmd): {cm['ms']:.4f} ms (estimate; the "
                     f"loop body x {cm['trips']:g} iterations), {cm['permutes']} "
                     "collective-permutes (0 cycles in the profile; the ring model "
                     f"{ring_ms:.4f} ms, overlapped): total {max(cm['ms'], ring_ms):.4f} ms.")
    lines += [*(f"- The kernel with its ring, {c}." for c in compiled), ""]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", default="4096", help="m of tpu-inference's keys, comma-separated "
                   "(n=51200 or 57344 as theirs), or 'all'")
    p.add_argument("--configs", default=",".join(SUBSET),
                   help="bn:bk:resident(0/1),... or 'space' (every config of the space that "
                        "divides the key and fits VMEM: about 60 compiles a key)")
    p.add_argument("--timeout", type=int, default=CHILD_TIMEOUT_S,
                   help="seconds one compile may take (on a loaded 2-core host the XLA "
                        "programs took over 600)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        what, *nums = args.child
        print(json.dumps(child(what, *map(int, nums[:5]), *(bool(int(v)) for v in nums[5:]))))
        return
    if bench.SMOKE:  # Compiled in this process (see _run_child): the profile set before JAX.
        bench.static_profile_env("pt-cmm-")
    if not bench.have_libtpu("compile"):
        return
    if bench.SMOKE:
        keys = [(256, 2048, 512)]
        named = [(128, 256, False), (128, 256, True)]  # The profiler aborts on bn = n.
    else:
        ms = None if args.keys == "all" else {int(v) for v in args.keys.split(",")}
        keys = [(km, kn, kk) for (_, km, kn, kk, _, _) in TPU_INFERENCE if ms is None or km in ms]
        named = [] if args.configs == "space" else [
            (int(a), int(b), c == "1") for a, b, c in
            (v.split(":") for v in args.configs.split(",") if v)]
    t0 = time.perf_counter()
    sections = run(keys, named, timeout=args.timeout)
    text = "\n".join([
        "# Collective matmul: our kernel against XLA's, v6e:2x4 (tp=8), deviceless", "",
        f"Command: `{bench.command(__file__)}`  ",
        f"Versions: {bench.versions('jax', 'jaxlib', 'libtpu', 'tpu-inference')}; "
        f"{bench.today()}; host {bench.host()}; wall {time.perf_counter() - t0:.0f} s.", "",
        "Figures: `estimate` = libtpu's static profile (one chip's bundles; remote DMAs, "
        "collective-permutes and all-gathers get 0 cycles there); `model` = bytes over the "
        "ICI bandwidth (steps/collectives.py). No figure here is measured on a TPU.", "",
        *sections])
    bench.write(bench.output(OUT), text)


if __name__ == "__main__":
    main()
