"""Tune a whole step, not a kernel: every tunable call of a small decoder-style block found by
tracing it (forward here; a gradient's backward kernels too, where the kernels declare them),
each distinct (kernel, shape) tuned once, the result applied to the step as a context manager.

On a CPU host the kernels run in Pallas interpret mode: times are interpreter wall clock (they
track grid steps, not TPU speed), and XLA is no candidate unless asked for (--xla).

With --estimate (needs libtpu: pip install 'pallas-tune[tpu]') every call is tuned for v6e on
the compiler's static estimates instead, XLA beside it, and the step's time is composed from
deviceless compiles (its glue whole, each call alone): v6e ESTIMATES, not measurements.

    python examples/autotune_step.py [--tokens 200] [--trials 4] [--xla] [--estimate]
"""

from __future__ import annotations

import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tune as pt
from pallas_tune.kernels.matmul import matmul
from pallas_tune.kernels.rms_norm import rms_norm


def block(x, w_norm, w_up, w_down):
    """rms_norm -> up projection -> GELU -> down projection, with a residual."""
    h = rms_norm(x, w_norm)
    return x + matmul(jax.nn.gelu(matmul(h, w_up)), w_down)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=200)  # Ragged: no tile divides it.
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--xla", action="store_true", help="time XLA too, even in interpret mode")
    p.add_argument("--estimate", action="store_true",
                   help="tune for v6e on compiler estimates; the step's estimate composed")
    args = p.parse_args()
    if args.estimate:
        return estimate(args)

    keys = jax.random.split(jax.random.key(0), 4)
    d, f = args.hidden, 2 * args.hidden
    x = jax.random.normal(keys[0], (args.tokens, d), jnp.float32)
    params = (jnp.ones((d,), jnp.float32), 0.05 * jax.random.normal(keys[1], (d, f)),
              0.05 * jax.random.normal(keys[2], (f, d)))

    result = pt.autotune(block, x, *params, trials=args.trials, repeats=2, seed=0,
                         xla=True if args.xla else None, step_time=True)
    print(result)  # One row per call (times not measured show as "-"), then the step's.

    with result:  # The tuned configs, without touching the cache.
        out = jax.jit(block)(x, *params)
    want = x + jax.nn.gelu((x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
                            * params[0]) @ params[1]) @ params[2]
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        result.dump(f.name)
        print(f"saved and reloaded: {pt.AutotuneResult.load(f.name)}")
    print("the tuned block matches the plain-JAX block")


def estimate(args: argparse.Namespace) -> None:
    """The block tuned for v6e on compiler estimates, and the step's composed estimate."""
    d, f, bf = args.hidden, 2 * args.hidden, jnp.bfloat16
    shapes = [jax.ShapeDtypeStruct(s, bf) for s in ((args.tokens, d), (d,), (d, f), (f, d))]
    result = pt.autotune(block, *shapes, trials=args.trials, seed=0, timer="tpu-estimate",
                         chip="v6e", step_time="composed")
    print(result)  # One row per call, then the step's figures: all ESTIMATES.
    glue = result.step_detail["glue"]
    print(f"step ({result.step_timer}):\n  glue {glue['ms']:.4g} ms; " + ", ".join(
        f"{k} {v:.4g} ms" for k, v in result.step_ms.items()))


if __name__ == "__main__":
    main()
