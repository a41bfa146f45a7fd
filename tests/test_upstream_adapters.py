"""Adapters for JAX's own Pallas TPU ops: run in interpret mode, lower for TPU, tune."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals

import pallas_tune as pt
from pallas_tune.kernels import upstream
from pallas_tune.kernels.flash_attention import flash_attention_reference
from pallas_tune.kernels.grouped_matmul import grouped_matmul_reference


def _qkv(shape, dtype=jnp.float32):
    return normals(0, [shape] * 3, dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("adapter,blocks", [
    (upstream.flash_attention, dict(block_q=128, block_k_major=256, block_k=128)),
    (upstream.splash_attention, dict(block_q=128, block_kv=256, block_kv_compute=128)),
])
def test_attention_adapters_match_reference(adapter, blocks, causal):
    q, k, v = _qkv((1, 2, 256, 128))
    out = adapter(q, k, v, causal=causal, **blocks)
    ref = flash_attention_reference(q, k, v, causal=causal)
    np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3)


def test_invalid_block_combination_is_reported():
    q, k, v = _qkv((1, 2, 256, 128))
    with pytest.raises(pt.InvalidConfig, match="must divide"):
        upstream.flash_attention(q, k, v, block_q=128, block_k_major=128, block_k=256)


def test_megablox_adapter():
    lhs, rhs = normals(1, [(512, 256), (3, 256, 256)])
    gs = jnp.array([200, 0, 312], jnp.int32)
    out = upstream.megablox_gmm(lhs, rhs, gs, tm=128, tk=128, tn=128)
    np.testing.assert_allclose(out, grouped_matmul_reference(lhs, rhs, gs), rtol=1e-4, atol=1e-3)


def test_adapters_lower_for_tpu():
    q = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    lhs = jax.ShapeDtypeStruct((2048, 4096), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((8, 4096, 1024), jnp.bfloat16)
    gs = jax.ShapeDtypeStruct((8,), jnp.int32)
    with pt.target("v6e"):
        for fn, args in ((upstream.flash_attention, (q, q, q)),
                         (upstream.splash_attention, (q, q, q)),
                         (upstream.megablox_gmm, (lhs, rhs, gs))):
            cfg = fn.space.default
            text = jax.jit(lambda *a: fn(*a, **cfg)).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text


def test_tuner_records_invalid_upstream_configs_as_infeasible(cache_dir):
    q, k, v = _qkv((1, 1, 256, 128))
    res = upstream.flash_attention.tune(q, k, v, trials=6, seed=0, repeats=1)
    df = res.trials
    bkm, bk = df.block_k_major.clip(upper=256), df.block_k.clip(upper=256)  # Clamped to seq.
    assert (df[bkm % bk != 0].outcome == "infeasible").all()
    assert df[bkm % bk == 0].outcome.isin(["ok", "slow"]).all()  # slow: timed, cut short.


def _qkv_heads(hq, hkv, sq, sk, d, dtype=jnp.float32):
    return tuple(normals(0, [(1, hq, sq, d), (1, hkv, sk, d), (1, hkv, sk, d)], dtype))


@pytest.mark.parametrize("adapter,shape,blocks", [
    # Upstream flash attention takes any q_len (its q blocks are cdiv-gridded).
    (upstream.flash_attention, (2, 2, 1000, 512, 128),
     dict(block_q=128, block_k_major=256, block_k=128)),
    # One KV block spanning kv_len: any kv_len and head_dim.
    (upstream.flash_attention, (2, 2, 100, 100, 192),
     dict(block_q=128, block_k_major=128, block_k=128)),
    # Splash: GQA, q_len a block multiple (1000 with block_q clamped to it), any head_dim.
    (upstream.splash_attention, (4, 2, 1000, 256, 80),
     dict(block_q=1024, block_kv=256, block_kv_compute=128)),
])
def test_attention_adapters_accept_what_upstream_accepts(adapter, shape, blocks):
    q, k, v = _qkv_heads(*shape)
    for causal in (False, True):
        out = adapter(q, k, v, causal=causal, **blocks)
        np.testing.assert_allclose(out, flash_attention_reference(q, k, v, causal=causal),
                                   atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("adapter,shape,blocks,error,match", [
    (upstream.flash_attention, (4, 2, 256, 256, 128),
     dict(block_q=128, block_k_major=128, block_k=128), ValueError, "as many k/v heads"),
    (upstream.flash_attention, (2, 2, 256, 1000, 128),
     dict(block_q=128, block_k_major=256, block_k=128), pt.InvalidConfig, "must divide kv_len"),
    (upstream.flash_attention, (2, 2, 512, 512, 192),
     dict(block_q=128, block_k_major=256, block_k=128), pt.InvalidConfig, "head_dim=192"),
    (upstream.splash_attention, (2, 2, 256, 1000, 128),
     dict(block_q=128, block_kv=256, block_kv_compute=128), ValueError, "multiple of 128"),
    (upstream.splash_attention, (2, 2, 1000, 256, 128),
     dict(block_q=128, block_kv=256, block_kv_compute=128), pt.InvalidConfig,
     "block_q=128 must divide q_len=1000"),
])
def test_attention_adapters_refuse_before_tracing_upstream(adapter, shape, blocks, error, match,
                                                           monkeypatch):
    def never(*a, **kw):
        raise AssertionError("the upstream kernel was traced")

    monkeypatch.setattr(upstream._fa, "flash_attention", never)
    monkeypatch.setattr(upstream._splash, "make_splash_mha", never)
    q, k, v = _qkv_heads(*shape)
    with pytest.raises(error, match=match):
        adapter(q, k, v, **blocks)


def test_megablox_adapter_refusals():
    lhs = jnp.zeros((1000, 256), jnp.float32)
    rhs = jnp.zeros((2, 256, 256), jnp.float32)
    gs = jnp.array([500, 500], jnp.int32)
    with pytest.raises(pt.InvalidConfig, match="tm=128 must divide m=1000"):
        upstream.megablox_gmm(lhs, rhs, gs, tm=128, tk=128, tn=128)
    with pytest.raises(ValueError, match="int32"):
        upstream.megablox_gmm(lhs, rhs, gs.astype(jnp.int16), tm=128, tk=128, tn=128)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        upstream.megablox_gmm(lhs.astype(jnp.float16), rhs.astype(jnp.float16), gs, tm=128,
                              tk=128, tn=128)


def test_megablox_adapter_takes_ragged_k_and_n():
    lhs, rhs = normals(1, [(256, 300), (3, 300, 200)])
    gs = jnp.array([7, 0, 249], jnp.int32)
    out = upstream.megablox_gmm(lhs, rhs, gs, tm=128, tk=128, tn=128)
    np.testing.assert_allclose(out, grouped_matmul_reference(lhs, rhs, gs), rtol=1e-4, atol=1e-3)


# ---- gradients: backward blocks as tunable kernels of their own ------------------------------

def _attention_loss(fn, q, k, v, causal):
    return jnp.sum(fn(q, k, v, causal=causal) * jnp.cos(q))


def _reference_grads(q, k, v, causal):
    return jax.grad(_attention_loss, argnums=(1, 2, 3))(flash_attention_reference, q, k, v,
                                                         causal)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("adapter,shape,blocks", [
    (upstream.flash_attention, (2, 2, 512, 256, 128),
     dict(block_q=128, block_k_major=256, block_k=128)),
    (upstream.splash_attention, (4, 2, 256, 512, 64),
     dict(block_q=128, block_kv=256, block_kv_compute=128)),
])
def test_attention_adapters_are_differentiable(adapter, shape, blocks, causal):
    """jax.grad through the adapters: upstream's backward kernels, their blocks resolved from
    the backward adapters' own cache entries (here their defaults) when the gradient is traced."""
    q, k, v = _qkv_heads(*shape)
    fwd = lambda a, b, c, causal: adapter(a, b, c, causal=causal, **blocks)  # noqa: E731
    grads = jax.jit(jax.grad(_attention_loss, argnums=(1, 2, 3)), static_argnums=(0, 4))(
        fwd, q, k, v, causal)
    for g, r in zip(grads, _reference_grads(q, k, v, causal), strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("adapter,blocks", [
    (upstream.flash_attention_bwd,
     dict(block_q_major_dkv=256, block_q_dkv=128, block_k_major_dkv=256, block_k_dkv=128,
          block_q_dq=128, block_k_major_dq=256, block_k_dq=256)),
    (upstream.splash_attention_bwd,
     dict(block_q_dkv=128, block_kv_dkv=256, block_kv_dkv_compute=128, block_q_dq=256,
          block_kv_dq=128, use_fused_bwd_kernel=False)),
    (upstream.splash_attention_bwd,
     dict(block_q_dkv=256, block_kv_dkv=256, block_kv_dkv_compute=256, block_q_dq=128,
          block_kv_dq=128, use_fused_bwd_kernel=True)),
])
def test_backward_adapters_match_reference(adapter, blocks):
    q, k, v = _qkv_heads(2, 2, 256, 256, 128)
    do = jnp.cos(q)
    if adapter is upstream.flash_attention_bwd:
        (q, k, v, o, lse, do), _ = upstream.flash_attention_bwd_args((q, k, v), {"causal": True})
        grads = adapter(q, k, v, o, jnp.ones_like(lse), lse, do, causal=True, **blocks)
    else:
        grads = adapter(q, k, v, do, causal=True, **blocks)
    _, vjp = jax.vjp(lambda a, b, c: flash_attention_reference(a, b, c, causal=True), q, k, v)
    for g, r in zip(grads, vjp(do), strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, atol=2e-3, rtol=2e-3)


def test_backward_adapters_refuse_blocks_upstream_cannot_run():
    q, k, v = _qkv_heads(2, 2, 256, 384, 128)
    lse = jnp.zeros((1, 2, 256))
    fa = dict(block_q_major_dkv=128, block_q_dkv=128, block_k_major_dkv=256, block_k_dkv=128,
              block_q_dq=128, block_k_major_dq=128, block_k_dq=128)
    with pytest.raises(pt.InvalidConfig, match="block_k_major_dkv=256 must divide kv_len=384"):
        upstream.flash_attention_bwd(q, k, v, q, lse, lse, q, **fa)
    with pytest.raises(pt.InvalidConfig, match="block_k_dq=384 must divide block_k_major_dq"):
        upstream.flash_attention_bwd(q, k, v, q, lse, lse, q,
                                     **{**fa, "block_k_major_dkv": 128, "block_k_dq": 512})
    with pytest.raises(pt.InvalidConfig, match="block_kv_dq=256 must divide kv_len=384"):
        upstream.splash_attention_bwd(
            q, k, v, q, block_q_dkv=128, block_kv_dkv=128, block_kv_dkv_compute=128,
            block_q_dq=128, block_kv_dq=256, use_fused_bwd_kernel=False)


def test_adapter_gradients_lower_for_tpu():
    q = jax.ShapeDtypeStruct((1, 8, 2048, 128), jnp.bfloat16)
    gs = jnp.full((8,), 256, jnp.int32)  # Made outside: JAX 0.12 runs no op under the target's
    with pt.target("v6e"):               # abstract mesh (only lowering with platforms).
        for fn in (upstream.flash_attention, upstream.splash_attention):
            cfg = fn.space.default
            grad = jax.grad(lambda a, b, c: jnp.sum(fn(a, b, c, causal=True, **cfg).astype(
                jnp.float32)), argnums=(0, 1, 2))
            text = jax.jit(grad).trace(q, q, q).lower(lowering_platforms=("tpu",)).as_text()
            # Forward, dK/dV, dQ; splash's fused backward (which its served config may be: the
            # nearest shipped entry) computes dQ in the dK/dV kernel.
            fused = fn is upstream.splash_attention and upstream.splash_attention_bwd.config_for(
                q, q, q, q, causal=True)["use_fused_bwd_kernel"]
            assert text.count("tpu_custom_call") >= (2 if fused else 3), fn.name
        lhs = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
        rhs = jax.ShapeDtypeStruct((8, 1024, 2048), jnp.bfloat16)
        grad = jax.grad(lambda a, b: jnp.sum(upstream.megablox_gmm(
            a, b, gs, **upstream.megablox_gmm.space.default).astype(jnp.float32)), argnums=(0, 1))
        text = jax.jit(grad).trace(lhs, rhs).lower(lowering_platforms=("tpu",)).as_text()
        assert text.count("tpu_custom_call") == 2  # gmm (rhs transposed), tgmm: a linear loss.


def test_megablox_adapter_is_differentiable():
    """jax.grad through megablox gmm: dlhs by gmm against rhs transposed, drhs by tgmm, their
    tilings resolved from megablox_gmm_bwd's own cache entries (here its default); an empty
    group gets a zero gradient."""
    lhs, rhs = normals(1, [(512, 256), (3, 256, 384)])
    gs = jnp.array([200, 0, 312], jnp.int32)
    weights = jnp.cos(jnp.arange(384.0))

    def loss(fn, a, b):
        return jnp.sum(fn(a, b, gs) * weights)

    gmm = lambda a, b, c: upstream.megablox_gmm(a, b, c, tm=128, tk=128, tn=256)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(1, 2)), static_argnums=0)(gmm, lhs, rhs)
    ref = jax.grad(loss, argnums=(1, 2))(grouped_matmul_reference, lhs, rhs)
    for g, r in zip(grads, ref, strict=True):
        assert np.isfinite(np.asarray(g)).all()
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-3)
    assert not np.asarray(grads[1][1]).any()
    with pytest.raises(pt.InvalidConfig, match="tm_t=256 must divide m=384"):
        upstream.megablox_gmm_bwd(lhs[:384], rhs, gs, jnp.zeros((384, 384)), tm=128, tk=128,
                                  tn=128, tm_t=256, tk_t=128, tn_t=128)


def test_splash_standin_computes_every_block_without_tables():
    """Splash's estimate stand-in (kernels/_splash.py): with its mask tables taken out it
    fetches and computes every block in grid order, i.e. full attention, on one KV head and
    its query heads, scaled back by the heads and the causal share of blocks."""
    from pallas_tune.kernels import _splash

    q, k, v = _qkv((1, 4, 512, 128))
    kk, vv = k[:, :2], v[:, :2]  # GQA: 2 query heads per KV head.
    blocks = dict(block_q=128, block_kv=256, block_kv_compute=128)
    out = upstream.splash_attention(q, kk, vv, causal=False, tables=False, **blocks)
    ref = flash_attention_reference(q, kk, vv, causal=False)
    np.testing.assert_allclose(out, ref, atol=2e-3, rtol=2e-3)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, kk, vv)]
    cut, kwargs, scale = _splash.forward_standin(specs, {"causal": True}, blocks)
    assert [a.shape for a in cut] == [(1, 2, 512, 128), (1, 1, 512, 128), (1, 1, 512, 128)]
    assert kwargs == {"causal": False, "tables": False}
    # 4 query blocks of 128 over 2 KV blocks of 256: rows 0-1 see block 0 only, rows 2-3 both.
    assert _splash.causal_fraction(512, 512, 128, 256) == 6 / 8
    assert scale == pytest.approx(2 * 6 / 8)  # Two KV heads, 6 of 8 blocks computed.
    assert _splash.causal_fraction(8192, 8192, 512, 512) == pytest.approx(17 / 32)
    bwd = dict(block_q_dkv=512, block_kv_dkv=512, block_kv_dkv_compute=512, block_q_dq=256,
               block_kv_dq=512, use_fused_bwd_kernel=False)
    _, _, s = _splash.backward_standin(specs + specs[:1], {"causal": True}, bwd)
    dkv, dq = _splash.causal_fraction(512, 512, 512, 512), _splash.causal_fraction(
        512, 512, 256, 512)
    assert s == pytest.approx(2 * (6 * dkv + 3 * dq) / 9)


def test_a_standin_is_used_where_the_full_problem_has_no_estimate():
    """Splash's full program has no static estimate at any config (its tables read as 0): the
    stand-in is then used, marked unverifiable, not dropped."""
    from pallas_tune.measure.estimate import EstimateResult
    from pallas_tune.measure.loops import NOT_ESTIMABLE
    from pallas_tune.measure.standin import standin_verdict

    scaled = EstimateResult(ok=True, kind="ok", cycles=1000, scale=4.25)
    blind = EstimateResult(ok=False, kind=NOT_ESTIMABLE, message="blind fetches")
    use, record = standin_verdict({"block_q": 512}, 4.25, scaled, blind)
    assert use and record["unverifiable"] and not record["trusted"]
    assert "blind fetches" in record["note"]
    other = EstimateResult(ok=False, kind="compile_error", message="boom")
    assert standin_verdict({"block_q": 512}, 4.25, scaled, other)[0] is False
