"""The backward of chunked linear attention with decay (kernels/linear_attention.py): two Pallas
passes over the chunks, each with its own chunk size.

The forward, per (batch, head) and chunk of C positions, with Γq[i] = γ^(i+1), Γk[j] =
γ^(C-1-j) and D[i, j] = γ^(i-j) for i ≥ j (else 0):

  O = ((Q Kᵀ) ⊙ D) V + (Γq ⊙ Q) S_prev,    S = γ^C S_prev + (Γk ⊙ K)ᵀ V

Given dO, with G the gradient of the state after the chunk (zero after the last chunk):

- dQ pass, chunks in order, the state S recomputed as in the forward (``chunk_dq``):
  dQ = ((dO Vᵀ) ⊙ D) K + Γq ⊙ (dO S_prevᵀ).
- dK/dV pass, chunks last first, G carried in VMEM (``chunk_dkv``):
  dV = ((Q Kᵀ) ⊙ D)ᵀ dO + (Γk ⊙ K) G,   dK = ((dO Vᵀ) ⊙ D)ᵀ Q + Γk ⊙ (V Gᵀ),
  then G ← γ^C G + (Γq ⊙ Q)ᵀ dO for the chunk before.

Every transpose is a ``dot_general`` contraction in the kernel; accumulation in float32, the
cotangents in the inputs' dtype. Any sequence length: a ragged one is zero-padded to whole
chunks (padded keys, values and cotangents contribute nothing; padded rows are dropped).

The reference (the XLA candidate and the tuner's check) is ``jax.vjp`` of the quadratic form
O = ((Q Kᵀ) ⊙ D_T) V over the whole sequence: the same function as the forward's recurrence,
written independently of it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["linear_attention_bwd", "linear_attention_bwd_args",
           "linear_attention_bwd_reference"]

_NT = (((1,), (1,)), ((), ()))  # (a, c) · (b, c) -> (a, b)
_TN = (((0,), (0,)), ((), ()))  # (c, a) · (c, b) -> (a, b)
_F32 = jnp.float32


# Registered as a tunable kernel (search_spaces/linear_attention_bwd.toml) at the end of the file.
def linear_attention_bwd(q, k, v, g, *, decay: float = 1.0, chunk_dq: int, chunk_dkv: int):
    """``(dq, dk, dv)`` of ``linear_attention(q, k, v, decay=decay)`` for the cotangent ``g``
    of its output: q, k (batch, heads, seq, dim), v and g (batch, heads, seq, dim_v), one dtype
    (float32 or bfloat16). Chunks larger than the sequence are clamped to it.

    Raises:
      ValueError: the shapes do not match, ``decay`` is outside (0, 1], or the dtypes differ
        or are unsupported.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3] \
            or g.shape != v.shape:
        raise ValueError(f"linear_attention_bwd needs q, k (batch, heads, seq, dim) and v, g "
                         f"(batch, heads, seq, dim_v); got q {q.shape}, k {k.shape}, "
                         f"v {v.shape}, g {g.shape}")
    if not q.dtype == k.dtype == v.dtype == g.dtype or q.dtype not in (_F32, jnp.bfloat16):
        raise ValueError(f"linear_attention_bwd supports float32 or bfloat16 q, k, v, g of one "
                         f"dtype; got {q.dtype}, {k.dtype}, {v.dtype}, {g.dtype}")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay={decay} must be in (0, 1]")
    b, h, t, d = q.shape
    flat = [x.reshape(b * h, t, x.shape[-1]) for x in (q, k, v, g)]
    log_decay = math.log(decay)
    (dq,) = _pass(_dq_kernel, flat, min(chunk_dq, t), log_decay, ("dq",), reverse=False)
    dk, dv = _pass(_dkv_kernel, flat, min(chunk_dkv, t), log_decay, ("dk", "dv"), reverse=True)
    return tuple(x[:, :t].reshape(b, h, t, x.shape[-1]) for x in (dq, dk, dv))


def _pass(kernel, arrays, c, log_decay, outs, *, reverse):
    """One pass over the chunks of ``arrays`` (q, k, v, g as (rows, seq, dim)), zero-padded to
    whole chunks; chunks last first where ``reverse``. Returns the outputs named ``outs``
    (dq: q's shape; dk: k's; dv: v's), padded."""
    rows, t, d = arrays[0].shape
    dv = arrays[2].shape[-1]
    n = pl.cdiv(t, c)
    if n * c != t:
        arrays = [jnp.pad(x, ((0, 0), (0, n * c - t), (0, 0))) for x in arrays]
    chunk = (lambda i, j: (i, n - 1 - j, 0)) if reverse else (lambda i, j: (i, j, 0))
    spec = lambda last: pl.BlockSpec((None, c, last), chunk)  # noqa: E731
    widths = {"dq": d, "dk": d, "dv": dv}
    return pl.pallas_call(
        functools.partial(kernel, chunk=c, log_decay=log_decay),
        out_shape=[jax.ShapeDtypeStruct((rows, n * c, widths[o]), arrays[0].dtype) for o in outs],
        grid=(rows, n),
        in_specs=[spec(d), spec(d), spec(dv), spec(dv)],
        out_specs=[spec(widths[o]) for o in outs],
        scratch_shapes=[pltpu.VMEM((d, dv), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name=f"linear_attention_{'_'.join(outs)}_{c}",
    )(*arrays)


def _factors(chunk, log_decay):
    """(D, Γq, Γk) of one chunk: the decay mask and the row scales of Q and K."""
    row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
    col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
    mask = jnp.where(row >= col, jnp.exp((row - col).astype(_F32) * log_decay), 0.0)
    pos = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(_F32)
    return mask, jnp.exp((pos + 1.0) * log_decay), jnp.exp((chunk - 1.0 - pos) * log_decay)


def _load(*refs):
    return [r[...].astype(_F32) for r in refs]


def _dq_kernel(q_ref, k_ref, v_ref, g_ref, dq_ref, s_ref, *, chunk, log_decay):
    @pl.when(pl.program_id(1) == 0)
    def _init():
        s_ref[...] = jnp.zeros_like(s_ref)

    _, k, v, g = _load(q_ref, k_ref, v_ref, g_ref)
    mask, gamma_q, gamma_k = _factors(chunk, log_decay)
    dp = lax.dot_general(g, v, _NT, preferred_element_type=_F32) * mask
    dq = jnp.dot(dp, k, preferred_element_type=_F32) + gamma_q * lax.dot_general(
        g, s_ref[...], _NT, preferred_element_type=_F32)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    s_ref[...] = s_ref[...] * math.exp(chunk * log_decay) + lax.dot_general(
        k * gamma_k, v, _TN, preferred_element_type=_F32)


def _dkv_kernel(q_ref, k_ref, v_ref, g_ref, dk_ref, dv_ref, state_ref, *, chunk, log_decay):
    @pl.when(pl.program_id(1) == 0)  # The last chunk: nothing reads the state after it.
    def _init():
        state_ref[...] = jnp.zeros_like(state_ref)

    q, k, v, g = _load(q_ref, k_ref, v_ref, g_ref)
    mask, gamma_q, gamma_k = _factors(chunk, log_decay)
    state = state_ref[...]
    p = lax.dot_general(q, k, _NT, preferred_element_type=_F32) * mask
    dv = lax.dot_general(p, g, _TN, preferred_element_type=_F32) + jnp.dot(
        k * gamma_k, state, preferred_element_type=_F32)
    dp = lax.dot_general(g, v, _NT, preferred_element_type=_F32) * mask
    dk = lax.dot_general(dp, q, _TN, preferred_element_type=_F32) + gamma_k * lax.dot_general(
        v, state, _NT, preferred_element_type=_F32)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    state_ref[...] = state * math.exp(chunk * log_decay) + lax.dot_general(
        q * gamma_q, g, _TN, preferred_element_type=_F32)


def _quadratic(q, k, v, *, decay):
    """Linear attention with decay as one masked product over the whole sequence (f32)."""
    t = q.shape[2]
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    mask = jnp.where(i >= j, jnp.asarray(decay, _F32) ** jnp.maximum(i - j, 0).astype(_F32),
                     0.0)
    scores = jnp.einsum("bhid,bhjd->bhij", q.astype(_F32), k.astype(_F32)) * mask
    return jnp.einsum("bhij,bhjd->bhid", scores, v.astype(_F32)).astype(q.dtype)


def linear_attention_bwd_reference(q, k, v, g, *, decay: float = 1.0):
    """(dq, dk, dv) by ``jax.vjp`` of the quadratic form (see the module docstring)."""
    _, vjp = jax.vjp(functools.partial(_quadratic, decay=decay), q, k, v)
    return vjp(g.astype(q.dtype))


def linear_attention_bwd_args(args, kwargs, seed: int = 1):
    """The backward's arguments for a forward call ``linear_attention(q, k, v, ...)``:
    ``((q, k, v, g), kwargs)``, g a random cotangent shaped like the output."""
    q, k, v = args[:3]
    g = jax.random.normal(jax.random.key(seed), v.shape, _F32).astype(q.dtype)
    return (q, k, v, g), {"decay": kwargs["decay"]} if "decay" in kwargs else {}


def _inputs(q, k, v, g, **kwargs):
    """Tuning inputs from shapes: q, k, v and g at random (any are valid), scaled so that the
    decayed sums stay moderate."""
    keys = jax.random.split(jax.random.key(0), 4)
    scale = 1.0 / math.sqrt(q.shape[-1])
    return [(scale * jax.random.normal(key, x.shape, _F32)).astype(x.dtype)
            for key, x in zip(keys, (q, k, v, g), strict=True)], kwargs


def _standin(args, kwargs, config):
    """Fewer (batch, head) rows, identical work each, same chunks (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v, g = args
    b, h, t, _ = q.shape
    steps = pl.cdiv(t, min(config["chunk_dq"], t)) + pl.cdiv(t, min(config["chunk_dkv"], t))
    (nb, nh), scale = shrink_parallel([b, h], steps)
    shape = lambda x: jax.ShapeDtypeStruct((nb, nh, t, x.shape[-1]), x.dtype)  # noqa: E731
    return [shape(q), shape(k), shape(v), shape(g)], kwargs, scale


linear_attention_bwd = pt.tunable(space="linear_attention_bwd",
                                  reference=linear_attention_bwd_reference, inputs=_inputs,
                                  standin=_standin)(linear_attention_bwd)
