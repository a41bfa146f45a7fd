"""The collective matmul (kernels/collective_matmul.py): an all-gather fused with the matmul,
inside ``jax.shard_map``.

Host-device checks run in one subprocess (the device count is set before JAX starts:
tests/collective_matmul_checks.py): on JAX 0.11+ four devices, forward (each config, with
and without the varying-axes check) and gradient against ``all_gather(x) @ y``, and the per-shard
key autotune meets; on JAX 0.10 two devices, and the clear refusal over four. Errors and a
deviceless compile for an 8-chip v6e (tp = 8) run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from conftest import TESTS_DIR, subprocess_env

from pallas_tune.errors import NoFeasibleConfigError, PallasTuneWarning


def _new_jax() -> bool:
    import jax

    return tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11)


@pytest.fixture(scope="module")
def checks():
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "collective_matmul_checks.py")],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_forward_matches_all_gather_then_dot(checks):
    """Every config (y streamed or resident in VMEM, one or several k chunks, the looked-up
    one), inside shard_map with and without check_vma: the gathered (tp·m, n) product."""
    rows = [r for r in checks if r["check"] == "forward"]
    devices = 4 if _new_jax() else 2
    assert len(rows) == (8 if _new_jax() else 4), rows
    for r in rows:
        assert r["devices"] == devices
        assert r["error"] <= 1e-5 * r["scale"], r
        assert r["shape"] == [devices * 16, devices * 256], r


def test_gradient_matches_the_reference(checks):
    """jax.grad through the shard_map: XLA's composed backward (a reduce-scatter of g @ yᵀ
    for x, the gathered x's product with g for y)."""
    rows = [r for r in checks if r["check"] == "gradient"]
    assert rows
    for r in rows:
        assert max(r["errors"]) <= 1e-6 * r["scale"], r


@pytest.mark.skipif(not _new_jax(), reason="JAX 0.10's TPU interpreter runs the kernel over "
                    "2 devices only; its refusal over 4 is checked instead")
def test_autotune_finds_the_per_shard_key_and_says_why_it_cannot_tune(checks):
    """A TP step's collective matmul is found at the device's shard (x 32x128 of 128x128, y
    128x128 of 128x512), keyed with the axis's name and size; autotune (each call on one
    device, outside the mesh) lists it untuned, naming why, rather than failing the step."""
    row = next(r for r in checks if r["check"] == "calls")
    key = 'x=32x128:float32,y=128x128:float32,axis_name="d",axis_size=4'
    assert row["keys"] == [f"collective_matmul {key}"], row
    [[kernel, found, source, mesh, error]] = row["autotune"]
    assert (kernel, found, source, mesh) == ("collective_matmul", key, "untuned", "d=4"), row
    assert "inside jax.shard_map" in error and "not bound" in error, error


@pytest.mark.skipif(_new_jax(), reason="JAX 0.11+ runs the kernel over 4 host devices")
def test_jax_0_10_refuses_more_than_two_devices_with_the_way_out(checks):
    row = next(r for r in checks if r["check"] == "refused")
    assert "JAX 0.11 or newer" in row["message"] and "hangs" in row["message"], row
    row = next(r for r in checks if r["check"] == "refused_mesh")  # Not a hang: refused.
    assert "a ring of 2 on a mesh of 4 devices" in row["message"], row


def _one_device_mesh_call(fn):
    import jax
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:1]), ("d",))
    return jax.shard_map(fn, mesh=mesh, in_specs=(P("d"), P(None, "d")), out_specs=P(None, "d"),
                         check_vma=False)


def test_bad_input_gets_a_clear_error():
    import jax.numpy as jnp

    from pallas_tune.kernels.collective_matmul import (
        AxisNotBoundError,
        collective_matmul,
        ring_free_standin,
    )

    x, y = jnp.ones((16, 256)), jnp.ones((256, 384))
    call = lambda **kw: (lambda x, y: collective_matmul(x, y, axis_name="d", **kw))  # noqa: E731
    # Explicit blocks that do not divide: refused by the space's constraint, named.
    with pytest.raises(ValueError, match=r"constraint bn_divides_n .* does not hold for bn=256"):
        _one_device_mesh_call(call(axis_size=1, bn=256, bk=128, y_resident=False))(x, y)
    with pytest.raises(ValueError, match=r"constraint bk_divides_k .* does not hold for bk=96"):
        _one_device_mesh_call(call(axis_size=1, bn=128, bk=96, y_resident=False))(x, y)
    # The kernel's own check (what a caller of its body meets), with the fix.
    raw = lambda **kw: (lambda x, y: ring_free_standin(x, y, axis_name="d", **kw))  # noqa: E731
    with pytest.raises(ValueError, match=r"bn=256 does not divide y's columns per device "
                                         r"\(384\): pick a bn that divides 384"):
        _one_device_mesh_call(raw(axis_size=1, bn=256, bk=128, y_resident=False))(x, y)
    with pytest.raises(ValueError, match=r"bk=96 does not divide the contracted k \(256\)"):
        _one_device_mesh_call(raw(axis_size=1, bn=128, bk=96, y_resident=False))(x, y)
    with pytest.raises(ValueError, match=r"axis_size=4 but the mesh axis 'd' has 1 devices: "
                                         r"pass axis_size=1"):
        _one_device_mesh_call(call(axis_size=4, bn=128, bk=128, y_resident=False))(
            x, jnp.ones((256, 512)))
    with pytest.raises(NoFeasibleConfigError, match=r"x_and_y_chain .* y=128x512"):
        _one_device_mesh_call(call(axis_size=1))(x, jnp.ones((128, 512)))
    with pytest.raises(ValueError, match=r"needs the shard's x \(m, k\) and y \(k, n\)"):
        _one_device_mesh_call(raw(axis_size=1, bn=128, bk=128, y_resident=False))(
            x, jnp.ones((128, 512)))
    # Outside shard_map: the axis is not bound; the error says where to call it. It is a
    # NoFeasibleConfigError too, so that autotune lists the call untuned instead of failing.
    with pytest.raises(AxisNotBoundError, match="call it inside jax.shard_map") as e:
        ring_free_standin(x, y, axis_name="d", axis_size=4, bn=128, bk=128, y_resident=False)
    assert isinstance(e.value, NoFeasibleConfigError) and isinstance(e.value, ValueError)
    with pytest.raises(ValueError, match="call it inside jax.shard_map"):
        collective_matmul(x, y, axis_name="d", axis_size=4, bn=128, bk=128, y_resident=False)
    # Over one device the gather is the identity: a plain matmul, inside shard_map or not.
    out = collective_matmul(x, y, axis_name="d", axis_size=1, bn=128, bk=128, y_resident=False)
    assert float(jnp.max(jnp.abs(out - x @ y))) == 0.0


def test_the_space_refuses_blocks_that_do_not_divide():
    """The tuner never proposes such a block: the space's constraints say so."""
    import jax
    import jax.numpy as jnp

    from pallas_tune.kernels.collective_matmul import collective_matmul

    x = jax.ShapeDtypeStruct((512, 5120), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((5120, 6400), jnp.bfloat16)
    statics = {"axis_name": "tp", "axis_size": 8}
    bad = collective_matmul.declared_problems({"bn": 1024, "bk": 5120, "y_resident": True},
                                              (x, y), statics)
    assert any("bn_divides_n" in v for v in bad), bad
    assert not collective_matmul.declared_problems({"bn": 3200, "bk": 5120, "y_resident": True},
                                                   (x, y), statics)


@pytest.mark.libtpu
def test_deviceless_compile_for_an_8_chip_v6e():
    """Compiled for v6e:2x4 (tp = 8) from this CPU host: Mosaic's kernel with its remote DMAs
    and barrier (no all-gather left to XLA), at the device's shard, resolved for tpu_v6e; and
    its gradient."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_tune import chips
    from pallas_tune.kernels.collective_matmul import collective_matmul
    from pallas_tune.runtime import tunable

    topo = topologies.get_topology_desc("v6e:2x4", platform="tpu", chips_per_host_bounds=[2, 4, 1])
    mesh = Mesh(np.array(topo.devices), ("tp",))
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("tp")))
    y = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P(None, "tp")))
    seen = set()

    def hook(kernel, args, kwargs):
        seen.add((kernel.name.rsplit(".", 1)[-1], chips.current_chip(),
                  tuple(a.shape for a in args)))

    mapped = jax.shard_map(lambda x, y: collective_matmul(x, y, axis_name="tp", axis_size=8),
                           mesh=mesh, in_specs=(P("tp"), P(None, "tp")), out_specs=P(None, "tp"))
    loss = lambda x, y: jnp.sum(mapped(x, y).astype(jnp.float32))  # noqa: E731
    with tunable.resolution_hook(hook), warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasTuneWarning)  # A miss at this shape.
        text = jax.jit(mapped).lower(x, y).compile().as_text()
        grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, y).compile().as_text()
    assert text.count("tpu_custom_call") == 1 and "all-gather" not in text
    # The gradient is XLA's (the reference's VJP, recomputed from x and y): x's cotangent
    # reduce-scattered, y's from the gathered x; the forward kernel is not needed for it.
    assert "reduce-scatter" in grad and "all-gather" in grad
    assert seen == {("collective_matmul", "tpu_v6e", ((128, 1024), (1024, 256)))}, seen
