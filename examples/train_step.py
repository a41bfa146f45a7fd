"""Tune for training, then train: a jitted training step through the shipped kernels' backwards.

A 2-layer MLP with an RMSNorm in front (rms_norm -> matmul -> relu -> matmul, MSE loss). Each
kernel call of the step is tuned with ``grad=True``: the forward for its shape, then its backward
kernel (``matmul_bwd``, ``rms_norm_bwd``) for the backward's shapes, each into its own cache
entry. ``jax.jit(jax.value_and_grad(loss))`` then resolves every forward and backward config
from the cache when it is traced, and a few SGD steps run; the gradient is checked against the
plain-JAX references' gradient.

On a CPU host the kernels run in Pallas interpret mode, so the times are interpreter wall clock
(they track grid steps, not TPU speed). Odd sizes on purpose (72 rows, 160 hidden): tiles are
clamped to them or leave a ragged last block.

    python examples/train_step.py [--trials 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

from pallas_tune.kernels.matmul import matmul, matmul_reference
from pallas_tune.kernels.rms_norm import rms_norm, rms_norm_reference

BATCH, D_IN, HIDDEN, D_OUT = 72, 96, 160, 40


def mlp(params, x, *, norm=rms_norm, mm=matmul):
    h = norm(x, params["norm"])
    return mm(jax.nn.relu(mm(h, params["w1"])), params["w2"])


def loss(params, x, y, **ops):
    return jnp.mean(jnp.square(mlp(params, x, **ops) - y))


def init(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    params = {"norm": jnp.ones((D_IN,), jnp.float32),
              "w1": jax.random.normal(k1, (D_IN, HIDDEN)) * D_IN ** -0.5,
              "w2": jax.random.normal(k2, (HIDDEN, D_OUT)) * HIDDEN ** -0.5}
    x = jax.random.normal(k3, (BATCH, D_IN))
    y = jax.random.normal(k4, (BATCH, D_OUT))
    return params, x, y


def tune_step(params, x, trials: int) -> None:
    """Every kernel call of the step, forward and backward (grad=True)."""
    fast = dict(trials=trials, seed=0, repeats=2, retime_top=0)
    h = jax.ShapeDtypeStruct((BATCH, HIDDEN), jnp.float32)
    calls = [(rms_norm, (x, params["norm"])), (matmul, (x, params["w1"])),
             (matmul, (h, params["w2"]))]
    for kernel, args in calls:
        t0 = time.perf_counter()
        result = kernel.tune(*args, grad=True, **fast)
        print(f"{kernel.name.rsplit('.', 1)[1]} {result.key}\n"
              f"  forward  {result.best}\n"
              f"  backward ({result.backward_backend}) {result.backward.kernel.rsplit('.', 1)[1]}"
              f" {result.backward.best}  [{time.perf_counter() - t0:.1f}s]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.1)
    args = p.parse_args()

    params, x, y = init(jax.random.key(0))
    tune_step(params, x, args.trials)

    g = jax.ShapeDtypeStruct((BATCH, HIDDEN), jnp.float32)
    print(f"\nthe gradient's matmul_bwd for x@w1 resolves: "
          f"{matmul.backward.config_for(x, params['w1'], g)}")

    step = jax.jit(jax.value_and_grad(loss))
    reference = jax.jit(jax.value_and_grad(functools.partial(
        loss, norm=rms_norm_reference, mm=matmul_reference)))
    (value, grads), (ref_value, ref_grads) = step(params, x, y), reference(params, x, y)
    err = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(
        jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True))
    finite = all(bool(jnp.isfinite(a).all()) for a in jax.tree_util.tree_leaves(grads))
    print(f"loss {float(value):.5f} (reference {float(ref_value):.5f}); max |grad - reference "
          f"grad| = {err:.3g}; all finite: {finite}")
    for i in range(args.steps):
        value, grads = step(params, x, y)
        params = jax.tree_util.tree_map(lambda p, g: p - args.lr * g, params, grads)
        print(f"step {i}: loss {float(value):.5f}")
    value, _ = step(params, x, y)
    print(f"after {args.steps} steps: loss {float(value):.5f}")


if __name__ == "__main__":
    main()
