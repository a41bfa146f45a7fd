"""Shipped kernels under ``jax.jit`` on sharded arrays (no ``shard_map`` of the caller's), on
four host devices, and the calls ``autotune`` finds in sharded training steps.

Run as a script (the device count must be set before JAX starts): ``python
sharded_jit_checks.py MODE [MODE ...]`` with MODE ``explicit`` or ``auto`` (the mesh's axis
types; kernels, forward and gradient), ``steps`` (FSDP and TP steps, sharded-jit and
shard_map forms: the calls found) or ``tuned`` (an FSDP step autotuned), one JSON line per
check. tests/test_sharded_jit.py runs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from draws import normal  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pallas_tune.kernels.flash_attention import (  # noqa: E402
    flash_attention,
    flash_attention_reference,
)
from pallas_tune.kernels.matmul import matmul, matmul_reference  # noqa: E402
from pallas_tune.kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from pallas_tune.runtime import tunable  # noqa: E402




def _err(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b),
                               strict=True))


def _cases():
    """name -> (kernel call, reference, inputs, specs)."""
    q, kv = normal(3, (2, 4, 128, 64)), normal(4, (2, 2, 128, 64))
    return {
        "matmul": (matmul, matmul_reference, (normal(0, (256, 256)), normal(1, (256, 256))),
                   (P("x", None), P(None, "y"))),
        "rms_norm": (rms_norm, rms_norm_reference,
                     (normal(2, (4, 64, 256)), 1 + normal(5, (256,))), (P("x", "y"), P())),
        "flash_attention": (lambda q, kv: flash_attention(q, kv, kv),
                            lambda q, kv: flash_attention_reference(q, kv, kv), (q, kv),
                            (P("x", "y"), P("x", "y"))),
        "flash_attention_causal": (lambda q, kv: flash_attention(q, kv, kv, causal=True),
                                   lambda q, kv: flash_attention_reference(q, kv, kv, causal=True),
                                   (q, kv), (P("x", "y"), P("x", "y"))),
        # The contracted axis sharded: gathered for the call, warned about.
        "matmul_k_sharded": (matmul, matmul_reference,
                             (normal(0, (256, 256)), normal(1, (256, 256))),
                             (P(None, "x"), P("x", None))),
    }


def _more_cases():
    """The other shipped kernels with a rule (explicit axes only): name -> as _cases, and
    whether to differentiate."""
    from pallas_tune.kernels import grouped_matmul as gm
    from pallas_tune.kernels import hstu_attention as hs
    from pallas_tune.kernels import linear_attention as la
    from pallas_tune.kernels import quantized_grouped_matmul as qg
    from pallas_tune.kernels import quantized_matmul as qm
    from pallas_tune.kernels import upstream as up

    q = normal(3, (2, 4, 128, 64))
    heads = P("x", "y")
    return {
        **_upstream_and_mamba2(up, q, heads),
        "linear_attention": (la.linear_attention, la.linear_attention_reference,
                             (q, normal(5, q.shape), normal(6, q.shape)), (heads,) * 3, True),
        "hstu_attention": (hs.hstu_attention, hs.hstu_attention_reference,
                           (q, normal(5, q.shape), normal(6, q.shape), normal(7, (16,))),
                           (heads, heads, heads, P()), True),
        # Experts' columns split (the rows follow the routing: kept whole).
        "grouped_matmul": (gm.grouped_matmul, gm.grouped_matmul_reference,
                           (normal(8, (256, 64)), normal(10, (3, 64, 256)),
                            jnp.array([40, 0, 216], jnp.int32)), (P(), P(None, None, "y"), P()),
                           True),
        "quantized_matmul": (qm.quantized_matmul, qm.quantized_matmul_reference,
                             (normal(11, (32, 128)).astype(jnp.bfloat16),
                              (normal(9, (128, 256)) * 40).astype(jnp.int8),
                              jnp.abs(normal(12, (256,))) / 40), (P("x"), P(None, "y"), P("y")),
                             False),
        # Its reference (ragged_dot) types its result only outside the explicit mesh.
        "quantized_grouped_matmul": (
            qg.quantized_grouped_matmul, qg.quantized_grouped_matmul_reference,
            (normal(21, (256, 128)).astype(jnp.bfloat16),
             (normal(22, (3, 128, 256)) * 40).astype(jnp.int8),
             jnp.abs(normal(23, (3, 256))) / 40, jnp.array([40, 0, 216], jnp.int32)),
            (P(), P(None, None, "y"), P(None, "y"), P()), False),
    }


def _upstream_and_mamba2(up, q, heads):
    """JAX's kernels through their adapters, and Mamba-2's SSD (its batch split)."""
    from pallas_tune.kernels import mamba2_ssd as m2

    kv = normal(4, (2, 2, 128, 64))
    dt = jax.nn.softplus(normal(13, (2, 128, 4)) - 1.0)
    ssd = (normal(14, (2, 128, 4 * 32)), dt, -jnp.exp(normal(15, (4,))),
           normal(16, (2, 128, 16)) / 4, normal(17, (2, 128, 16)) / 4, normal(18, (4,)))
    batch = P("x")
    return {
        "upstream_flash_attention": (
            lambda q, k, v: up.flash_attention(q, k, v, causal=True),
            lambda q, k, v: flash_attention_reference(q, k, v, causal=True),
            (q, normal(5, q.shape), normal(6, q.shape)), (heads,) * 3, True),
        "upstream_splash_attention": (
            lambda q, kv: up.splash_attention(q, kv, kv),
            lambda q, kv: flash_attention_reference(q, kv, kv), (q, kv), (heads, heads), True),
        "upstream_megablox_gmm": (
            up.megablox_gmm, lambda x, w, g: up.grouped_matmul_reference(x, w, g),
            (normal(8, (256, 128)), normal(10, (3, 128, 256)),
             jnp.array([40, 0, 216], jnp.int32)), (P(), P(None, None, "y"), P()), True),
        "mamba2_ssd": (m2.mamba2_ssd, m2.mamba2_ssd_reference, ssd,
                       (batch, batch, P(), batch, batch, P()), True),
    }


AUTO = ("matmul", "matmul_k_sharded")


def kernels(mode: str) -> None:
    types = (AxisType.Explicit if mode == "explicit" else AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 2), ("x", "y"), axis_types=types)
    cases = {k: (*v, True) for k, v in _cases().items()}
    if mode == "explicit":
        cases.update(_more_cases())
    else:  # The same split through custom_partitioning: the matmul shows it.
        cases = {k: v for k, v in cases.items() if k in AUTO}
    for name, (fn, ref, inputs, specs, differentiable) in cases.items():
        loss = lambda f: (lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2))  # noqa: E731
        grad = (jax.grad(loss(ref), argnums=(0, 1)) if differentiable else
                lambda *a: jnp.zeros(()))
        # The references compiled whole: op by op they compiled each op (most of this run).
        want = jax.jit(lambda *a: (ref(*a), grad(*a)))(*inputs)
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(inputs, specs)]
        shapes = set()

        def hook(kernel, a, kw, shapes=shapes):
            shapes.add((kernel.name.rsplit(".", 1)[-1], tuple(x.shape for x in a)))

        ctx = jax.set_mesh(mesh) if mode == "explicit" else contextlib.nullcontext()
        with ctx, tunable.resolution_hook(hook), warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = jax.jit(fn)(*args)
            grads = (jax.jit(jax.grad(loss(fn), argnums=(0, 1)))(*args) if differentiable
                     else jnp.zeros(()))
            # Gathered or not: the matmuls' programs (a compile of their own) say.
            hlo = (jax.jit(fn).lower(*args).compile().as_text() if name.startswith("matmul")
                   else "")
        print(json.dumps({
            "mode": mode, "name": name, "forward": _err(out, want[0]),
            "grads": _err(grads, want[1]),
            "scale": float(np.max(np.abs(np.asarray(jax.tree_util.tree_leaves(want[1])[0])))),
            "out_scale": float(np.max(np.abs(np.asarray(want[0], np.float32)))),
            "spec": str(out.sharding.spec), "shapes": sorted(map(str, shapes)),
            "gathered": [str(w.message) for w in seen if "is gathered" in str(w.message)],
            "all_gather": "all-gather" in hlo}), flush=True)


def _step(params, x):
    h = rms_norm(x, params["norm"])
    return jnp.sum(matmul(h, params["w"]) ** 2)


def steps() -> None:
    """The calls find_calls (autotune's) meets in FSDP and TP steps, as sharded jit on an
    explicit mesh and as shard_map; the shapes they are keyed by."""
    from pallas_tune.step.program import find_calls

    params = {"norm": jnp.ones((256,)), "w": normal(0, (256, 512))}
    x = normal(1, (64, 256))
    layouts = {  # name -> (params' specs, the batch's spec)
        "fsdp": ({"norm": P(), "w": P("d", None)}, P("d", None)),
        "tp": ({"norm": P(), "w": P(None, "d")}, P()),
    }
    for layout, (pspec, xspec) in layouts.items():
        mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
        put = lambda a, s, mesh=mesh: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        p = jax.tree_util.tree_map(put, params, pspec)
        with jax.set_mesh(mesh), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = find_calls(jax.grad(_step), p, put(x, xspec))
        print(json.dumps({"step": f"{layout}/jit", "calls": sorted(
            f"{c.kernel.name.rsplit('.', 1)[-1]} {c.key}" for c in found)}), flush=True)
        auto = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Auto,))
        put = lambda a, s, mesh=auto: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
        with warnings.catch_warnings():  # Split when XLA partitions it (custom_partitioning).
            warnings.simplefilter("ignore")
            found = find_calls(jax.grad(_step), jax.tree_util.tree_map(put, params, pspec),
                               put(x, xspec))
        print(json.dumps({"step": f"{layout}/jit-auto", "calls": sorted(
            f"{c.kernel.name.rsplit('.', 1)[-1]} {c.key}" for c in found)}), flush=True)
        # check_vma=False: JAX 0.10 refuses a checking shard_map's kernels on a CPU host.
        def local(params, x, fsdp=layout == "fsdp"):  # The step as shard_map code writes it.
            if fsdp:  # FSDP: the weight gathered where it is used.
                params = {**params, "w": jax.lax.all_gather(params["w"], "d", tiled=True)}
            return _step(params, x)

        mapped = jax.shard_map(jax.grad(local), mesh=auto, in_specs=(pspec, xspec),
                               out_specs=pspec, check_vma=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = find_calls(mapped, params, x)
        print(json.dumps({"step": f"{layout}/shard_map", "calls": sorted(
            f"{c.kernel.name.rsplit('.', 1)[-1]} {c.key}" for c in found)}), flush=True)


def tuned() -> None:
    """autotune of an FSDP step as sharded jit (explicit mesh axes): each call tuned at its
    per-shard shapes, on one device, its result applied to the sharded step."""
    import pallas_tune as pt

    mesh = jax.make_mesh((4,), ("d",), axis_types=(AxisType.Explicit,))
    params = {"norm": jnp.ones((128,)), "w": normal(0, (128, 128))}
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    p = {"norm": put(params["norm"], P()), "w": put(params["w"], P("d", None))}
    x = put(normal(1, (64, 128)), P("d", None))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pt.autotune(jax.grad(_step), p, x, trials=1)
        with result:
            grads = jax.jit(jax.grad(_step))(p, x)
    def reference(q, y):
        return jnp.sum(matmul_reference(rms_norm_reference(y, q["norm"]), q["w"]) ** 2)

    want = jax.jit(jax.grad(reference))(params, normal(1, (64, 128)))
    print(json.dumps({"autotune": [[c.kernel.rsplit(".", 1)[-1], c.key, c.source]
                                   for c in result.calls],
                      "meshes": sorted({c.mesh for c in result.calls}), "table": str(result),
                      "grads": _err(grads, want), "spec": str(grads["w"].sharding.spec),
                      "scale": float(np.max(np.abs(np.asarray(want["w"]))))}),
          flush=True)


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        {"steps": steps, "tuned": tuned}.get(arg, lambda: kernels(arg))()
