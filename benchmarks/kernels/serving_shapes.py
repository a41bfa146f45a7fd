"""The quantized matmuls at serving shapes, on TPU v6e: XLA / default / tuned, from the cache.

Reads the v6e estimate entries of ``pallas_tune.kernels.quantized_matmul`` and
``quantized_grouped_matmul`` for every shape of their shape sets
(``search_spaces/quantized_*.toml``: Llama-3.1-8B and 70B/TP8 projections at decode and prefill,
Mixtral-8x7B and DeepSeek-style experts), as ``pallas-tune sweep --space SPACE --chip v6e
--timer tpu-estimate`` wrote them (the user cache first, then the shipped ``caches/``), and prints per
shape: the default config's figure, the tuned config's, XLA's (the dequantize-then-dot
reference) and which one calls run, with each figure's fraction of the v6e roofline:
max(FLOPs / peak, bytes / 1.64 TB/s), the peak being bf16's (918 TFLOP/s) for bf16 activations
and int8's (twice that) where activations are quantized (``quantize_x``), the bytes each operand
read once and the output written once (8-bit weights: one byte each).

Every figure is a libtpu static ESTIMATE (deviceless compile on a CPU host, converted at
1.75 GHz), not a measurement; XLA's is on the footing of ``pallas_tune.tuning.footing``.

    python benchmarks/kernels/serving_shapes.py [--out benchmarks/results/serving_shapes.md]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

RESULTS = bench.result("serving_shapes.md")
CHIP = "tpu_v6e"


def dims(spec: str) -> list[int]:
    return [int(d) for d in spec.split(":")[0].split("x")]


def roofline_ms(shape: dict[str, str], quantize_x: bool) -> float:
    """The v6e roofline of one call, ms (a grouped call: every expert's weights read once)."""
    from pallas_tune.chips import chip_spec

    spec = chip_spec("v6e")
    if "lhs" in shape:  # Grouped: each row goes through one expert.
        (m, k), (g, _, n) = dims(shape["lhs"]), dims(shape["rhs_q"])
        weights, scales = g * k * n, g * n * 4
    else:
        (m, k), (_, n) = dims(shape["x"]), dims(shape["w_q"])
        weights, scales = k * n, n * 4
    peak = (spec.int8_ops or 2 * spec.bf16_flops) if quantize_x else spec.bf16_flops
    data = m * k * 2 + weights + scales + m * n * 2 + (m * 8 if quantize_x else 0)
    return max(2.0 * m * n * k / peak, data / spec.hbm_bw_bytes_per_s) * 1e3


def rows(kernel: Any, space: str) -> tuple[list[str], int]:
    """One table row per shape of the kernel's shape set, and how many have no entry."""
    from pallas_tune.cli.shapes import build_call
    from pallas_tune.space import load_space

    out, missing = [], 0
    for shape in load_space(space)["shapes"]:
        spec = ",".join(f"{k}={v}" for k, v in shape.items())
        args, kwargs = build_call(kernel, spec)
        found = kernel.cache.lookup(CHIP, kernel.name, kernel.cache_key(*args, **kwargs))
        weights = shape.get("w_q") or shape["rhs_q"]
        name = (f"{shape.get('x') or shape['lhs']} @ {weights}").replace(":bfloat16", "")
        if not found:
            out.append(f"| {name} | | not tuned | | | | | | |")
            missing += 1
            continue
        entry = found[0]
        qx = bool(kwargs.get("quantize_x"))
        roof = roofline_ms(shape, qx)
        best, default = float(entry["median_ms"]), float(entry.get("default_ms", math.nan))
        xla = float(entry.get("xla_ms", math.nan))
        runs = entry.get("implementation", "pallas")
        fastest = xla if runs == "xla" else best
        cfg = {k: v for k, v in entry["config"].items() if k != "vmem_limit_bytes"}
        out.append(f"| {name.split(':')[0]}{' (x int8)' if qx else ''} | "
                   f"{weights.split(':')[1]} | {default:.4f} | {best:.4f} {cfg} | "
                   f"{'no figure' if math.isnan(xla) else f'{xla:.4f}'} | {runs} | {roof:.4f} | "
                   f"{roof / best:.0%} | {roof / fastest:.0%} |")
    return out, missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    from pallas_tune.kernels.quantized_grouped_matmul import quantized_grouped_matmul
    from pallas_tune.kernels.quantized_matmul import quantized_matmul

    lines = ["# Quantized matmuls at serving shapes (TPU v6e, compiler estimates)", "",
             __doc__.split("\n\n")[1].replace("\n", " "), "",
             __doc__.split("\n\n")[2].replace("\n", " "), "",
             f"- command: `{bench.command(__file__, argv)}` ({bench.today()}), "
             "reading the entries written by `pallas-tune sweep --space SPACE --chip v6e "
             "--timer tpu-estimate --trials 10 --workers 1 --seed 0` for SPACE = "
             "quantized_matmul and quantized_grouped_matmul, then `pallas-tune recheck-xla "
             "KERNEL --chip v6e --again` (XLA decided under the current footing)",
             "- XLA's figure for the grouped matmul is XLA's own cost model brought to the "
             "Pallas estimate's footing: libtpu's profiled compile of XLA's ragged_dot program "
             "dies (it runs the compile worker out of address space), so "
             "`pallas_tune.tuning.footing` takes the cost model from a compile without the "
             "profiling flag (each entry's note says so).",
             "- Above 100%: libtpu's model moves HBM bytes at 1.44x the spec bandwidth the "
             "roofline uses, so a memory-bound estimate can beat the spec roofline; read the "
             "fractions as estimates of estimates.", ""]
    missing = 0
    for kernel, space, title in (
            (quantized_matmul, "quantized_matmul", "Weight-quantized matmul"),
            (quantized_grouped_matmul, "quantized_grouped_matmul", "MoE grouped matmul, 8-bit "
             "experts (every expert's weights in the roofline's bytes)")):
        table, miss = rows(kernel, space)
        missing += miss
        lines += [f"## {title}", "",
                  "| shape | weights | default ms | tuned ms (config) | XLA ms | runs | "
                  "roofline ms | tuned / roofline | best / roofline |",
                  "|---|---|---|---|---|---|---|---|---|", *table, ""]
    if missing:
        lines.append(f"{missing} shape(s) not tuned: no entry in the caches (`pallas-tune sweep "
                     "--space SPACE --chip v6e --timer tpu-estimate` fills them).")
    bench.write(a.out, "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
