"""Small tunable kernels for the tests (importable as ``toy_kernels`` with tests/ on sys.path)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt


def _scale_kernel(x_ref, o_ref, *, factor):
    o_ref[...] = x_ref[...] * factor


@pt.tunable(br=[8, 16, 32, 64], bc=[128, 256], buffering=[1, 2])
def scale(x, *, factor=2.0, br, bc, buffering):
    """Elementwise x * factor, tiled (br, bc)."""
    r, c = x.shape
    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j), pipeline_mode=pl.Buffered(buffering))
    return pl.pallas_call(
        lambda x_ref, o_ref: _scale_kernel(x_ref, o_ref, factor=factor),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(r, br), pl.cdiv(c, bc)),
        in_specs=[spec],
        out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        name="scale",
    )(x)


def scale_reference(x, *, factor=2.0):
    return x * factor


# A space where some tiles break the TPU block rules (br=12 is not a multiple of 8; bc=100 not
# of 128), and one config computes the wrong thing: the tuner must never measure the first and
# must reject the second.
@pt.tunable(br=[12, 16, 32], bc=[100, 128], wrong=[False, True], reference=scale_reference,
            default={"br": 16, "bc": 128, "wrong": False})
def scale_checked(x, *, factor=2.0, br, bc, wrong):
    r, c = x.shape
    f = factor + (1.0 if wrong else 0.0)
    return pl.pallas_call(
        lambda x_ref, o_ref: _scale_kernel(x_ref, o_ref, factor=f),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(r, br), pl.cdiv(c, bc)),
        in_specs=[pl.BlockSpec((br, bc), lambda i, j: (i, j))],
        out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
        name="scale_checked",
    )(x)


def plain_add(x, y, *, unroll):
    """Not a Pallas kernel: tunable anyway (the decorator is generic)."""
    del unroll
    return x + y


add = pt.tunable(unroll=[1, 2])(plain_add)


def ones(shape=(64, 256), dtype=jnp.float32):
    return jnp.arange(shape[0] * shape[1], dtype=jnp.float32).reshape(shape).astype(dtype)


@pt.tunable(br=[8, 16, 64], bc=[128, 256], buffering=[2])
def crashy(x, *, br, bc, buffering):
    """Like `scale`, but the process dies for br=64 (a stand-in for a compiler abort)."""
    if br == 64:
        import os

        os.abort()
    return scale.fn(x, br=br, bc=bc, buffering=buffering)


def _host(fn, x):
    return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def _hang(a):
    import time

    time.sleep(600)
    return a


def _abort(a):
    import os

    os.abort()


def _raise(a):
    raise RuntimeError("this candidate fails at run time")


def _hang_at_trace():
    import time

    while True:  # Python that never returns, while the kernel is being traced.
        time.sleep(1)


def _spec(br, mode):
    if mode != "spec_hang":
        return pl.BlockSpec((br, 128), lambda i, j: (i, j))

    def index_map(i, j):  # A block-spec function that loops when traced.
        _hang_at_trace()
        return i, j

    return pl.BlockSpec((br, 128), index_map)


@pt.tunable(mode=["good", "raise", "hang", "abort", "wrong", "trace_raise", "trace_hang",
                  "trace_abort", "spec_hang"], br=[8, 16],
            # Each hanging mode once: every hang waits out the whole time limit.
            constraints={"hangs_once": "br == 8 or mode not in ('hang', 'trace_hang', "
                                       "'spec_hang')"},
            reference=scale_reference, default={"mode": "good", "br": 8})
def misbehaving(x, *, factor=2.0, mode, br):
    """`scale` plus every way to fail: at trace time (raise, hang in the body or in a block-spec
    function, kill the process) and at run time (raise, hang, kill the process, wrong values)."""
    if mode == "trace_raise":
        raise RuntimeError("this candidate fails while traced")
    if mode == "trace_hang":
        _hang_at_trace()
    if mode == "trace_abort":
        import os

        os.abort()
    f = factor + (1.0 if mode == "wrong" else 0.0)
    r, c = x.shape
    out = pl.pallas_call(
        lambda x_ref, o_ref: _scale_kernel(x_ref, o_ref, factor=f),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(r, br), pl.cdiv(c, 128)),
        in_specs=[_spec(br, mode)],
        out_specs=pl.BlockSpec((br, 128), lambda i, j: (i, j)),
        name=f"misbehaving_{mode}",
    )(x)
    if mode in ("raise", "hang", "abort"):
        out = _host({"raise": _raise, "hang": _hang, "abort": _abort}[mode], out)
    return out


@pt.tunable(b=[8, 16, 32, 64, 128], buffering=[1, 2])
def clamped(x, *, b, buffering):
    """Rows per block clamped to the array (as the shipped kernels clamp their tiles); the
    name carries the unclamped size. At 16 rows b=16, 32, 64 and 128 are one program, and in
    interpret mode the buffer depth changes nothing: 2 programs among 10 configs."""
    rows = min(b, x.shape[0])
    return pl.pallas_call(
        lambda x_ref, o_ref: _scale_kernel(x_ref, o_ref, factor=2.0),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(pl.cdiv(x.shape[0], rows),),
        in_specs=[pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0),
                               pipeline_mode=pl.Buffered(buffering))],
        out_specs=pl.BlockSpec((rows, x.shape[1]), lambda i: (i, 0)),
        name=f"clamped_{b}",
    )(x)


@pt.tunable(b=[8, 16, 32, 64, 128], buffering=[1, 2], clamp={"b": "x.shape[0]"})
def clamped_declared(x, *, b, buffering):
    """``clamped``, with its clamp declared: tuning searches one config per program."""
    return clamped.fn(x, b=b, buffering=buffering)


CALLS = {"reference": 0}  # How often scale_or_xla's reference ran (the dispatch test).


def counted_reference(x, *, factor=2.0):
    CALLS["reference"] += 1
    return x * factor


def _slow(a):
    import time

    time.sleep(0.05)  # Every run of the kernel's program takes at least 50 ms: XLA wins,
    return a          # whatever the load on the host (interpret-mode timings alone do not).


@pt.tunable(br=[8, 16], bc=[128], reference=counted_reference, fallback="reference")
def scale_or_xla(x, *, factor=2.0, br, bc):
    """``scale`` made slow on purpose (a 50 ms host callback in its program) and its
    reference declared as the alternative implementation (plain JAX: far under 50 ms)."""
    return _host(_slow, scale.fn(x, factor=factor, br=br, bc=bc, buffering=2))


class ToySession:
    """A worker session for the pool's own tests (see test_evaluate.py)."""

    def __init__(self, tag):
        self.tag = tag
        self.value = None

    def info(self, channel=None):
        import os

        return {"tag": self.tag, "pid": os.getpid()}

    def keep(self, value, channel=None):
        self.value = value

    def kept(self, channel=None):
        return self.value

    def work(self, phase, seconds, channel):
        import time

        channel.phase(phase)
        time.sleep(seconds)
        return phase

    def span(self, seconds, channel):
        import os
        import time

        start = time.time()
        time.sleep(seconds)
        return os.getpid(), start, time.time()

    def die(self, channel):
        import os

        channel.phase("run")
        os.abort()

    def flood(self, megabytes, seconds, channel):
        """What libtpu does when its static profiler trips: ``megabytes`` to a glog file in
        ``$TPU_LOG_DIR`` (appended, as glog does) and to stderr, over ``seconds``; then the
        abort."""
        import os
        import sys
        import time

        channel.phase("compile")
        d = os.environ["TPU_LOG_DIR"]
        os.makedirs(d, exist_ok=True)
        fd = os.open(os.path.join(d, f"tpu_driver.host.log.ERROR.{os.getpid()}"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        chunk = b"E LLO dump line " + b"x" * 1000 + b"\n"
        steps = megabytes * 2**20 // len(chunk)
        for i in range(steps):
            os.write(fd, chunk)
            if i % 64 == 0:
                sys.stderr.buffer.write(chunk * 64)
                time.sleep(seconds / (steps / 64))
        sys.stderr.buffer.write(b"F Check failed: LLO_CHECK failure (the last line)\n")
        sys.stderr.flush()
        os.abort()

    def question(self, q, channel):
        return channel.ask(q)

    def fail(self, channel):
        raise ValueError("a bug in the session")


@pt.tunable(br=[8, 16], bc=[128], buffering=[2], reference=scale_reference,
            fallback="reference")
def poor_scale(x, *, factor=2.0, br, bc, buffering):
    """``scale`` with only its smallest tiles: many grid steps of tiny blocks, so that XLA's
    multiply beats every config on the compiler's estimate (the XLA-wins case for
    ``tpu-estimate``)."""
    return scale.fn(x, factor=factor, br=br, bc=bc, buffering=buffering)


def matmul_bwd_whole(x, y, g, **tiles):
    """matmul_bwd's two kernels inside a nested jit: kernels the tpu-estimate timer does not
    split out, so it compiles the program whole (the comparison for the kernel-by-kernel
    estimate of matmul_bwd itself)."""
    import functools

    from pallas_tune.kernels.matmul_bwd import matmul_bwd

    return jax.jit(functools.partial(matmul_bwd.fn, **tiles))(x, y, g)


def matmul_bwd_dx(x, y, g, **tiles):
    """matmul_bwd's dx kernel alone: dy's result is dropped, so the compiler drops its kernel
    (and the tpu-estimate timer does not split the program)."""
    from pallas_tune.kernels.matmul_bwd import matmul_bwd

    return matmul_bwd.fn(x, y, g, **tiles)[0]


def matmul_bwd_dy(x, y, g, **tiles):
    """matmul_bwd's dy kernel alone (see matmul_bwd_dx)."""
    from pallas_tune.kernels.matmul_bwd import matmul_bwd

    return matmul_bwd.fn(x, y, g, **tiles)[1]


def _stacked_kernel(a_ref, b_ref, o_ref, acc_ref, *, stacked):
    i = pl.program_id(2)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jax.lax.dot_general(a_ref[...], b_ref[...], (((0,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)

    @pl.when(i == pl.num_programs(2) - 1)
    def _store():
        if stacked:
            o_ref[0] = acc_ref[...].astype(o_ref.dtype)
        else:
            o_ref[...] = acc_ref[...].astype(o_ref.dtype)


def stacked_output(a, b, *, t, stacked):
    """aᵀ·b (m, k) x (m, n) -> (k, n), accumulated over m tiles: every step does a (t, t, t)
    dot. ``stacked``: the result is written as group 0 of an (8, k, n) output, through one
    (8, t, t) block (as a grouped matmul's drhs with every group resident would); libtpu
    0.0.50.1's static profile counts next to nothing for that program (measured)."""
    m, k = a.shape
    n = b.shape[1]
    out = (8, k, n) if stacked else (k, n)
    block = (8, t, t) if stacked else (t, t)
    return pl.pallas_call(
        lambda a_ref, b_ref, o_ref, acc_ref: _stacked_kernel(a_ref, b_ref, o_ref, acc_ref,
                                                              stacked=stacked),
        out_shape=jax.ShapeDtypeStruct(out, a.dtype),
        grid=(k // t, n // t, m // t),
        in_specs=[pl.BlockSpec((t, t), lambda kk, nn, i: (i, kk)),
                  pl.BlockSpec((t, t), lambda kk, nn, i: (i, nn))],
        out_specs=pl.BlockSpec(block, (lambda kk, nn, i: (0, kk, nn)) if stacked
                               else (lambda kk, nn, i: (kk, nn))),
        scratch_shapes=[pltpu.VMEM((t, t), jnp.float32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
    )(a, b)
