"""A collective matmul inside ``jax.shard_map``: all_gather(x) @ y, the gather's ring transfers
overlapped with the matmul, on simulated devices of this CPU host (under a minute).

Tensor parallelism's first projection: the activations x are sharded along their rows (tokens)
over the "model" axis, the weight y along its columns; each device computes every token against
its own columns. On a CPU host the kernel runs on JAX's TPU interpreter, which simulates the
remote DMAs and semaphores between the devices (JAX 0.11+: 4 devices; JAX 0.10: 2); on a TPU
slice it is Mosaic's.

    python examples/collective_matmul.py
"""

from __future__ import annotations

import os

import jax

NEW = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
DEVICES = 4 if NEW else 2  # JAX 0.10's TPU interpreter hangs on the ring over more than 2.
# Four host devices either way (JAX 0.10's interpreter also hung with only two on the host).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_tune.kernels.collective_matmul import collective_matmul  # noqa: E402


def main() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:DEVICES]), ("model",),
                             axis_types=(AxisType.Auto,))
    tokens, hidden, out = 64 * DEVICES, 256, 256 * DEVICES
    x = jax.random.normal(jax.random.key(0), (tokens, hidden), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (hidden, out), jnp.float32) / 16
    # x's rows (64 a device) and w's columns (256 a device) are split by the shard_map below.

    def project(x, w):  # Inside the shard_map: x (64, 256) and w (256, 256) are the shards.
        return collective_matmul(x, w, axis_name="model", axis_size=DEVICES)

    # check_vma=False only where JAX 0.10 interprets it; from 0.11 the default works too.
    layer = jax.jit(jax.shard_map(project, mesh=mesh, in_specs=(P("model"), P(None, "model")),
                                  out_specs=P(None, "model"), check_vma=NEW))
    y = layer(x, w)
    want = np.asarray(x) @ np.asarray(w)
    print(f"{DEVICES} devices: y {y.shape} sharded {y.sharding.spec}; "
          f"max |y - x @ w| = {np.max(np.abs(np.asarray(y) - want)):.2e}")

    # The config used for the shard's shapes (the key names the axis and its size).
    shard = (jax.ShapeDtypeStruct((64, hidden), jnp.float32),
             jax.ShapeDtypeStruct((hidden, 256), jnp.float32))
    config = collective_matmul.config_for(*shard, axis_name="model", axis_size=DEVICES)
    print("config:", dict(config), "source:", config.source)
    # jax.grad through the shard_map works too (XLA's composed backward: a reduce-scatter for
    # x, the gathered x for w); tests/test_collective_matmul.py checks it.


if __name__ == "__main__":
    main()
