"""Tune Pallas kernels you did not write, for TPU v6e, on a CPU host.

Two of JAX's own TPU kernels (``jax.experimental.pallas.ops.tpu``), declared tunable without
editing their source:

- ``matmul``: a function jitted with static block sizes, one of them a tuple
  (``block_shape=(bm, bn)``). ``pallas_tune.tunable(fn, ...)`` wraps the function as it is;
  tuple choices are served as tuples, so its ``jax.jit`` static arguments stay hashable.
- ``flash_attention``: its block sizes live in an argument object (``BlockSizes``). A four-line
  adapter, the tunable, builds that object from the tuned parameters.

Both are tuned with ``timer="tpu-estimate"``: the real Mosaic and XLA:TPU compiler for v6e runs
here, on the CPU, and each config gets libtpu's static cycle estimate. Every time printed is that
ESTIMATE (or the model's figure where libtpu gives none, labelled), not a measurement. Then a
call made for v6e looks its config up in the cache, and its program is the one a hand-written
config gives. Without libtpu (``pip install 'pallas-tune[tpu]'``) the matmul is tuned on this
host instead, in Pallas interpret mode, whose times track grid steps, not TPU speed.

The tunables are module-level names so that the tuner's worker processes can import them (a
tunable made inside a function cannot be sent to a worker).

    python examples/tune_third_party.py [--trials 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import re

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import flash_attention as upstream_flash
from jax.experimental.pallas.ops.tpu import matmul as upstream_matmul

import pallas_tune as pt


def matmul_reference(x, y, **_):
    return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


# 1. The kernel as its authors wrote it: jitted, block sizes static, one of them a tuple.
matmul = pt.tunable(
    upstream_matmul.matmul, name="jax.ops.tpu.matmul",
    block_shape=[(128, 128), (256, 256), (512, 512), (256, 512), (512, 256)],
    block_k=[128, 256, 512],
    constraints={"tiles_divide": "x.shape[0] % block_shape[0] == 0 and "
                                 "y.shape[1] % block_shape[1] == 0 and x.shape[1] % block_k == 0"},
    default={"block_shape": (128, 128), "block_k": 128},
    reference=matmul_reference)


def attention_reference(q, k, v):
    return upstream_flash.mha_reference(q, k, v, None, causal=True, sm_scale=1.0)


# 2. Block sizes in an argument object: an adapter builds it from the tuned parameters.
@pt.tunable(name="jax.ops.tpu.flash_attention", block_q=[128, 256, 512], block_k=[128, 256, 512],
            constraints={"q_tiles": "q.shape[2] % block_q == 0",
                         "k_tiles": "k.shape[2] % block_k == 0"},
            default={"block_q": 128, "block_k": 128}, reference=attention_reference)
def flash_attention(q, k, v, *, block_q, block_k):
    sizes = upstream_flash.BlockSizes(block_q=block_q, block_k_major=block_k, block_k=block_k,
                                      block_b=1)
    return upstream_flash.flash_attention(q, k, v, causal=True, block_sizes=sizes)


def show(result, params) -> None:
    """The configs that ran, best first, what was refused and why, and the winner against the
    default."""
    rows = result.trials.sort_values("median_ms")
    ran = rows[rows["outcome"] == "ok"]
    print(ran[[*params, "median_ms"]].to_string(index=False))
    refused = rows[rows["outcome"] != "ok"]["outcome"].value_counts()
    if len(refused):
        print("not timed: " + ", ".join(f"{n} {why}" for why, n in refused.items()))
    print(f"winner {result.best}: {result.best_ms:.4f} ms, {result.speedup:.2f}x the default "
          f"({result.provenance['timing_note']})\n")


def lowered(fn, *args) -> str:
    """The program a call lowers to for TPU, without source locations and the module name."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    return re.sub(r"loc\(.*?\)|#loc\d*( = .*)?|module @\w+", "", text)


def on_cpu(trials: int) -> None:
    x = jnp.asarray(jax.random.normal(jax.random.key(0), (512, 512)), jnp.float32)
    print("libtpu is not installed (pip install 'pallas-tune[tpu]' for v6e estimates): tuning "
          "the matmul on this host, in interpret mode\n")
    result = matmul.tune(x, x, trials=trials, seed=0)
    show(result, ["block_shape", "block_k"])
    out = matmul(x, x)
    assert float(jnp.max(jnp.abs(out - matmul_reference(x, x)))) < 1e-2


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    a = p.parse_args()
    if importlib.util.find_spec("libtpu") is None:
        on_cpu(a.trials)
        return
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)
    qkv = jax.ShapeDtypeStruct((1, 4, 1024, 128), jnp.bfloat16)
    estimate = dict(timer="tpu-estimate", chip="v6e", trials=a.trials, workers=1, seed=0)

    print(f"JAX's matmul, {matmul.cache_key(x, x)}, v6e compiler estimates:")
    show(matmul.tune(x, x, **estimate), ["block_shape", "block_k"])
    print(f"JAX's flash attention (causal), {flash_attention.cache_key(qkv, qkv, qkv)}:")
    show(flash_attention.tune(qkv, qkv, qkv, **estimate), ["block_q", "block_k"])

    # Serving: a call traced for v6e takes its config from the cache, and lowers to the very
    # program that writing the config by hand gives.
    with pt.target("v6e"):
        config = matmul.config_for(x, x)
        same = lowered(matmul, x, x) == lowered(
            lambda x, y: upstream_matmul.matmul(x, y, **dict(config)), x, x)
        attention = flash_attention.config_for(qkv, qkv, qkv)
    print(f"a v6e call of the matmul uses {dict(config)} (source: {config.source}); its program "
          f"is the hand-written config's: {same}")
    print(f"a v6e call of flash attention uses {dict(attention)} (source: {attention.source})")
    assert config.source == "cache" and attention.source == "cache" and same


if __name__ == "__main__":
    main()
