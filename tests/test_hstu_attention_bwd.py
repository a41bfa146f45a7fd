"""HSTU attention's Pallas backward (kernels/hstu_attention_bwd.py) in interpret mode: dq, dk, dv
and the relative-bias table's gradient against jax.vjp of the plain-JAX reference at ragged
lengths, tables shorter and longer than the sequence, f32 and bf16, NaN/Inf counted; jax.grad,
vjp, jit, checkpoint and vmap through hstu_attention; the backward tuned and looked up when a
gradient is traced; deviceless v6e compiles of the real Mosaic kernels."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normal, normals
from hypothesis import example, given
from hypothesis import strategies as st
from model_kernel_checks import assert_cotangents_close, oracle

import pallas_tune as pt
from pallas_tune.kernels.hstu_attention import hstu_attention, hstu_attention_reference
from pallas_tune.kernels.hstu_attention_bwd import (hstu_attention_bwd, hstu_attention_bwd_args,
                                                    hstu_attention_bwd_reference)

SMALL = dict(bq_dq=128, bkv_dq=128, bq_dkv=128, bkv_dkv=128)
NAMES = ("dq", "dk", "dv", "drel_bias")


def _args(b, h, s, d, dv, nb, dtype, seed=0):
    q, k, v, g = normals(seed, [(b, h, s, d), (b, h, s, d), (b, h, s, dv), (b, h, s, dv)], dtype)
    return q, k, v, normal(seed + 7919, (nb,), dtype, 0.5).astype(jnp.float32), g


def _assert_grads_close(grads, ref, args):
    assert_cotangents_close(grads, ref, args, NAMES)


def _f32_reference(args, **kwargs):
    """The reference's gradients in float32 from the same (rounded) inputs."""
    return oracle(hstu_attention_bwd_reference, *(jnp.asarray(x, jnp.float32) for x in args),
                  **kwargs)


@pytest.mark.parametrize("dtype,s,nb,config", [
    (jnp.float32, 256, 300, SMALL),                      # Two blocks each way, a long table.
    (jnp.float32, 200, 16, dict(bq_dq=128, bkv_dq=256, bq_dkv=256, bkv_dkv=128)),  # Ragged.
    (jnp.bfloat16, 300, 64, SMALL),
])
def test_backward_matches_reference_grads(dtype, s, nb, config):
    args = _args(2, 2, s, 64, 32, nb, dtype, seed=s)
    _assert_grads_close(hstu_attention_bwd(*args, **config), _f32_reference(args), args)


def test_bias_gradient_folds_distances_past_the_table():
    """Distances past the table read its last bucket, so its gradient sums all of them; a
    table longer than the sequence gets zeros past it."""
    args = _args(1, 1, 300, 32, 32, 4, jnp.float32, seed=3)
    dbias = hstu_attention_bwd(*args, **SMALL)[3]
    ref = _f32_reference(args)[3]
    np.testing.assert_allclose(dbias, ref, atol=1e-5 * float(np.abs(ref).max()))
    long = _args(1, 1, 100, 32, 32, 500, jnp.float32, seed=4)
    dlong = np.asarray(hstu_attention_bwd(*long, **SMALL)[3])
    assert np.all(dlong[100:] == 0) and np.any(dlong[:100] != 0)


def _loss(f, *a, **kw):
    return jnp.sum(jnp.square(f(*a, **kw).astype(jnp.float32)))


def test_jax_transformations_through_hstu_attention():
    """jax.vjp, jax.jit of jax.grad, jax.checkpoint and jax.vmap give the reference's gradients
    (f32, sequence 130, alpha and norm given)."""
    q, k, v, bias, g = _args(1, 2, 130, 16, 16, 50, jnp.float32, seed=5)
    opts = dict(alpha=0.3, norm=0.01)
    fwd = functools.partial(hstu_attention, bq=128, bkv=128, **opts)
    ref_fn = functools.partial(hstu_attention_reference, **opts)
    out, vjp = jax.vjp(fwd, q, k, v, bias)
    def ref_vjp(*args):
        ref_out, pullback = jax.vjp(ref_fn, *args)
        return ref_out, pullback(g)

    # The references compiled whole (oracle): op by op they compiled each op at these shapes.
    ref_out, ref_cot = oracle(ref_vjp, q, k, v, bias)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    _assert_grads_close(vjp(g), ref_cot, (q, k, v, bias))

    ref_grad = jax.grad(functools.partial(_loss, ref_fn), argnums=(0, 1, 2, 3))
    ref = oracle(ref_grad, q, k, v, bias)
    grad = jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2, 3))
    _assert_grads_close(jax.jit(grad)(q, k, v, bias), ref, (q, k, v, bias))
    remat = jax.grad(jax.checkpoint(functools.partial(_loss, fwd)), argnums=(0, 1, 2, 3))
    _assert_grads_close(jax.jit(remat)(q, k, v, bias), ref, (q, k, v, bias))

    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))  # A leading axis to map over.
    mapped = jax.vmap(grad, in_axes=(0, 0, 0, None))(qs, ks, vs, bias)
    ref1 = oracle(ref_grad, 2 * q, 2 * k, 2 * v, bias)
    _assert_grads_close([x[0] for x in mapped], ref, (q, k, v, bias))
    _assert_grads_close([x[1] for x in mapped], ref1, (q, k, v, bias))


def test_the_gradient_is_the_pallas_backward():
    """hstu_attention declares its Pallas backward, not XLA's autodiff, and jax.grad runs it:
    the traced gradient holds its two kernels."""
    assert hstu_attention.backward is hstu_attention_bwd
    assert hstu_attention.backward_backend == "pallas"
    q, k, v, bias, _ = _args(1, 1, 256, 32, 32, 20, jnp.float32)
    fwd = functools.partial(hstu_attention, bq=128, bkv=128)
    text = str(jax.make_jaxpr(jax.grad(functools.partial(_loss, fwd), argnums=(0, 3)))(
        q, k, v, bias))
    assert "hstu_attention_dkv_" in text and "hstu_attention_dq_" in text


def test_bad_input_is_a_clear_error():
    q, k, v, bias, g = _args(1, 1, 200, 32, 32, 8, jnp.float32)
    with pytest.raises(ValueError, match="shapes do not match"):
        hstu_attention_bwd(q, k, v, bias, g[:, :, :100], **SMALL)
    with pytest.raises(ValueError, match="non-empty 1-D table"):
        hstu_attention_bwd(q, k, v, bias[:0], g, **SMALL)
    with pytest.raises(pt.InvalidConfig, match="multiple of 128"):
        hstu_attention_bwd(q, k, v, bias, g, **{**SMALL, "bq_dkv": 100})


@st.composite
def _cases(draw):
    s = draw(st.integers(1, 300))
    shape = (draw(st.integers(1, 2)), 1, s, draw(st.sampled_from([8, 32, 128])),
             draw(st.sampled_from([16, 128])),
             draw(st.integers(1, 2 * s + 1)))
    config = {name: draw(st.sampled_from([128, 256])) for name in SMALL}
    return shape, config, draw(st.sampled_from([jnp.float32, jnp.bfloat16]))


@given(case=_cases())
@example(case=((1, 1, 1, 8, 16, 1), SMALL, jnp.float32))
@example(case=((2, 1, 257, 128, 128, 300), dict(bq_dq=256, bkv_dq=128, bq_dkv=128,
                                                 bkv_dkv=256), jnp.bfloat16))
def test_backward_property(case):
    """Any sequence (one block or several, ragged or not), head dims, table lengths and blocks."""
    (b, h, s, d, dv, nb), config, dtype = case
    args = _args(b, h, s, d, dv, nb, dtype, seed=s + nb)
    _assert_grads_close(hstu_attention_bwd(*args, **config), _f32_reference(args), args)


def test_args_builder_and_lookup_when_the_gradient_is_traced(cache_dir, monkeypatch):
    """hstu_attention_bwd_args builds (q, k, v, rel_bias, g) with the forward's alpha and norm;
    a tuned backward entry is what the gradient's trace resolves."""
    q, k, v, bias, _ = _args(1, 1, 300, 32, 32, 40, jnp.float32, seed=6)
    args, kwargs = hstu_attention_bwd_args((q, k, v, bias), {"norm": 0.5, "bq": 128})
    assert kwargs == {"norm": 0.5} and args[0] is q and args[4].shape == v.shape
    hstu_attention_bwd._memo.clear()
    res = hstu_attention_bwd.tune(*args, **kwargs, trials=3, seed=0, repeats=1, retime_top=1)
    seen = []
    resolve = hstu_attention_bwd._resolve
    monkeypatch.setattr(hstu_attention_bwd, "_resolve",
                        lambda a, kw: seen.append(resolve(a, kw)) or seen[-1])
    hstu_attention_bwd._memo.clear()
    fwd = functools.partial(hstu_attention, bq=128, bkv=128, norm=0.5)
    jax.jit(jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    assert len(seen) == 1 and seen[0].source == "cache" and dict(seen[0]) == dict(res.best)
    hstu_attention_bwd._memo.clear()


@pytest.mark.libtpu
def test_backward_compiles_for_tpu():
    """Deviceless v6e compiles (the real Mosaic kernels, the row reversal and strided rotate of
    the bias gradient included): a ragged bf16 sequence at several blocks, and a DLRM-HSTU shape
    with the default blocks."""
    from pallas_tune.feasibility.compile import compile_deviceless

    def structs(b, h, s, nb):
        x = jax.ShapeDtypeStruct((b, h, s, 128), jnp.bfloat16)
        return [x, x, x, jax.ShapeDtypeStruct((nb,), jnp.float32), x]

    cases = [(structs(1, 2, 1000, 64), dict(bq_dq=bq, bkv_dq=bkv, bq_dkv=bkv, bkv_dkv=bq))
             for bq, bkv in ((256, 128), (512, 1024), (128, 2048))]
    cases.append((structs(4, 4, 2048, 2048), dict(hstu_attention_bwd.space.default)))
    for args, config in cases:
        res = compile_deviceless(hstu_attention_bwd.fn, args, config, chip="v6e")
        assert res.ok, (config, res.message)
