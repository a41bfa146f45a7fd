"""The shipped kernels inside ``jax.shard_map`` with its defaults (``check_vma=True``), on four
host devices (issue 54): forward and ``jax.grad`` through the shard_map against the kernel's
plain-JAX reference in the same shard_map (a replicated weight's gradient is summed over the
shards, as JAX does for the reference), each config resolved for the per-shard shapes.

The device count must be set before JAX starts, so each kernel runs in a subprocess
(tests/shard_map_checks.py). On JAX 0.10 a CPU host refuses such a call with the way out (its
TPU interpreter hangs on some kernels there): that refusal is what is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import TESTS_DIR, subprocess_env

# name -> (the kernel's registered name, the per-shard shape its config must be resolved for:
# the first operand's).
PER_SHARD = {
    "matmul": ("pallas_tune.kernels.matmul.matmul", (64, 128)),
    "rms_norm": ("pallas_tune.kernels.rms_norm.rms_norm", (8, 160)),
    "flash_attention": ("pallas_tune.kernels.flash_attention.flash_attention", (1, 2, 64, 32)),
    "linear_attention": ("pallas_tune.kernels.linear_attention.linear_attention",
                         (1, 2, 64, 32)),
    "hstu_attention": ("pallas_tune.kernels.hstu_attention.hstu_attention", (1, 2, 64, 32)),
    "mamba2_ssd": ("pallas_tune.kernels.mamba2_ssd.mamba2_ssd", (1, 64, 64)),
    "grouped_matmul": ("pallas_tune.kernels.grouped_matmul.grouped_matmul", (128, 64)),
    "quantized_matmul": ("pallas_tune.kernels.quantized_matmul.quantized_matmul", (16, 128)),
    "quantized_grouped_matmul": (
        "pallas_tune.kernels.quantized_grouped_matmul.quantized_grouped_matmul", (128, 128)),
    "splash_attention": ("jax.ops.tpu.splash_attention", (1, 2, 128, 64)),
    "megablox_gmm": ("jax.ops.tpu.megablox.gmm", (128, 128)),
    "upstream_flash_attention": ("jax.ops.tpu.flash_attention", (1, 2, 128, 64)),
}


def _run(names):
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "shard_map_checks.py"),
                           *names], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["name"]: r for r in map(json.loads, proc.stdout.splitlines())}


@pytest.mark.parametrize("name", sorted(PER_SHARD))
def test_kernel_inside_shard_map_with_its_defaults(name):
    from pallas_tune._vma import interpreter_runs_sharded

    result = _run([name])[name]
    if not interpreter_runs_sharded():  # JAX 0.10: a clear refusal on a CPU host, no hang.
        assert "check_vma=False" in result["refused"] and "JAX 0.11" in result["refused"]
        return
    tol = 2e-2 if name.startswith("quantized") else 1e-4  # bf16 activations there.
    assert result["forward"] <= tol * max(result["scale"], 1.0), result
    for err in result.get("grads", []):
        assert err <= 1e-4, result
    assert result.get("finite", True), result
    # The config was resolved for the shard's shapes, never the global ones.
    kernel, shape = PER_SHARD[name]
    first = [s for s in result["shapes"] if s.startswith(f"('{kernel}',")]
    assert first and all(f"[{shape}" in s for s in first), result["shapes"]


@pytest.mark.libtpu
def test_deviceless_multichip_compile_inside_shard_map_resolves_for_the_mesh_chip():
    """Compiled for a 4-chip v6e topology from this CPU host (real Mosaic and XLA:TPU), flash
    attention forward and gradient inside a default shard_map: every call resolves its config
    for the mesh's chip (tpu_v6e, not the host's cpu) at the per-shard shape, and the compiled
    program holds the Mosaic kernels."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_tune.kernels.flash_attention import flash_attention
    from pallas_tune.runtime import tunable

    topo = topologies.get_topology_desc("v6e:2x2", platform="tpu",
                                        chips_per_host_bounds=[2, 2, 1])
    mesh = Mesh(np.array(topo.devices).reshape(4), ("x",))
    step = jax.shard_map(lambda q: flash_attention(q, q, q, causal=True), mesh=mesh,
                         in_specs=P("x"), out_specs=P("x"))
    q = jax.ShapeDtypeStruct((8, 4, 1024, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    seen = []

    def hook(kernel, args, kwargs):
        from pallas_tune import chips

        seen.append((kernel.name.rsplit(".", 1)[-1], chips.current_chip(), args[0].shape))

    with tunable.resolution_hook(hook):
        forward = jax.jit(step).lower(q).compile().as_text()
        grad = jax.jit(jax.grad(lambda q: jnp.sum(step(q).astype(jnp.float32)))).lower(q)
        backward = grad.compile().as_text()
    assert "tpu_custom_call" in forward and backward.count("tpu_custom_call") >= 2
    assert {name for name, _, _ in seen} == {"flash_attention", "flash_attention_bwd"}
    assert all(chip == "tpu_v6e" and shape == (2, 4, 1024, 128) for _, chip, shape in seen), seen
