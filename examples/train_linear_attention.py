"""Train through linear attention with decay (retention): its Pallas backward (a dQ pass and a
dK/dV pass over the chunks) tuned, then looked up when the gradient is traced.

A toy retention layer: a sequence of 200 tokens (deliberately not a multiple of the chunks)
projected to q, k, v per head, linear attention with decay 0.95, merged back, and a regression
loss on the output. The attention call is tuned with ``grad=True``: its forward, then
``linear_attention_bwd`` for the backward's shapes, each into its own cache entry.
``jax.jit(jax.value_and_grad(loss))`` then resolves both configs from the cache, a few SGD
steps run, and the gradient is checked against XLA's autodiff of the forward's plain-JAX
recurrence (``jax.vjp`` of ``lax.scan``).

On a CPU host the kernels run in Pallas interpret mode: the times printed are interpreter wall
clock (they track grid steps, not TPU speed).

    python examples/train_linear_attention.py [--trials 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_tune.kernels.linear_attention import linear_attention, linear_attention_reference

BATCH, HEADS, TOKENS, DIM, DECAY, LR = 1, 2, 200, 32, 0.95, 1e-3


def layer(params, x, *, attention=linear_attention):
    """x (batch, tokens, dim) -> (batch, tokens, dim): per-head q, k, v, retention, merge."""
    def heads(w):
        return jnp.einsum("bsd,hde->bhse", x, w)

    out = attention(heads(params["wq"]), heads(params["wk"]), heads(params["wv"]), decay=DECAY)
    return jnp.einsum("bhse,hed->bsd", out, params["wo"])


def loss(params, x, y, **ops):
    return jnp.mean(jnp.square(layer(params, x, **ops) - y))


def init(key):
    ks = jax.random.split(key, 5)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * shape[-2] ** -0.5  # noqa: E731
    params = {name: w(k, (HEADS, DIM, DIM)) for name, k in zip(("wq", "wk", "wv", "wo"), ks)}
    x = jax.random.normal(ks[4], (BATCH, TOKENS, DIM), jnp.float32)
    return params, x, jnp.roll(x, 1, axis=1)  # Target: the previous token's embedding.


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    params, x, y = init(jax.random.key(0))

    # The attention call's arguments, as the step makes them, tuned for training.
    q = jnp.einsum("bsd,hde->bhse", x, params["wq"])
    t0 = time.perf_counter()
    res = linear_attention.tune(q, q, q, decay=DECAY, grad=True, trials=a.trials, seed=0)
    print(f"tuned in {time.perf_counter() - t0:.1f}s: forward {dict(res.best)}, backward "
          f"({res.backward_backend}) {dict(res.backward.best)}")

    step = jax.jit(jax.value_and_grad(loss))
    value, grads = step(params, x, y)
    ref = jax.grad(functools.partial(loss, attention=linear_attention_reference))(params, x, y)
    for name in params:
        np.testing.assert_allclose(grads[name], ref[name], rtol=1e-4,
                                   atol=1e-5 * float(jnp.abs(ref[name]).max()))
    print(f"gradient matches the reference's (jax.vjp) for {', '.join(sorted(params))}")
    for i in range(a.steps):
        params = jax.tree.map(lambda w, g: w - LR * g, params, grads)
        value, grads = step(params, x, y)
        print(f"step {i + 1}: loss {float(value):.5f}")


if __name__ == "__main__":
    main()
