"""Flash attention's backward (kernels/flash_attention_bwd.py) and its gradient wiring, in interpret
mode: dq, dk, dv against jax.vjp of the plain-JAX reference at ragged lengths, f32 and bf16,
causal and not, GQA; the lse the forward saves; jax.grad / vjp / jit / checkpoint / vmap through
flash_attention; the backward tuned and then looked up when a gradient is traced."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals
from hypothesis import example, given
from hypothesis import strategies as st
from model_kernel_checks import assert_matches_reference, oracle

import pallas_tune as pt
from pallas_tune.kernels import flash_attention as fa_module
from pallas_tune.kernels._attention import reference_lse
from pallas_tune.kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_tune.kernels.flash_attention_bwd import (flash_attention_bwd,
                                                     flash_attention_bwd_args,
                                                     flash_attention_bwd_reference)

SMALL = dict(bq_dq=128, bkv_dq=128, bq_dkv=128, bkv_dkv=128, fused=False)
FUSED = {**SMALL, "fused": True}  # One pass: dK/dV with dq accumulated (dQ blocks unused).


def _qkv(hq, hkv, sq, sk, d, dtype, seed=0, b=1):
    return tuple(normals(seed, [(b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d)], dtype))


def _f32_reference_grads(args, causal):
    """The reference's gradients computed in float32 from the same (rounded) inputs."""
    q, k, v, o, lse, do = (jnp.asarray(x, jnp.float32) for x in args)
    return oracle(flash_attention_bwd_reference, q, k, v, o, lse, do, causal=causal)


def _assert_grads_close(grads, ref, dtype):
    """Finite (NaN/Inf counted), right shapes and dtypes, and close to the f32 reference: f32 as
    the forward's tests, bf16 within 3% of each gradient's largest magnitude."""
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref, strict=True):
        g32, r32 = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == r.shape and g.dtype == dtype, (name, g.shape, g.dtype)
        bad = int(np.sum(~np.isfinite(g32)))
        assert bad == 0, f"{name}: {bad} NaN/Inf values"
        tol = (3e-2 if dtype == jnp.bfloat16 else 2e-5) * max(1.0, float(np.abs(r32).max()))
        np.testing.assert_allclose(g32, r32, atol=tol, rtol=0, err_msg=name)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype,causal,hq,hkv,sq,sk", [
    (jnp.float32, False, 4, 2, 200, 77),
    (jnp.float32, True, 4, 2, 200, 77),
    (jnp.float32, True, 4, 1, 200, 200),
    (jnp.bfloat16, False, 4, 1, 200, 200),
    (jnp.bfloat16, True, 2, 2, 77, 300),   # q_len < kv_len: KV blocks no query sees.
    (jnp.bfloat16, True, 4, 2, 300, 200),  # q_len > kv_len.
])
def test_backward_matches_reference_grads(dtype, causal, hq, hkv, sq, sk, fused):
    """Blocks of 128: several query and KV blocks, ragged last blocks along both axes, causal
    blocks skipped, straddling and wholly below the diagonal; GQA groups of 2 and 4; the two
    passes and the fused one (its dq summed over KV blocks in VMEM, keys past kv_len masked)."""
    args, kwargs = flash_attention_bwd_args(_qkv(hq, hkv, sq, sk, 64, dtype), {"causal": causal})
    grads = flash_attention_bwd(*args, **kwargs, **(FUSED if fused else SMALL))
    _assert_grads_close(grads, _f32_reference_grads(args, causal), dtype)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("sq,sk,config", [
    (1100, 1100, dict(bq_dq=512, bkv_dq=512, bq_dkv=512, bkv_dkv=512)),
    (1100, 1100, dict(bq_dq=1024, bkv_dq=256, bq_dkv=256, bkv_dkv=1024)),
    (1100, 1100, dict(bq_dq=256, bkv_dq=1024, bq_dkv=1024, bkv_dkv=256)),
    (600, 1100, dict(bq_dq=512, bkv_dq=1024, bq_dkv=512, bkv_dkv=256)),
    (1100, 700, dict(bq_dq=512, bkv_dq=1024, bq_dkv=1024, bkv_dkv=512)),  # bkv clamped: 700.
])
def test_backward_strips_and_staircases(sq, sk, config, fused):
    """Blocks of 512-1024 queries: several column strips per block, the causal staircase on
    diagonal blocks with either block size the larger (each strip against only the keys it
    sees), blocks no size divides (masked by position), ragged last blocks, q_len != kv_len;
    fused, a query block's dq written at its last KV block, before the grid's end."""
    args, kwargs = flash_attention_bwd_args(_qkv(2, 1, sq, sk, 32, jnp.float32), {"causal": True})
    if fused:  # The space pins the dq blocks (unused when fused) to 128.
        config = {**config, "bq_dq": 128, "bkv_dq": 128}
    grads = flash_attention_bwd(*args, **kwargs, **config, fused=fused)
    _assert_grads_close(grads, _f32_reference_grads(args, True), jnp.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_forward_lse_matches_reference(causal):
    q, k, v = _qkv(4, 2, 300, 200, 64, jnp.float32)
    with pt.chips.interpret_mode():
        o, lse = fa_module._forward(q, k, v, causal=causal, sm_scale=None, bq=128, bkv=128,
                                    lse=True)
    assert lse.shape == (1, 4, 300) and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(lse)).all()
    np.testing.assert_allclose(lse, reference_lse(q, k, causal=causal), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(o, flash_attention_reference(q, k, v, causal=causal), atol=2e-5,
                               rtol=2e-5)


def _loss(fn, q, k, v, causal=True):
    return jnp.sum(fn(q, k, v, causal=causal).astype(jnp.float32) * jnp.cos(q.astype(jnp.float32)))


def test_grad_through_flash_attention_matches_reference():
    """The custom VJP end to end in bf16: jax.grad of a loss, forward blocks explicit (f32: the
    next test)."""
    dtype = jnp.bfloat16
    q, k, v = _qkv(4, 2, 200, 77, 64, dtype, seed=1)
    fwd = functools.partial(flash_attention, bq=128, bkv=128)
    grads = jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2))(q, k, v)
    ref = jax.grad(functools.partial(_loss, flash_attention_reference), argnums=(0, 1, 2))(
        *(x.astype(jnp.float32) for x in (q, k, v)))
    _assert_grads_close(grads, ref, dtype)


def test_jax_transformations_through_flash_attention():
    """jax.vjp, jax.jit of jax.grad, jax.checkpoint and jax.vmap all give the reference's
    gradients in f32 (a non-causal call too: sm_scale given); GQA, q_len 77, kv_len 50."""
    q, k, v = _qkv(4, 2, 77, 50, 32, jnp.float32, seed=2)
    fwd = functools.partial(flash_attention, bq=128, bkv=128)
    ref = jax.grad(functools.partial(_loss, flash_attention_reference), argnums=(0, 1, 2))(q, k, v)

    out, vjp = jax.vjp(lambda a, b, c: fwd(a, b, c, causal=False, sm_scale=0.3), q, k, v)
    do = jnp.cos(q)
    ref_out, ref_vjp = jax.vjp(lambda a, b, c: flash_attention_reference(
        a, b, c, causal=False, sm_scale=0.3), q, k, v)
    np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=2e-5)
    _assert_grads_close(vjp(do), ref_vjp(do), jnp.float32)

    grad = jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2))
    _assert_grads_close(jax.jit(grad)(q, k, v), ref, jnp.float32)
    remat = jax.grad(jax.checkpoint(functools.partial(_loss, fwd)), argnums=(0, 1, 2))
    _assert_grads_close(jax.jit(remat)(q, k, v), ref, jnp.float32)

    qs, ks, vs = (jnp.stack([x, 2 * x]) for x in (q, k, v))  # A leading axis to map over.
    mapped = jax.vmap(grad)(qs, ks, vs)
    ref1 = jax.grad(functools.partial(_loss, flash_attention_reference), argnums=(0, 1, 2))(
        2 * q, 2 * k, 2 * v)
    _assert_grads_close([g[0] for g in mapped], ref, jnp.float32)
    _assert_grads_close([g[1] for g in mapped], ref1, jnp.float32)


def test_forward_without_grad_is_one_kernel_without_lse():
    """Not differentiated, flash_attention is the forward pallas_call alone (no lse output):
    the program its cache entries were tuned on."""
    q, k, v = _qkv(2, 1, 256, 256, 128, jnp.bfloat16)
    jaxpr = jax.make_jaxpr(lambda a, b, c: flash_attention(a, b, c, causal=True, bq=128,
                                                            bkv=128))(q, k, v)
    calls = [e for e in _equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]
    assert len(calls) == 1 and len(calls[0].outvars) == 1
    grad_jaxpr = jax.make_jaxpr(jax.grad(lambda a, b, c: _loss(
        functools.partial(flash_attention, bq=128, bkv=128), a, b, c)))(q, k, v)
    names = sorted(str(e.params.get("name") or e.params["name_and_src_info"].name)
                   for e in _equations(grad_jaxpr.jaxpr) if e.primitive.name == "pallas_call")
    assert [n.split("_")[2] for n in names] == ["dkv", "dq", "lse"], names


def test_fused_backward_is_one_pass_with_the_two_passes_results():
    """fused=True: one pallas_call makes dq, dk and dv (no dQ pass), with the two passes' dk
    and dv to rounding and their dq to the f32 reference; its VMEM limit rises by the dq
    accumulator (group x q_len x head_dim f32) above the default 32 MiB."""
    args, kwargs = flash_attention_bwd_args(_qkv(4, 2, 384, 384, 64, jnp.float32),
                                            {"causal": True})
    from pallas_tune.feasibility.inspect import find_pallas_calls

    calls = find_pallas_calls(flash_attention_bwd.fn, args, {**kwargs, **FUSED})
    assert [c.name.split("_")[2] for c in calls] == ["fused"], [c.name for c in calls]
    # 33 MiB: 32 + 2 heads x 384 x 64 x 4 bytes of dq, kᵀ and dq's output buffers, rounded up.
    assert calls[0].vmem_limit_bytes == 33 * 2**20
    assert calls[0].dimension_semantics[2] == "arbitrary"  # dq sums over the KV blocks.
    two = find_pallas_calls(flash_attention_bwd.fn, args, {**kwargs, **SMALL})
    assert [c.name.split("_")[2] for c in two] == ["dkv", "dq"]
    assert two[0].vmem_limit_bytes is None and two[0].dimension_semantics[2] == "parallel"
    fused = flash_attention_bwd(*args, **kwargs, **FUSED)
    two = flash_attention_bwd(*args, **kwargs, **SMALL)
    for name, a, b in zip(("dq", "dk", "dv"), fused, two, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5 * max(1.0, float(np.abs(b).max())),
                                   err_msg=name)
    _assert_grads_close(fused, _f32_reference_grads(args, True), jnp.float32)


def test_fused_pass_is_refused_where_its_dq_accumulator_does_not_fit():
    """The feasibility check sees the fused pass's VMEM (its raised limit, its accumulator):
    Llama-3.1-8B at 8192 tokens fits v6e and 7x; one chip of Llama-3.1-70B under 8-way
    tensor parallelism (8 query heads per KV head) at 32768 tokens needs a 128 MiB
    accumulator and is refused, naming the fused call, so that tuning keeps the two passes."""
    from pallas_tune.feasibility.model import check_feasible

    def args(hq, hkv, s):
        q = jax.ShapeDtypeStruct((1, hq, s, 128), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, hkv, s, 128), jnp.bfloat16)
        return [q, kv, kv, q, jax.ShapeDtypeStruct((1, hq, s), jnp.float32), q]

    tiles = dict(causal=True, bq_dq=128, bkv_dq=128, bq_dkv=1024, bkv_dkv=2048)
    for chip in ("v6e", "7x"):
        ok = check_feasible(flash_attention_bwd, *args(32, 8, 8192), chip=chip, fused=True,
                            **tiles)
        assert ok.ok and ok.limit_bytes > 32 * 2**20, (chip, ok.reason)
        big = check_feasible(flash_attention_bwd, *args(8, 1, 32768), chip=chip, fused=True,
                             **tiles)
        assert not big.ok and "flash_attention_fused" in big.reason, (chip, big.reason)
        two = check_feasible(flash_attention_bwd, *args(8, 1, 32768), chip=chip, fused=False,
                             **tiles)
        assert two.status != "infeasible", (chip, two.reason)


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, list | tuple) else [param]:
                inner = getattr(sub, "jaxpr", sub)  # A ClosedJaxpr's Jaxpr.
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


def test_bad_residual_shapes_are_a_clear_error():
    q, k, v = _qkv(2, 1, 64, 64, 32, jnp.float32)
    with pytest.raises(ValueError, match="lse"):
        flash_attention_bwd(q, k, v, q, jnp.zeros((1, 2, 63)), q, **SMALL)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        flash_attention_bwd(q[:, :1].repeat(3, 1), k[:, :1].repeat(2, 1), v[:, :1].repeat(2, 1),
                            q, jnp.zeros((1, 2, 64)), q, **SMALL)


@st.composite
def _cases(draw):
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    shape = (kv_heads * group, kv_heads, draw(st.integers(1, 300)), draw(st.integers(1, 300)),
             draw(st.sampled_from([8, 32, 80, 128])))
    config = {name: draw(st.sampled_from([128, 256])) for name in SMALL if name != "fused"}
    config["fused"] = draw(st.booleans())
    if config["fused"]:  # The space pins the dq blocks (unused when fused) to 128.
        config.update(bq_dq=128, bkv_dq=128)
    return shape, config, draw(st.booleans()), draw(st.sampled_from([jnp.float32, jnp.bfloat16]))


@given(case=_cases())
@example(case=((2, 1, 1, 1, 8), SMALL, True, jnp.float32))
@example(case=((4, 2, 257, 129, 80), dict(bq_dq=256, bkv_dq=128, bq_dkv=128, bkv_dkv=256,
                                          fused=False), True, jnp.bfloat16))
@example(case=((4, 2, 257, 129, 80), dict(bq_dq=128, bkv_dq=128, bq_dkv=128, bkv_dkv=256,
                                          fused=True), False, jnp.bfloat16))
def test_backward_property(case):
    """Any lengths (one block or several, ragged or not), head dims, blocks of the space, the
    two passes or the fused one."""
    shape, config, causal, dtype = case
    args, kwargs = flash_attention_bwd_args(_qkv(*shape, dtype, seed=sum(shape)),
                                            {"causal": causal})
    _assert_grads_close(flash_attention_bwd(*args, **kwargs, **config),
                        _f32_reference_grads(args, causal), dtype)


def test_args_builder_matches_the_forward():
    """flash_attention_bwd_args: o and lse are the reference forward's, do is seeded."""
    q, k, v = _qkv(4, 2, 100, 60, 32, jnp.float32)
    (q2, k2, v2, o, lse, do), kw = flash_attention_bwd_args((q, k, v), {"causal": True,
                                                                        "bq": 128})
    assert kw == {"causal": True, "sm_scale": None} and q2 is q and k2 is k and v2 is v
    np.testing.assert_allclose(o, flash_attention_reference(q, k, v, causal=True), atol=1e-5)
    np.testing.assert_allclose(lse, reference_lse(q, k, causal=True), atol=1e-5)
    again = flash_attention_bwd_args((q, k, v), {"causal": True})[0][5]
    np.testing.assert_array_equal(do, again)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)]
    built = flash_attention_bwd_args(shapes, {})[0]
    assert [x.shape for x in built] == [q.shape, k.shape, v.shape, q.shape, (1, 4, 100), q.shape]
    assert all(np.isfinite(np.asarray(x)).all() for x in built)


def test_tuned_backward_is_looked_up_when_the_gradient_is_traced(cache_dir, monkeypatch):
    q, k, v = _qkv(2, 1, 300, 300, 32, jnp.float32, seed=4)
    args, kwargs = flash_attention_bwd_args((q, k, v), {"causal": True})
    flash_attention_bwd._memo.clear()
    assert flash_attention_bwd.config_for(*args, **kwargs).source != "cache"
    res = flash_attention_bwd.tune(*args, **kwargs, trials=3, seed=0, repeats=1, retime_top=1)
    flash_attention_bwd._memo.clear()
    cfg = flash_attention_bwd.config_for(*args, **kwargs)
    assert cfg.source == "cache" and dict(cfg) == dict(res.best)

    seen = []
    resolve = flash_attention_bwd._resolve
    monkeypatch.setattr(flash_attention_bwd, "_resolve",
                        lambda a, kw: seen.append(resolve(a, kw)) or seen[-1])
    flash_attention_bwd._memo.clear()
    fwd = functools.partial(flash_attention, bq=128, bkv=128)  # The forward's own blocks.
    grads = jax.jit(jax.grad(functools.partial(_loss, fwd), argnums=(0, 1, 2)))(q, k, v)
    assert len(seen) == 1 and seen[0].source == "cache" and dict(seen[0]) == dict(res.best)
    ref = jax.grad(functools.partial(_loss, flash_attention_reference), argnums=(0, 1, 2))(q, k, v)
    _assert_grads_close(grads, ref, jnp.float32)
    flash_attention_bwd._memo.clear()


@pytest.mark.libtpu
def test_backward_compiles_for_tpu_at_ragged_and_llama_shapes():
    """Deviceless v6e compiles (the real Mosaic kernels): a ragged GQA shape in bf16 at a few
    block combinations, two passes and fused, and Llama-3.1-8B's attention at 2048 tokens with
    the default blocks, two passes and fused."""
    from pallas_tune.feasibility.compile import compile_deviceless

    def structs(hq, hkv, s, dtype=jnp.bfloat16):
        q = jax.ShapeDtypeStruct((1, hq, s, 128), dtype)
        kv = jax.ShapeDtypeStruct((1, hkv, s, 128), dtype)
        return [q, kv, kv, q, jax.ShapeDtypeStruct((1, hq, s), jnp.float32), q]

    cases = [(structs(4, 2, 1000), causal, dict(bq_dq=bq, bkv_dq=bkv, bq_dkv=bkv, bkv_dkv=bq,
                                                fused=fused))
             for causal in (False, True) for bq, bkv in ((256, 128), (512, 1024))
             for fused in (False, True)]
    cases.append((structs(32, 8, 2048), True, dict(flash_attention_bwd.space.default)))
    cases.append((structs(32, 8, 2048), True, {**flash_attention_bwd.space.default,
                                               "bq_dq": 128, "bkv_dq": 128, "fused": True}))
    for args, causal, config in cases:
        res = compile_deviceless(flash_attention_bwd.fn, args, dict(causal=causal, **config),
                                 chip="v6e")
        assert res.ok, (causal, config, res.message)
