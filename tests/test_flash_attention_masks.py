"""Sliding-window and document (segment-id) masks of flash attention (kernels/_masks.py), forward
and backward, in interpret mode: against a float64 reference at ragged lengths (window, segment
ids, both; causal and not; GQA; f32 and bf16), queries that see no key (0, finite gradients),
the pairs of blocks no query sees really skipped (grid steps counted; NaN in skipped blocks never
reaching a result), cache keys, jit / checkpoint / vmap through the gradient with traced segment
ids, clear errors, a property test, v6e compiles (libtpu)."""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draws import normals
from hypothesis import example, given
from hypothesis import strategies as st

import pallas_tune as pt
from pallas_tune.kernels import flash_attention as fa_module
from pallas_tune.kernels import _flash_bwd
from pallas_tune.kernels._attention import reference_lse
from pallas_tune.kernels.flash_attention import (SegmentIds, flash_attention,
                                                 flash_attention_reference)
from pallas_tune.kernels.flash_attention_bwd import flash_attention_bwd

SMALL = dict(bq_dq=128, bkv_dq=128, bq_dkv=128, bkv_dkv=128, fused=False)
FUSED = {**SMALL, "fused": True}  # One pass: dK/dV with dq accumulated.


def _qkv(hq, hkv, sq, sk, d, dtype=jnp.float32, seed=0, b=1):
    q, k, v, do = normals(seed, [(b, hq, sq, d), (b, hkv, sk, d), (b, hkv, sk, d),
                                 (b, hq, sq, d)], dtype)
    return q, k, v, do


def _docs(lengths, b=1):
    """Segment ids (batch, sum of lengths) of documents of these lengths packed one after
    another; batch row r packs them rotated by r (rows differ) and numbers them from 10 r."""
    rows = []
    for r in range(b):
        order = lengths[r % len(lengths):] + lengths[:r % len(lengths)]
        rows.append(np.concatenate([np.full(n, 10 * r + i, np.int32)
                                    for i, n in enumerate(order)]))
    return jnp.asarray(np.stack(rows))


def _seen(sq, sk, causal, window, segments):
    """(batch or 1, 1, q_len, kv_len) booleans from the definitions, in numpy."""
    q = np.arange(sq)[:, None]
    k = np.arange(sk)[None, :]
    ok = np.ones((sq, sk), bool)
    if causal:
        ok &= k <= q
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok &= (q - left <= k) & (k <= q + right)
    ok = ok[None, None]
    if segments is not None:
        qs, ks = (np.asarray(x) for x in segments)
        ok = ok & (qs[:, None, :, None] == ks[:, None, None, :])
    return ok


def f64_attention(q, k, v, do, *, causal=False, window=None, segments=None):
    """o, dq, dk, dv in float64 from the kernel's own (rounded) inputs: softmax over the keys
    each query sees, 0 for a query that sees none; the gradients by the softmax's own rule."""
    q, k, v, do = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v, do))
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    group = hq // hkv
    kr, vr = np.repeat(k, group, 1), np.repeat(v, group, 1)
    scale = 1 / np.sqrt(d)
    s = np.einsum("bhqd,bhkd->bhqk", q, kr) * scale
    seen = _seen(sq, sk, causal, window, segments)
    m = np.where(seen, s, -np.inf).max(-1, keepdims=True)
    e = np.where(seen, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    o = p @ vr
    dp = do @ np.swapaxes(vr, -1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = scale * ds @ kr
    dk = (scale * np.swapaxes(ds, -1, -2) @ q).reshape(b, hkv, group, sk, d).sum(2)
    dv = (np.swapaxes(p, -1, -2) @ do).reshape(b, hkv, group, sk, d).sum(2)
    return o, dq, dk, dv


def _assert_close(got, want, dtype, what):
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    bad = int(np.sum(~np.isfinite(got)))
    assert bad == 0, f"{what}: {bad} NaN/Inf values"
    assert got.shape == want.shape, (what, got.shape, want.shape)
    tol = (3e-2 if dtype == jnp.bfloat16 else 3e-5) * max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(got, want, atol=tol, rtol=0, err_msg=what)


def _masks(window, segments):
    out = {}
    if window is not None:
        out["local_window_size"] = window
    if segments is not None:
        out["segment_ids"] = SegmentIds(*segments)
    return out


def _check(q, k, v, do, *, causal, window, segments, fwd, bwd):
    """The forward kernel (blocks ``fwd``) and the backward kernel (``bwd``, from the
    forward kernel's own o and lse) against float64."""
    masks = _masks(window, segments)
    want = f64_attention(q, k, v, do, causal=causal, window=window, segments=segments)
    with pt.chips.interpret_mode():
        o, (*_, lse) = fa_module._residuals(q, k, v, causal=causal, **masks, **fwd)
    _assert_close(o, want[0], q.dtype, "o")
    grads = flash_attention_bwd(q, k, v, o, lse, do, causal=causal, **masks, **bwd)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want[1:], strict=True):
        assert g.dtype == q.dtype, (name, g.dtype)
        _assert_close(g, w, q.dtype, name)


@pytest.mark.parametrize("hq,hkv,sq,sk,causal,window,docs", [
    (4, 2, 300, 300, False, (100, 0), None),          # Sliding window, causal by its right edge.
    (2, 1, 300, 300, True, 50, None),                 # An int window with causal.
    (2, 2, 300, 200, False, (40, 70), None),          # q_len > kv_len: the last queries see none.
    (4, 2, 333, 333, True, None, [50, 130, 1, 100, 52]),  # Documents, causal.
    (2, 1, 300, 300, False, (30, 30), [120, 60, 120]),  # Both, not causal.
    (2, 1, 200, 300, False, None, ([80, 70, 50], [100, 0, 150, 50])),  # Cross: doc 1 has no key.
])
@pytest.mark.parametrize("fused", [False, True], ids=["two_passes", "fused"])
def test_masks_match_float64_at_ragged_lengths(hq, hkv, sq, sk, causal, window, docs, fused):
    """Blocks of 128 (several per axis, ragged last blocks both ways), GQA groups of 1-2; the
    backward's two passes and its fused one (whose dq of a query block no key reaches is never
    a step's block: zero, from its lse)."""
    segments = None
    if docs is not None:
        q_docs, kv_docs = docs if isinstance(docs, tuple) else (docs, docs)
        segments = (_docs(q_docs), _docs(kv_docs))
    q, k, v, do = _qkv(hq, hkv, sq, sk, 32, seed=sq + sk)
    _check(q, k, v, do, causal=causal, window=window, segments=segments,
           fwd=dict(bq=128, bkv=128), bwd=FUSED if fused else SMALL)


@pytest.mark.parametrize("window,docs,fwd,bwd", [
    ((200, 0), None, dict(bq=512, bkv=256),
     dict(bq_dq=512, bkv_dq=256, bq_dkv=256, bkv_dkv=512, fused=False)),
    (None, [300, 5, 395], dict(bq=256, bkv=512),
     dict(bq_dq=256, bkv_dq=512, bq_dkv=512, bkv_dkv=256, fused=False)),
    (None, [300, 5, 395], dict(bq=256, bkv=512),
     dict(bq_dq=128, bkv_dq=128, bq_dkv=512, bkv_dkv=256, fused=True)),
])
def test_masked_strips_of_large_blocks(window, docs, fwd, bwd):
    """Blocks of 512: masked blocks cut into column strips (the mask read from each strip's
    own columns of the block), causal, at 700 tokens."""
    segments = None if docs is None else (_docs(docs), _docs(docs))
    q, k, v, do = _qkv(2, 1, 700, 700, 32, seed=7)
    _check(q, k, v, do, causal=True, window=window, segments=segments, fwd=fwd, bwd=bwd)


def test_bf16_masks_match_float64():
    segments = (_docs([100, 157, 43], b=2), _docs([100, 157, 43], b=2))
    q, k, v, do = _qkv(4, 1, 300, 300, 64, jnp.bfloat16, seed=3, b=2)
    _check(q, k, v, do, causal=True, window=(64, 0), segments=segments,
           fwd=dict(bq=128, bkv=128), bwd=SMALL)


def test_a_query_that_sees_no_key_gives_zero_and_finite_gradients():
    """Queries whose document has no key, and queries past the keys' window: output 0 exactly,
    log-sum-exp -inf (as the reference's), gradients finite and as float64's."""
    q, k, v, do = _qkv(2, 1, 260, 260, 32, seed=11)
    segments = (_docs([100, 60, 100]), _docs([100, 0, 160]))  # Doc 1 has no keys.
    masks = _masks(None, segments)
    with pt.chips.interpret_mode():
        o, (*_, lse) = fa_module._residuals(q, k, v, bq=128, bkv=128, **masks)
    assert (np.asarray(o[:, :, 100:160]) == 0).all()
    assert np.isneginf(np.asarray(lse[:, :, 100:160])).all()
    ref_lse = reference_lse(q, k, **masks)
    np.testing.assert_allclose(lse, ref_lse, atol=1e-5)
    _check(q, k, v, do, causal=False, window=None, segments=segments,
           fwd=dict(bq=128, bkv=128), bwd=SMALL)
    q2, k2, v2, do2 = _qkv(2, 2, 384, 128, 32, seed=12)  # Queries past 128 + 20 see nothing.
    _check(q2, k2, v2, do2, causal=False, window=(20, 20), segments=None,
           fwd=dict(bq=128, bkv=128), bwd=SMALL)


def _expected_pairs(sq, sk, bq, bkv, causal, window, segments):
    """The (query block, KV block) pairs in which some query sees some key (by definition)."""
    seen = _seen(sq, sk, causal, window, segments)[0, 0]
    return {(i, j) for i in range(-(-sq // bq)) for j in range(-(-sk // bkv))
            if seen[i * bq:(i + 1) * bq, j * bkv:(j + 1) * bkv].any()}


@pytest.mark.parametrize("sq,sk,causal,window,docs", [
    (700, 700, False, (150, 0), None),
    (700, 700, True, 100, None),
    (300, 700, False, (0, 200), None),
    (700, 700, True, None, [90, 300, 10, 300]),
    (700, 700, False, None, [128, 256, 200, 116]),
])
def test_blocks_no_query_sees_are_not_computed(monkeypatch, sq, sk, causal, window, docs):
    """The grid steps that compute (a host callback in each computing branch, forward and
    both backward passes) are exactly the pairs of blocks with a visible (query, key) pair:
    fewer than the grid's, none of the others computed and masked."""
    segments = None if docs is None else (_docs(docs), _docs(docs))
    want = _expected_pairs(sq, sk, 128, 128, causal, window, segments)
    assert 0 < len(want) < (-(-sq // 128)) * (-(-sk // 128))
    ran = {}

    def counting(dispatch, tag):
        def wrapped(update, *a, **kw):
            blocks = kw.get("blocks", a[0] if a else None)
            here = ran.setdefault(f"{tag}{len(ran)}", [])

            def counted(*args, **kwargs):
                jax.debug.callback(lambda i, j: here.append((int(i), int(j))), blocks.i,
                                   blocks.j)
                return update(*args, **kwargs)
            return dispatch(counted, *a, **kw)
        return wrapped

    monkeypatch.setattr(fa_module, "_dispatch_masked", counting(fa_module._dispatch_masked, "f"))
    monkeypatch.setattr(_flash_bwd, "dispatch", counting(_flash_bwd.dispatch, "b"))
    q, k, v, do = _qkv(1, 1, sq, sk, 16, seed=1)
    masks = _masks(window, segments)
    with pt.chips.interpret_mode():
        o, (*_, lse) = fa_module._residuals(q, k, v, causal=causal, bq=128, bkv=128, **masks)
    flash_attention_bwd(q, k, v, o, lse, do, causal=causal, **masks, **SMALL)
    flash_attention_bwd(q, k, v, o, lse, do, causal=causal, **masks, **FUSED)
    # The forward, then dK/dV and dQ, then the fused pass (the explicit configs' validity
    # check traces the backward too, without running it: those tags stay empty).
    ran = {tag: steps for tag, steps in ran.items() if steps}
    assert sorted(tag[0] for tag in ran) == ["b", "b", "b", "f"]
    for tag, steps in ran.items():
        assert len(steps) == len(set(steps)) and set(steps) == want, tag


def test_nan_in_skipped_blocks_never_reaches_a_result():
    """Keys and values in blocks that no query sees are NaN: a kernel that computed such a block
    and masked it would carry 0 * NaN into its sums. Window (keys beyond every query's reach)
    and segment ids (a document no query belongs to); forward and backward."""
    cases = [(128, (0, 100), None, slice(256, 512)),  # Query 127 sees up to key 227.
             (256, None, (_docs([200, 56]), _docs([200, 56, 128, 128])), slice(256, 384))]
    for sq, window, segments, dead in cases:  # Doc 2 (keys 256-383) has no query.
        q, k, v, do = _qkv(2, 1, sq, 512, 32, seed=2)
        clean = f64_attention(q, k, v, do, window=window, segments=segments)
        poisoned_k = k.at[:, :, dead].set(jnp.nan)
        poisoned_v = v.at[:, :, dead].set(jnp.nan)
        masks = _masks(window, segments)
        with pt.chips.interpret_mode():
            o, (*_, lse) = fa_module._residuals(q, poisoned_k, poisoned_v, bq=128, bkv=128,
                                                **masks)
        _assert_close(o, clean[0], q.dtype, "o")
        for bwd in (SMALL, FUSED):
            grads = flash_attention_bwd(q, poisoned_k, poisoned_v, o, lse, do, **masks, **bwd)
            for name, g, w in zip(("dq", "dk", "dv"), grads, clean[1:], strict=True):
                _assert_close(g, w, q.dtype, name)
            assert (np.asarray(grads[1][:, :, dead]) == 0).all()


def test_gradient_through_the_custom_vjp_with_traced_segment_ids():
    """jax.grad through flash_attention (its backward resolved as any call's) under jit and
    jax.checkpoint (two policies), the segment ids arguments of the jitted function (traced,
    not constants); and jax.vmap over a leading axis."""
    q, k, v, do = _qkv(4, 2, 200, 200, 32, seed=5)
    ids = _docs([70, 60, 70])
    fwd = functools.partial(flash_attention, causal=True, local_window_size=(90, 0), bq=128,
                            bkv=128)

    def loss(fn, q, k, v, ids):
        return jnp.sum(fn(q, k, v, segment_ids=SegmentIds(ids, ids)) * do)

    want = f64_attention(q, k, v, do, causal=True, window=(90, 0), segments=(ids, ids))
    for wrap in (lambda f: f, functools.partial(jax.checkpoint,
                                                 policy=jax.checkpoint_policies.nothing_saveable),
                 functools.partial(jax.checkpoint,
                                   policy=jax.checkpoint_policies.dots_saveable)):
        grads = jax.jit(jax.grad(wrap(functools.partial(loss, fwd)), argnums=(0, 1, 2)))(
            q, k, v, ids)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want[1:], strict=True):
            _assert_close(g, w, q.dtype, name)
    ref = jax.grad(functools.partial(loss, functools.partial(
        flash_attention_reference, causal=True, local_window_size=(90, 0))), argnums=(0, 1, 2))
    mapped = jax.vmap(jax.grad(functools.partial(loss, fwd), argnums=(0, 1, 2)))(
        *(jnp.stack([x, x[::-1]]) for x in (q, k, v, ids)))
    for n in range(2):
        args = [x[::-1] if n else x for x in (q, k, v, ids)]
        for g, r in zip(mapped, ref(*args), strict=True):
            np.testing.assert_allclose(g[n], r, atol=3e-5 * max(1, float(np.abs(r).max())))


def test_cache_keys_and_no_unmasked_entry_for_a_masked_call():
    """Calls without masks keep their keys (the shipped entries serve them); with a window or
    segment ids the key names them, and no entry tuned without them serves the call."""
    q = jax.ShapeDtypeStruct((1, 32, 512, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 8, 512, 128), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 512), jnp.int32)
    plain = ("q=1x32x512x128:bfloat16,k=1x8x512x128:bfloat16,v=1x8x512x128:bfloat16,"
             "causal=true,sm_scale=null")
    assert flash_attention.cache_key(q, kv, kv, causal=True) == plain
    assert flash_attention.cache_key(q, kv, kv, causal=True, local_window_size=None,
                                     segment_ids=None) == plain
    window = flash_attention.cache_key(q, kv, kv, causal=True, local_window_size=(256, 0))
    assert window == plain + ",local_window_size=[256,0]"
    docs = flash_attention.cache_key(q, kv, kv, causal=True, segment_ids=SegmentIds(ids, ids))
    assert "segment_ids=(1x512:int32;1x512:int32)" in docs
    with pt.target("v6e"):
        flash_attention._memo.clear()
        assert flash_attention.config_for(q, kv, kv, causal=True).source == "cache"
        for masks in (dict(local_window_size=(256, 0)), dict(segment_ids=SegmentIds(ids, ids))):
            with warnings.catch_warnings():  # The miss's advice (once per process).
                warnings.simplefilter("ignore", pt.PallasTuneWarning)
                found = flash_attention.config_for(q, kv, kv, causal=True, **masks)
            assert found.source == "default", (masks, found.source)
    flash_attention._memo.clear()
    o = jax.ShapeDtypeStruct((1, 32, 512), jnp.float32)
    bwd_key = flash_attention_bwd.cache_key(q, kv, kv, q, o, q, causal=True)
    assert bwd_key.endswith("causal=true,sm_scale=null")


def test_bad_masks_are_clear_errors():
    q, k, v, _ = _qkv(2, 1, 64, 64, 32)
    ids = _docs([64])
    for window in (-1, (1, 2, 3), (1.5, 0), True):
        with pytest.raises(ValueError, match="local_window_size"):
            flash_attention(q, k, v, local_window_size=window, bq=128, bkv=128)
    for segments in (ids, SegmentIds(ids[:, :32], ids), SegmentIds(ids.astype(jnp.float32), ids)):
        with pytest.raises(ValueError, match="segment_ids"):
            flash_attention(q, k, v, segment_ids=segments, bq=128, bkv=128)


@st.composite
def _cases(draw):
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    sq, sk = draw(st.integers(1, 300)), draw(st.integers(1, 300))
    window = draw(st.one_of(st.none(), st.integers(0, 300),
                            st.tuples(st.integers(0, 300), st.integers(0, 300))))
    segments = None
    if window is None or draw(st.booleans()):
        n = draw(st.integers(1, 4))
        cuts = sorted(draw(st.lists(st.integers(0, max(sq, sk)), min_size=n - 1,
                                    max_size=n - 1)))
        ids = np.searchsorted(np.array(cuts), np.arange(max(sq, sk)), side="right")
        segments = (jnp.asarray(ids[None, :sq], jnp.int32), jnp.asarray(ids[None, :sk], jnp.int32))
    blocks = [draw(st.sampled_from([128, 256])) for _ in range(6)] + [draw(st.booleans())]
    return ((kv_heads * group, kv_heads, sq, sk), window, segments, draw(st.booleans()), blocks)


@given(case=_cases())
@example(case=((2, 1, 1, 1), (0, 0), None, True, [128] * 6 + [False]))
@example(case=((2, 1, 257, 129), (3, 200), None, False, [256, 128, 128, 256, 256, 128, False]))
@example(case=((2, 1, 257, 129), (3, 200), None, False, [256, 128, 128, 256, 256, 128, True]))
def test_masks_property(case):
    """Any lengths, windows (or none), documents (or none), causal or not, blocks of the
    space, the backward's two passes or its fused one; forward and backward against float64."""
    (hq, hkv, sq, sk), window, segments, causal, b = case
    q, k, v, do = _qkv(hq, hkv, sq, sk, 8, seed=sq * 7 + sk)
    _check(q, k, v, do, causal=causal, window=window, segments=segments,
           fwd=dict(bq=b[0], bkv=b[1]), bwd=dict(bq_dq=128 if b[6] else b[2],  # The space's
                                                 bkv_dq=128 if b[6] else b[3],  # fused pin.
                                                 bq_dkv=b[4], bkv_dkv=b[5], fused=b[6]))


@pytest.mark.libtpu
def test_masked_kernels_compile_for_tpu():
    """Deviceless v6e compiles of the masked forward and backward passes (a window; segment
    ids: SMEM tables, id blocks), bf16, GQA, at a ragged length."""
    from pallas_tune.feasibility.compile import compile_deviceless

    S = jax.ShapeDtypeStruct
    q, kv = S((1, 4, 1000, 128), jnp.bfloat16), S((1, 2, 1000, 128), jnp.bfloat16)
    ids, lse = S((1, 1000), jnp.int32), S((1, 4, 1000), jnp.float32)

    def fwd(q, k, v, qs, ks, **kw):
        return flash_attention.fn(q, k, v, segment_ids=SegmentIds(qs, ks), **kw)

    def bwd(q, k, v, o, lse, do, qs, ks, **kw):
        return flash_attention_bwd.fn(q, k, v, o, lse, do, segment_ids=SegmentIds(qs, ks), **kw)

    cases = [
        (flash_attention.fn, [q, kv, kv], dict(causal=True, local_window_size=(256, 0), bq=512,
                                               bkv=256)),
        (fwd, [q, kv, kv, ids, ids], dict(causal=False, local_window_size=100, bq=256, bkv=512)),
        (flash_attention_bwd.fn, [q, kv, kv, q, lse, q],
         dict(causal=True, local_window_size=(256, 0), bq_dq=256, bkv_dq=512, bq_dkv=512,
              bkv_dkv=256, fused=False)),
        (bwd, [q, kv, kv, q, lse, q, ids, ids],
         dict(causal=True, bq_dq=512, bkv_dq=256, bq_dkv=256, bkv_dkv=512, fused=False)),
        (flash_attention_bwd.fn, [q, kv, kv, q, lse, q],  # The fused pass, masked.
         dict(causal=True, local_window_size=(256, 0), bq_dq=128, bkv_dq=128, bq_dkv=512,
              bkv_dkv=256, fused=True)),
        (bwd, [q, kv, kv, q, lse, q, ids, ids],
         dict(causal=True, bq_dq=128, bkv_dq=128, bq_dkv=256, bkv_dkv=512, fused=True)),
    ]
    for fn, args, kwargs in cases:
        res = compile_deviceless(fn, args, kwargs, chip="v6e")
        assert res.ok, (kwargs, res.message)
