"""Tune the GPU adapters on their model shape sets and compare tuned, upstream default and XLA.

    python benchmarks/kernels/gpu_adapters.py [--spaces gpu_attention,gpu_softmax] [--trials 24]

For every shape of every ``search_spaces/gpu_*.toml``: tune the adapter (the cache entry is
written under ``PALLAS_TUNE_CACHE_DIR`` with its receipts), then time the upstream default, the
tuned config and the kernel's plain-JAX reference compiled by XLA, interleaved (A B C A B C ...),
by device time from the profiler (the whole program of each: the Pallas kernel and the XLA ops
around it, such as decode attention's split-k reduction). For attention (``mha``) also cuDNN's
fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``), what a GPU user
would otherwise run. A program that cannot run (the reference's scores past the GPU's memory at
long context) gets its error in its column, not a figure. Prints a Markdown table.

Needs an NVIDIA GPU; on a CPU host everything runs in interpret mode and the figures are
meaningless (the script says so and refuses unless ``--allow-cpu``).

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1, with ``--allow-cpu`` on a CPU host): the softmax at one
small shape, 2 trials, one round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import jax  # noqa: E402

from pallas_tune import chips, cli  # noqa: E402
from pallas_tune.measure.timing import compare, compile_candidate, make_inputs  # noqa: E402
from pallas_tune.measure.timing import profile_device_times  # noqa: E402
from pallas_tune.space import load_space  # noqa: E402

SPACES = ("gpu_attention", "gpu_decode_attention", "gpu_paged_attention", "gpu_softmax",
          "gpu_layer_norm", "gpu_rms_norm", "gpu_attention_long")
SMOKE_SHAPES = {"gpu_softmax": {"x": "16x256:float32"}}  # Smoke runs: a set's one tiny shape.


def _cudnn_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None):
    """cuDNN's fused attention on mha's layout (batch, seq, heads, head_dim)."""
    return jax.nn.dot_product_attention(q, k, v, scale=sm_scale, is_causal=causal,
                                        implementation="cudnn")


def _device_times(fn, args, rounds: int) -> list[list[float] | str]:
    """Interleaved device times (ms) of compiled programs ``fn`` over ``rounds`` rounds; a
    program that fails to compile or run gets its error (a string) instead."""
    compiled: list = []
    for f in fn:
        try:
            exe, _ = compile_candidate(f, args, {}, interpret=chips.should_interpret())
            if isinstance(exe, BaseException):
                raise exe
            jax.block_until_ready(exe(*args))
            compiled.append(exe)
        except Exception as e:  # noqa: BLE001 - e.g. XLA's scores past the GPU's memory.
            compiled.append(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    times: list = [[] if not isinstance(c, str) else c for c in compiled]
    for _ in range(rounds):
        for i, exe in enumerate(compiled):
            if isinstance(exe, str):
                continue
            t = profile_device_times(exe, args, 5, None)
            if t is None:  # No device events (CPU): wall clock, labelled by the caller.
                t0 = time.perf_counter()
                jax.block_until_ready(exe(*args))
                t = [(time.perf_counter() - t0) * 1e3]
            times[i].extend(t)
    return times


def run_shape(kernel, spec: str, trials: int, rounds: int) -> dict:
    call_args, call_kwargs = cli.build_call(kernel, spec)
    t0 = time.perf_counter()
    result = kernel.tune(*call_args, trials=trials, timer="profiler", **call_kwargs)
    tune_s = time.perf_counter() - t0
    if kernel.inputs is not None:
        args, kwargs = kernel.inputs(*call_args, **call_kwargs)
    else:
        args, kwargs = make_inputs(call_args, 0), dict(call_kwargs)
    default, best = dict(kernel.space.default), result.best
    fns = [lambda *a, c=default: kernel.fn(*a, **kwargs, **c),
           lambda *a, c=best: kernel.fn(*a, **kwargs, **c),
           lambda *a: kernel.reference(*a, **kwargs)]
    if kernel.name == "jax.ops.gpu.attention.mha":
        fns.append(lambda *a: _cudnn_attention(*a, **kwargs))
    med = [statistics.median(t) if t and not isinstance(t, str) else t
           for t in _device_times(fns, args, rounds)]
    # Correctness against the reference where it runs, else against cuDNN (long context).
    oracle = next((i for i in (2, 3) if i < len(med) and not isinstance(med[i], str)), None)
    if oracle is not None:
        ref = jax.block_until_ready(jax.jit(fns[oracle])(*args))
        for f in fns[:2]:
            ok, _, why = compare(jax.jit(f)(*args), ref)
            if not ok:
                raise AssertionError(f"{kernel.name} {spec}: {why}")
    counts = result.trials["outcome"].value_counts().to_dict()
    return {"key": result.key, "default": default, "best": best, "default_ms": med[0],
            "tuned_ms": med[1], "xla_ms": med[2], "cudnn_ms": med[3] if len(med) > 3 else None,
            "tune_s": tune_s, "outcomes": counts, "measured": int(counts.get("ok", 0))}


def _ms(x) -> str:
    return "-" if x is None else (f"fails: {x}" if isinstance(x, str) else f"{x:.4f}")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--spaces", default=bench.smoke(",".join(SPACES), "gpu_softmax"))
    p.add_argument("--trials", type=int, default=bench.smoke(24, 2))
    p.add_argument("--rounds", type=int, default=bench.smoke(5, 1))
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args(argv)
    device = jax.devices()[0]
    if device.platform != "gpu" and not args.allow_cpu:
        print("gpu_adapters.py measures GPU kernels; no GPU here (use --allow-cpu to smoke-test "
              "in interpret mode, figures meaningless).", file=sys.stderr)
        return 2
    print("# $ " + bench.command(__file__, ["--spaces", args.spaces, "--trials",
                                           str(args.trials), "--rounds", str(args.rounds)]))
    print(f"# {bench.today()}, {device.device_kind}, jax {jax.__version__}; device time "
          "(profiler) of the whole program, median of interleaved rounds; chip "
          f"{chips.current_chip()}")
    print("\n".join(bench.table(
        ["kernel", "shape (key)", "upstream default", "ms", "tuned", "ms", "XLA reference ms",
         "cuDNN ms", "tuned vs default", "tuned vs XLA", "tuned vs cuDNN", "measured",
         "tune s"], [])))
    for name in args.spaces.split(","):
        loaded = load_space(name)
        kernel = cli._load_kernel(loaded["kernel"])
        tiny = SMOKE_SHAPES.get(name)
        for shape in [tiny] if bench.SMOKE and tiny else loaded["shapes"]:
            spec = cli._spec_items(shape)
            try:
                r = run_shape(kernel, spec, args.trials, args.rounds)
            except Exception as e:  # noqa: BLE001 - one failing shape must not hide the rest.
                print(f"| {kernel.name} | {spec} | FAILED: {type(e).__name__}: "
                      f"{str(e)[:200]} |||||||||||", flush=True)
                continue
            fmt = lambda c: " ".join(f"{k}={v}" for k, v in c.items())  # noqa: E731
            print(f"| {kernel.name} | `{r['key']}` | {fmt(r['default'])} | "
                  f"{_ms(r['default_ms'])} | {fmt(r['best'])} | {_ms(r['tuned_ms'])} | "
                  f"{_ms(r['xla_ms'])} | {_ms(r['cudnn_ms'])} | "
                  f"{_ratio(r['default_ms'], r['tuned_ms'])} | "
                  f"{_ratio(r['xla_ms'], r['tuned_ms'])} | {_ratio(r['cudnn_ms'], r['tuned_ms'])} | "
                  f"{r['measured']} | {r['tune_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.exit(main())
