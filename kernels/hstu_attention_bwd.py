"""HSTU attention backward for TPU: dq, dk, dv and the relative-bias table's gradient, in Pallas.

For ``out = norm · (silu(S) ⊙ causal) v`` with ``S = alpha q kᵀ + rab`` (kernels/hstu_attention.py)
and the cotangent g::

    dP = norm · g vᵀ      dv = norm · Pᵀ g      dS = dP ⊙ silu'(S) ⊙ causal
    dq = alpha · dS k     dk = alpha · dSᵀ q    drel_bias[n] = Σ dS[i, j] over (batch, head,
                                                  i >= j) with min(i - j, nb - 1) = n

with silu'(x) = σ(x) (1 + x (1 - σ(x))). There is no softmax, so the forward saves nothing: both
passes recompute S from q, k and the bias table. Two pallas_calls, each on transposed scores
sᵀ = k (alpha q)ᵀ (bkv, bq) as the forward:

- dK/dV and the bias: grid (batch, heads, kv blocks, q blocks), the q axis last and
  "arbitrary": dv += pᵀ g and dk += dsᵀ (alpha q) per KV block; and the bias table's gradient
  of every step, added into one row per (batch, head, KV block), which XLA sums afterwards.
- dQ: grid (batch, heads, q blocks, kv blocks), the KV axis last and "arbitrary": dq += ds k.

Blocks wholly above the diagonal are skipped, with no compute and no DMA (their index map
repeats a needed block); only blocks that straddle it are masked.

The bias gradient. A block's bias is Toeplitz, read from the table through ``_hstu.bias_rows``:
a slice of the table broadcast to 128 rows with row ρ rotated by ρ, each 128-row slab of the
block a lane-aligned slice of that. Its adjoint: each step adds its dsᵀ slabs at those lane
offsets (shifted by where the step's slice starts in the table) into one (128, table) f32 sum
per KV block; once per KV block its rows are reversed, row ρ rotated by ρ + 1 and the rows
summed: the table's gradient from that block. Mosaic rotates only by a non-negative stride (a
row rotated by -ρ does not lower), hence the reversal: a gather within each 8-row vreg and the
vregs taken in reverse order.

Ragged sequences are zero-padded to a multiple of the blocks, which is exact under the causal
mask: a padded key comes after every real query, and a padded query's cotangent is zero.
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
from pallas_tune.kernels import _hstu
from pallas_tune.kernels._hstu import LANES, hstu_attention_reference

__all__ = ["hstu_attention_bwd", "hstu_attention_bwd_args", "hstu_attention_bwd_reference"]

_SUBLANES = 8
_DOT_T = (((1,), (1,)), ((), ()))  # a bᵀ: contract both minor dims.


# The public entry; registered as a tunable kernel (search_spaces/hstu_attention_bwd.toml) at
# the end of the file, once its reference, inputs and stand-in exist.
def hstu_attention_bwd(q, k, v, rel_bias, g, *, alpha: float | None = None,
                       norm: float | None = None, bq_dq: int, bkv_dq: int, bq_dkv: int,
                       bkv_dkv: int):
    """(dq, dk, dv, drel_bias) of ``hstu_attention(q, k, v, rel_bias, alpha=, norm=)`` for the
    cotangent ``g`` (shaped like its output). Each cotangent has its argument's dtype. Block
    sizes are multiples of 128; those above the sequence (rounded up to 128) are clamped.

    Raises:
      ValueError: shapes the forward refuses, or g not shaped like its output.
      InvalidConfig: a block size that is not a multiple of 128.
    """
    b, h, s, d = q.shape
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or g.shape != v.shape:
        raise ValueError(f"shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}, g "
                         f"{g.shape} (q and k equal; v and g equal, sharing q's batch, heads "
                         "and sequence)")
    if rel_bias.ndim != 1 or rel_bias.shape[0] < 1:
        raise ValueError(f"rel_bias must be a non-empty 1-D table, got shape {rel_bias.shape}")
    alpha = 1.0 / math.sqrt(d) if alpha is None else float(alpha)
    norm = 1.0 / s if norm is None else float(norm)
    dkv_blocks, dq_blocks = _blocks(s, bq_dkv, bkv_dkv), _blocks(s, bq_dq, bkv_dq)
    n = _padded(s, *dkv_blocks, *dq_blocks)
    qa = (q.astype(jnp.float32) * alpha).astype(q.dtype)  # As the forward scales q.
    qa, kp, vp, gp = (_pad(x, n) for x in (qa, k, v, g.astype(v.dtype)))
    dk, dv, dtab, pad = _dkv_call(rel_bias, qa, kp, vp, gp, *dkv_blocks, norm=norm)
    dq = _dq_call(rel_bias, qa, kp, vp, gp, *dq_blocks, scale=alpha * norm)
    return (dq[:, :, :s], dk[:, :, :s], dv[:, :, :s],
            _fold(dtab, pad, s, rel_bias.shape[0]).astype(rel_bias.dtype))


def _blocks(s: int, bq: int, bkv: int) -> tuple[int, int]:
    """(bq, bkv) clamped to the sequence rounded up to 128; multiples of 128."""
    top = pl.cdiv(s, LANES) * LANES
    for name, blk in (("bq", bq), ("bkv", bkv)):
        if blk % LANES or blk < LANES:
            raise pt.InvalidConfig(f"{name}={blk} must be a positive multiple of {LANES}")
    return min(bq, top), min(bkv, top)


def _padded(s: int, *blocks: int) -> int:
    step = functools.reduce(math.lcm, blocks)
    return pl.cdiv(s, step) * step


def _pad(x, n: int):
    return x if x.shape[2] == n else jnp.pad(x, ((0, 0), (0, 0), (0, n - x.shape[2]), (0, 0)))


def _fold(dtab, pad: int, s: int, nb: int):
    """The table gradient (per batch, head and KV block) as rel_bias's: distance i - j reads
    bucket min(i - j, nb - 1)."""
    dist = jnp.sum(dtab, axis=(0, 1, 2, 3))[pad:pad + s]  # Distances 0 .. s - 1.
    if s <= nb:
        return jnp.concatenate([dist, jnp.zeros((nb - s,), dist.dtype)])
    return jnp.concatenate([dist[:nb - 1], jnp.sum(dist[nb - 1:])[None]])


def _recompute(tab_ref, q_ref, k_ref, v_ref, g_ref, *, i, j, bq, bkv, pad, rotated, mask):
    """(pᵀ, dsᵀ without norm) of the block, (bkv, bq) f32, and the table offset it read."""
    q_start, k_start = i * bq, j * bkv
    base = pl.multiple_of(q_start - k_start - bkv + pad, LANES)
    if rotated:
        bias = _hstu.bias_slice(tab_ref, base, 0, bq, bkv, rows=bkv)
    else:
        bias = _hstu.bias_part(_hstu.bias_rows(tab_ref, base, rows=bkv, cols=bq), 0, bq, bkv,
                               rows=bkv)
    s = lax.dot_general(k_ref[...], q_ref[...], _DOT_T, preferred_element_type=jnp.float32)
    s = s + bias
    sig = jax.nn.sigmoid(s)
    p = s * sig
    dp = lax.dot_general(v_ref[...], g_ref[...], _DOT_T, preferred_element_type=jnp.float32)
    ds = dp * (sig * (1.0 + s * (1.0 - sig)))
    if mask:  # The block straddles the diagonal: keys after the query get nothing.
        k_pos = k_start + lax.broadcasted_iota(jnp.int32, s.shape, 0)
        q_pos = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        keep = q_pos >= k_pos
        p, ds = jnp.where(keep, p, 0.0), jnp.where(keep, ds, 0.0)
    return p, ds, base


def _causal(step, *, run, below):
    """``step()`` where every key precedes every query, ``step(mask=True)`` where the block
    straddles the diagonal, nothing where it is wholly above it."""
    pl.when(below)(step)
    pl.when(jnp.logical_and(run, jnp.logical_not(below)))(functools.partial(step, mask=True))


def _reverse_rows(x):
    """x with its rows in reverse order (rows a multiple of 8): a sublane gather within each
    vreg, the vregs taken last first (Mosaic lowers no ``lax.rev``)."""
    flip = _SUBLANES - 1 - lax.broadcasted_iota(jnp.int32, (_SUBLANES, x.shape[1]), 0)
    return jnp.concatenate([jnp.take_along_axis(x[a:a + _SUBLANES], flip, axis=0)
                            for a in range(x.shape[0] - _SUBLANES, -1, -_SUBLANES)], axis=0)


def _slab_sum(ds, acc_ref, base, *, bkv, bq):
    """Adds the block's dsᵀ, slab by slab, where ``_hstu.bias_rows``' rotated rows held its bias:
    slab k (rows k·128 ..) at lanes base + (n-1-k)·128 of the KV block's (128, table) sum."""
    n = bkv // LANES
    for k in range(n):
        lo = pl.multiple_of(base + (n - 1 - k) * LANES, LANES)
        acc_ref[:, pl.ds(lo, bq)] += ds[k * LANES:(k + 1) * LANES]


def _unrotate(acc):
    """The table's gradient from the slab sums, (1, table): the adjoint of the broadcast and the
    rotation of row ρ by ρ (see the module docstring), once per KV block. No rotation wraps: the
    sums end at least 256 entries before the table does."""
    turned = pltpu.roll(_reverse_rows(acc), 1, 1, stride=1, stride_axis=0)
    return jnp.sum(turned, axis=0, keepdims=True)


def _dkv_call(rel_bias, qa, k, v, g, bq, bkv, *, norm):
    b, h, n, d = qa.shape
    nq, nk = n // bq, n // bkv
    table, pad, rotated = _hstu.bias_table(rel_bias, seq=n, bq=bq, bkv=bkv)
    width = table.shape[1]

    def q_index(bi, hi, j, i):  # The q blocks before the first that sees KV block j repeat it.
        return (bi, hi, jnp.maximum(i, j * bkv // bq), 0)

    kv_spec = pl.BlockSpec((None, None, bkv, d), lambda bi, hi, j, i: (bi, hi, j, 0))
    kv_spec_v = pl.BlockSpec((None, None, bkv, v.shape[-1]), lambda bi, hi, j, i: (bi, hi, j, 0))
    kernel = functools.partial(_dkv_kernel, bq=bq, bkv=bkv, pad=pad, rotated=rotated, norm=norm)
    dk, dv, dtab = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype),
                   jax.ShapeDtypeStruct((b, h, nk, 1, width), jnp.float32)],
        grid=(b, h, nk, nq),
        in_specs=[
            pl.BlockSpec(table.shape, lambda bi, hi, j, i: (0, 0), pipeline_mode=pl.Buffered(1)),
            pl.BlockSpec((None, None, bq, d), q_index), kv_spec, kv_spec_v,
            pl.BlockSpec((None, None, bq, v.shape[-1]), q_index),
        ],
        out_specs=[kv_spec, kv_spec_v,
                   pl.BlockSpec((None, None, None, 1, width),
                                lambda bi, hi, j, i: (bi, hi, j, 0, 0))],
        scratch_shapes=[pltpu.VMEM((bkv, d), jnp.float32),
                        pltpu.VMEM((bkv, v.shape[-1]), jnp.float32),
                        pltpu.VMEM((LANES, width), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"hstu_attention_dkv_{bq}x{bkv}",
    )(table, qa, k, v, g)
    return dk, dv, dtab, pad


def _dkv_kernel(tab_ref, q_ref, k_ref, v_ref, g_ref, dk_ref, dv_ref, dtab_ref, dk_acc, dv_acc,
                slab_acc, *, bq, bkv, pad, rotated, norm):
    """One KV block against one query block: dv += pᵀ g, dk += dsᵀ (alpha q), and the bias
    table's gradient of the block."""
    j, i = pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk_acc[...] = jnp.zeros_like(dk_acc)
        dv_acc[...] = jnp.zeros_like(dv_acc)
        slab_acc[...] = jnp.zeros_like(slab_acc)

    def step(mask=False):
        p, ds, base = _recompute(tab_ref, q_ref, k_ref, v_ref, g_ref, i=i, j=j, bq=bq, bkv=bkv,
                                 pad=pad, rotated=rotated, mask=mask)
        dv_acc[...] += jnp.dot(p.astype(g_ref.dtype), g_ref[...],
                               preferred_element_type=jnp.float32)
        dk_acc[...] += jnp.dot(ds.astype(q_ref.dtype), q_ref[...],
                               preferred_element_type=jnp.float32)
        _slab_sum(ds, slab_acc, base, bkv=bkv, bq=bq)

    _causal(step, run=j * bkv <= i * bq + bq - 1, below=j * bkv + bkv - 1 <= i * bq)

    @pl.when(i == pl.num_programs(3) - 1)
    def _write():
        dk_ref[...] = (dk_acc[...] * norm).astype(dk_ref.dtype)
        dv_ref[...] = (dv_acc[...] * norm).astype(dv_ref.dtype)
        dtab_ref[...] = _unrotate(slab_acc[...]) * norm


def _dq_call(rel_bias, qa, k, v, g, bq, bkv, *, scale):
    b, h, n, d = qa.shape
    table, pad, rotated = _hstu.bias_table(rel_bias, seq=n, bq=bq, bkv=bkv)

    def kv_index(bi, hi, i, j):  # Skipped blocks repeat the last needed one (no DMA).
        return (bi, hi, jnp.minimum(j, (i * bq + bq - 1) // bkv), 0)

    q_spec = pl.BlockSpec((None, None, bq, d), lambda bi, hi, i, j: (bi, hi, i, 0))
    kernel = functools.partial(_dq_kernel, bq=bq, bkv=bkv, pad=pad, rotated=rotated,
                               scale=scale)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(qa.shape, qa.dtype),
        grid=(b, h, n // bq, n // bkv),
        in_specs=[
            pl.BlockSpec(table.shape, lambda bi, hi, i, j: (0, 0), pipeline_mode=pl.Buffered(1)),
            q_spec, pl.BlockSpec((None, None, bkv, d), kv_index),
            pl.BlockSpec((None, None, bkv, v.shape[-1]), kv_index),
            pl.BlockSpec((None, None, bq, v.shape[-1]), lambda bi, hi, i, j: (bi, hi, i, 0)),
        ],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM((bq, d), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")),
        name=f"hstu_attention_dq_{bq}x{bkv}",
    )(table, qa, k, v, g)


def _dq_kernel(tab_ref, q_ref, k_ref, v_ref, g_ref, dq_ref, dq_acc, *, bq, bkv, pad, rotated,
               scale):
    """One query block against one KV block: dq += ds k, from dsᵀ (bkv, bq)."""
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_acc[...] = jnp.zeros_like(dq_acc)

    def step(mask=False):
        _, ds, _ = _recompute(tab_ref, q_ref, k_ref, v_ref, g_ref, i=i, j=j, bq=bq, bkv=bkv,
                              pad=pad, rotated=rotated, mask=mask)
        dq_acc[...] += lax.dot_general(ds.astype(k_ref.dtype), k_ref[...],
                                       (((0,), (0,)), ((), ())),
                                       preferred_element_type=jnp.float32)  # (bq, d)

    _causal(step, run=j * bkv <= i * bq + bq - 1, below=j * bkv + bkv - 1 <= i * bq)

    @pl.when(j == pl.num_programs(3) - 1)
    def _write():
        dq_ref[...] = (dq_acc[...] * scale).astype(dq_ref.dtype)


def hstu_attention_bwd_reference(q, k, v, rel_bias, g, *, alpha: float | None = None,
                                 norm: float | None = None):
    """(dq, dk, dv, drel_bias) by ``jax.vjp`` of the plain-JAX forward."""
    _, vjp = jax.vjp(functools.partial(hstu_attention_reference, alpha=alpha, norm=norm),
                     q, k, v, rel_bias)
    return vjp(g.astype(q.dtype))


def hstu_attention_bwd_args(args, kwargs, seed: int = 1):
    """The backward's arguments for a forward call ``hstu_attention(q, k, v, rel_bias, ...)``:
    ``((q, k, v, rel_bias, g), kwargs)``, g a random cotangent shaped like the output."""
    q, k, v, rel_bias = args[:4]
    g = jax.random.normal(jax.random.key(seed), v.shape, jnp.float32).astype(q.dtype)
    return (q, k, v, rel_bias, g), {key: kwargs[key] for key in ("alpha", "norm")
                                    if key in kwargs}


def _inputs(q, k, v, rel_bias, g, **kwargs):
    """Tuning inputs from shapes: q, k, v, g at random, a small bias table (any are valid)."""
    keys = jax.random.split(jax.random.key(0), 5)
    arrays = [jax.random.normal(key, x.shape, jnp.float32).astype(x.dtype)
              for key, x in zip(keys, (q, k, v, g))]
    bias = (0.1 * jax.random.normal(keys[4], rel_bias.shape, jnp.float32)).astype(rel_bias.dtype)
    return [*arrays[:3], bias, arrays[3]], kwargs


def _standin(args, kwargs, config):
    """Fewer (batch, head) rows, identical work each, same tiles (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    q, k, v, rel_bias, g = args
    b, h, s, _ = q.shape
    n = _padded(s, *_blocks(s, config["bq_dkv"], config["bkv_dkv"]),
                *_blocks(s, config["bq_dq"], config["bkv_dq"]))
    steps = (n // min(config["bq_dkv"], n)) * (n // min(config["bkv_dkv"], n))
    (nb, nh), scale = shrink_parallel([b, h], steps)
    shape = lambda x: jax.ShapeDtypeStruct((nb, nh, s, x.shape[-1]), x.dtype)  # noqa: E731
    return [shape(q), shape(k), shape(v), rel_bias, shape(g)], kwargs, scale


hstu_attention_bwd = pt.tunable(space="hstu_attention_bwd",
                                reference=hstu_attention_bwd_reference, inputs=_inputs,
                                standin=_standin)(hstu_attention_bwd)
