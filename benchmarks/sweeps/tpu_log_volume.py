"""How many bytes libtpu's logs take during a ``--timer tpu-estimate`` sweep of a kernel that
trips libtpu's static profiler, before and after pallas-tune bounded them.

The kernel (``trip`` below) multiplies bf16 blocks by a constant: on v6e, libtpu 0.0.50's
static profiler aborts on it (``LLO_CHECK failure ... Expected vector-bf16packed, got
vector-int32``), writing the kernel's LLO program to its INFO, WARNING and ERROR logs, once per
candidate. The sweep runs in a subprocess with ``--no-storage --no-write``; a thread samples
the bytes on disk under the log location every 0.2 s (the peak) and at the end.

    python benchmarks/sweeps/tpu_log_volume.py                      # this tree: bounded, off
    python benchmarks/sweeps/tpu_log_volume.py --tree /tmp/old-tree # another checkout: before
    PALLAS_TUNE_BENCH_SMOKE=1 python benchmarks/sweeps/tpu_log_volume.py  # bounded, 2 candidates

"FATAL logs seen" counts the aborts whose FATAL file the sampler saw (one per aborting
process; none where logs are off). ``--tree`` runs another checkout's ``pallas_tune`` (e.g. ``git worktree add /tmp/old-tree
ccf1d2e``): that code sets no log location, so libtpu writes to ``$TPU_LOG_DIR``, which this
script points at a fresh directory in place of ``/tmp/tpu_logs`` (the same files, counted
apart from other processes' logs).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

HERE = os.path.dirname(os.path.abspath(__file__))  # On the sweep's --path: `trip` is here.
sys.path.insert(0, os.path.dirname(HERE))
import _common as bench  # noqa: E402


def _trip_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 1.4427  # bf16 times a constant: the profiler's LLO_CHECK.


@pt.tunable(br=[16, 32, 64, 128, 256], bc=[128, 256], buffering=[1, 2],
            name="tpu_log_volume.trip")
def trip(x, *, br, bc, buffering):
    r, c = x.shape
    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j), pipeline_mode=pl.Buffered(buffering))
    return pl.pallas_call(
        _trip_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(r, br), pl.cdiv(c, bc)), in_specs=[spec],
        out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
    )(x)


def _bytes(path: str, fatal: set[str] | None = None) -> int:
    """Bytes on disk under ``path``; adds the FATAL logs' names (one per abort) to ``fatal``."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            if fatal is not None and ".log.FATAL." in f:
                fatal.add(f)
            try:
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    return total


WORKERS = bench.smoke(2, 1)


def run(label: str, tree: str, env: dict[str, str], where: str, trials: int) -> str:
    peak, fatal = [0], set()
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _bytes(where, fatal))

    threading.Thread(target=sample, daemon=True).start()
    cmd = [sys.executable, "-m", "pallas_tune", "sweep", "tpu_log_volume:trip",
           "--path", HERE, "--shapes", "x=512x512:bfloat16", "--timer", "tpu-estimate",
           "--chip", "v6e", "--trials", str(trials), "--no-storage", "--no-write",
           "--no-transfer", "--workers", str(WORKERS)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, **env, "PYTHONPATH": os.pathsep.join([tree, HERE])},
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    done.set()
    final = _bytes(where, fatal)
    peak[0] = max(peak[0], final)
    aborted = "LLO_CHECK failure" in proc.stderr
    return (f"| {label} | {peak[0] / 2**20:.1f} | {final / 2**20:.1f} | {aborted} | "
            f"{len(fatal)} | {proc.returncode} | {seconds:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", help="another checkout to run (the 'before' figure)")
    p.add_argument("--trials", type=int, default=bench.smoke(20, 2))
    a = p.parse_args()
    rows = []
    scratch = bench.scratch("tpu-log-volume-")
    if a.tree:
        where = os.path.join(scratch, "tpu_logs")
        rows.append(run(f"before ({os.path.basename(a.tree.rstrip('/'))}: libtpu's default "
                        "logs)", a.tree, {"TPU_LOG_DIR": where}, where, a.trials))
    for label, value in (("after (default: bounded, 64 MiB)", "bounded"),
                         ("after (PALLAS_TUNE_TPU_LOGS=off)", "off"))[:bench.smoke(2, 1)]:
        where = os.path.join(scratch, value)
        os.makedirs(where, exist_ok=True)
        env = {"PALLAS_TUNE_TPU_LOGS": where if value == "bounded" else "off",
               "TPU_LOG_DIR": os.path.join(where, "libtpu-default")}
        rows.append(run(label, bench.REPO, env, where, a.trials))
    print(f"{a.trials} candidates of tpu_log_volume.trip (x=512x512:bfloat16), --timer "
          f"tpu-estimate --chip v6e, {WORKERS} worker(s); MiB on disk under the log location")
    print("\n".join(bench.table(["run", "peak MiB", "final MiB", "profiler aborted",
                                 "FATAL logs seen", "exit", "seconds"], [])))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
