"""The collective matmul inside ``jax.shard_map`` on host devices (TPU interpreter: remote DMAs
and semaphores simulated), against ``all_gather(x) @ y``.

Run as a script (the device count must be set before JAX starts): ``python
collective_matmul_checks.py`` prints one JSON line per check: forward errors per config (and
per ``check_vma``), the gradient's error, the keys autotune's ``find_calls`` meets, and what
JAX 0.10 says over 4 devices. tests/test_collective_matmul.py runs it.
"""

from __future__ import annotations

import json
import os
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from draws import normal  # noqa: E402
from jax.sharding import AxisType, Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_tune.kernels.collective_matmul import collective_matmul  # noqa: E402

NEW = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)
SPECS = dict(in_specs=(P("d"), P(None, "d")), out_specs=P(None, "d"))


def _mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("d",), axis_types=(AxisType.Auto,))


def _inputs(n, m=16, k=256, cols=256, dtype=jnp.float32):
    # Drawn with numpy (draws.py): jax.random compiles a program for every new shape.
    return normal(0, (n * m, k), dtype), normal(1, (k, n * cols), dtype)


def _err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


def forward(n):
    x, y = _inputs(n)
    want = x @ y
    configs = [dict(bn=128, bk=128, y_resident=False), dict(bn=256, bk=256, y_resident=True),
               dict(bn=128, bk=64, y_resident=True), {}]  # {}: the config looked up.
    for config in configs:
        for vma in (False, True) if NEW else (False,):
            fn = lambda x, y, c=config: collective_matmul(  # noqa: E731
                x, y, axis_name="d", axis_size=n, **c)
            out = jax.jit(jax.shard_map(fn, mesh=_mesh(n), check_vma=vma, **SPECS))(x, y)
            print(json.dumps({"check": "forward", "devices": n, "config": config, "vma": vma,
                              "error": _err(out, want), "scale": float(jnp.max(jnp.abs(want))),
                              "shape": list(out.shape)}), flush=True)


def gradient(n):
    x, y = _inputs(n)

    def loss(fn, vma):
        mapped = jax.shard_map(fn, mesh=_mesh(n), check_vma=vma, **SPECS)
        return lambda x, y: jnp.sum(mapped(x, y) ** 2)

    want = jax.grad(lambda x, y: jnp.sum((x @ y) ** 2), argnums=(0, 1))(x, y)
    for vma in (False, True) if NEW else (False,):
        got = jax.jit(jax.grad(loss(lambda x, y: collective_matmul(
            x, y, axis_name="d", axis_size=n), vma), argnums=(0, 1)))(x, y)
        print(json.dumps({"check": "gradient", "devices": n, "vma": vma,
                          "errors": [_err(a, b) for a, b in zip(got, want)],
                          "scale": max(float(jnp.max(jnp.abs(w))) for w in want)}), flush=True)


def calls(n):
    """The (kernel, key) autotune meets in a TP step's shard_map: the per-device shard's."""
    import pallas_tune as pt
    from pallas_tune.step.program import find_calls

    x, y = _inputs(n, m=32, k=128, cols=128)

    def step(x, y):
        return jnp.sum(collective_matmul(x, y, axis_name="d", axis_size=n) ** 2)

    mapped = jax.shard_map(jax.grad(step, argnums=1), mesh=_mesh(n), in_specs=SPECS["in_specs"],
                           out_specs=P(None, "d"), check_vma=False)
    found = find_calls(mapped, x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pt.autotune(mapped, x, y, trials=1)
    print(json.dumps({"check": "calls", "devices": n,
                      "keys": sorted(f"{c.kernel.name.rsplit('.', 1)[-1]} {c.key}"
                                     for c in found),
                      "autotune": [[c.kernel.rsplit(".", 1)[-1], c.key, c.source, c.mesh,
                                    c.error] for c in result.calls]}),
          flush=True)


def refused(n):
    x, y = _inputs(n)
    fn = lambda x, y: collective_matmul(x, y, axis_name="d", axis_size=n)  # noqa: E731
    try:
        jax.jit(jax.shard_map(fn, mesh=_mesh(n), check_vma=False, **SPECS))(x, y)
        message = ""
    except NotImplementedError as e:
        message = str(e)
    print(json.dumps({"check": "refused", "devices": n, "message": message}), flush=True)


def refused_in_a_larger_mesh():
    """A ring of 2 on a (2, 2) mesh: JAX 0.10 simulates all 4 devices, and hung there."""
    x, y = _inputs(2)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("other", "d"),
                axis_types=(AxisType.Auto,) * 2)
    fn = lambda x, y: collective_matmul(x, y, axis_name="d", axis_size=2)  # noqa: E731
    try:
        jax.jit(jax.shard_map(fn, mesh=mesh, check_vma=False, **SPECS))(x, y)
        message = ""
    except NotImplementedError as e:
        message = str(e)
    print(json.dumps({"check": "refused_mesh", "message": message}), flush=True)


if __name__ == "__main__":
    if NEW:
        forward(4)
        gradient(4)
        calls(4)
    else:  # JAX 0.10: its TPU interpreter runs the ring over 2 devices, hangs over more.
        forward(2)
        gradient(2)
        refused(4)
        refused_in_a_larger_mesh()
