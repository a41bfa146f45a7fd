"""Weight-quantized matmul for serving: bf16 activations, int8 or fp8 (e4m3) weights with one
scale per output channel, optionally activations quantized per token to int8 inside the kernel.

``x (M, K) bf16 @ dequant(w_q (K, N)) → (M, N) bf16``, ``dequant(w_q)[:, n] = w_q[:, n] ·
w_scale[n]``. Grid (cdiv(M, bm), cdiv(N, bn), cdiv(K, bk)), K last and "arbitrary". Weights
stay 8-bit in HBM (half the bytes of bf16: what makes decode faster) and are widened to bf16 in
VMEM, one block at a time; the scale is applied once, to the f32 accumulator, on the last K step.

With ``quantize_x=True`` (int8 weights only) each row of x is quantized to int8 with its own
scale ``max|x[m, :]| / 127`` (the row's maximum over all of K, computed outside the kernel: one
reduction; each element's step is ``round(x · (1 / scale))``) and the dot runs int8 x int8 →
int32 on the MXU (v5e/v6e: twice the bf16 rate), the product scaled by both scales at the end.
That changes the numbers (it is what vLLM's and MaxText's "w8a8" modes do), so it is a call
argument and part of the cache key, not a tuned one. A row of x holding NaN or inf has no int8
scale: its output row is NaN (see :func:`row_scales`, and there what rounds alike where).

Inputs are checked once, before a config is resolved or a candidate traced
(:class:`InputsChecked`): shapes, dtypes or sizes no config can run raise ``ValueError``.

Any M, K, N: ragged M and N blocks are dropped on store; when no bk divides K, the last K step
zeroes the columns of x and rows of w_q past K (emitted only then).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune.kernels import _ragged

__all__ = ["WEIGHT_DTYPES", "InputsChecked", "inputs_checked", "quantized_matmul",
           "quantized_matmul_reference", "row_scales", "shapes_of"]

WEIGHT_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
_INT8_MAX = 127.0


def shapes_of(kernel: str, **arrays: object) -> dict[str, tuple[int, ...]]:
    """Each named argument's shape; ValueError naming any that is not an array (a jax or numpy
    array, or a ``jax.ShapeDtypeStruct`` when tuning) or has an empty axis (nothing to compute:
    the kernels take at least one element along every axis)."""
    shapes = {}
    for name, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise ValueError(f"{kernel}: {name} must be an array (jax.Array, numpy array or "
                             f"jax.ShapeDtypeStruct); got {type(a).__name__}: wrap it in "
                             "jnp.asarray")
        shapes[name] = tuple(a.shape)
    empty = [f"{name} {shape}" for name, shape in shapes.items() if 0 in shape]
    if empty:
        raise ValueError(f"{kernel} takes at least one element along every axis; got "
                         f"{', '.join(empty)}: skip the call (its result is empty, or zeros where "
                         "only the contracted axis is)")
    return shapes


def _check(x, w_q, w_scale, quantize_x):
    shapes = shapes_of("quantized_matmul", x=x, w_q=w_q, w_scale=w_scale)
    xs, ws, ss = shapes["x"], shapes["w_q"], shapes["w_scale"]
    if len(xs) != 2 or len(ws) != 2 or xs[1] != ws[0]:
        raise ValueError(f"quantized_matmul needs x (M, K) and w_q (K, N); got x {xs}, "
                         f"w_q {ws}")
    if ss != (ws[1],):
        raise ValueError(f"quantized_matmul needs one scale per output channel, w_scale "
                         f"({ws[1]},); got {ss}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"quantized_matmul takes bfloat16 activations; got x {x.dtype}: cast "
                         "x to bfloat16")
    if w_q.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"quantized_matmul takes int8 or float8_e4m3fn weights; got w_q "
                         f"{w_q.dtype} (for bfloat16 weights use pallas_tune.kernels.matmul)")
    if quantize_x and w_q.dtype != jnp.int8:
        raise ValueError("quantize_x=True quantizes x to int8 for an int8 x int8 dot: it needs "
                         f"int8 weights, got {w_q.dtype}; call with quantize_x=False")


def _check_call(x, w_q, w_scale, *, quantize_x=False, **_):
    """:func:`_check` on a call's arguments (tuned keywords and tuning options aside). A traced
    ``quantize_x`` is left to the runtime, which refuses a traced static value naming it."""
    _check(x, w_q, w_scale, False if isinstance(quantize_x, jax.core.Tracer) else quantize_x)


class InputsChecked(pt.TunableKernel):
    """A tunable kernel whose call's inputs are checked once, before a config is resolved or
    any candidate traced: inputs no config can run raise the kernel's ``ValueError`` at once,
    naming the problem and the fix, whether tuned keywords are given or not (resolution would
    otherwise trace every candidate and end in a ``NoFeasibleConfigError``). ``check_inputs``
    takes the call's arguments and ignores tuned keywords and tuning options."""

    check_inputs: Callable[..., None]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.check_inputs(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    def config_for(self, *args: Any, **kwargs: Any) -> Any:
        self.check_inputs(*args, **kwargs)
        return super().config_for(*args, **kwargs)

    def tune(self, *args: Any, options: Any = None, **kwargs: Any) -> Any:
        self.check_inputs(*args, **kwargs)
        return super().tune(*args, options=options, **kwargs)


def inputs_checked(kernel: pt.TunableKernel, check: Callable[..., None]) -> InputsChecked:
    """``kernel`` (just declared by ``pt.tunable``) made an :class:`InputsChecked` by ``check``."""
    kernel.__class__ = InputsChecked
    kernel.check_inputs = check  # type: ignore[attr-defined]
    return kernel  # type: ignore[return-value]


def row_scales(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each row's int8 scale, max|x[m, :]| / 127 (1 for an all-zero row; NaN for a row holding
    NaN or inf, which int8 cannot hold, so that its output row is NaN, as a dot of it would not
    be finite either), and its inverse, both (M, 1) float32. A row is quantized as
    ``round(x · inverse)``.

    What rounds alike: the kernel and :func:`quantized_matmul_reference` take their scales from
    this one function, outside the kernel, so on one backend they quantize every element to the
    same step (on CPU, JAX 0.10.2 and 0.12: all 38,400 outputs of a 300 x 256 x 128 call equal,
    eager and jitted). Across backends they need not: the scale and its inverse are divisions,
    which XLA's CPU backend computes within 2 ulps of IEEE f32 division, not exactly (3,000
    bf16 rows of 4096 normals: 111 scales and 105 inverses differ from numpy's), so an element
    at or next to a .5 tie of its step may round to the neighbouring step (446 of 12.3 M
    elements, in 94 rows; never by more than one step: one ``scale · |w|`` term of a sum of K).
    """
    xf = x.astype(jnp.float32)
    top = jnp.max(jnp.abs(xf), axis=1, keepdims=True)
    finite = jnp.all(jnp.isfinite(xf), axis=1, keepdims=True)  # Whatever max makes of NaN.
    scale = jnp.where(finite, jnp.where(top > 0, top / _INT8_MAX, 1.0), jnp.nan)
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
    the MXU (int8 weights only); a row of x holding NaN or inf gives a NaN output row. The kernel
    and its reference round alike on one backend, not across backends (see
    :func:`row_scales`). Block sizes larger than a dimension are clamped to it.
    ``vmem_limit_bytes``: the scoped VMEM the kernel may use; 0 leaves the chip's default.

    Raises:
      ValueError: before any config is resolved: an argument that is not an array, an empty
        axis, shapes that do not match, x not bfloat16, weights neither int8 nor
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


quantized_matmul = inputs_checked(
    pt.tunable(space="quantized_matmul", reference=quantized_matmul_reference, standin=_standin,
               inputs=_inputs, partition="m K, K n, n -> m n")(quantized_matmul), _check_call)
