"""benchmarks/kernels/training_shapes.py's pure helpers: the backward roofline's FLOP and byte
counts, and the words each row gives for where the tuned kernel stands against XLA."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from draws import normals

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                "benchmarks", "kernels"))
import training_shapes as ts  # noqa: E402

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def test_matmul_backward_is_two_products_of_the_forward():
    m, k, n = 4096, 4096, 6144
    x, y, g = S((m, k), BF16), S((k, n), BF16), S((m, n), BF16)
    flops, nbytes = ts.backward_roofline("matmul", [x, y], {}, [x, y, g])
    assert flops == 2 * (2.0 * m * k * n)  # dX = g Wᵀ and dW = xᵀ g.
    # Reads x, y and g; writes dx and dy.
    assert nbytes == 2 * (m * k + k * n + m * n) + 2 * (m * k + k * n)


def test_causal_attention_backward_counts_the_lower_triangle_at_2_5x():
    b, hq, hkv, s, d = 1, 8, 1, 4096, 128
    q, kv = S((b, hq, s, d), BF16), S((b, hkv, s, d), BF16)
    lse = S((b, hq, s), jnp.float32)
    flops, nbytes = ts.backward_roofline("flash_attention", [q, kv, kv], {"causal": True},
                                         [q, kv, kv, q, lse, q])
    assert flops == 2.5 * 4.0 * b * hq * (s * (s + 1) / 2) * d
    q_bytes, kv_bytes = 2 * b * hq * s * d, 2 * b * hkv * s * d
    # Reads q, k, v, o, lse (f32), do; writes dq, dk, dv.
    assert nbytes == (3 * q_bytes + 2 * kv_bytes + 4 * b * hq * s) + (q_bytes + 2 * kv_bytes)


def test_grouped_matmul_backward_writes_no_cotangent_for_group_sizes():
    m, k, n, e = 8192, 4096, 3584, 8
    lhs, rhs, sizes, d = S((m, k), BF16), S((e, k, n), BF16), S((e,), jnp.int32), S((m, n), BF16)
    flops, nbytes = ts.backward_roofline("grouped_matmul", [lhs, rhs, sizes], {},
                                         [lhs, rhs, sizes, d])
    assert flops == 2 * (2.0 * m * k * n)
    assert nbytes == 2 * (m * k + e * k * n + m * n) + 4 * e + 2 * (m * k + e * k * n)


def test_standing_says_where_xla_is_faster():
    assert ts.standing({"xla_ms": 2.0, "tuned_ms": 1.0}) == "tuned 2.00x faster"
    assert ts.standing({"xla_ms": 1.0, "tuned_ms": 1.5}) == "XLA 1.50x faster"
    assert ts.standing({"xla_ms": 1.0, "tuned_ms": 1.005}) == "on par with XLA (within 1%)"
    assert ts.standing({"xla_ms": 0.5, "tuned_ms": 1.0, "xla_partial": True}).startswith(
        "undecided")
    assert ts.standing({"xla_ms": None, "tuned_ms": 1.0}) == "XLA not estimated"
    assert ts.standing({"xla_ms": 1.0, "tuned_ms": None, "config": None}) == "not tuned"
    assert ts.standing({"xla_ms": 1.0, "tuned_ms": None, "config": {"bm": 8}}) == (
        "no tuned estimate")


def test_ragged_dot_alternative_computes_the_grouped_matmul_and_its_gradient():
    """benchmarks/kernels/grouped_xla.py's XLA alternative is the same function as
    grouped_matmul's reference (empty and uneven groups, summing to m), forward and gradient, so
    its figures compare like with like."""
    import numpy as np
    from xla_gradient import ragged_dot_grouped, xla_gradient

    from pallas_tune.kernels.grouped_matmul import grouped_matmul_reference

    lhs, rhs, g = normals(3, [(40, 24), (4, 24, 16), (40, 16)])
    sizes = jnp.array([7, 0, 25, 8], jnp.int32)
    np.testing.assert_allclose(ragged_dot_grouped(lhs, rhs, sizes),
                               grouped_matmul_reference(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    ours = xla_gradient(lhs, rhs, sizes, g, forward="xla_gradient:ragged_dot_grouped")
    ref = xla_gradient(lhs, rhs, sizes, g,
                       forward="pallas_tune.kernels.grouped_matmul:grouped_matmul_reference")
    for a, b in zip(ours[:2], ref[:2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_grouped_xla_claims_no_ranking_from_a_figure_below_the_compute_floor():
    import grouped_xla as gx

    lhs, rhs = S((16384, 4096), BF16), S((8, 4096, 3584), BF16)
    floor = gx.floor_ms([lhs, rhs], backward=False)
    assert abs(floor - 2 * 16384 * 4096 * 3584 / 918e12 * 1e3) < 1e-9
    assert gx.floor_ms([lhs, rhs], backward=True) == 2 * floor
    assert gx.standing(0.4914, 0.7219, floor).startswith("not comparable: ragged_dot below")
    assert gx.standing(0.9, 0.6, floor) == "tuned 1.50x faster"
    assert gx.standing(0.6, 0.9, floor) == "ragged_dot 1.50x faster"
    assert gx.standing(None, 0.6, floor) == "—"
