"""Linear attention's Pallas backward (kernels/linear_attention_bwd.py) in interpret mode: dq, dk
and dv against jax.vjp of the forward's recurrence (lax.scan, f32) at ragged lengths, several
decays and chunk pairs, f32 and bf16, NaN/Inf counted; jax.grad, vjp, jit, checkpoint and vmap
through linear_attention; the backward tuned and looked up when a gradient is traced; deviceless
v6e compiles of the real Mosaic kernels."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals
from hypothesis import example, given
from hypothesis import strategies as st
from model_kernel_checks import assert_cotangents_close, oracle

from pallas_tune.kernels.linear_attention import linear_attention, linear_attention_reference
from pallas_tune.kernels.linear_attention_bwd import (linear_attention_bwd,
                                                      linear_attention_bwd_args,
                                                      linear_attention_bwd_reference)

SMALL = dict(chunk_dq=64, chunk_dkv=64)
NAMES = ("dq", "dk", "dv")


def _args(b, h, t, d, dv, dtype, seed=0):
    return tuple(normals(seed, [(b, h, t, d), (b, h, t, d), (b, h, t, dv), (b, h, t, dv)],
                         dtype, 1 / math.sqrt(d)))


def _recurrence_vjp(q, k, v, g, *, decay):
    """The gradients of the forward's own reference, the recurrence (not the backward's)."""
    _, vjp = jax.vjp(functools.partial(linear_attention_reference, decay=decay), q, k, v)
    return vjp(g)


def _f32_reference(args, decay):
    return oracle(_recurrence_vjp, *(jnp.asarray(x, jnp.float32) for x in args), decay=decay)


def _assert_grads_close(grads, ref, args):
    assert_cotangents_close(grads, ref, args, NAMES, f32_tol=2e-5)


def _loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)


@pytest.mark.parametrize("dtype,t,decay,config", [
    (jnp.float32, 256, 0.9, dict(chunk_dq=128, chunk_dkv=128)),   # Two chunks each way.
    (jnp.float32, 200, 1.0, dict(chunk_dq=64, chunk_dkv=128)),    # Ragged, no decay.
    (jnp.float32, 5, 0.5, SMALL),                                 # Shorter than a chunk.
    (jnp.bfloat16, 300, 0.96875, dict(chunk_dq=128, chunk_dkv=64)),
])
def test_backward_matches_the_recurrences_gradients(dtype, t, decay, config):
    args = _args(1, 2, t, 32, 16, dtype, seed=t)
    grads = linear_attention_bwd(*args, decay=decay, **config)
    _assert_grads_close(grads, _f32_reference(args, decay), args)


def test_the_backwards_reference_is_the_recurrences_gradient():
    """The quadratic form the backward's reference differentiates is the forward's function."""
    args = _args(2, 1, 130, 16, 8, jnp.float32, seed=3)
    ref = linear_attention_bwd_reference(*args, decay=0.9)
    _assert_grads_close(ref, _f32_reference(args, 0.9), args)


def test_jax_transformations_through_linear_attention():
    """jax.vjp, jax.jit of jax.grad, jax.checkpoint and jax.vmap give the recurrence's
    gradients (f32, sequence 130, decay 0.95)."""
    q, k, v, g = _args(1, 2, 130, 16, 16, jnp.float32, seed=5)
    fwd = functools.partial(linear_attention, chunk=64, decay=0.95)
    ref_fn = functools.partial(linear_attention_reference, decay=0.95)
    out, vjp = jax.vjp(fwd, q, k, v)
    np.testing.assert_allclose(out, ref_fn(q, k, v), atol=2e-5, rtol=2e-5)
    _assert_grads_close(vjp(g), _f32_reference((q, k, v, g), 0.95), (q, k, v))

    ref = jax.grad(functools.partial(_loss, ref_fn), argnums=(0, 1, 2))(q, k, v)
    grad = jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2))
    _assert_grads_close(jax.jit(grad)(q, k, v), ref, (q, k, v))
    remat = jax.grad(jax.checkpoint(functools.partial(_loss, fwd)), argnums=(0, 1, 2))
    _assert_grads_close(jax.jit(remat)(q, k, v), ref, (q, k, v))

    qs, ks, vs = (jnp.stack([x, 0.5 * x]) for x in (q, k, v))  # A leading axis to map over.
    mapped = jax.vmap(grad)(qs, ks, vs)
    ref1 = jax.grad(functools.partial(_loss, ref_fn), argnums=(0, 1, 2))(0.5 * q, 0.5 * k,
                                                                         0.5 * v)
    _assert_grads_close([x[0] for x in mapped], ref, (q, k, v))
    _assert_grads_close([x[1] for x in mapped], ref1, (q, k, v))


def test_the_gradient_is_the_pallas_backward():
    """linear_attention declares its Pallas backward, not XLA's autodiff, and jax.grad runs it:
    the traced gradient holds its two passes."""
    assert linear_attention.backward is linear_attention_bwd
    assert linear_attention.backward_backend == "pallas"
    q, k, v, _ = _args(1, 1, 256, 32, 32, jnp.float32)
    fwd = functools.partial(linear_attention, chunk=128)
    text = str(jax.make_jaxpr(jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2)))(
        q, k, v))
    assert "linear_attention_dq_" in text and "linear_attention_dk_dv_" in text


def test_bad_input_is_a_clear_error():
    q, k, v, g = _args(1, 1, 100, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="dim_v"):
        linear_attention_bwd(q, k, v, g[:, :, :50], **SMALL)
    with pytest.raises(ValueError, match="one dtype"):
        linear_attention_bwd(q, k, v, g.astype(jnp.bfloat16), **SMALL)
    with pytest.raises(ValueError, match=r"decay=1.5 must be in \(0, 1\]"):
        linear_attention_bwd(q, k, v, g, decay=1.5, **SMALL)


@st.composite
def _cases(draw):
    t = draw(st.integers(1, 300))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), t,
             draw(st.sampled_from([8, 32, 128])), draw(st.sampled_from([16, 128])))
    config = {name: draw(st.sampled_from([64, 128, 256])) for name in SMALL}
    decay = draw(st.sampled_from([1.0, 0.99, 0.9, 0.5]))
    return shape, config, decay, draw(st.sampled_from([jnp.float32, jnp.bfloat16]))


@given(case=_cases())
@example(case=((1, 1, 1, 8, 16), SMALL, 1.0, jnp.float32))
@example(case=((2, 1, 257, 128, 128), dict(chunk_dq=256, chunk_dkv=64), 0.9, jnp.bfloat16))
def test_backward_property(case):
    """Any sequence (one chunk or several, ragged or not), head dims, decays and chunks."""
    (b, h, t, d, dv), config, decay, dtype = case
    args = _args(b, h, t, d, dv, dtype, seed=t + d)
    _assert_grads_close(linear_attention_bwd(*args, decay=decay, **config),
                        _f32_reference(args, decay), args)


def test_args_builder_and_lookup_when_the_gradient_is_traced(cache_dir, monkeypatch):
    """linear_attention_bwd_args builds (q, k, v, g) with the forward's decay; a tuned backward
    entry is what the gradient's trace resolves."""
    q, k, v, _ = _args(1, 1, 200, 32, 32, jnp.float32, seed=6)
    args, kwargs = linear_attention_bwd_args((q, k, v), {"decay": 0.9, "chunk": 64})
    assert kwargs == {"decay": 0.9} and args[0] is q and args[3].shape == v.shape
    linear_attention_bwd._memo.clear()
    res = linear_attention_bwd.tune(*args, **kwargs, trials=3, seed=0, repeats=1, retime_top=1)
    seen = []
    resolve = linear_attention_bwd._resolve
    monkeypatch.setattr(linear_attention_bwd, "_resolve",
                        lambda a, kw: seen.append(resolve(a, kw)) or seen[-1])
    linear_attention_bwd._memo.clear()
    fwd = functools.partial(linear_attention, chunk=64, decay=0.9)
    jax.jit(jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2)))(q, k, v)
    assert len(seen) == 1 and seen[0].source == "cache" and dict(seen[0]) == dict(res.best)
    linear_attention_bwd._memo.clear()


@pytest.mark.libtpu
def test_backward_compiles_for_tpu():
    """Deviceless v6e compiles of both passes: a ragged bf16 sequence at several chunk pairs,
    and the shape set's 2048-token shape with the default chunks."""
    from pallas_tune.feasibility.compile import compile_deviceless

    def structs(b, h, t):
        x = jax.ShapeDtypeStruct((b, h, t, 128), jnp.bfloat16)
        return [x, x, x, x]

    cases = [(structs(1, 2, 1000), dict(chunk_dq=a, chunk_dkv=b))
             for a, b in ((64, 256), (512, 128), (1024, 1024))]
    cases.append((structs(1, 16, 2048), dict(linear_attention_bwd.space.default)))
    for args, config in cases:
        res = compile_deviceless(linear_attention_bwd.fn, args, {"decay": 0.96875, **config},
                                 chip="v6e")
        assert res.ok, (config, res.message)
