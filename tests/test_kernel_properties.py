"""Property tests: every shipped kernel matches its reference at random shapes, in interpret mode.

Shapes mix sizes of 1, primes, one below and one above a tile multiple and sizes past one tile
with any integer in a range; configs are drawn from each kernel's own search space and passed in
full (no dispatcher); float32 and bfloat16. Outputs are compared with the kernel's ``*_reference``
by ``pallas_tune.measure.timing.compare`` (dtype-aware tolerances); NaN or Inf anywhere fails.

Hypothesis profiles: ``ci`` (the default: few examples, derandomized, about 2 minutes on two
cores) and ``long`` (``HYPOTHESIS_PROFILE=long pytest tests/test_kernel_properties.py``: many
random examples, for local runs; ``HYPOTHESIS_MAX_EXAMPLES`` sets how many per test).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from model_kernel_checks import assert_matches_reference, oracle

import pallas_tune as pt
from pallas_tune.kernels import _ragged, upstream
from pallas_tune.kernels.flash_attention import flash_attention, flash_attention_reference
from pallas_tune.kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_tune.kernels.linear_attention import linear_attention, linear_attention_reference
from pallas_tune.kernels.matmul import matmul, matmul_reference
from pallas_tune.kernels.rms_norm import rms_norm, rms_norm_reference

DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])
MM = ("parallel", "parallel", "arbitrary")


def sizes(upper: int) -> st.SearchStrategy[int]:
    """1, primes, tile multiples and their neighbours, sizes past a tile, or any size."""
    special = [n for n in (1, 2, 3, 7, 13, 61, 127, 128, 129, 131, 255, 256, 257, 383, 384, 385,
                           509, 511, 513, 640, 1000, 1023, 1025) if n <= upper]
    return st.one_of(st.sampled_from(special), st.integers(1, upper))


def configs(kernel) -> st.SearchStrategy[dict]:
    return st.sampled_from([dict(c) for c in kernel.space])


def _array(rng: np.random.Generator, shape, dtype, scale: float = 1.0) -> jax.Array:
    return jnp.asarray(scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype)


# ---- matmul ---------------------------------------------------------------------------------

@st.composite
def matmul_cases(draw):
    return (draw(sizes(1100)), draw(sizes(1100)), draw(sizes(1100)), draw(configs(matmul)),
            draw(DTYPES), draw(st.integers(0, 2**16)))


@given(case=matmul_cases())
@example(case=(384, 640, 256, dict(bm=256, bn=256, bk=256, buffering=2, semantics=MM),
               jnp.float32, 0))  # Issue 12's shapes: every element was non-finite.
@example(case=(1000, 1000, 1000, dict(bm=512, bn=256, bk=256, buffering=1, semantics=MM),
               jnp.float32, 1))
@example(case=(100, 300, 200, dict(bm=128, bn=128, bk=128, buffering=2, semantics=MM),
               jnp.bfloat16, 2))
def test_matmul(case):
    m, k, n, config, dtype, seed = case
    rng = np.random.default_rng(seed)
    x, y = _array(rng, (m, k), dtype), _array(rng, (k, n), dtype)
    assert_matches_reference(matmul(x, y, **config), oracle(matmul_reference, x, y))


# ---- flash attention ------------------------------------------------------------------------

@st.composite
def attention_cases(draw, max_len: int = 1100):
    kv_heads, group = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 2)), kv_heads, group, draw(sizes(max_len)),
             draw(sizes(max_len)), draw(st.sampled_from([1, 8, 32, 64, 80, 128, 192, 256])))
    return shape, draw(st.booleans()), draw(DTYPES), draw(st.integers(0, 2**16))


def _qkv(shape, dtype, seed):
    b, hkv, group, sq, sk, d = shape
    rng = np.random.default_rng(seed)
    return (_array(rng, (b, hkv * group, sq, d), dtype), _array(rng, (b, hkv, sk, d), dtype),
            _array(rng, (b, hkv, sk, d), dtype))


@given(case=attention_cases(), config=configs(flash_attention))
@example(case=((1, 1, 2, 1000, 1000, 128), True, jnp.float32, 0),
         config=dict(bq=256, bkv=256))  # Issue 12: NaN at S=1000, causal.
@example(case=((1, 2, 1, 129, 300, 64), False, jnp.bfloat16, 1), config=dict(bq=128, bkv=128))
def test_flash_attention(case, config):
    shape, causal, dtype, seed = case
    q, k, v = _qkv(shape, dtype, seed)
    assert_matches_reference(flash_attention(q, k, v, causal=causal, **config),
                             oracle(flash_attention_reference, q, k, v, causal=causal))


# ---- grouped matmul -------------------------------------------------------------------------

@st.composite
def grouped_cases(draw):
    m, k, n = draw(sizes(700)), draw(sizes(700)), draw(sizes(700))
    groups = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, m), min_size=groups - 1, max_size=groups - 1)))
    group_sizes = np.diff([0, *cuts, m]).tolist()  # Sums to m; repeated cuts: empty groups.
    return m, k, n, group_sizes, draw(DTYPES), draw(st.integers(0, 2**16))


@given(case=grouped_cases(), config=configs(grouped_matmul))
@example(case=(1000, 512, 256, [100, 0, 300, 600], jnp.float32, 0),
         config=dict(tm=128, tk=128, tn=128))  # Issue 12: m=1000 raised ValueError.
@example(case=(250, 300, 130, [7, 0, 243], jnp.bfloat16, 1), config=dict(tm=128, tk=256, tn=128))
def test_grouped_matmul(case, config):
    m, k, n, group_sizes, dtype, seed = case
    rng = np.random.default_rng(seed)
    lhs, rhs = _array(rng, (m, k), dtype), _array(rng, (len(group_sizes), k, n), dtype)
    gs = jnp.asarray(group_sizes, jnp.int32)
    assert_matches_reference(grouped_matmul(lhs, rhs, gs, **config),
                             oracle(grouped_matmul_reference, lhs, rhs, gs))


# ---- linear attention -----------------------------------------------------------------------

@st.composite
def linear_cases(draw):
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(sizes(1100)),
             draw(st.sampled_from([1, 8, 64, 128])), draw(st.sampled_from([8, 64, 128])))
    return (shape, draw(st.sampled_from([1.0, 0.96875, 0.5])), draw(DTYPES),
            draw(st.integers(0, 2**16)))


@given(case=linear_cases(), config=configs(linear_attention))
@example(case=((1, 2, 300, 128, 128), 0.96875, jnp.float32, 0), config=dict(chunk=128))
@example(case=((1, 1, 1000, 64, 64), 1.0, jnp.float32, 1), config=dict(chunk=256))  # Issue 12.
def test_linear_attention(case, config):
    (b, h, t, d, dv), decay, dtype, seed = case
    rng = np.random.default_rng(seed)
    scale = 1.0 / math.sqrt(d)  # Keeps o = q·S of order one at every length.
    q, k = _array(rng, (b, h, t, d), dtype, scale), _array(rng, (b, h, t, d), dtype, scale)
    v = _array(rng, (b, h, t, dv), dtype)
    assert_matches_reference(linear_attention(q, k, v, decay=decay, **config),
                             oracle(linear_attention_reference, q, k, v, decay=decay))


# ---- rms norm -------------------------------------------------------------------------------

@given(lead=st.sampled_from([(), (2,), (3, 1)]), rows=sizes(2100),
       hidden=st.sampled_from([1, 7, 128, 300, 1024]), config=configs(rms_norm), dtype=DTYPES,
       seed=st.integers(0, 2**16))
def test_rms_norm(lead, rows, hidden, config, dtype, seed):
    rng = np.random.default_rng(seed)
    x = _array(rng, (*lead, rows, hidden), dtype)
    w = (1.0 + _array(rng, (hidden,), jnp.float32, 0.1)).astype(dtype)
    assert_matches_reference(rms_norm(x, w, **config), oracle(rms_norm_reference, x, w))


# ---- upstream adapters: what they accept is correct; the rest is refused before tracing ------

@pytest.fixture
def upstream_calls(monkeypatch):
    """Counts calls into the upstream kernels (a refused input must not reach them)."""
    calls = []
    for module, name in ((upstream._fa, "flash_attention"), (upstream._splash, "make_splash_mha"),
                         (upstream._gmm, "gmm")):
        real = getattr(module, name)

        def spy(*a, _real=real, **kw):
            calls.append(_real)
            return _real(*a, **kw)

        monkeypatch.setattr(module, name, spy)
    return calls


def _upstream_case(fn, args, kwargs, config, accepts: bool, reference, calls) -> None:
    """An input the adapter's documented contract accepts must match the reference; any other
    must raise ValueError or InvalidConfig without tracing the upstream kernel."""
    calls.clear()
    event("accepted" if accepts else "refused")  # --hypothesis-show-statistics shows the split.
    if accepts:
        assert_matches_reference(fn(*args, **kwargs, **config), reference)
        assert calls, "the upstream kernel was not called"
    else:
        with pytest.raises((ValueError, pt.InvalidConfig)):
            fn(*args, **kwargs, **config)
        assert not calls, "the upstream kernel was traced before the input was refused"


def _clamped(config, dims):
    return {name: min(value, dims[name]) for name, value in config.items()}


@settings(suppress_health_check=[*settings().suppress_health_check,
                                 HealthCheck.function_scoped_fixture])
@given(case=attention_cases(max_len=700), config=configs(upstream.flash_attention))
@example(case=((1, 2, 1, 1000, 512, 128), True, jnp.float32, 0),
         config=dict(block_q=128, block_k_major=256, block_k=128))  # Any q_len.
def test_upstream_flash_attention(case, config, upstream_calls):
    shape, causal, dtype, seed = case
    q, k, v = _qkv(shape, dtype, seed)
    _, _, group, sq, sk, d = shape
    c = _clamped(config, dict(block_q=sq, block_k_major=sk, block_k=sk))
    bkm, bk = c["block_k_major"], c["block_k"]
    accepts = (group == 1 and sk % bkm == 0 and sk % bk == 0 and bkm % bk == 0
               and (bk == sk or d <= 128 or d % 128 == 0))
    _upstream_case(upstream.flash_attention, (q, k, v), dict(causal=causal), config, accepts,
                   oracle(flash_attention_reference, q, k, v, causal=causal) if accepts else None,
                   upstream_calls)


@settings(suppress_health_check=[*settings().suppress_health_check,
                                 HealthCheck.function_scoped_fixture])
@given(case=attention_cases(max_len=700), config=configs(upstream.splash_attention),
       kv_blocks=st.sampled_from([0, 1, 2, 3, 4]))
@example(case=((1, 1, 2, 1000, 0, 80), True, jnp.float32, 0),
         config=dict(block_q=1024, block_kv=256, block_kv_compute=128), kv_blocks=4)
def test_upstream_splash_attention(case, config, kv_blocks, upstream_calls):
    shape, causal, dtype, seed = case
    if kv_blocks:  # Most drawn kv lengths are refused (not multiples of 128): draw some that fit.
        shape = (*shape[:4], 128 * kv_blocks, shape[5])
    q, k, v = _qkv(shape, dtype, seed)
    sq, sk = shape[3], shape[4]
    c = _clamped(config, dict(block_q=sq, block_kv=sk, block_kv_compute=sk))
    bq, bkv, bkvc = c["block_q"], c["block_kv"], c["block_kv_compute"]
    accepts = (sk % 128 == 0 and sq % bq == 0 and (bq == sq or bq % 8 == 0) and sk % bkv == 0
               and bkv % bkvc == 0)
    _upstream_case(upstream.splash_attention, (q, k, v), dict(causal=causal), config, accepts,
                   oracle(flash_attention_reference, q, k, v, causal=causal) if accepts else None,
                   upstream_calls)


@settings(suppress_health_check=[*settings().suppress_health_check,
                                 HealthCheck.function_scoped_fixture])
@given(case=grouped_cases(), config=configs(upstream.megablox_gmm),
       m_tiles=st.sampled_from([0, 1, 2, 3]))
@example(case=(1000, 300, 200, [500, 500], jnp.float32, 0), config=dict(tm=128, tk=128, tn=128),
         m_tiles=0)
@example(case=(7, 300, 200, [0, 7], jnp.bfloat16, 1), config=dict(tm=256, tk=128, tn=128),
         m_tiles=2)
def test_upstream_megablox_gmm(case, config, m_tiles, upstream_calls):
    m, k, n, group_sizes, dtype, seed = case
    if m_tiles:  # Most drawn m are refused (tm must divide m): draw some that fit.
        m = 128 * m_tiles
        group_sizes = [*group_sizes[:-1], m - sum(group_sizes[:-1])]
        if group_sizes[-1] < 0:
            group_sizes = [0] * (len(group_sizes) - 1) + [m]
    rng = np.random.default_rng(seed)
    lhs, rhs = _array(rng, (m, k), dtype), _array(rng, (len(group_sizes), k, n), dtype)
    gs = jnp.asarray(group_sizes, jnp.int32)
    accepts = m % min(config["tm"], m) == 0
    _upstream_case(upstream.megablox_gmm, (lhs, rhs, gs), {}, config, accepts,
                   oracle(grouped_matmul_reference, lhs, rhs, gs) if accepts else None,
                   upstream_calls)


# ---- shapes that divide: no mask code at all ------------------------------------------------

S = jax.ShapeDtypeStruct
_DIVIDING = [  # (kernel, args, kwargs, config, ragged variant of the args)
    (matmul, [S((512, 1024), jnp.bfloat16), S((1024, 256), jnp.bfloat16)], {},
     dict(bm=256, bn=128, bk=512, buffering=2, semantics=MM),
     [S((512, 1000), jnp.bfloat16), S((1000, 256), jnp.bfloat16)]),
    (flash_attention, [S((1, 4, 1024, 128), jnp.bfloat16), S((1, 2, 1024, 128), jnp.bfloat16),
                       S((1, 2, 1024, 128), jnp.bfloat16)], {"causal": True},
     dict(bq=256, bkv=512),
     [S((1, 4, 1024, 128), jnp.bfloat16), S((1, 2, 1000, 128), jnp.bfloat16),
      S((1, 2, 1000, 128), jnp.bfloat16)]),
    (grouped_matmul, [S((512, 512), jnp.float32), S((4, 512, 256), jnp.float32),
                      S((4,), jnp.int32)], {}, dict(tm=128, tk=256, tn=128),
     [S((512, 500), jnp.float32), S((4, 500, 256), jnp.float32), S((4,), jnp.int32)]),
    (linear_attention, [S((1, 2, 1024, 64), jnp.float32)] * 3, {"decay": 0.9},
     dict(chunk=256), [S((1, 2, 1000, 64), jnp.float32)] * 3),
]


@pytest.mark.parametrize("kernel,args,kwargs,config,ragged", _DIVIDING,
                         ids=[c[0].name.rsplit(".", 1)[-1] for c in _DIVIDING])
def test_tail_masks_only_where_an_axis_is_ragged(kernel, args, kwargs, config, ragged,
                                                 monkeypatch):
    def traced(specs):
        return jax.jit(lambda *a: kernel(*a, **kwargs, **config)).trace(*specs)

    calls = []
    monkeypatch.setattr(_ragged, "fill_tail", lambda *a, **kw: calls.append(a) or a[0])
    traced(args)
    assert not calls, "a tail mask was emitted at shapes every block divides"
    traced(ragged)
    assert calls, "no tail mask at a ragged shape"


# ---- odd shapes compile for a TPU (deviceless, v6e) -----------------------------------------

_ODD = [  # (kernel, args, kwargs and config): sizes of 1, primes, odd head dims, in bf16.
    (matmul, [S((1, 1), jnp.bfloat16), S((1, 1), jnp.bfloat16)],
     dict(bm=256, bn=256, bk=256, buffering=2, semantics=MM)),
    (matmul, [S((13, 300), jnp.bfloat16), S((300, 1000), jnp.bfloat16)],
     dict(bm=256, bn=256, bk=256, buffering=2, semantics=MM)),
    (flash_attention, [S((1, 2, 5, 8), jnp.bfloat16), S((1, 1, 3, 8), jnp.bfloat16),
                       S((1, 1, 3, 8), jnp.bfloat16)], dict(causal=True, bq=128, bkv=128)),
    (flash_attention, [S((1, 2, 257, 72), jnp.bfloat16), S((1, 1, 129, 72), jnp.bfloat16),
                       S((1, 1, 129, 72), jnp.bfloat16)], dict(causal=False, bq=128, bkv=128)),
    (linear_attention,
     [S((1, 2, 300, 100), jnp.bfloat16)] * 2 + [S((1, 2, 300, 72), jnp.bfloat16)],
     dict(decay=0.9, chunk=64)),
    (grouped_matmul, [S((250, 300), jnp.bfloat16), S((3, 300, 130), jnp.bfloat16),
                      S((3,), jnp.int32)], dict(tm=128, tk=128, tn=128)),
    (rms_norm, [S((13, 7), jnp.bfloat16), S((7,), jnp.bfloat16)], dict(block_rows=8)),
]


@pytest.mark.libtpu
@pytest.mark.parametrize("kernel,args,kwargs", _ODD, ids=[f"{c[0].name.rsplit('.', 1)[-1]}-{i}"
                                                        for i, c in enumerate(_ODD)])
def test_odd_shapes_compile_for_tpu(kernel, args, kwargs):
    from pallas_tune.feasibility.compile import compile_deviceless

    res = compile_deviceless(kernel.fn, args, kwargs, chip="v6e")
    assert res.ok, res.message
