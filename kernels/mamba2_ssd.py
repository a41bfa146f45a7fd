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

Grid (batch, chunks, groups, head blocks of the group): the chunk axis is "arbitrary" and comes
before the heads, so per chunk the cumsum rows, B and C blocks are fetched once and C Bᵀ is
computed once per group (on the group's first head block: a plain program-id comparison, which
libtpu's static estimate follows per step); the f32 state of every head stays in VMEM.

The kernel works transposed (benchmarks/results/mamba2_profile.txt): a head block's xᵀ is
(heads_per_block * head_dim, L), so every head owns a row block and every per-position factor
(dt, decays) is a (1, L) row: no lane selects. The in-chunk product is yᵀ = (dt ⊙ x)ᵀ Wᵀ with
the (L, L) Wᵀ as the MXU's weights and head_dim 64 rows streamed; Wᵀ's diagonal 128x128 tiles
are built elementwise (exp2 of the masked segment sums), the tiles above them factor through
the group's C Bᵀ with a row scaling on either side (see ``_intra``). The state is kept as Sᵀ
(head_dim rows per head, d_state). The in-chunk cumulative sums of dt·A (in log2 units, for
exp2) and the transposed dt and cumsum rows are computed in the wrapper (small XLA ops).

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
_LOG2E = 1.4426950408889634


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
    """The chunked dual form in plain JAX (f32), any sequence length (zero-padded chunks), with
    no loop: the states passed between chunks by a (chunks x chunks) decay weight."""
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
    # The state entering chunk c: the sum over j < c of states[j] decayed by the chunks between
    # (exp of tot summed over j < i < c), as one einsum over a (c, j) weight, not a scan: a
    # loop is serial on TPU, and libtpu 0.0.50.1's static profile aborts on this one.
    ct = jnp.cumsum(tot, axis=1)
    gap = ct[:, :, None, :] - tot[:, :, None, :] - ct[:, None, :, :]  # (b, c, j, h)
    before = jnp.tril(jnp.ones((nc, nc), bool), -1)[None, :, :, None]
    prev = jnp.einsum("bcjh,bjhnp->bchnp", jnp.exp(jnp.where(before, gap, -jnp.inf)), states)
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


def _intra(xdt, cb_ref, cbm_ref, acs_row, acs_col, *, chunk, dtype):
    """yᵀ[:, l] = Σ_{s <= l} xdt[:, s] (B Cᵀ)[s, l] 2^(acs_l - acs_s) for one head, in column
    strips of 128 (xdt (rows, chunk) f32; acs in log2 units, non-increasing along the chunk).

    Only the diagonal 128x128 tile of a strip builds the decay mask elementwise (16 vregs, exp2
    per element). The strip's earlier rows s < l0 = j * 128 factor through m = acs_{l0 - 1}:
    2^(acs_l - acs_s) = 2^(acs_l - m) 2^(m - acs_s), both factors <= 1 (no overflow; where one
    underflows the product is below it; this needs dt·A <= 0, as Mamba-2's dt > 0 and A < 0
    give), so that part is ((xdt ⊙ 2^(m - acs_s)) (B Cᵀ)) ⊙
    2^(acs_l - m): the group's B Cᵀ itself is the MXU's weights, no per-head mask at all.
    """
    bs = _LANES if chunk % _LANES == 0 else chunk
    tri = lax.broadcasted_iota(jnp.int32, (bs, bs), 1) >= lax.broadcasted_iota(
        jnp.int32, (bs, bs), 0)
    strips = []
    for j in range(chunk // bs):
        lo, lj = j * bs, slice(j * bs, (j + 1) * bs)
        seg = jnp.where(tri, acs_row[:, lj] - acs_col[lj], -jnp.inf)
        w = (cb_ref[lj, lj] * jnp.exp2(seg)).astype(dtype)
        acc = jnp.dot(xdt[:, lj].astype(dtype), w, preferred_element_type=jnp.float32)
        if j:
            m = acs_row[:, lo - 1:lo]
            scaled = (xdt[:, :lo] * jnp.exp2(m - acs_row[:, :lo])).astype(dtype)
            acc = acc + jnp.dot(scaled, cbm_ref[:lo, lj], preferred_element_type=jnp.float32
                                ) * jnp.exp2(acs_row[:, lj] - m)
        strips.append(acc)
    return strips[0] if len(strips) == 1 else jnp.concatenate(strips, axis=1)


def _kernel(a_ref, d_ref, x_ref, acs_ref, acst_ref, dtt_ref, b_ref, c_ref, o_ref, state_ref,
            cb_ref, cbm_ref, *, seq, chunk, hb, p):
    """One (batch row, chunk, group, head block) step, transposed: head i owns rows
    [i*p, (i+1)*p) of xᵀ, (C S)ᵀ and yᵀ, and its per-position factors are (1, chunk) rows, so
    there are no lane selects; the state is kept transposed, Sᵀ (hb * p, d_state).
    """
    ci, gi, hj = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    f32 = jnp.float32
    nblk = pl.num_programs(3)
    blk = gi * nblk + hj

    def valid(v):  # A ragged last chunk's padding rows may hold NaN; whole chunks are kept.
        if seq % chunk == 0:
            return v
        rows_ok = ci * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < seq
        return jnp.where(rows_ok, v, jnp.zeros_like(v))

    bm, cm = valid(b_ref[...]), valid(c_ref[...])

    @pl.when(ci == 0)
    def _init():
        state_ref[blk] = jnp.zeros(state_ref.shape[1:], f32)

    @pl.when(hj == 0)  # First head block of a group: its (B Cᵀ)[s, l], shared by the group.
    def _cb():
        cb = lax.dot_general(bm, cm, (((1,), (1,)), ((), ())), preferred_element_type=f32)
        cb_ref[...] = cb
        cbm_ref[...] = cb.astype(cbm_ref.dtype)

    xt = valid(x_ref[...]).astype(f32).T  # (hb*p, chunk)
    prev = state_ref[blk]  # Sᵀ (hb*p, d_state)
    inter = lax.dot_general(prev.astype(cm.dtype), cm, (((1,), (1,)), ((), ())),
                            preferred_element_type=f32)  # (C S)ᵀ: (hb*p, chunk)
    ys, upds, decays = [], [], []
    for i in range(hb):  # Static: head i owns rows [i*p, (i+1)*p).
        head = blk * hb + i
        rows = slice(i * p, (i + 1) * p)
        acs_row = acst_ref[pl.ds(head, 1), :]  # (1, chunk)
        acs_col = acs_ref[:, i:i + 1]  # (chunk, 1)
        tot = acs_row[:, chunk - 1:]
        xdt = xt[rows] * dtt_ref[pl.ds(head, 1), :]
        y = _intra(xdt, cb_ref, cbm_ref, acs_row, acs_col, chunk=chunk, dtype=x_ref.dtype)
        ys.append(y + inter[rows] * jnp.exp2(acs_row) + d_ref[head] * xt[rows])
        upds.append((xdt * jnp.exp2(tot - acs_row)).astype(x_ref.dtype))
        decays.append(jnp.broadcast_to(jnp.exp2(tot), (p, 1)))
    o_ref[...] = jnp.concatenate(ys, axis=0).T.astype(o_ref.dtype)
    state_ref[blk] = prev * jnp.concatenate(decays, axis=0) + jnp.dot(
        jnp.concatenate(upds, axis=0), bm, preferred_element_type=f32)


def _standin(args, kwargs, config):
    """Fewer batch rows (identical work each), same chunk and head blocks (tpu-estimate)."""
    from pallas_tune.measure.estimate import shrink_parallel

    x, dt, A, B, C, D = args
    b, t = x.shape[:2]
    h = A.shape[0]
    groups = kwargs.get("groups", 1)
    hb = heads_per_block_for(config["heads_per_block"], heads=h, groups=groups,
                             head_dim=x.shape[-1] // h)
    # Grid steps per batch row with this config's head block: each kernel's fixed cost (the
    # pipeline's first and last DMAs) is scaled with the rest, so a stand-in of too few steps
    # overstates big blocks (1 of 4 rows at 512x16: 8.3% over the full compile's estimate).
    steps = pl.cdiv(t, min(config["chunk"], t)) * (h // hb)
    (nb,), scale = shrink_parallel([b], steps)
    sub = lambda a: jax.ShapeDtypeStruct((nb,) + a.shape[1:], a.dtype)  # noqa: E731
    return [sub(x), sub(dt), A, sub(B), sub(C), D], kwargs, scale


# backward="xla": jax.grad is jax.vjp of the reference (the step recurrence), recomputed from the
# inputs (no backward kernel yet: nothing of the gradient is tuned).
# Sharded jit (pallas_tune.runtime.partition): the batch splits; the sequence is the scan's and
# x's heads share one axis with the head dim, so both are kept whole.
@pt.tunable(space="mamba2_ssd", reference=mamba2_ssd_reference, standin=_standin, backward="xla",
            partition="b T X, b T H, H, b T N, b T N, H -> b T X")
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
    # In-chunk cumulative sums of dt·A in log2 units (the kernel's exponentials are exp2).
    acs = jnp.cumsum((dtp * (A.astype(f32) * _LOG2E)).reshape(b, nc, L, h), axis=2)
    acst = jnp.swapaxes(acs.reshape(b, nc * L, h), 1, 2)  # (b, h, t): rows per head.
    acs = jnp.swapaxes(acs.reshape(b, nc * L, h // hb, hb), 1, 2)  # (b, blocks, t, hb): columns.
    if groups == 1:
        bc_spec = pl.BlockSpec((None, L, n), lambda bi, ci, gi, hj: (bi, ci, 0))
    else:
        B = jnp.swapaxes(B.reshape(b, t, groups, n), 1, 2)
        C = jnp.swapaxes(C.reshape(b, t, groups, n), 1, 2)
        bc_spec = pl.BlockSpec((None, None, L, n), lambda bi, ci, gi, hj: (bi, gi, ci, 0))
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    nblk = h // groups // hb  # Head blocks per group.
    xspec = pl.BlockSpec((None, L, hb * p), lambda bi, ci, gi, hj: (bi, ci, gi * nblk + hj))
    cols = pl.BlockSpec((None, None, L, hb), lambda bi, ci, gi, hj: (bi, gi * nblk + hj, ci, 0))
    rows = pl.BlockSpec((None, h, L), lambda bi, ci, gi, hj: (bi, 0, ci))
    kernel = functools.partial(_kernel, seq=t, chunk=L, hb=hb, p=p)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(b, nc, groups, nblk),
        in_specs=[smem, smem, xspec, cols, rows, rows, bc_spec, bc_spec],
        out_specs=xspec,
        scratch_shapes=[pltpu.VMEM((h // hb, hb * p, n), f32), pltpu.VMEM((L, L), f32),
                        pltpu.VMEM((L, L), x.dtype)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary", "arbitrary")),
        name=f"mamba2_ssd_{L}x{hb}",
    )(A.astype(f32), D.astype(f32), x, acs, acst, jnp.swapaxes(dtp, 1, 2), B, C)
