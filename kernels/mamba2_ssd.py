"""Mamba-2 SSD (state-space dual) chunked scan, forward, for TPU.

Per head h with scalar decay A_h < 0 and step sizes dt_t > 0, state S (d_state, head_dim)::

    S_t = exp(dt_t A_h) S_{t-1} + dt_t B_tᵀ x_t,     y_t = C_t S_t + D_h x_t

with B_t, C_t (d_state,) shared by the heads of a group (Dao & Gu, "Transformers are SSMs",
2024). The chunked dual form splits the sequence into chunks of L steps; within a chunk the
output is a masked, decay-weighted attention-like product, and chunks are linked through the
state::

    y = ((C Bᵀ) ⊙ exp(segsum)) (dt ⊙ x) + exp(cumsum) ⊙ (C S_prev) + D ⊙ x
    S = exp(sum) S_prev + Bᵀ (exp(sum - cumsum) ⊙ dt ⊙ x)

Layouts are the ones Mamba-2 produces before its reshapes, which on TPU are not free: x is
(batch, seq, heads * head_dim), dt (batch, seq, heads), B and C (batch, seq, groups * d_state).

Grid (batch, chunks, head blocks): the chunk axis is "arbitrary" and comes before the head
blocks, so per chunk the dt, cumsum, B and C blocks are fetched once and C Bᵀ is computed once
for all heads of a group; the (d_state, heads * head_dim) f32 state of every head stays in VMEM.
A head block of ``heads_per_block`` heads runs its state update and inter-chunk product as one
matmul of width heads_per_block * head_dim (head_dim 64 fills a quarter of v6e's 256-wide MXU
per head). The in-chunk cumulative sums of dt·A are computed in the wrapper (a small XLA op).

Every sequence length is accepted: a ragged last chunk is masked in the kernel.
``heads_per_block`` is lowered to the nearest head count that divides the heads of a group and
gives a 128-lane block (or all heads); ``chunk`` is clamped to the sequence length, and must
otherwise be a multiple of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt

__all__ = ["mamba2_ssd", "mamba2_ssd_reference", "mamba2_ssd_scan"]

_LANES = 128


def _split(x, dt, A, B, C, D, groups):
    b, t, hp = x.shape
    h = A.shape[0]
    if dt.shape != (b, t, h) or D.shape != (h,) or hp % h:
        raise ValueError(f"shapes do not match: x {x.shape}, dt {dt.shape}, A {A.shape}, "
                         f"D {D.shape} (x: (batch, seq, heads*head_dim), dt: (batch, seq, "
                         "heads), A and D: (heads,))")
    if groups < 1 or h % groups or B.shape != C.shape or B.shape[:2] != (b, t) \
            or B.shape[2] % groups:
        raise ValueError(f"B {B.shape} and C {C.shape} must be (batch, seq, groups*d_state) "
                         f"with groups={groups} dividing heads={h}")
    return b, t, h, hp // h, B.shape[2] // groups


def mamba2_ssd_reference(x, dt, A, B, C, D, *, groups: int = 1, chunk: int = 256):
    """The chunked dual form in plain JAX (f32), any sequence length (zero-padded chunks)."""
    b, t, h, p, n = _split(x, dt, A, B, C, D, groups)
    nc = -(-t // chunk)
    pad = nc * chunk - t
    f32 = jnp.float32

    def chunks(a, *tail):
        a = jnp.pad(a.astype(f32), ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        return a.reshape(b, nc, chunk, *tail)

    xs = chunks(x, h, p)
    Bs = jnp.repeat(chunks(B, groups, n), h // groups, axis=3)  # (b, c, l, h, n)
    Cs = jnp.repeat(chunks(C, groups, n), h // groups, axis=3)
    dts = chunks(dt, h)
    acs = jnp.cumsum(dts * A.astype(f32), axis=2)  # (b, c, l, h)
    seg = acs[:, :, :, None, :] - acs[:, :, None, :, :]  # (b, c, l, s, h)
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))[None, None, :, :, None]
    decay = jnp.exp(jnp.where(causal, seg, -jnp.inf))
    X = xs * dts[..., None]
    y = jnp.einsum("bclhn,bcshn,bclsh,bcshp->bclhp", Cs, Bs, decay, X)
    tot = acs[:, :, -1]  # (b, c, h)
    states = jnp.einsum("bclhn,bclh,bclhp->bchnp", Bs, jnp.exp(tot[:, :, None] - acs), X)

    def carry(s, inp):
        st, tt = inp
        return s * jnp.exp(tt)[:, :, None, None] + st, s

    _, prev = lax.scan(carry, jnp.zeros((b, h, n, p), f32),
                       (jnp.moveaxis(states, 1, 0), jnp.moveaxis(tot, 1, 0)))
    prev = jnp.moveaxis(prev, 0, 1)  # State entering each chunk.
    y = y + jnp.einsum("bclhn,bchnp,bclh->bclhp", Cs, prev, jnp.exp(acs))
    y = y + xs * D.astype(f32)[:, None]
    return y.reshape(b, nc * chunk, h * p)[:, :t].astype(x.dtype)


def mamba2_ssd_scan(x, dt, A, B, C, D, *, groups: int = 1):
    """The recurrence itself, one step at a time (lax.scan, f32): the slow, exact oracle."""
    b, t, h, p, n = _split(x, dt, A, B, C, D, groups)
    f32 = jnp.float32
    xs = x.astype(f32).reshape(b, t, h, p)
    Bs = jnp.repeat(B.astype(f32).reshape(b, t, groups, n), h // groups, axis=2)
    Cs = jnp.repeat(C.astype(f32).reshape(b, t, groups, n), h // groups, axis=2)

    def step(s, inp):
        xt, dtt, bt, ct = inp  # (b,h,p), (b,h), (b,h,n), (b,h,n)
        s = s * jnp.exp(dtt * A)[:, :, None, None] + jnp.einsum(
            "bhn,bhp->bhnp", bt, xt * dtt[..., None])
        return s, jnp.einsum("bhn,bhnp->bhp", ct, s)

    _, ys = lax.scan(step, jnp.zeros((b, h, n, p), f32),
                     (jnp.moveaxis(xs, 1, 0), jnp.moveaxis(dt.astype(f32), 1, 0),
                      jnp.moveaxis(Bs, 1, 0), jnp.moveaxis(Cs, 1, 0)))
    y = jnp.moveaxis(ys, 0, 1) + xs * D.astype(f32)[:, None]
    return y.reshape(b, t, h * p).astype(x.dtype)


def heads_per_block_for(requested: int, *, heads: int, groups: int, head_dim: int) -> int:
    """The head-block size used for ``requested``: it must divide the heads of one group and
    give a block of whole 128-lane tiles (or be all heads). The largest such size up to
    ``requested``, else the smallest above it.

    Raises:
      ValueError: no head-block size fits (e.g. head_dim 64 with an odd number of heads per
        group and several groups).
    """
    per_group = heads // groups
    ok = [k for k in range(1, per_group + 1) if per_group % k == 0
          and (k * head_dim % _LANES == 0 or k == heads)]
    if not ok:
        raise ValueError(
            f"no head block fits heads={heads}, groups={groups}, head_dim={head_dim}: a block of "
            f"k heads needs k to divide {per_group} (heads per group) and k*head_dim to be a "
            "multiple of 128 (or k to be all heads, with groups=1)")
    below = [k for k in ok if k <= requested]
    return max(below) if below else min(ok)


def _kernel(a_ref, d_ref, x_ref, acs_ref, acst_ref, dtt_ref, b_ref, c_ref, o_ref, state_ref,
            cb_ref, *, seq, chunk, hb, p):
    """One (batch row, chunk, group, head block) step, transposed: every per-head quantity is a
    row block of 64 sublanes with per-position factors as (1, chunk) rows, so no lane selects.

    yᵀ_h = (dt ⊙ x_h)ᵀ Wᵀ_h with Wᵀ_h = (B Cᵀ) ⊙ exp(segsum)ᵀ the MXU's (chunk, chunk) weights
    and the 64-row xᵀ streamed; the state is kept transposed, Sᵀ (hb * p, d_state).
    """
    ci, gi, hj = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    f32 = jnp.float32
    nblk = pl.num_programs(3)
    blk = gi * nblk + hj
    rows_ok = ci * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < seq
    bm = jnp.where(rows_ok, b_ref[...], jnp.zeros_like(b_ref))  # Ragged tail: may hold NaN.
    cm = jnp.where(rows_ok, c_ref[...], jnp.zeros_like(c_ref))

    @pl.when(ci == 0)
    def _init():
        state_ref[blk] = jnp.zeros(state_ref.shape[1:], f32)

    @pl.when(hj == 0)  # First head block of a group: its (B Cᵀ)[s, l], shared by the group.
    def _cb():
        cb_ref[...] = lax.dot_general(bm, cm, (((1,), (1,)), ((), ())),
                                      preferred_element_type=f32)

    # Wᵀ[s, l] is nonzero for l >= s: key position s on sublanes, query position l on lanes.
    tri = lax.broadcasted_iota(jnp.int32, (chunk, chunk), 1) >= lax.broadcasted_iota(
        jnp.int32, (chunk, chunk), 0)
    xt = jnp.where(rows_ok, x_ref[...], jnp.zeros_like(x_ref)).astype(f32).T  # (hb*p, chunk)
    prev = state_ref[blk]  # Sᵀ (hb*p, d_state)
    inter = lax.dot_general(prev.astype(cm.dtype), cm, (((1,), (1,)), ((), ())),
                            preferred_element_type=f32)  # (C S)ᵀ: (hb*p, chunk)
    heads_lane = lax.broadcasted_iota(jnp.int32, (1, acs_ref.shape[1]), 1)
    acs_blk = acs_ref[...]
    ys, upds, decays = [], [], []
    for i in range(hb):  # Static: head i owns rows [i*p, (i+1)*p).
        head = blk * hb + i
        rows = slice(i * p, (i + 1) * p)
        acs_row = acst_ref[pl.ds(head, 1), :]  # (1, chunk)
        acs_col = jnp.sum(jnp.where(heads_lane == head, acs_blk, 0.0), axis=1, keepdims=True)
        tot = acs_row[:, chunk - 1:]
        wt = cb_ref[...] * jnp.exp(jnp.where(tri, acs_row - acs_col, -jnp.inf))
        xdt = xt[rows] * dtt_ref[pl.ds(head, 1), :]
        y = jnp.dot(xdt.astype(x_ref.dtype), wt.astype(x_ref.dtype), preferred_element_type=f32)
        ys.append(y + inter[rows] * jnp.exp(acs_row) + d_ref[head] * xt[rows])
        upds.append((xdt * jnp.exp(tot - acs_row)).astype(x_ref.dtype))
        decays.append(jnp.broadcast_to(jnp.exp(tot), (p, 1)))
    o_ref[...] = jnp.concatenate(ys, axis=0).T.astype(o_ref.dtype)
    upd = jnp.concatenate(upds, axis=0)  # (hb*p, chunk)
    state_ref[blk] = prev * jnp.concatenate(decays, axis=0) + jnp.dot(
        upd, bm, preferred_element_type=f32)


def _standin(args, kwargs, config):
    """Fewer batch rows (identical work each), same chunk and head blocks (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    x, dt, A, B, C, D = args
    b, t = x.shape[:2]
    h = A.shape[0]
    steps = pl.cdiv(t, min(config["chunk"], t)) * h
    (nb,), scale = shrink_parallel([b], steps)
    sub = lambda a: jax.ShapeDtypeStruct((nb,) + a.shape[1:], a.dtype)  # noqa: E731
    return [sub(x), sub(dt), A, sub(B), sub(C), D], kwargs, scale


@pt.tunable(space="mamba2_ssd", reference=mamba2_ssd_reference, standin=_standin)
def mamba2_ssd(x, dt, A, B, C, D, *, groups: int = 1, chunk: int, heads_per_block: int):
    """Mamba-2 SSD forward; see the module docstring for layouts. Returns y like x.

    Raises:
      ValueError: mismatched shapes, or no head block fits (see heads_per_block_for).
    """
    b, t, h, p, n = _split(x, dt, A, B, C, D, groups)
    hb = heads_per_block_for(heads_per_block, heads=h, groups=groups, head_dim=p)
    L = min(chunk, t)
    if L != t and L % _LANES:  # The chunk is the lane dim of the cumsum-row block.
        raise pt.InvalidConfig(f"chunk={chunk} must be a multiple of 128 (or cover seq={t})")
    nc = pl.cdiv(t, L)
    pad = nc * L - t
    f32 = jnp.float32
    dtp = jnp.pad(dt.astype(f32), ((0, 0), (0, pad), (0, 0)))
    acs = jnp.cumsum((dtp * A.astype(f32)).reshape(b, nc, L, h), axis=2).reshape(b, nc * L, h)
    acst = jnp.swapaxes(acs, 1, 2)
    if groups == 1:
        bc_spec = pl.BlockSpec((None, L, n), lambda bi, ci, gi, hj: (bi, ci, 0))
    else:
        B = jnp.swapaxes(B.reshape(b, t, groups, n), 1, 2)
        C = jnp.swapaxes(C.reshape(b, t, groups, n), 1, 2)
        bc_spec = pl.BlockSpec((None, None, L, n), lambda bi, ci, gi, hj: (bi, gi, ci, 0))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    nblk = h // groups // hb  # Head blocks per group.
    xspec = pl.BlockSpec((None, L, hb * p), lambda bi, ci, gi, hj: (bi, ci, gi * nblk + hj))
    cols = pl.BlockSpec((None, L, h), lambda bi, ci, gi, hj: (bi, ci, 0))
    rows = pl.BlockSpec((None, h, L), lambda bi, ci, gi, hj: (bi, 0, ci))
    kernel = functools.partial(_kernel, seq=t, chunk=L, hb=hb, p=p)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(b, nc, groups, nblk),
        in_specs=[smem, smem, xspec, cols, rows, rows, bc_spec, bc_spec],
        out_specs=xspec,
        scratch_shapes=[pltpu.VMEM((h // hb, hb * p, n), f32), pltpu.VMEM((L, L), f32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary", "arbitrary")),
        name=f"mamba2_ssd_{L}x{hb}",
    )(A.astype(f32), D.astype(f32), x, acs, acst, jnp.swapaxes(dtp, 1, 2), B, C)
