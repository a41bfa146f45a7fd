"""Every shipped kernel inside ``jax.shard_map`` with its defaults, on host devices.

Run as a script (the device count must be set before JAX starts): ``python shard_map_checks.py
NAME [NAME ...]`` prints one JSON line per kernel: the forward's and each gradient's largest
error against the kernel's plain-JAX reference run in the same shard_map (unchecked: some
references' scans start from an invariant carry), and the shapes the
kernel resolved its config for (the per-shard ones). tests/test_shard_map.py runs it.
"""

from __future__ import annotations

import json
import os
import sys

DEVICES = 4
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={DEVICES}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from draws import normal, standard  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def _cases():
    """name -> (kernel, reference, global inputs, in_specs, out_spec, argnums to differentiate)."""
    from pallas_tune.kernels import flash_attention as fa
    from pallas_tune.kernels import grouped_matmul as gm
    from pallas_tune.kernels import hstu_attention as hs
    from pallas_tune.kernels import linear_attention as la
    from pallas_tune.kernels import mamba2_ssd as ms
    from pallas_tune.kernels import quantized_grouped_matmul as qg
    from pallas_tune.kernels import matmul as mm
    from pallas_tune.kernels import quantized_matmul as qm
    from pallas_tune.kernels import rms_norm as rn
    from pallas_tune.kernels import upstream as up
    from pallas_tune.kernels._attention import flash_attention_reference as attention

    q = normal(3, (DEVICES, 2, 64, 32))
    sizes = np.array([40, 0, 88], np.int32)
    w_q = jnp.asarray((standard(9, (128, 64)) * 40).astype(np.int8))
    rows = P("x")
    b, t, h, p, n = DEVICES, 64, 4, 16, 8
    ssm = tuple(map(jnp.asarray, (
        standard(13, (b, t, h * p)), np.logaddexp(0.0, standard(14, (b, t, h)) - 1.0),  # softplus
        -np.exp(np.linspace(0.0, 2.5, h, dtype=np.float32)), standard(15, (b, t, n)) / 3,
        standard(16, (b, t, n)) / 3, standard(17, (h,)))))
    q128 = normal(18, (DEVICES, 2, 128, 64))
    kv128 = (normal(19, q128.shape), normal(20, q128.shape))
    causal = lambda f: lambda q, k, v: f(q, k, v, causal=True)  # noqa: E731
    return {
        # The weight is replicated: its gradient is the sum over the shards (a psum).
        "matmul": (mm.matmul, mm.matmul_reference, (normal(0, (256, 128)), normal(1, (128, 96))),
                   (rows, P()), rows, (0, 1)),
        "rms_norm": (rn.rms_norm, rn.rms_norm_reference,
                     (normal(2, (DEVICES * 8, 160)), normal(4, (160,))), (rows, P()), rows,
                     (0, 1)),
        "flash_attention": (lambda q, k, v: fa.flash_attention(q, k, v, causal=True),
                            lambda q, k, v: fa.flash_attention_reference(q, k, v, causal=True),
                            (q, normal(5, q.shape), normal(6, q.shape)), (rows,) * 3, rows,
                            (0, 1, 2)),
        "linear_attention": (la.linear_attention, la.linear_attention_reference,
                             (q, normal(5, q.shape), normal(6, q.shape)), (rows,) * 3, rows,
                             (0, 1, 2)),
        "hstu_attention": (hs.hstu_attention, hs.hstu_attention_reference,
                           (q, normal(5, q.shape), normal(6, q.shape),
                            normal(7, (16,))), (rows, rows, rows, P()), rows, (0, 1, 2, 3)),
        # Experts (groups) replicated, the rows of every group sharded: each shard's own sizes.
        "grouped_matmul": (gm.grouped_matmul, gm.grouped_matmul_reference,
                           (normal(8, (DEVICES * 128, 64)), normal(10, (3, 64, 96)),
                            jnp.asarray(np.tile(sizes, DEVICES))),
                           (rows, P(), rows), rows, (0, 1)),
        "quantized_matmul": (qm.quantized_matmul, qm.quantized_matmul_reference,
                             (normal(11, (DEVICES * 16, 128), jnp.bfloat16), w_q,
                              jnp.asarray(np.abs(standard(12, (64,))) / 40)),
                             (rows, P(), P()), rows, ()),
        "mamba2_ssd": (ms.mamba2_ssd, ms.mamba2_ssd_reference, ssm,
                       (rows, rows, P(), rows, rows, P()), rows, (0, 1, 2, 3, 4, 5)),
        "quantized_grouped_matmul": (
            qg.quantized_grouped_matmul, qg.quantized_grouped_matmul_reference,
            (normal(21, (DEVICES * 128, 128), jnp.bfloat16),
             jnp.asarray((standard(22, (3, 128, 64)) * 40).astype(np.int8)),
             jnp.asarray(np.abs(standard(23, (3, 64))) / 40),
             jnp.asarray(np.tile(sizes, DEVICES))),
            (rows, P(), P(), rows), rows, ()),
        # Upstream kernels, as MaxText runs them: inside a shard_map over the batch.
        "splash_attention": (causal(up.splash_attention), causal(attention), (q128, *kv128),
                             (rows,) * 3, rows, (0, 1, 2)),
        "megablox_gmm": (up.megablox_gmm, gm.grouped_matmul_reference,
                         (normal(24, (DEVICES * 128, 128)), normal(25, (3, 128, 128)),
                          jnp.asarray(np.tile(sizes, DEVICES))), (rows, P(), rows), rows, (0, 1)),
        "upstream_flash_attention": (causal(up.flash_attention), causal(attention),
                                     (q128, *kv128), (rows,) * 3, rows, (0, 1, 2)),
    }


def _loss(f):
    return lambda *a: jnp.sum(jnp.square(f(*a).astype(jnp.float32)))


def check(name):
    from pallas_tune.runtime import tunable

    kernel, reference, inputs, in_specs, out_spec, argnums = _cases()[name]
    mesh = jax.make_mesh((DEVICES,), ("x",))
    inputs = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inputs, in_specs))
    seen = []

    def hook(k, args, kwargs):  # Records the shapes each call resolves its config for.
        seen.append((k.name, [tuple(getattr(a, "shape", ())) for a in args]))

    def sharded(f, check_vma=True):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_spec,
                             check_vma=check_vma)

    with tunable.resolution_hook(hook):
        got = jax.jit(sharded(kernel))(*inputs)
    want = jax.jit(sharded(reference, False))(*inputs)
    result = {"name": name, "forward": float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                                             - want.astype(jnp.float32)))),
              "scale": float(jnp.max(jnp.abs(want.astype(jnp.float32)))),
              "shapes": sorted({str(s) for s in seen})}
    if argnums:
        with jax.set_mesh(mesh) if hasattr(jax, "set_mesh") else _null():
            g = jax.jit(jax.grad(_loss(sharded(kernel)), argnums=argnums))(*inputs)
            r = jax.jit(jax.grad(_loss(sharded(reference, False)), argnums=argnums))(*inputs)
        result["grads"] = [float(jnp.max(jnp.abs(a - b)) / max(float(jnp.max(jnp.abs(b))), 1e-30))
                           for a, b in zip(g, r)]
        result["finite"] = bool(all(bool(jnp.isfinite(a).all()) for a in g))
    return result


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    for n in sys.argv[1:]:
        try:
            print(json.dumps(check(n)), flush=True)
        except NotImplementedError as e:  # JAX 0.10 on a CPU host: refused, with the way out.
            print(json.dumps({"name": n, "refused": str(e)}), flush=True)
