"""The adapters for JAX's Pallas GPU ops: correct in interpret mode at every shape they accept,
clear errors for the rest, and every config of their spaces lowers for the Triton backend (on
this CPU host, under an abstract H100 mesh), so the tuner's spaces hold only real candidates."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from draws import normal
from hypothesis import given, settings
from hypothesis import strategies as st
from model_kernel_checks import oracle

import pallas_tune as pt
from pallas_tune.kernels import upstream_gpu as g
from pallas_tune.measure.timing import compare

S = jax.ShapeDtypeStruct
# Random examples each run (Hypothesis's own defaults, not the derandomized `ci` profile).
RANDOM = settings.get_profile("default")
DTYPES = [jnp.float32, jnp.bfloat16]


def _rand(shape, dtype, seed=0):
    return normal(seed, shape, dtype)


def _assert_close(out, ref):
    for leaf in jax.tree_util.tree_leaves(out):
        assert bool(jnp.all(jnp.isfinite(leaf.astype(jnp.float32)))), "NaN/Inf in the output"
    ok, err, why = compare(out, ref)
    assert ok, why


def _config(kernel, draw_index: int):
    """A config of the kernel's space that is valid for the call (InvalidConfig ones skipped by
    the caller), chosen deterministically from an index."""
    configs = list(kernel.space)
    return configs[draw_index % len(configs)]


@settings(RANDOM, max_examples=6, deadline=None)
@given(seq=st.sampled_from([16, 48, 64, 144]), heads=st.integers(1, 3),
       dim=st.sampled_from([32, 48, 64]), causal=st.booleans(),
       dtype=st.sampled_from(DTYPES), pick=st.integers(0, 10_000))
def test_mha_matches_reference(seq, heads, dim, causal, dtype, pick):
    q, k, v = (_rand((1, seq, heads, dim), dtype, s) for s in range(3))
    config = _config(g.mha, pick)
    try:
        out = g.mha(q, k, v, causal=causal, **config)
    except pt.InvalidConfig:  # A block that does not divide seq: refused before tracing.
        assert seq % min(config["block_q"], seq) or seq % min(config["block_k"], seq)
        return
    _assert_close(out, oracle(g._mha_reference, q, k, v, causal=causal))


@settings(RANDOM, max_examples=6, deadline=None)
@given(kv_len=st.sampled_from([16, 48, 128, 272]), groups=st.sampled_from([(1, 1), (8, 2),
                                                                           (6, 3)]),
       dtype=st.sampled_from(DTYPES), pick=st.integers(0, 10_000))
def test_decode_attention_matches_reference(kv_len, groups, dtype, pick):
    hq, hkv = groups
    q = _rand((2, hq, 64), dtype, 0)
    k, v = (_rand((2, kv_len, hkv, 64), dtype, s) for s in (1, 2))
    config = _config(g.decode_attention, pick)
    try:
        out = g.decode_attention(q, k, v, **config)
    except pt.InvalidConfig:
        return
    _assert_close(out, oracle(g._decode_reference, q, k, v))


@settings(RANDOM, max_examples=6, deadline=None)
@given(pages=st.sampled_from([1, 3, 4, 8]), page=st.sampled_from([16, 32]),
       dtype=st.sampled_from(DTYPES), short=st.booleans(), pick=st.integers(0, 10_000))
def test_paged_attention_matches_reference(pages, page, dtype, short, pick):
    specs = (S((2, 4, 64), dtype), S((2, 16, page, 64), dtype), S((2, 16, page, 64), dtype),
             S((2, pages), jnp.int32), S((2,), jnp.int32))
    (q, kp, vp, tables, lengths), _ = g._paged_inputs(*specs)
    if short:  # Ragged lengths: the second sequence ends mid-page.
        lengths = lengths.at[1].set(max(1, pages * page - page // 2 - 1))
    config = _config(g.paged_attention, pick)
    try:
        out = g.paged_attention(q, kp, vp, tables, lengths, **config)
    except pt.InvalidConfig:
        return
    _assert_close(out, oracle(g._paged_reference, q, kp, vp, tables, lengths))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 1), (5, 7), (2, 3, 1000)])
def test_softmax_any_row_length(shape, dtype):
    x = _rand(shape, dtype)
    _assert_close(g.softmax(x, num_warps=4), g._softmax_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", [1, 100, 4096, 5000])
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norms_any_feature_count(op, features, dtype):
    x = _rand((2, 3, features), dtype)
    w = _rand((features,), jnp.float32, 1)
    b = _rand((features,), jnp.float32, 2)
    fn, ref = getattr(g, op), getattr(g, f"_{op}_reference")
    _assert_close(fn(x, w, b, num_stages=2), ref(x, w, b))


@pytest.mark.parametrize("call, match", [
    (lambda: g.mha(*(_rand((1, 40, 2, 64), jnp.float32),) * 3, block_q=16, block_k=16,
                   num_warps=4, num_stages=2), "multiple of 16"),
    (lambda: g.mha(_rand((1, 32, 2, 64), jnp.float32), *(_rand((1, 32, 1, 64),
                                                               jnp.float32),) * 2,
                   block_q=16, block_k=16, num_warps=4, num_stages=2), "GQA"),
    (lambda: g.decode_attention(_rand((1, 4, 48), jnp.float32),
                                *(_rand((1, 64, 1, 48), jnp.float32),) * 2, block_k=16,
                                k_splits=1, num_warps=4, num_stages=2), "power of two"),
    (lambda: g.decode_attention(_rand((1, 4, 64), jnp.float32),
                                *(_rand((1, 40, 1, 64), jnp.float32),) * 2, block_k=16,
                                k_splits=1, num_warps=4, num_stages=2), "multiple of 16"),
    (lambda: g.layer_norm(_rand((4, 8), jnp.float32), jnp.ones(8), jnp.zeros(8),
                          num_stages=2), "batch, seq, features"),
])
def test_shapes_upstream_cannot_serve_raise_before_tracing(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_configs_upstream_refuses_are_invalid_configs():
    q = _rand((1, 48, 1, 64), jnp.float32)
    with pytest.raises(pt.InvalidConfig, match="must divide"):
        g.mha(q, q, q, block_q=32, block_k=16, num_warps=4, num_stages=2)
    qd, kd = _rand((1, 4, 64), jnp.float32), _rand((1, 64, 1, 64), jnp.float32)
    with pytest.raises(pt.InvalidConfig, match="k_splits"):
        g.decode_attention(qd, kd, kd, block_k=16, k_splits=8, num_warps=4, num_stages=2)


def _h100_mesh():
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                      platform="gpu")
    return jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)


_LOWERING_CASES = {
    "mha": (g.mha, (S((1, 256, 4, 64), jnp.bfloat16),) * 3),
    "decode_attention": (g.decode_attention, (S((4, 32, 64), jnp.bfloat16),
                                              S((4, 1024, 8, 64), jnp.bfloat16),
                                              S((4, 1024, 8, 64), jnp.bfloat16))),
    "paged_attention": (g.paged_attention, (S((4, 32, 128), jnp.bfloat16),
                                            S((8, 64, 16, 128), jnp.bfloat16),
                                            S((8, 64, 16, 128), jnp.bfloat16),
                                            S((4, 16), jnp.int32), S((4,), jnp.int32))),
    "softmax": (g.softmax, (S((64, 1000), jnp.float32),)),
    "layer_norm": (g.layer_norm, (S((2, 64, 1000), jnp.bfloat16), S((1000,), jnp.float32),
                                  S((1000,), jnp.float32))),
}


@pytest.mark.parametrize("name", sorted(_LOWERING_CASES))
def test_every_config_of_the_space_lowers_for_triton(name):
    kernel, args = _LOWERING_CASES[name]
    lowered, invalid = 0, 0
    configs = list(kernel.space)
    if len(configs) > 24:  # Keep CI short: a fixed, spread-out sample of the larger spaces.
        configs = configs[:: len(configs) // 24 + 1]
    with jax.sharding.use_abstract_mesh(_h100_mesh()):
        for config in configs:
            fn = jax.jit(lambda *a, c=config: kernel(*a, **c))
            try:
                text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
            except pt.InvalidConfig:
                invalid += 1
                continue
            assert "triton" in text.lower()
            lowered += 1
    assert lowered > 0 and lowered + invalid == len(configs)


def test_the_spaces_hold_only_values_upstream_honours():
    assert set(itertools.chain.from_iterable(
        p.choices for p in g.layer_norm.space.params)) <= {1, 2, 3, 4}
    assert g.layer_norm.space.names == ("num_stages",)  # Upstream overwrites num_warps.
    assert g.rms_norm.space.names == ("num_stages",)


def test_shipped_h100_caches_serve_the_adapters(monkeypatch):
    """The caches tuned on the lent H100 resolve at trace time for a user on that chip."""
    from pallas_tune import _settings, cache

    monkeypatch.setenv("PALLAS_TUNE_CHIP", "nvidia_h100")
    monkeypatch.setenv("PALLAS_TUNE_CACHE_DIR", "/nonexistent-user-cache")
    _settings.reload()
    cache.reset_default_cache()
    try:
        x = S((16, 32000), jnp.float32)
        config = g.softmax.config_for(x)
        assert config.source == "cache" and "nvidia_h100" in config.origin
        entry, _ = g.softmax.cache.lookup("nvidia_h100", g.softmax.name, g.softmax.cache_key(x))
        prov = entry["provenance"]
        assert prov["timer"] == "profiler" and prov["device_kind"].startswith("NVIDIA H100")
        assert prov["kind"] == "measured" and not prov["interpret"]
    finally:
        monkeypatch.undo()
        _settings.reload()
        cache.reset_default_cache()
