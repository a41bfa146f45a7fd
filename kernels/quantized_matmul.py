"""Weight-quantized matmul for serving: bf16 activations, int8 or fp8 (e4m3) weights with one
scale per output channel, optionally activations quantized per token to int8 inside the kernel.

``x (M, K) bf16 @ dequant(w_q (K, N)) → (M, N) bf16``, ``dequant(w_q)[:, n] = w_q[:, n] ·
w_scale[n]``. Grid (cdiv(M, bm), cdiv(N, bn), cdiv(K, bk)), K last and "arbitrary". Weights
stay 8-bit in HBM (half the bytes of bf16: what makes decode faster) and are widened to bf16 in
VMEM, one block at a time; the scale is applied once, to the f32 accumulator, on the last K step.

With ``quantize_x=True`` (int8 weights only) each row of x is quantized to int8 with its own
scale ``max|x[m, :]| / 127`` (the row's maximum over all of K, computed outside the kernel: one
reduction; each element's step is ``round(x · (1 / scale))``) and the dot runs int8 x int8 → int32 on the MXU (v5e/v6e: twice the bf16 rate), the
product scaled by both scales at the end. That changes the numbers (it is what vLLM's and
MaxText's "w8a8" modes do), so it is a call argument and part of the cache key, not a tuned one.

Any M, K, N: ragged M and N blocks are dropped on store; when no bk divides K, the last K step
zeroes the columns of x and rows of w_q past K (emitted only then).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged

__all__ = ["WEIGHT_DTYPES", "quantized_matmul", "quantized_matmul_reference"]

WEIGHT_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
_INT8_MAX = 127.0


def _check(x, w_q, w_scale, quantize_x):
    if x.ndim != 2 or w_q.ndim != 2 or x.shape[1] != w_q.shape[0]:
        raise ValueError(f"quantized_matmul needs x (M, K) and w_q (K, N); got x {x.shape}, "
                         f"w_q {w_q.shape}")
    if w_scale.shape != (w_q.shape[1],):
        raise ValueError(f"quantized_matmul needs one scale per output channel, w_scale "
                         f"({w_q.shape[1]},); got {w_scale.shape}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"quantized_matmul takes bfloat16 activations; got x {x.dtype}: cast "
                         "x to bfloat16")
    if w_q.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"quantized_matmul takes int8 or float8_e4m3fn weights; got w_q "
                         f"{w_q.dtype} (for bfloat16 weights use pallas_tune.kernels.matmul)")
    if quantize_x and w_q.dtype != jnp.int8:
        raise ValueError("quantize_x=True quantizes x to int8 for an int8 x int8 dot: it needs "
                         f"int8 weights, got {w_q.dtype}; call with quantize_x=False")


def row_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's int8 scale, max|x[m, :]| / 127 (1 for an all-zero row), and its inverse,
    both (M, 1) float32. A row is quantized as ``round(x · inverse)``: one f32 multiply, the same
    on every backend (a divide may be computed as a reciprocal and a multiply, and round the
    other way at a tie)."""
    top = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True)
    scale = jnp.where(top > 0, top / _INT8_MAX, 1.0)
    return scale, 1.0 / scale


# The public entry; registered as a tunable kernel (search_spaces/quantized_matmul.toml) at the end
# of the file, once its reference and stand-in exist.
def quantized_matmul(
    x: jax.Array,
    w_q: jax.Array,
    w_scale: jax.Array,
    *,
    quantize_x: bool = False,
    bm: int,
    bn: int,
    bk: int,
    buffering: int,
    vmem_limit_bytes: int = 0,
) -> jax.Array:
    """``x @ (w_q · w_scale)`` for x (M, K) bfloat16, w_q (K, N) int8 or float8_e4m3fn and
    w_scale (N,) (any float dtype; used as float32) → (M, N) bfloat16.

    ``quantize_x``: quantize each row of x to int8 (its own scale) and multiply int8 x int8 on
    the MXU (int8 weights only). Block sizes larger than a dimension are clamped to it.
    ``vmem_limit_bytes``: the scoped VMEM the kernel may use; 0 leaves the chip's default.

    Raises:
      ValueError: shapes that do not match, x not bfloat16, weights neither int8 nor
        float8_e4m3fn, or ``quantize_x`` with fp8 weights.
    """
    _check(x, w_q, w_scale, quantize_x)
    (m, k), n = x.shape, w_q.shape[1]
    bm, bn, bk = min(bm, m), min(bn, n), min(bk, k)
    buffered = functools.partial(pl.BlockSpec, pipeline_mode=pl.Buffered(buffering))
    scale = w_scale.astype(jnp.float32).reshape(1, n)
    operands = [x, w_q, scale]
    in_specs = [buffered((bm, bk), lambda i, j, kk: (i, kk)),
                buffered((bk, bn), lambda i, j, kk: (kk, j)),
                pl.BlockSpec((1, bn), lambda i, j, kk: (0, j))]
    if quantize_x:
        operands += row_scales(x)
        in_specs += [pl.BlockSpec((bm, 1), lambda i, j, kk: (i, 0))] * 2
    acc = jnp.int32 if quantize_x else jnp.float32
    return pl.pallas_call(
        functools.partial(_kernel, k_tail=k % bk, quantize_x=quantize_x),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), acc)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes or None),
        name=f"qmm_{jnp.dtype(w_q.dtype).name}{'_a8' if quantize_x else ''}_{bm}x{bn}x{bk}",
    )(*operands)


def _product(x, w, x_inverse, quantize_x):
    """One block's product: int8 x int8 → int32, or bf16 x widened weights → f32."""
    if quantize_x:
        xq = jnp.clip(jnp.round(x.astype(jnp.float32) * x_inverse), -_INT8_MAX, _INT8_MAX)
        return jnp.dot(xq.astype(jnp.int8), w, preferred_element_type=jnp.int32)
    return jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)


def _kernel(x_ref, w_ref, s_ref, *refs, k_tail, quantize_x):
    xs_ref, xi_ref, o_ref, acc_ref = refs if quantize_x else (None, None, *refs)
    x_inverse = xi_ref[...] if quantize_x else None

    @pl.when(pl.program_id(2) == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    if k_tail:  # K is ragged: only the last K step reads past it, and only it pays for the mask.
        last = pl.program_id(2) == pl.num_programs(2) - 1

        @pl.when(jnp.logical_not(last))
        def _full():
            acc_ref[...] += _product(x_ref[...], w_ref[...], x_inverse, quantize_x)

        @pl.when(last)
        def _tail():
            x = _ragged.fill_tail(x_ref[...], k_tail, axis=1)
            w = _ragged.fill_tail(w_ref[...], k_tail, axis=0)
            acc_ref[...] += _product(x, w, x_inverse, quantize_x)
    else:
        acc_ref[...] += _product(x_ref[...], w_ref[...], x_inverse, quantize_x)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _store():
        out = acc_ref[...].astype(jnp.float32) * s_ref[...]
        if quantize_x:
            out = out * xs_ref[...]
        o_ref[...] = out.astype(o_ref.dtype)


def _standin(args, kwargs, config):
    """Fewer (bm, bn) output blocks, same tiles: each block is the same work (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    x, w_q, w_scale = args
    (m, k), n = x.shape, w_q.shape[1]
    bm, bn, bk = min(config["bm"], m), min(config["bn"], n), min(config["bk"], k)
    (mb, nb), scale = shrink_parallel([pl.cdiv(m, bm), pl.cdiv(n, bn)], pl.cdiv(k, bk))
    n2 = min(nb * bn, n)
    return [jax.ShapeDtypeStruct((min(mb * bm, m), k), x.dtype),
            jax.ShapeDtypeStruct((k, n2), w_q.dtype),
            jax.ShapeDtypeStruct((n2,), w_scale.dtype)], kwargs, scale


def quantized_matmul_reference(x: jax.Array, w_q: jax.Array, w_scale: jax.Array, *,
                               quantize_x: bool = False) -> jax.Array:
    """Plain JAX (XLA's quantized dot: dequantize, then an f32-accumulated dot), the same
    per-token activation quantization where asked; the candidate the kernel must beat."""
    _check(x, w_q, w_scale, quantize_x)
    scale = w_scale.astype(jnp.float32)
    if quantize_x:
        xs, inverse = row_scales(x)
        xq = jnp.clip(jnp.round(x.astype(jnp.float32) * inverse), -_INT8_MAX, _INT8_MAX)
        acc = jnp.dot(xq.astype(jnp.int8), w_q, preferred_element_type=jnp.int32)
        return (acc.astype(jnp.float32) * scale * xs).astype(x.dtype)
    acc = jnp.dot(x, w_q.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return (acc * scale).astype(x.dtype)


def _inputs(x, w_q, w_scale, **kwargs):
    """Tuning inputs for ShapeDtypeStructs: normal activations, weights spread over the 8-bit
    range, scales near 1/64 (random normals would not exercise the range)."""
    kx, kw, ks = jax.random.split(jax.random.key(0), 3)
    xa = jax.random.normal(kx, x.shape, jnp.float32).astype(x.dtype)
    wa = jax.random.randint(kw, w_q.shape, -127, 128).astype(jnp.float32)
    if jnp.dtype(w_q.dtype) != jnp.dtype(jnp.int8):
        wa = wa / 16.0  # Within e4m3's range (448) and precision.
    sa = (jax.random.uniform(ks, w_scale.shape, jnp.float32) + 0.5) / 64.0
    return [xa, wa.astype(w_q.dtype), sa.astype(w_scale.dtype)], kwargs


quantized_matmul = pt.tunable(space="quantized_matmul", reference=quantized_matmul_reference,
                              standin=_standin, inputs=_inputs)(quantized_matmul)
