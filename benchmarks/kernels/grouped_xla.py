"""The MoE grouped matmul against XLA's own ``jax.lax.ragged_dot``: v6e compiler ESTIMATES.

``grouped_matmul``'s reference (a per-row gather of each row's expert weights) is a correctness
oracle that cannot fit v6e HBM at Mixtral's training shapes, so the training table has no XLA
figure for it. XLA does have a grouped matmul: ``lax.ragged_dot``, which XLA:TPU lowers to a Mosaic
kernel of its own (at 8192x4096 by 8x4096x3584 with tiles 256x4096x768, full K). This compiles it
deviceless for v6e, forward and gradient (``jax.vjp``, benchmarks/kernels/xla_gradient.py), and
sets its estimates beside the tuned entries (forward ``grouped_matmul``, backward
``grouped_matmul_bwd``) as recorded in the caches. Every figure is a COMPILER ESTIMATE, and a
figure below the compute floor is one where libtpu's static profile left work out (data-dependent
work on the group metadata): no ranking is claimed from it.

    python benchmarks/kernels/grouped_xla.py [--space mixtral_training_grouped_matmul]
        [--max-shapes N] [--memory-gb 20] [--out benchmarks/results/grouped_xla.md]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): one small shape (model_shapes.SMOKE_SHAPES).
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
from xla_gradient import ragged_dot_grouped, xla_gradient  # noqa: E402

from pallas_tune import cli  # noqa: E402
from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.measure.estimate import Estimator  # noqa: E402
from pallas_tune.space import load_space  # noqa: E402
from pallas_tune.tuning.grad import backward_call  # noqa: E402


def recorded_ms(kernel, args, kwargs):
    """(median_ms, libtpu) of ``kernel``'s v6e estimate entry for this call, or (None, None)."""
    found = kernel.cache.lookup("tpu_v6e", kernel.name, kernel.cache_key(*args, **kwargs))
    if not found:
        return None, None
    entry = found[0]
    return entry.get("median_ms"), entry.get("provenance", {}).get("versions", {}).get("libtpu")


def cell(r, clock) -> tuple[str, float | None]:
    if not r.ok:
        return f"no figure ({r.kind}: {r.message.splitlines()[0][:90] if r.message else ''})", None
    value = ms.cycles_to_ms(r.cycles, clock)
    return f"{value:.4f}" + (" partial" if r.ops_without_estimate else ""), value


def floor_ms(args, backward: bool) -> float:
    """The compute floor: 2mkn FLOPs forward (4mkn backward: dlhs and drhs) at v6e's peak."""
    (m, k), n = args[0].shape, args[1].shape[2]
    return (4.0 if backward else 2.0) * m * k * n / ms.PEAK_FLOPS * 1e3


def standing(xla, tuned, floor) -> str:
    """Where the tuned kernel stands, unless a figure is below the compute floor: then libtpu's
    static profile left out work (it cannot know data-dependent work, such as a branch or a
    trip count on the group metadata), and no ranking is claimed."""
    low = [name for name, v in (("ragged_dot", xla), ("tuned", tuned)) if v and v < floor]
    if low:
        return f"not comparable: {' and '.join(low)} below the {floor:.4f} ms compute floor"
    if not (xla and tuned):
        return "—"
    return f"tuned {xla / tuned:.2f}x faster" if xla > tuned else f"ragged_dot {tuned / xla:.2f}x faster"


def rows_for(est, kernel, shape, clock):
    args, kwargs = cli.build_call(kernel, cli._spec_items(shape))
    bwd_args, bwd_kwargs = backward_call(kernel, args, kwargs, 0)
    g = bwd_args[-1]
    out = []
    for pas, fn, a, kw, tuned_k, ta, tkw in (
            ("forward", ragged_dot_grouped, args, {}, kernel, args, kwargs),
            ("backward", xla_gradient, [*args, g],
             {"forward": "xla_gradient:ragged_dot_grouped"}, kernel.backward, bwd_args,
             bwd_kwargs)):
        t0 = time.perf_counter()
        r = est.map(fn, a, kw, [{}], "tpu_v6e", standin=False)[0]
        text, xla = cell(r, clock)
        tuned, libtpu = recorded_ms(tuned_k, ta, tkw)
        ratio = standing(xla, tuned, floor_ms(args, pas == "backward"))
        out.append([ms._short(kernel.cache_key(*args, **kwargs)), pas, text,
                    f"{tuned:.4f} (libtpu {libtpu})" if tuned else "not tuned", ratio,
                    f"{time.perf_counter() - t0:.0f} s"])
        print(" | ".join(out[-1]), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--space", default="mixtral_training_grouped_matmul")
    p.add_argument("--max-shapes", type=int, default=None)
    p.add_argument("--memory-gb", type=float, default=20.0,
                   help="memory cap of the compile worker (libtpu's static profile of the "
                        "8192x4096 by 8x4096x3584 ragged_dot peaked at 18 GB resident)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    loaded = load_space(a.space)
    kernel = cli._load_kernel(loaded["kernel"])
    clock = chip_spec("v6e").clock_hz
    rows = []
    with Estimator(1, memory_limit_bytes=int(a.memory_gb * 2**30)) as est:
        for shape in ms.smoke_shapes(a.space, loaded["shapes"][: a.max_shapes]):
            rows += rows_for(est, kernel, shape, clock)
    header = ["shape (forward's cache key)", "pass", "XLA lax.ragged_dot ms", "tuned ms (recorded)",
              "against ragged_dot", "compile wall"]
    lines = [f"# grouped_matmul vs XLA's lax.ragged_dot on TPU v6e: compiler ESTIMATES, not "
             f"measurements", "",
             f"`{bench.command(__file__, ['--space', a.space])}` on {bench.today()} "
             f"(libtpu {bench.version('libtpu', '?')}).", ""]
    lines += bench.table(header, rows)
    bench.write(a.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
