"""All-gather matmul for ``jax.shard_map``: ``all_gather(x, axis) @ y`` with the ring transfers
of ``x``'s shards overlapped with the matmul of the shards already present (a collective matmul).

Inside a ``shard_map`` over a mesh axis of ``tp`` devices, each device holds ``x`` rows
(m, k) (the rows of one shard of the gathered (tp·m, k)) and ``y`` columns (k, n) (its column
shard). It returns the (tp·m, n) product of the gathered ``x`` with its ``y``, as
``jax.lax.all_gather(x, axis, tiled=True) @ y``, without waiting for the all-gather first.

The ring is bidirectional: each device sends its shard to both neighbours at once, and forwards
what it receives one hop further, clockwise for the shards of the devices on its left and
counter-clockwise for those on its right, so both directions of every link carry half the
traffic. Step ``s`` of the ``tp`` steps multiplies one whole shard: its own (s = 0), then its
left neighbour's, its right neighbour's, the one two to the left, ... in the order they arrive;
each step's shard is forwarded when the step begins, so the next hop's transfer runs during
the two steps before the next device needs it. Received shards land in an HBM buffer (one slot
per source device, so no slot is reused within a call and no flow control is needed); a barrier
with both neighbours opens the call (``collective_id`` 0).

Grid (tp, n/bn, k/bk), all "arbitrary" (one core walks it in order). Per step the shard is
copied from HBM into VMEM in (m, bk) chunks while the first column block is computed (the next
chunk's copy runs under the current chunk's dot), then stays there for the other column blocks.
``y`` is either streamed by Pallas in (bk, bn) blocks at every step (``y_resident=False``: tp
reads of ``y``, little VMEM) or copied into VMEM once, during step 0 (``y_resident=True``:
one read, k·n of VMEM, as tpu-inference's kernel does). The output (tp·m, n) is written in
(m, bn) blocks at the rows of the step's source device (a scalar-prefetched device index).

Tunables: ``bn`` (output columns per block, divides n), ``bk`` (contracted chunk, divides k),
``y_resident``. The scoped-VMEM limit is derived from the blocks, not tuned.

Gradient: XLA's, composed (``backward="xla"``: ``jax.vjp`` of the reference: a reduce-scatter
of ``g @ yᵀ`` for x, an all-gather of x and a matmul for y); no Pallas backward kernel.

On a CPU host the kernel runs on JAX's TPU interpreter (``pltpu.InterpretParams``: it simulates
remote DMAs and semaphores; the HLO interpreter, pallas-tune's default there, does not), so a
host mesh of ``--xla_force_host_platform_device_count`` devices runs it; on a TPU it is Mosaic's.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt
from pallas_tune import _vma
from pallas_tune.errors import NoFeasibleConfigError

__all__ = ["AxisNotBoundError", "collective_matmul", "ring_free_standin", "collective_matmul_reference", "vmem_bytes"]

DTYPES = (jnp.float32, jnp.bfloat16)
_MiB = 1024 * 1024


def _order(tp: int) -> list[tuple[int, int]]:
    """Step s → (direction, hop): direction +1 for a shard from the left (clockwise, source
    my − hop), −1 from the right (source my + hop), 0 for the own shard at step 0."""
    steps = [(0, 0)]
    for s in range(1, tp):
        steps.append((1, (s + 1) // 2) if s % 2 else (-1, s // 2))
    return steps


def vmem_bytes(m: int, n: int, k: int, itemsize: int, *, bn: int, bk: int,
               y_resident: bool) -> int:
    """VMEM the kernel's buffers take: the shard (m, k), the f32 accumulator (m, bn), the
    output's two (m, bn) buffers, and y: all of it (resident) or two (bk, bn) blocks."""
    y = k * n * itemsize if y_resident else 2 * bk * bn * itemsize
    return m * k * itemsize + m * bn * 4 + 2 * m * bn * itemsize + y


class AxisNotBoundError(NoFeasibleConfigError, ValueError):
    """The kernel was called where its mesh axis is not bound (outside ``jax.shard_map``)."""


def _axis_size(axis_name: str, declared: int) -> int:
    """The mesh axis's size; 1 where it is not bound and 1 is declared (over one device the
    gather is the identity: the call is a plain matmul, anywhere)."""
    try:
        jax.lax.axis_index(axis_name)  # NameError where unbound (JAX 0.10's axis_size may not).
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        if declared == 1:
            return 1
        raise AxisNotBoundError(
            f"collective_matmul gathers x over the mesh axis {axis_name!r}, which is not bound "
            "here: call it inside jax.shard_map over a mesh with that axis (x sharded along its "
            "rows, y along its columns), with axis_name naming it. (pt.autotune tunes each "
            "call on one device, outside the step's mesh, so it cannot tune this one: rank its "
            "configs by a deviceless compile of the slice instead, as "
            "benchmarks/kernels/collective_matmul.py does.)") from e


def _check(x, y, axis_name, axis_size, bn, bk):
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[0]:
        raise ValueError(f"collective_matmul needs the shard's x (m, k) and y (k, n); got x "
                         f"{x.shape}, y {y.shape}")
    if x.dtype != y.dtype or x.dtype not in DTYPES:
        raise ValueError(f"collective_matmul supports float32 or bfloat16 operands of one dtype; "
                         f"got x {x.dtype}, y {y.dtype}: cast both to bfloat16 or float32")
    size = _axis_size(axis_name, axis_size)
    if size != axis_size:
        raise ValueError(f"collective_matmul: axis_size={axis_size} but the mesh axis "
                         f"{axis_name!r} has {size} devices: pass axis_size={size}")
    (m, k), n = x.shape, y.shape[1]
    for name, block, dim, what in (("bn", bn, n, "y's columns per device"),
                                   ("bk", bk, k, "the contracted k")):
        if block <= 0 or dim % block:
            raise ValueError(
                f"collective_matmul: {name}={block} does not divide {what} ({dim}): pick a "
                f"{name} that divides {dim} (e.g. {math.gcd(dim, 128 if dim % 128 == 0 else dim)}"
                f" or {dim}), or pad the shapes")


def _refusal(tp: int) -> str | None:
    """JAX 0.10's TPU interpreter hangs on this kernel where it simulates more than 2 devices:
    the ring's (``tp``), or the whole mesh's (a ring of 2 on a mesh of 4 hangs too)."""
    if _vma.interpreter_runs_sharded():  # JAX 0.11 and newer.
        return None
    mesh = jax.sharding.get_abstract_mesh()
    devices = max(tp, getattr(mesh, "size", 0) or 0)
    if devices <= 2:
        return None
    where = f"{tp} devices" if devices == tp else f"a ring of {tp} on a mesh of {devices} devices"
    return (f"collective_matmul over {where} cannot run on JAX {jax.__version__}'s TPU "
            "interpreter (a CPU host): where it simulates more than 2 devices it hangs on the "
            "ring's transfers (measured on 4 host devices; 2 run). Use JAX 0.11 or newer (pip "
            "install -U jax), a mesh of 2 devices, or a TPU, where the kernel is Mosaic's.")


def _tpu_interpreter(tp: int):
    """Where kernels are interpreted with the HLO interpreter (pallas-tune's default on a CPU
    host), this one runs on the TPU interpreter instead: only it simulates remote DMAs."""
    return _vma.tpu_interpreter(lambda: _refusal(tp))


# Registered as a tunable kernel (search_spaces/collective_matmul.toml) at the end of the file.
def collective_matmul(x: jax.Array, y: jax.Array, *, bn: int, bk: int, y_resident: bool,
                      axis_name: str = "model", axis_size: int = 1) -> jax.Array:
    """``jax.lax.all_gather(x, axis_name, tiled=True) @ y`` inside ``jax.shard_map``, the
    gather's ring transfers overlapped with the matmul; x (m, k) and y (k, n) are the device's
    shards, of one dtype (float32 or bfloat16); the result is (axis_size·m, n).

    ``axis_size`` is the mesh axis's size (in the cache key: the best blocks depend on it);
    its default, 1, is a plain matmul (no gather), inside ``shard_map`` or not.
    ``bn`` and ``bk`` larger than n and k are clamped to them; otherwise they must divide them.

    Raises:
      ValueError: the shapes do not chain, the dtypes differ or are unsupported, the axis is
        not bound (outside ``shard_map``) or has another size, or a block does not divide.
    """
    bn, bk = min(bn, y.shape[1]), min(bk, x.shape[1])
    _check(x, y, axis_name, axis_size, bn, bk)
    if axis_size == 1:
        return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)
    with _tpu_interpreter(axis_size):
        return _build(x, y, axis_name, axis_size, bn, bk, y_resident, ring=True)


def ring_free_standin(x: jax.Array, y: jax.Array, *, axis_name: str, axis_size: int, bn: int,
                      bk: int, y_resident: bool) -> jax.Array:
    """The kernel's program less its ring: the same grid, VMEM, local copies and dots, every
    step on the device's own shard, no barrier and no remote DMA (wrong numbers: for compiler
    estimates only). libtpu's static profile gives a kernel with remote DMAs 0 cycles
    (``dma_instruction_type: DMA_INSTRUCTION_TYPE_LOCAL_AND_REMOTE``), so the compute side of
    a config is estimated on this; the ring is modelled apart.

    A resident ``y`` is read here by Pallas's own (bk, bn) blocks at step 0, each later step
    keeping the last block (its index unchanged, so never fetched again): y read once and the
    same dots, as the kernel's step-0 copy into VMEM does: libtpu's profiler aborts on the
    kernel's own copy ("No DMA issue node found for sync flag"). It aborts so on some configs
    of this stand-in too: at tpu-inference's 4096 x 51200 x 5120 key over 8 chips, every one
    with a single column block (``bn == n``) or contracted chunk (``bk == k``), and streamed
    ones with ``bn`` = 256 (``benchmarks/results/collective_matmul.md``)."""
    bn, bk = min(bn, y.shape[1]), min(bk, x.shape[1])
    _check(x, y, axis_name, axis_size, bn, bk)
    return _build(x, y, axis_name, axis_size, bn, bk, y_resident, ring=False)


def _build(x, y, axis_name, tp, bn, bk, y_resident, *, ring):
    (m, k), n = x.shape, y.shape[1]
    order = _order(tp)
    # The source device of each step, as an offset from this one; read by the output's index
    # map through the scalar-prefetched device index.
    offsets = [d * -h if d else 0 for d, h in order]
    hops = {1: tp // 2, -1: (tp - 1) // 2}  # Clockwise, counter-clockwise.
    me = jax.lax.axis_index(axis_name).astype(jnp.int32).reshape(1)
    offset_table = jnp.asarray(offsets, jnp.int32)

    def out_rows(s, j, kk, me_ref, off_ref):
        return (jax.lax.rem(me_ref[0] + off_ref[s] + tp, tp), j)

    y_spec = (pl.BlockSpec(memory_space=pl.ANY) if y_resident else
              pl.BlockSpec((bk, bn), lambda s, j, kk, me_ref, off_ref: (kk, j)))
    if y_resident and not ring:
        # The stand-in's resident y (see ring_free_standin): Pallas's own blocks, fetched at
        # step 0 only; later steps keep the last block, so y is read once. Its (k, n) scratch
        # stays allocated, unused, so that the stand-in fits VMEM only where the kernel does.
        gk, gn = k // bk, n // bn
        y_spec = pl.BlockSpec((bk, bn), lambda s, j, kk, me_ref, off_ref: (
            jnp.where(s == 0, kk, gk - 1), jnp.where(s == 0, j, gn - 1)))
    need = vmem_bytes(m, n, k, x.dtype.itemsize, bn=bn, bk=bk, y_resident=y_resident)
    kernel = functools.partial(_kernel, axis_name=axis_name, tp=tp, order=tuple(order),
                               hops=hops, bn=bn, bk=bk, y_resident=y_resident, ring=ring)
    return _call(kernel, me, offset_table, x, y, out_rows, y_spec, hops=hops, bn=bn, bk=bk,
                 tp=tp, y_resident=y_resident, need=need, ring=ring)


def _call(kernel, me, offset_table, x, y, out_rows, y_spec, *, hops, bn, bk, tp, y_resident,
          need, ring):
    (m, k), n, itemsize = x.shape, y.shape[1], x.dtype.itemsize
    out, _ = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((tp * m, n), x.dtype),
                   jax.ShapeDtypeStruct((tp, m, k), x.dtype)),  # The gathered x, in HBM.
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(tp, n // bn, k // bk),
            in_specs=[pl.BlockSpec(memory_space=pl.ANY), y_spec],
            out_specs=[pl.BlockSpec((m, bn), out_rows), pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[
                pltpu.VMEM((m, k), x.dtype),  # The step's shard.
                pltpu.VMEM((m, bn), jnp.float32),  # Accumulator.
                pltpu.VMEM((k, n) if y_resident else (8, 128), y.dtype),
                pltpu.SemaphoreType.DMA((2,)),  # x chunks, HBM -> VMEM.
                pltpu.SemaphoreType.DMA((2,)),  # y blocks (resident).
                pltpu.SemaphoreType.DMA,  # The own shard into the gathered buffer.
                pltpu.SemaphoreType.DMA((2, max(hops[1], 1))),  # Sends, by direction, hop.
                pltpu.SemaphoreType.DMA((2, max(hops[1], 1))),  # Receives.
            ]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",) * 3, collective_id=0 if ring else None,
            vmem_limit_bytes=int(min(max(32 * _MiB, need * 1.2 + 4 * _MiB), 126 * _MiB))),
        cost_estimate=pl.CostEstimate(flops=2 * tp * m * n * k, transcendentals=0,
                                      bytes_accessed=itemsize * (m * k + k * n + tp * m * n),
                                      remote_bytes_transferred=(tp - 1) * m * k * itemsize),
        name=f"collective_matmul_{bn}x{bk}{'_yres' if y_resident else ''}",
    )(me, offset_table, x, y)
    return out


def _kernel(me_ref, off_ref, x_hbm, y_ref, o_ref, xg_hbm, x_vmem, acc, y_vmem, x_sem, y_sem,
            own_sem, send_sem, recv_sem, *, axis_name, tp, order, hops, bn, bk, y_resident,
            ring):
    s, j, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    grid_k = pl.num_programs(2)
    me = me_ref[0]

    def src(step):
        return jax.lax.rem(me + off_ref[step] + tp, tp)

    if ring:
        _ring(me, src, x_hbm, xg_hbm, own_sem, send_sem, recv_sem, axis_name=axis_name, tp=tp,
              order=order, hops=hops)

    def chunk(c, slot, own):  # The step's shard, columns [c·bk, (c+1)·bk), HBM -> VMEM.
        if bk == x_vmem.shape[1]:  # One chunk: the whole refs (libtpu's profiler aborts on a
            source = x_hbm if own or not ring else xg_hbm.at[src(s)]  # full-width slice's DMA).
            return pltpu.make_async_copy(source, x_vmem, x_sem.at[slot])
        cols = pl.ds(pl.multiple_of(c * bk, bk), bk)
        source = x_hbm.at[:, cols] if own or not ring else xg_hbm.at[src(s), :, cols]
        return pltpu.make_async_copy(source, x_vmem.at[:, cols], x_sem.at[slot])

    def start_chunk(c, slot):
        pl.when(s == 0)(lambda: chunk(c, slot, True).start())
        pl.when(s != 0)(lambda: chunk(c, slot, False).start())

    # The stand-in (no ring) copies each chunk and y block in the step that uses it, as the
    # simplest form for libtpu's static profiler.
    @pl.when(j == 0)
    def _fetch_x():
        if not ring:
            copy = chunk(kk, 0, True)
            copy.start()
            copy.wait()
            return

        @pl.when(kk == 0)
        def _():
            start_chunk(0, 0)

        @pl.when(kk + 1 < grid_k)
        def _():
            start_chunk(kk + 1, (kk + 1) % 2)

        chunk(kk, kk % 2, True).wait()  # Either copy: the wait counts the chunk's bytes.

    if y_resident and not ring:
        y_block = y_ref[...]  # Step 0's block, or (later steps) the last one: wrong numbers.
    elif y_resident:
        pl.when(s == 0)(functools.partial(_fetch_y, y_ref, y_vmem, y_sem, bn=bn, bk=bk))
        y_block = y_vmem[pl.ds(pl.multiple_of(kk * bk, bk), bk),
                         pl.ds(pl.multiple_of(j * bn, bn), bn)]
    else:
        y_block = y_ref[...]

    @pl.when(kk == 0)
    def _init():
        acc[...] = jnp.zeros_like(acc)

    x_block = x_vmem[:, pl.ds(pl.multiple_of(kk * bk, bk), bk)]
    acc[...] += jnp.dot(x_block, y_block, preferred_element_type=jnp.float32)

    @pl.when(kk == grid_k - 1)
    def _store():
        o_ref[...] = acc[...].astype(o_ref.dtype)


def _ring(me, src, x_hbm, xg_hbm, own_sem, send_sem, recv_sem, *, axis_name, tp, order, hops):
    """The ring's part of a grid step: the barrier and the first sends (step 0), each step's
    arrival waited and forwarded, and every send waited at the last grid step."""
    s, j, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    first = (j == 0) & (kk == 0)
    last = (s == tp - 1) & (j == pl.num_programs(1) - 1) & (kk == pl.num_programs(2) - 1)
    neighbour = {1: jax.lax.rem(me + 1, tp), -1: jax.lax.rem(me + tp - 1, tp)}  # To send to.

    def transfer(direction, hop, source):
        """The transfer that brings hop ``hop`` of ``direction`` to the next device: the
        shard of device ``source`` (the one it arrived at hop - 1 here, or our own)."""
        from_ref = x_hbm if hop == 0 else xg_hbm.at[source]
        return pltpu.make_async_remote_copy(
            from_ref, xg_hbm.at[source], send_sem.at[(1 - direction) // 2, hop],
            recv_sem.at[(1 - direction) // 2, hop], device_id={axis_name: neighbour[direction]})

    @pl.when((s == 0) & first)
    def _open():
        barrier = pltpu.get_barrier_semaphore()
        for d in (1, -1):
            pl.semaphore_signal(barrier, 1, device_id={axis_name: neighbour[d]})
        pl.semaphore_wait(barrier, 2)
        for d in (1, -1):
            if hops[d]:
                transfer(d, 0, me).start()
        pltpu.make_async_copy(x_hbm, xg_hbm.at[me], own_sem).start()

    # Step s > 0: its shard arrived (hop h of its direction); forward it one hop further.
    for step, (d, h) in enumerate(order[1:], start=1):
        @pl.when((s == step) & first)
        def _arrive(step=step, d=d, h=h):
            source = src(step)
            transfer(d, h - 1, source).wait_recv()
            if h < hops[d]:
                transfer(d, h, source).start()

    @pl.when(last)
    def _close():  # Every send done before the kernel returns.
        for step, (d, h) in enumerate(order):
            if step == 0:
                for dd in (1, -1):
                    if hops[dd]:
                        transfer(dd, 0, me).wait_send()
            elif h < hops[d]:
                transfer(d, h, src(step)).wait_send()
        pltpu.make_async_copy(x_hbm, xg_hbm.at[me], own_sem).wait()


def _fetch_y(y_ref, y_vmem, y_sem, *, bn, bk):
    """Step 0 of a resident y: its (bk, bn) block of this grid step copied into VMEM, the next
    block's copy started first, so that it runs under this step's dot."""
    j, kk = pl.program_id(1), pl.program_id(2)
    grid_k = pl.num_programs(2)
    t, total = j * grid_k + kk, pl.num_programs(1) * grid_k

    def block(t):
        rows = pl.ds(pl.multiple_of((t % grid_k) * bk, bk), bk)
        cols = pl.ds(pl.multiple_of((t // grid_k) * bn, bn), bn)
        return pltpu.make_async_copy(y_ref.at[rows, cols], y_vmem.at[rows, cols],
                                     y_sem.at[t % 2])

    @pl.when(t == 0)
    def _():
        block(t).start()

    @pl.when(t + 1 < total)
    def _():
        block(t + 1).start()

    block(t).wait()


def collective_matmul_reference(x: jax.Array, y: jax.Array, *, axis_name: str = "model",
                                axis_size: int = 1) -> jax.Array:
    """``all_gather(x) @ y`` in plain JAX (XLA's all-gather, then its dot), f32 accumulation."""
    if _axis_size(axis_name, axis_size) == 1:
        return jnp.dot(x, y, preferred_element_type=jnp.float32).astype(x.dtype)
    gathered = jax.lax.all_gather(x, axis_name, tiled=True)
    return jnp.dot(gathered, y, preferred_element_type=jnp.float32).astype(x.dtype)


# Differentiable through XLA's composed backward (jax.vjp of the reference); inside shard_map
# only (no partition rule: the gather is the kernel's own).
collective_matmul = pt.tunable(space="collective_matmul", reference=collective_matmul_reference,
                               backward="xla")(collective_matmul)
