"""Per kernel and shape: the tuned config against the declared default and the plain-JAX (XLA) version.

What can be measured or estimated here decides the columns. On a CPU-only host (this project's
CI and dev machines) every figure is a TPU v6e COMPILER ESTIMATE: each program is compiled
deviceless with libtpu and its static cycle estimate (all kernels of the program summed) is
converted at the chip clock. The tuned config is the one in the caches (user, then shipped
`caches/tpu_v6e/*.estimate.json`); a shape with no tuned entry is marked so. The XLA column
compiles the kernel's plain-JAX `*_reference` the same way, so Pallas is compared with what XLA
makes of the same math on the same chip model. libtpu reports its LLO estimate for some XLA
fusions as 0 (none); the XLA column then says "partial" and is a lower bound, and the column
"XLA model" gives XLA's own cost-model cycles for its fusions (another estimator, shown for
reference; Pallas kernels have no such figure).

    python benchmarks/kernels/kernels.py [--kernels matmul rms_norm ...] [--workers 2]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): rms_norm's first shape, one worker.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

from pallas_tune import cli  # noqa: E402
from pallas_tune.measure.estimate import Estimator, cycles_to_ms  # noqa: E402
from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.space import load_space  # noqa: E402

KERNELS = ["matmul", "flash_attention", "rms_norm", "linear_attention", "grouped_matmul"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernels", nargs="+", default=bench.smoke(KERNELS, ["rms_norm"]))
    p.add_argument("--workers", type=int, default=bench.smoke(2, 1))
    p.add_argument("--shapes-per-kernel", type=int, default=bench.smoke(None, 1),
                   help="only the first N shapes of each kernel's shape sets")
    a = p.parse_args()
    if not bench.have_libtpu():
        return
    spec = chip_spec("v6e")
    print(f"TPU v6e compiler ESTIMATES (deviceless libtpu, {spec.clock_hz / 1e9:g} GHz), in ms; "
          "not measurements\n")
    print(f"{'kernel':17s} {'shape':64s} {'tuned':>9s} {'default':>9s} {'XLA':>17s} "
          f"{'XLA model':>9s} {'default/tuned':>13s} {'XLA/tuned':>9s}  tuned config")
    t0 = time.perf_counter()
    with Estimator(a.workers) as est:
        for name in a.kernels:
            loaded = load_space(name)
            kernel = cli._load_kernel(loaded["kernel"])
            module = __import__(kernel.fn.__module__, fromlist=["_"])
            reference = getattr(module, f"{name}_reference")
            for shape in loaded["shapes"][: a.shapes_per_kernel]:
                spec_str = cli._spec_items(shape)
                args, kwargs = cli.build_call(kernel, spec_str)
                key = kernel.cache_key(*args, **kwargs)
                found = kernel.cache.lookup("tpu_v6e", kernel.name, key)
                tuned = found[0]["config"] if found else None
                default = dict(kernel.space.default)
                configs = [c for c in (tuned, default) if c is not None]
                res = est.map(kernel, args, kwargs, configs, "tpu_v6e")
                (xla,) = est.map(reference, args, kwargs, [{}], "tpu_v6e", standin=False)
                ms = [cycles_to_ms(r.cycles, spec.clock_hz) if r.ok else float("nan")
                      for r in res]
                t_ms = ms[0] if tuned is not None else float("nan")
                d_ms = ms[-1]
                x_ms = cycles_to_ms(xla.cycles, spec.clock_hz) if xla.ok else float("nan")
                partial = xla.ok and xla.ops_without_estimate > 0
                x_cell = f"{x_ms:9.4f}" + (" partial" if partial else "        ")
                xm = (cycles_to_ms(xla.model_cycles, spec.clock_hz)
                      if xla.ok and xla.model_cycles else float("nan"))
                label = str(tuned) if tuned is not None else "(not tuned: no cache entry)"
                short = spec_str if len(spec_str) <= 64 else spec_str[:61] + "..."
                ratio = f"{x_ms / t_ms:9.2f}" if not partial else f"{'>=' + format(x_ms / t_ms, '.2f'):>9s}"
                print(f"{name:17s} {short:64s} {t_ms:9.4f} {d_ms:9.4f} {x_cell:>17s} "
                      f"{xm:9.4f} {d_ms / t_ms:13.2f} {ratio}  {label}", flush=True)
    print(f"\n{time.perf_counter() - t0:.0f} s on {os.cpu_count()} CPU cores")


if __name__ == "__main__":
    main()
