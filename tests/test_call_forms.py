"""Every form a user writes a static keyword in, for every shipped kernel and adapter (issue 53).

A static parameter (``sm_scale``, ``eps``, ``causal``, a window size, ...) given as a Python
value, a numpy scalar of each width, an ``ml_dtypes`` bfloat16 scalar or a concrete JAX scalar is
one call: the same cache key and the same traced program (so the same output) as the call with
the Python value. A traced value there (under ``jax.jit``) is refused at once, naming the
parameter. Tracing is enough to compare programs (interpret mode is slow); a few calls also run.

The kernel list is discovered from ``pallas_tune.kernels``: a kernel added without a case here
fails :func:`test_every_shipped_kernel_has_a_case`.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_tune as pt
import pallas_tune.kernels as shipped
from pallas_tune.runtime.tunable import TunableKernel

S = jax.ShapeDtypeStruct
F32, BF16, I32 = jnp.float32, jnp.bfloat16, jnp.int32


def _attn(b=1, h=1, s=128, d=64, dtype=F32):
    return (S((b, h, s, d), dtype),) * 3


def _lse(b=1, h=1, s=128):
    return S((b, h, s), F32)


# Kernel name -> (arguments as ShapeDtypeStructs, {static parameter: its Python value}).
CASES = {
    "pallas_tune.kernels.flash_attention.flash_attention": (
        _attn(), dict(causal=True, sm_scale=0.125, local_window_size=16)),
    # Its local_window_size has no annotation (adding one would stale its shipped entries: the
    # kernel fingerprint counts annotations), so it is not static here; the forward's gradient
    # passes it on as the Python value the forward made of it.
    "pallas_tune.kernels.flash_attention_bwd.flash_attention_bwd": (
        (*_attn(), S((1, 1, 128, 64), F32), _lse(), S((1, 1, 128, 64), F32)),
        dict(causal=True, sm_scale=0.125)),
    "pallas_tune.kernels.hstu_attention.hstu_attention": (
        (*_attn(), S((7,), F32)), dict(alpha=0.125, norm=0.25)),
    "pallas_tune.kernels.hstu_attention_bwd.hstu_attention_bwd": (
        (*_attn(), S((7,), F32), S((1, 1, 128, 64), F32)), dict(alpha=0.125, norm=0.25)),
    "pallas_tune.kernels.linear_attention.linear_attention": (
        _attn(d=128), dict(decay=0.5)),
    "pallas_tune.kernels.linear_attention_bwd.linear_attention_bwd": (
        (*_attn(d=128), S((1, 1, 128, 128), F32)), dict(decay=0.5)),
    "pallas_tune.kernels.mamba2_ssd.mamba2_ssd": (
        (S((1, 128, 64), F32), S((1, 128, 2), F32), S((2,), F32), S((1, 128, 16), F32),
         S((1, 128, 16), F32), S((2,), F32)), dict(groups=1)),
    "pallas_tune.kernels.quantized_matmul.quantized_matmul": (
        (S((16, 256), BF16), S((256, 128), jnp.int8), S((128,), F32)), dict(quantize_x=True)),
    # Over a 1-device axis (no gather), so that it traces outside shard_map.
    "pallas_tune.kernels.collective_matmul.collective_matmul": (
        (S((8, 128), F32), S((128, 128), F32)), dict(axis_name="tp", axis_size=1)),
    "pallas_tune.kernels.rms_norm.rms_norm": (
        (S((8, 128), F32), S((128,), F32)), dict(eps=0.0625)),
    "pallas_tune.kernels.rms_norm_bwd.rms_norm_bwd": (
        (S((8, 128), F32), S((128,), F32), S((8, 128), F32)), dict(eps=0.0625)),
    "jax.ops.tpu.flash_attention": (_attn(s=256, d=128), dict(causal=True, sm_scale=0.125)),
    "jax.ops.tpu.flash_attention_bwd": (
        (*_attn(s=256, d=128), S((1, 1, 256, 128), F32), _lse(s=256), _lse(s=256),
         S((1, 1, 256, 128), F32)), dict(causal=True, sm_scale=0.125)),
    "jax.ops.tpu.splash_attention": (
        _attn(s=256, d=128), dict(causal=True, sm_scale=0.125, tables=False)),
    "jax.ops.tpu.splash_attention_bwd": (
        (*_attn(s=256, d=128), S((1, 1, 256, 128), F32)),
        dict(causal=True, sm_scale=0.125, tables=False)),
    "jax.ops.tpu.paged_attention": (
        (S((2, 4, 128), F32), S((1, 8, 16, 128), F32), S((1, 8, 16, 128), F32),
         S((2,), I32), S((2, 4), I32)), dict(attn_logits_soft_cap=8.0)),
    "jax.ops.tpu.ragged_paged_attention": (
        (S((64, 4, 128), BF16), S((64, 16, 4, 128), BF16), S((8,), I32), S((8, 8), I32),
         S((9,), I32), S((1,), I32)),
        dict(sm_scale=0.125, sliding_window=16, soft_cap=8.0, static_kv_blocks=2)),
    "jax.ops.gpu.attention.mha": (
        (S((1, 128, 2, 64), F32),) * 3, dict(causal=True, sm_scale=0.125)),
    "jax.ops.gpu.layer_norm": (
        (S((1, 8, 128), F32), S((128,), F32), S((128,), F32)), dict(eps=0.0625)),
    "jax.ops.gpu.rms_norm": (
        (S((1, 8, 128), F32), S((128,), F32), S((128,), F32)), dict(eps=0.0625)),
}
# Traced for a TPU: JAX's Pallas interpreters cannot run it (kernels/upstream_decode.py).
ON_TPU = {"jax.ops.tpu.ragged_paged_attention"}


def _shipped() -> dict[str, TunableKernel]:
    out = {}
    for info in pkgutil.iter_modules(shipped.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"pallas_tune.kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, TunableKernel) and obj.fn.__module__ == module.__name__:
                out[obj.name] = obj
    return out


KERNELS = _shipped()


def _forms(value):
    """The spellings of a Python value a user writes, with a label each."""
    if isinstance(value, str):  # No other spelling of a string (an axis name).
        return []
    if isinstance(value, bool):
        return [("np.bool_", np.bool_(value)), ("jnp.bool_", jnp.bool_(value))]
    if isinstance(value, int):
        return [("np.int32", np.int32(value)), ("np.int64", np.int64(value)),
                ("np.int16", np.int16(value)), ("jnp.int32", jnp.int32(value)),
                ("np.array 0-d", np.array(value))]
    return [("np.float16", np.float16(value)), ("np.float32", np.float32(value)),
            ("np.float64", np.float64(value)), ("bfloat16", jnp.bfloat16(value)),
            ("jnp.float32", jnp.float32(value)),
            ("1 / np.sqrt(d)", 1 / np.sqrt(np.float64(1 / value) ** 2))]


def test_every_shipped_kernel_has_a_case():
    """The matrix covers every kernel with static parameters, and each of their statics."""
    assert "jax.ops.tpu.ragged_paged_attention" in KERNELS
    for name, kernel in KERNELS.items():
        statics = kernel._statics.names  # noqa: SLF001
        if not statics:
            continue
        assert name in CASES, f"{name} has static parameters {sorted(statics)}: add a case"
        assert set(CASES[name][1]) == statics, (name, sorted(statics))


def _program(kernel, args, kwargs):
    where = pt.target("v6e") if kernel.name in ON_TPU else contextlib.nullcontext()
    with warnings.catch_warnings(), where:
        warnings.simplefilter("ignore")
        return str(jax.make_jaxpr(lambda *a: kernel(*a, **kwargs))(*args))


CELLS = [(name, param) for name, (_, statics) in CASES.items() for param in statics]


@pytest.mark.parametrize("name,param", CELLS, ids=[f"{n.rsplit('.', 1)[-1]}-{p}"
                                                   for n, p in CELLS])
def test_each_form_of_a_static_is_its_python_value(cache_dir, name, param):
    kernel = KERNELS[name]
    args, statics = CASES[name]
    value = statics[param]
    want_key = kernel.cache_key(*args, **{param: value})
    _program(kernel, args, {param: value})  # The first trace resolves the config, and warms
    want = _program(kernel, args, {param: value})  # JAX's caches, which its printing shows.
    for label, form in _forms(value):
        assert kernel.cache_key(*args, **{param: form}) == want_key, label
        assert _program(kernel, args, {param: form}) == want, label
    if isinstance(value, str):  # A string cannot be traced.
        return
    # Traced where a static value is needed: refused at once, naming the parameter.
    with pytest.raises(TypeError, match=f"{param} is a static parameter"):
        jax.jit(lambda s: kernel(*args, **{param: s}))(jnp.asarray(value))


def test_a_window_pair_of_numpy_ints_is_the_python_pair(cache_dir):
    kernel = KERNELS["pallas_tune.kernels.flash_attention.flash_attention"]
    args, _ = CASES[kernel.name]
    pair = (np.int64(16), np.int32(8))
    assert kernel.cache_key(*args, local_window_size=pair) == kernel.cache_key(
        *args, local_window_size=(16, 8))
    _program(kernel, args, {"local_window_size": (16, 8)})
    assert _program(kernel, args, {"local_window_size": pair}) == _program(
        kernel, args, {"local_window_size": (16, 8)})


def test_all_statics_at_once_share_the_python_calls_entry(cache_dir):
    """Every static of a kernel given as numpy scalars at once: the Python call's config,
    from the same memo (no second resolution)."""
    kernel = KERNELS["pallas_tune.kernels.flash_attention.flash_attention"]
    args, statics = CASES[kernel.name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = kernel.config_for(*args, **statics)
        numpy = {"causal": np.bool_(True), "sm_scale": np.float64(0.125),
                 "local_window_size": np.int64(16)}
        assert kernel.config_for(*args, **numpy) == config
        assert kernel.cache_key(*args, **numpy) == kernel.cache_key(*args, **statics)


@pytest.mark.parametrize("form", [np.float64(0.125), np.float32(0.125), jnp.float32(0.125)],
                         ids=["np.float64", "np.float32", "jnp.float32"])
def test_flash_attention_runs_with_a_numpy_scale(cache_dir, form):
    """Issue 53 item 3 as reported: every config was refused (NoFeasibleConfigError)."""
    from pallas_tune.kernels.flash_attention import flash_attention

    q = jax.random.normal(jax.random.key(0), (1, 2, 128, 64), F32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = flash_attention(q, q, q, sm_scale=0.125)
        got = flash_attention(q, q, q, sm_scale=form)
        grad = jax.grad(lambda x: flash_attention(x, q, q, sm_scale=form).sum())(q)
        want_grad = jax.grad(lambda x: flash_attention(x, q, q, sm_scale=0.125).sum())(q)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_grad))


def test_rms_norm_runs_with_a_numpy_eps(cache_dir):
    from pallas_tune.kernels.rms_norm import rms_norm

    x = jax.random.normal(jax.random.key(0), (8, 128), F32)
    w = jnp.ones((128,), F32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = rms_norm(x, w, eps=1e-6)
        got = rms_norm(x, w, eps=np.float64(1e-6))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_static_given_an_array_is_refused_naming_it(cache_dir):
    kernel = KERNELS["pallas_tune.kernels.rms_norm.rms_norm"]
    args, _ = CASES[kernel.name]
    with pytest.raises(TypeError, match=r"eps is a static parameter .* shape \(2,\)"):
        kernel.cache_key(*args, eps=np.array([1e-6, 1e-5]))
