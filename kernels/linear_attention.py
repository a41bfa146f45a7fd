"""Chunked linear attention with exponential decay (retention), forward.

For each (batch, head): S_t = γ S_{t-1} + k_tᵀ v_t and o_t = q_t S_t, with a scalar decay γ in
(0, 1] (γ = 1: plain causal linear attention). The kernel walks the sequence in chunks of C
positions, the chunk axis "arbitrary" with the (head_dim, head_dim) f32 state in VMEM scratch:

  O = ((Q Kᵀ) ⊙ D) V + (γ^{i+1} Q) S_prev,    D[i, j] = γ^{i-j} for i ≥ j, else 0
  S = γ^C S_prev + (γ^{C-1-j} K)ᵀ V

The chunk size trades MXU-friendly (C, C) intra-chunk work against sequential steps. Any sequence
length: when no chunk divides it, the last (partial) chunk zeroes the keys and values read past
the end (``D`` multiplies them by 0, but ``0 * NaN`` is NaN) and skips the state update nobody
reads; emitted only then, so lengths that divide compile to the same program as without it.
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
from pallas_tune.kernels import _ragged
from pallas_tune.kernels.linear_attention_bwd import (linear_attention_bwd,
                                                      linear_attention_bwd_args)

__all__ = ["linear_attention", "linear_attention_reference"]

DTYPES = (jnp.float32, jnp.bfloat16)


# The public entry; registered as a tunable kernel (search_spaces/linear_attention.toml) at the
# end of the file, once its reference and stand-in exist.
def linear_attention(q, k, v, *, decay: float = 1.0, chunk: int):
    """Causal linear attention with decay γ=``decay`` over q, k (batch, heads, seq, dim) and v
    (batch, heads, seq, dim_v), float32 or bfloat16 (one dtype) → (batch, heads, seq, dim_v).

    Any sequence length; the chunk is clamped to it.

    Raises:
      ValueError: the shapes do not match, ``decay`` is outside (0, 1], or the dtypes are not
        one of float32 and bfloat16.
    """
    if q.ndim != 4 or k.shape != q.shape or v.ndim != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"linear_attention needs q, k (batch, heads, seq, dim) and v (batch, "
                         f"heads, seq, dim_v); got q {q.shape}, k {k.shape}, v {v.shape}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES:
        raise ValueError(f"linear_attention supports float32 or bfloat16 q, k, v of one dtype; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}: cast them to one of these")
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay={decay} must be in (0, 1]")
    b, h, t, d = q.shape
    dv = v.shape[-1]
    c = min(chunk, t)
    bh = b * h
    spec = lambda last: pl.BlockSpec((None, c, last), lambda i, j: (i, j, 0))  # noqa: E731
    out = pl.pallas_call(
        functools.partial(_kernel, chunk=c, log_decay=math.log(decay), tail=t % c),
        out_shape=jax.ShapeDtypeStruct((bh, t, dv), q.dtype),
        grid=(bh, pl.cdiv(t, c)),
        in_specs=[spec(d), spec(d), spec(dv)],
        out_specs=spec(dv),
        scratch_shapes=[pltpu.VMEM((d, dv), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        name=f"linear_attention_{c}",
    )(q.reshape(bh, t, d), k.reshape(bh, t, d), v.reshape(bh, t, dv))
    return out.reshape(b, h, t, dv)


def _kernel(q_ref, k_ref, v_ref, o_ref, s_ref, *, chunk, log_decay, tail):
    c = pl.program_id(1)

    @pl.when(c == 0)
    def _init():
        s_ref[...] = jnp.zeros_like(s_ref)

    def _chunk(valid=0):  # valid: positions in this (last, ragged) chunk; 0: all of them.
        q = q_ref[...].astype(jnp.float32)
        k = k_ref[...].astype(jnp.float32)
        v = v_ref[...].astype(jnp.float32)
        if valid:
            k = _ragged.fill_tail(k, valid, axis=0)
            v = _ragged.fill_tail(v, valid, axis=0)
        row = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 0)
        col = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1)
        diff = (row - col).astype(jnp.float32)
        mask = jnp.where(row >= col, jnp.exp(diff * log_decay), 0.0)
        scores = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32) * mask
        intra = jnp.dot(scores, v, preferred_element_type=jnp.float32)
        pos = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0).astype(jnp.float32)
        inter = jnp.dot(q * jnp.exp((pos + 1.0) * log_decay), s_ref[...],
                        preferred_element_type=jnp.float32)
        o_ref[...] = (intra + inter).astype(o_ref.dtype)
        if valid:
            return  # The last chunk: the state after it is never read.
        k_decayed = k * jnp.exp((chunk - 1.0 - pos) * log_decay)
        s_ref[...] = s_ref[...] * math.exp(chunk * log_decay) + lax.dot_general(
            k_decayed, v, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    if tail:  # Ragged sequence: only the last chunk reads past it, and only it pays the mask.
        last = c == pl.num_programs(1) - 1
        pl.when(jnp.logical_not(last))(_chunk)
        pl.when(last)(functools.partial(_chunk, tail))
    else:
        _chunk()


def _standin(args, kwargs, config):
    """Fewer (batch, head) rows, identical work each (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v = args
    b, h, t, d = q.shape
    c = min(config["chunk"], t)
    (nb, nh), scale = shrink_parallel([b, h], pl.cdiv(t, c))
    shape = lambda x: jax.ShapeDtypeStruct((nb, nh, t, x.shape[-1]), x.dtype)  # noqa: E731
    return [shape(q), shape(k), shape(v)], kwargs, scale


def linear_attention_reference(q, k, v, *, decay: float = 1.0):
    """The recurrence itself, by lax.scan over time (f32 state)."""
    b, h, t, d = q.shape

    def per_head(qh, kh, vh):
        def step(s, x):
            qt, kt, vt = x
            s = decay * s + jnp.outer(kt, vt)
            return s, qt @ s

        _, o = lax.scan(step, jnp.zeros((d, vh.shape[-1]), jnp.float32),
                        (qh.astype(jnp.float32), kh.astype(jnp.float32),
                         vh.astype(jnp.float32)))
        return o

    out = jax.vmap(jax.vmap(per_head))(q, k, v)
    return out.astype(q.dtype)


# jax.grad runs linear_attention_bwd, a tunable kernel of its own (two Pallas passes).
linear_attention = pt.tunable(space="linear_attention", reference=linear_attention_reference,
                              standin=_standin, backward=linear_attention_bwd,
                              backward_args=linear_attention_bwd_args,
                              # Sharded jit: batch, heads and v's features split; the causal
                              # sequence and the q/k dim kept whole.
                              partition="b h S D, b h S D, b h S e -> b h S e")(linear_attention)
