"""Shipped kernels under ``jax.jit`` on sharded arrays, without a ``shard_map`` of the caller's:
each kernel splits itself by its declared ``partition=`` rule (pallas_tune.runtime.partition),
forward and gradient, its config resolved for the shard's shapes; autotune finds a sharded
step's calls at those shapes, as jit and as shard_map alike.

Host-device checks run in one subprocess (the device count is set before JAX starts:
tests/sharded_jit_checks.py); deviceless compiles for a 4-chip v6e run here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
from conftest import TESTS_DIR, subprocess_env

from pallas_tune.errors import PallasTuneWarning, SearchSpaceError


@pytest.fixture(scope="module")
def checks():
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, os.path.join(TESTS_DIR, "sharded_jit_checks.py"),
                           "explicit", "auto", "steps", "tuned"], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


# name -> (the kernels resolved, each with the first operand's per-shard shape; the output's
# spec). Global shapes: matmul 256x256 @ 256x256 over a 2x2 mesh ("x", "y"); rms_norm
# (4, 64, 256); flash attention q (2, 4, 128, 64), k and v (2, 2, 128, 64).
EXPECTED = {
    "matmul": ({"matmul": (128, 256), "matmul_bwd": (128, 256)}, "P('x', 'y')"),
    "rms_norm": ({"rms_norm": (2, 32, 256), "rms_norm_bwd": (2, 32, 256)}, "P('x', 'y'"),
    "flash_attention": ({"flash_attention": (1, 2, 128, 64),
                         "flash_attention_bwd": (1, 2, 128, 64)}, "P('x', 'y'"),
    "flash_attention_causal": ({"flash_attention": (1, 2, 128, 64),
                                "flash_attention_bwd": (1, 2, 128, 64)}, "P('x', 'y'"),
    # The contracted axis gathered: each device runs the whole product.
    "matmul_k_sharded": ({"matmul": (256, 256), "matmul_bwd": (256, 256)}, "P("),
    # Explicit axes only: q, k, v (2, 4, 128, 64); grouped_matmul rhs (3, 64, 256) split along
    # n; quantized_matmul x (32, 128) bf16, its int8 weight (128, 256) (forward only).
    "linear_attention": ({"linear_attention": (1, 2, 128, 64),
                          "linear_attention_bwd": (1, 2, 128, 64)}, "P('x', 'y'"),
    "hstu_attention": ({"hstu_attention": (1, 2, 128, 64),
                        "hstu_attention_bwd": (1, 2, 128, 64)}, "P('x', 'y'"),
    "grouped_matmul": ({"grouped_matmul": (256, 64), "grouped_matmul_bwd": (256, 64)},
                       "P(None, 'y')"),
    "quantized_matmul": ({"quantized_matmul": (16, 128)}, "P('x', 'y')"),
    "quantized_grouped_matmul": ({"quantized_grouped_matmul": (256, 128)}, "P(None, 'y')"),
    # JAX's kernels through their adapters (flash: k, v as q; splash: k, v (2, 2, 128, 64);
    # megablox: lhs (256, 128), rhs (3, 128, 256) split along n), and Mamba-2's SSD, x
    # (2, 128, 128) split along its batch.
    "upstream_flash_attention": ({"flash_attention": (1, 2, 128, 64),
                                  "flash_attention_bwd": (1, 2, 128, 64)}, "P('x', 'y'"),
    "upstream_splash_attention": ({"splash_attention": (1, 2, 128, 64),
                                   "splash_attention_bwd": (1, 2, 128, 64)}, "P('x', 'y'"),
    "upstream_megablox_gmm": ({"gmm": (256, 128), "gmm_bwd": (256, 128)}, "P(None, 'y')"),
    "mamba2_ssd": ({"mamba2_ssd": (1, 128, 128)}, "P('x'"),
}
AUTO = ("matmul", "matmul_k_sharded")


@pytest.mark.parametrize("mode", ["explicit", "auto"])
def test_kernels_split_by_their_rule_forward_and_gradient(checks, mode):
    """Explicit mesh axes: the kernel's own shard_map, every shipped kernel with a rule;
    automatic ones: custom_partitioning (this CPU host's XLA runs its callback), the matmul.
    Against the reference on the whole arrays; the configs resolved at the shard's shapes,
    never the global ones."""
    rows = {r["name"]: r for r in checks if r.get("mode") == mode}
    expected = {k: v for k, v in EXPECTED.items() if mode == "explicit" or k in AUTO}
    assert set(rows) == set(expected)
    for name, (kernels, spec) in expected.items():
        r = rows[name]
        tol = 2e-2 if name.startswith("quantized") else 1e-5  # bf16 results there.
        assert r["forward"] <= tol * max(r["out_scale"], 1.0), r
        assert r["grads"] <= 1e-5 * max(r["scale"], 1.0), r
        assert r["spec"].startswith(spec), r
        resolved = {}
        for s in r["shapes"]:
            kernel, shapes = eval(s)  # noqa: S307  Our own repr of (name, shapes).
            resolved.setdefault(kernel, set()).add(shapes[0])
        assert resolved == {k: {v} for k, v in kernels.items()}, r["shapes"]
    assert not rows["matmul"]["all_gather"]  # Split, not gathered.
    assert rows["matmul_k_sharded"]["all_gather"]


def test_a_dimension_that_cannot_be_split_is_gathered_with_a_warning(checks):
    row = next(r for r in checks if r.get("mode") == "explicit"
               and r["name"] == "matmul_k_sharded")
    assert row["gathered"] and "'K'" in row["gathered"][0], row
    assert "jax.shard_map" in row["gathered"][0]
    assert not next(r for r in checks if r.get("mode") == "explicit"
                    and r["name"] == "matmul")["gathered"]


def test_a_sharded_step_s_calls_are_found_at_their_per_shard_shapes(checks):
    """autotune's find_calls on FSDP and TP training steps (rms_norm then matmul, jax.grad) on
    four devices: the sharded-jit form (explicit mesh axes: at trace time; automatic ones: the
    program compiled, its calls met as XLA splits them) and the shard_map form find the same
    calls, each at its per-shard shape, each distinct (kernel, key) once."""
    steps = {r["step"]: r["calls"] for r in checks if "step" in r}
    assert steps["fsdp/jit"] == steps["fsdp/shard_map"] == steps["fsdp/jit-auto"]
    assert steps["tp/jit"] == steps["tp/shard_map"] == steps["tp/jit-auto"]
    assert "matmul x=16x256:float32,y=256x512:float32" in steps["fsdp/jit"]  # Rows / 4.
    assert "matmul x=64x256:float32,y=256x128:float32" in steps["tp/jit"]  # Columns / 4.
    for calls in steps.values():
        assert len(calls) == len(set(calls)) == 4, calls


def test_autotune_of_a_sharded_jit_step_tunes_each_shard_shape_once(checks):
    """pt.autotune of an FSDP step's gradient under an explicit 4-device mesh: every call
    tuned (on one device, outside the step's mesh: before, each candidate traced under it was
    refused as a sharding type error, and the matmuls came back untuned) at its shard's
    shapes, each naming the mesh it is a shard of, and the result applied to the sharded step
    gives the reference's gradients."""
    row = next(r for r in checks if "autotune" in r)
    assert [c[2] for c in row["autotune"]] == ["tuned"] * 4, row
    assert ["matmul", "x=16x128:float32,y=128x128:float32", "tuned"] in row["autotune"]
    assert row["grads"] <= 1e-5 * row["scale"], row
    assert row["spec"] == "P('d', None)"
    assert row["meshes"] == ["d=4"]  # Each call's key is a shard's of this mesh, and says so.
    assert "(a shard over d=4)" in row["table"]


def test_partition_rules_are_checked_when_declared_and_when_called():
    import jax
    import jax.numpy as jnp

    import pallas_tune as pt
    from pallas_tune.runtime import partition, partition_plan

    with pytest.raises(SearchSpaceError, match="OPERANDS -> RESULTS"):
        pt.tunable(b=[1], name="bad_rule", partition="m K, K n")(lambda x, *, b: x)
    with pytest.raises(SearchSpaceError, match="is not a list of dimension names"):
        partition.parse("m K, K n. -> m n")
    rule = partition.parse("... D, D -> ... D")
    dims = partition_plan.expand("k", rule, [(4, 8, 16), (16,)], [(4, 8, 16)])
    assert dims.operands == [("ell1", "ell0", "D"), ("D",)]
    with pytest.raises(SearchSpaceError, match="gives operand 0 the dimensions m K"):
        partition_plan.expand("k", partition.parse("m K, K n -> m n"), [(4,), (4, 2)], [(4, 2)])
    # A cotangent is summed over the mesh axes of the split names its operand lacks.
    assert partition_plan.summed({"m": ("x",), "n": ("y",)}, ("K", "n"), (8, 4)) == ("x",)
    assert partition_plan.summed({"h": ("y",)}, ("b", "h"), (2, 1)) == ("y",)  # Broadcast.
    # Unsharded operands: the call's usual path, not a partitioned one.
    assert not partition.sharded(None, [jnp.ones((4, 4))])
    assert not partition.sharded(None, [jax.ShapeDtypeStruct((4, 4), jnp.float32)])


def _v6e_mesh(axis_type):
    import numpy as np
    from jax.experimental import topologies
    from jax.sharding import Mesh

    topo = topologies.get_topology_desc("v6e:2x2", platform="tpu",
                                        chips_per_host_bounds=[2, 2, 1])
    return Mesh(np.array(topo.devices).reshape(2, 2), ("data", "model"),
                axis_types=(axis_type,) * 2)


@pytest.mark.libtpu
def test_deviceless_multichip_compile_of_sharded_jit_without_shard_map():
    """Compiled for a 4-chip v6e from this CPU host (real Mosaic and XLA:TPU): flash attention
    (causal), matmul and rms_norm under jax.jit on sharded operands, forward and gradient, with
    no shard_map of the caller's. Before, Mosaic refused ('cannot be automatically
    partitioned'); now each call is the kernel on its shard, resolved for tpu_v6e there."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_tune import chips
    from pallas_tune.kernels.flash_attention import flash_attention
    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.kernels.rms_norm import rms_norm
    from pallas_tune.runtime import tunable

    mesh = _v6e_mesh(AxisType.Explicit)

    def sds(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    q = sds((8, 8, 1024, 128), P("data", "model"))
    x, w, g = sds((1024, 512), P("data")), sds((512, 1024), P(None, "model")), sds((512,), P())
    cases = [(lambda q: flash_attention(q, q, q, causal=True), (q,)), (matmul, (x, w)),
             (rms_norm, (x, g))]
    seen = set()

    def hook(kernel, args, kwargs):
        seen.add((kernel.name.rsplit(".", 1)[-1], chips.current_chip(), args[0].shape))

    with jax.set_mesh(mesh), tunable.resolution_hook(hook), warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasTuneWarning)  # Misses at these shapes.
        for fn, args in cases:
            loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32))  # noqa: E731
            forward = jax.jit(fn).lower(*args).compile().as_text()
            grad = jax.jit(jax.grad(loss, argnums=tuple(range(len(args))))).lower(*args)
            assert "tpu_custom_call" in forward and "tpu_custom_call" in grad.compile().as_text()
    assert seen == {
        ("flash_attention", "tpu_v6e", (4, 4, 1024, 128)),
        ("flash_attention_bwd", "tpu_v6e", (4, 4, 1024, 128)),
        ("matmul", "tpu_v6e", (512, 512)), ("matmul_bwd", "tpu_v6e", (512, 512)),
        ("rms_norm", "tpu_v6e", (512, 512)), ("rms_norm_bwd", "tpu_v6e", (512, 512))}, seen


def _adapter_cases(sds, P):
    """JAX's kernels through pallas-tune's adapters, and Mamba-2's SSD: (name, fn, args)."""
    import jax.numpy as jnp

    from pallas_tune.kernels import mamba2_ssd as m2
    from pallas_tune.kernels import upstream as up

    q, kv = sds((8, 8, 1024, 128), P("data", "model")), sds((8, 4, 1024, 128), P("data", "model"))
    x, w = sds((1024, 256), P()), sds((4, 256, 1024), P(None, None, "model"))
    sizes = sds((4,), P(), jnp.int32)
    b = P("data")
    ssd = (sds((8, 512, 8 * 64), b), sds((8, 512, 8), b, jnp.float32), sds((8,), P(), jnp.float32),
           sds((8, 512, 128), b), sds((8, 512, 128), b), sds((8,), P(), jnp.float32))
    return [("flash_attention", lambda q: up.flash_attention(q, q, q, causal=True), (q,)),
            ("splash_attention", lambda q, kv: up.splash_attention(q, kv, kv, causal=True),
             (q, kv)),
            ("gmm", up.megablox_gmm, (x, w, sizes)),
            ("mamba2_ssd", m2.mamba2_ssd, ssd)]


@pytest.mark.libtpu
@pytest.mark.parametrize("case", range(4), ids=["flash", "splash", "megablox", "mamba2"])
def test_adapters_and_mamba2_compile_sharded_for_a_multichip_tpu(case):
    """JAX's own kernels through their adapters, and Mamba-2's SSD, under jax.jit on sharded
    operands, compiled for a 4-chip v6e: without their partition rules Mosaic refused ('cannot
    be automatically partitioned'); now each runs on its shard (forward and gradient)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_tune.runtime import tunable

    mesh = _v6e_mesh(AxisType.Explicit)

    def sds(shape, spec, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    name, fn, args = _adapter_cases(sds, P)[case]
    seen = set()

    def hook(kernel, a, kwargs):
        seen.add((kernel.name.rsplit(".", 1)[-1], a[0].shape))

    with jax.set_mesh(mesh), tunable.resolution_hook(hook), warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasTuneWarning)
        assert "tpu_custom_call" in jax.jit(fn).lower(*args).compile().as_text()
        loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))  # noqa: E731
        grad = jax.jit(jax.grad(loss)).lower(*args).compile().as_text()
    assert "tpu_custom_call" in grad or name == "mamba2_ssd"  # Its gradient is XLA's.
    shard = {"flash_attention": (4, 4, 1024, 128), "splash_attention": (4, 4, 1024, 128),
             "gmm": (1024, 256), "mamba2_ssd": (4, 512, 512)}[name]
    assert (name, shard) in seen, seen


@pytest.mark.libtpu
def test_a_tpu_mesh_with_automatic_axes_is_left_as_written_and_warned_about():
    """libtpu does not run custom_partitioning, and automatic axes hide the operands' specs:
    the call compiles as it did (replicated operands compile), with a warning naming the
    way out (explicit axes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_tune.kernels.matmul import matmul
    from pallas_tune.runtime import partition

    partition._WARNED.discard(matmul.name)  # noqa: SLF001
    mesh = _v6e_mesh(AxisType.Auto)
    x = jax.ShapeDtypeStruct((512, 512), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        text = jax.jit(matmul).lower(x, x).compile().as_text()
    assert "HloModule" in text  # Compiled as it always was (replicated operands).
    assert any("AxisType.Explicit" in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_a_result_names_the_mesh_of_its_calls_and_its_step():
    from pallas_tune.step.result import AutotuneResult, TunedCall

    call = TunedCall(kernel="pallas_tune.kernels.matmul.matmul", key="x=16x128:float32",
                     chip="cpu", config={"bm": 16}, source="tuned", mesh="data=2,model=2")
    result = AutotuneResult([call, TunedCall(kernel="k", key="x=4", chip="cpu", config={},
                                             source="cache")], step_ms={"tuned": 1.0},
                            step_timer="wall clock")
    text = str(result)
    assert "x=16x128:float32 (a shard over data=2,model=2)" in text
    assert "x=4  " in text and "x=4 (a shard" not in text  # An unsplit call says nothing.
    assert "step on the mesh data=2,model=2 (wall clock)" in text
    assert AutotuneResult.from_json(result.to_json()).calls[0].mesh == "data=2,model=2"


@pytest.mark.libtpu
def test_flash_attention_backward_uses_the_forward_s_residuals_on_each_device(monkeypatch):
    """Explicit axes: the forward keeps each device's o and lse (stacked, one slice per
    device) for the backward, which no longer runs the forward again on the shard."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_tune.kernels.flash_attention import flash_attention

    traced = {"fn": 0, "residuals": 0}
    fn, residuals = flash_attention.fn, flash_attention.backward_residuals

    def counted(name, f):
        def run(*a, **k):
            traced[name] += 1
            return f(*a, **k)
        return run

    monkeypatch.setattr(flash_attention, "fn", counted("fn", fn))
    monkeypatch.setattr(flash_attention, "backward_residuals", counted("residuals", residuals))
    mesh = _v6e_mesh(AxisType.Explicit)
    q = jax.ShapeDtypeStruct((8, 8, 1024, 128), jnp.bfloat16,
                             sharding=NamedSharding(mesh, P("data", "model")))
    with jax.set_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore", PallasTuneWarning)
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda q: jnp.sum(
            flash_attention(q, q, q, causal=True).astype(jnp.float32))))(q))
    # The forward with its residuals traced once (the primal's trace aside: never run under
    # jax.grad), and a device's lse kept stacked for the backward.
    assert traced["residuals"] == 1, traced
    assert "f32[1,4,4,1024]" in jaxpr
