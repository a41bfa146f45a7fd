"""The candidates benchmarks/feasibility/feasibility_accuracy.py checks against the compiler.

``rules``: ragged shapes for the block rules. ``calibration``: pallas-tune's own kernels (what
the VMEM model was built from). ``heldout``: JAX's upstream TPU matmul and flash attention.
``limits``: matmul tiles under declared scoped VMEM limits (``vmem_limit_bytes`` in the call's
compiler params): the shipped matmul, and JAX's ops.tpu matmul with the limit put into its
``pltpu.CompilerParams``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import flash_attention as upstream_fa
from jax.experimental.pallas.ops.tpu import matmul as upstream_mm

import pallas_tune as pt
from pallas_tune.kernels.flash_attention import flash_attention
from pallas_tune.kernels.matmul import matmul
from pallas_tune.kernels.rms_norm import rms_norm

S = jax.ShapeDtypeStruct
SEM = ("parallel", "parallel", "arbitrary")
CHIPS = {"rules": ["v5e", "v6e", "7x"], "calibration": ["v6e", "v5e", "7x"],
         "heldout": ["v6e", "v5e"], "limits": ["v6e", "7x"]}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    group: str
    label: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


# ---- rules: ragged shapes ------------------------------------------------------------------

def _scale_kernel(x_ref, o_ref):
    o_ref[...] = (x_ref[...].astype(jnp.float32) * 2).astype(o_ref.dtype)


def scale(x, *, block, grid=None, buffers=None):
    """An elementwise kernel over ``block``-shaped windows (grid: cdiv unless given)."""
    g = grid or tuple(pl.cdiv(a, b or 1) for a, b in zip(x.shape, block, strict=True))
    mode = {} if buffers is None else {"pipeline_mode": pl.Buffered(buffers)}
    return pl.pallas_call(
        _scale_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=g,
        in_specs=[pl.BlockSpec(block, lambda *i: i, **mode)],
        out_specs=pl.BlockSpec(block, lambda *i: i))(x)


DTYPES = (jnp.float32, jnp.bfloat16, jnp.int8)


def _name(dt: Any) -> str:
    return jnp.dtype(dt).name


def rule_cases(chip: str) -> list[Case]:
    del chip
    out = []
    for shape in ((1000, 1000), (100, 4100), (30, 1000), (512, 100)):
        rows = sorted({4, 8, 16, 24, 32, 100, 256, shape[0]})
        cols = sorted({100, 128, 384, 1024, shape[1]})
        for dt, r, c in itertools.product(DTYPES, rows, cols):
            out.append(Case(group=f"2-D {shape[0]}x{shape[1]}", label=f"{_name(dt)} ({r}, {c})",
                            fn=scale, args=(S(shape, dt),), kwargs={"block": (r, c)}))
    for dt, blk in itertools.product(DTYPES, [(None, 8, 128), (2, None, 128), (None, 1000, 100),
                                              (4, 24, 1000), (None, None, 1024), (3, 40, 256)]):
        out.append(Case(group="3-D 6x1000x1000 (squeezed dims)", label=f"{_name(dt)} {blk}",
                        fn=scale, args=(S((6, 1000, 1000), dt),), kwargs={"block": blk}))
    for dt, (n, b) in itertools.product(DTYPES, [(4000, b) for b in (100, 128, 256, 512, 1000,
                                                                      1024, 2048, 3072, 4000)]
                                        + [(4096, 128), (4096, 256), (4096, 512)]):
        out.append(Case(group="rank-1", label=f"{_name(dt)} ({n},) block {b}", fn=scale,
                        args=(S((n,), dt),), kwargs={"block": (b,)}))
    out += [
        Case(group="grid past the array", label="f32 1000x1000 (128, 128) grid (9, 8)",
             fn=scale, args=(S((1000, 1000), jnp.float32),),
             kwargs={"block": (128, 128), "grid": (9, 8)}),
        Case(group="grid past the array", label="f32 (4000,) block 1024 grid (5,)", fn=scale,
             args=(S((4000,), jnp.float32),), kwargs={"block": (1024,), "grid": (5,)}),
    ]
    for n in (1, 2, 3):
        out.append(Case(group="pl.Buffered(n)", label=f"f32 1000x1000 (128, 128) Buffered({n})",
                        fn=scale, args=(S((1000, 1000), jnp.float32),),
                        kwargs={"block": (128, 128), "buffers": n}))
    for (m, k, n), dt in (((1000, 1000, 600), jnp.bfloat16), ((300, 4100, 700), jnp.float32)):
        for bm, bn, bk in itertools.product((128, 256, 512), repeat=3):
            out.append(Case(group=f"matmul {m}x{k}x{n} {_name(dt)}", label=f"{bm},{bn},{bk}",
                            fn=matmul.fn, args=(S((m, k), dt), S((k, n), dt)),
                            kwargs=dict(bm=bm, bn=bn, bk=bk, buffering=2, semantics=SEM)))
    for br in (8, 16, 24, 100, 128, 256, 1000):
        out.append(Case(group="rms_norm 1000x4100 bf16", label=f"block_rows={br}", fn=rms_norm.fn,
                        args=(S((1000, 4100), jnp.bfloat16), S((4100,), jnp.bfloat16)),
                        kwargs={"block_rows": br}))
    return out


# ---- calibration: the kernels the model was built from -------------------------------------

# The shipped matmul space stops at 1024 tiles; this one reaches past every chip's limits.
matmul_wide = pt.tunable(bm=[256, 512, 1024, 2048], bn=[256, 512, 1024, 2048],
                         bk=[256, 512, 1024, 2048], buffering=[1, 2], semantics=[SEM],
                         name="matmul_wide")(matmul.fn)
_CALIBRATION = [
    ("matmul 4096^3 bf16, tiles to 2048", matmul_wide, (S((4096, 4096), jnp.bfloat16),) * 2, {}),
    ("matmul 2048^3 bf16", matmul, (S((2048, 2048), jnp.bfloat16),) * 2, {}),
    ("matmul 4096^3 f32", matmul, (S((4096, 4096), jnp.float32),) * 2, {}),
    ("flash_attention llama8b S=8192 causal", flash_attention,
     (S((1, 32, 8192, 128), jnp.bfloat16), S((1, 8, 8192, 128), jnp.bfloat16),
      S((1, 8, 8192, 128), jnp.bfloat16)), {"causal": True}),
    ("rms_norm 8192x4096 bf16", rms_norm,
     (S((8192, 4096), jnp.bfloat16), S((4096,), jnp.bfloat16)), {}),
]


def calibration_cases(chip: str) -> list[Case]:
    del chip
    return [Case(group=label, label=str(dict(config)), fn=kernel.fn, args=args,
                 kwargs={**static, **config})
            for label, kernel, args, static in _CALIBRATION for config in kernel.space]


# ---- held out: JAX's own TPU kernels -------------------------------------------------------

def upstream_matmul(x, y, *, bm, bn, bk):
    return upstream_mm.matmul(x, y, block_shape=(bm, bn), block_k=bk)


def upstream_flash(q, k, v, *, block_q, block_k_major, block_k):
    sizes = upstream_fa.BlockSizes(block_q=block_q, block_k_major=block_k_major, block_k=block_k,
                                   block_b=1)
    return upstream_fa.flash_attention(q, k, v, causal=True, sm_scale=128**-0.5,
                                       block_sizes=sizes)


def heldout_cases(chip: str) -> list[Case]:
    del chip
    out = []
    for dt, tiles in ((jnp.bfloat16, (512, 1024, 2048)), (jnp.float32, (256, 512, 1024))):
        x = S((4096, 4096), dt)
        for bm, bn, bk in itertools.product(tiles, repeat=3):
            out.append(Case(group=f"jax ops.tpu.matmul 4096^3 {_name(dt)}",
                            label=f"block_shape=({bm}, {bn}) block_k={bk}", fn=upstream_matmul,
                            args=(x, x), kwargs=dict(bm=bm, bn=bn, bk=bk)))
    q = S((1, 8, 4096, 128), jnp.bfloat16)
    for bq, bkm in itertools.product((512, 1024, 2048), repeat=2):
        for bk in (b for b in (256, 512, 1024, 2048) if b <= bkm):
            out.append(Case(group="jax ops.tpu.flash_attention S=4096 causal bf16",
                            label=f"block_q={bq} block_k_major={bkm} block_k={bk}",
                            fn=upstream_flash, args=(q, q, q),
                            kwargs=dict(block_q=bq, block_k_major=bkm, block_k=bk)))
    return out


# ---- limits: declared vmem_limit_bytes --------------------------------------------------------

MiB = 2**20
LIMITS = {"v6e": (0, 64 * MiB, 100 * MiB), "7x": (100 * MiB,)}  # 0: no limit (the default).


class _LimitedTpu:
    """``pltpu`` for an upstream module, with ``vmem_limit_bytes`` added to its CompilerParams."""

    def __init__(self, limit: int):
        self.limit = limit

    def __getattr__(self, name: str) -> Any:
        return getattr(pltpu, name)

    def CompilerParams(self, **kw: Any) -> Any:  # noqa: N802 - pltpu's name.
        return pltpu.CompilerParams(**kw, vmem_limit_bytes=self.limit or None)


_PATCH = threading.Lock()


def upstream_matmul_limited(x, y, *, bm, bn, bk, limit):
    """JAX's ops.tpu matmul with ``vmem_limit_bytes=limit`` in its compiler params (while it is
    traced, unjitted so that no cached trace skips the patch; a lock keeps threads from seeing
    each other's limit)."""
    fn = getattr(upstream_mm.matmul, "__wrapped__", upstream_mm.matmul)
    with _PATCH:
        saved, upstream_mm.pltpu = upstream_mm.pltpu, _LimitedTpu(limit)
        try:
            return fn(x, y, block_shape=(bm, bn), block_k=bk)
        finally:
            upstream_mm.pltpu = saved


def _windows_mib(bm: int, bn: int, bk: int, buffering: int) -> float:
    """bf16 input windows, output window (2 buffers) and f32 accumulator, in MiB."""
    return (buffering * (bm * bk + bk * bn) * 2 + 2 * bm * bn * 2 + bm * bn * 4) / MiB


def limit_cases(chip: str) -> list[Case]:
    """Tiles to 2048 whose windows and accumulator take at least 20 MiB (smaller ones fit every
    limit by far; deviceless compiles cost 10-20 s each on the shared host)."""
    x = S((4096, 4096), jnp.bfloat16)
    out = []
    tiles = list(itertools.product((512, 1024, 2048), repeat=3))
    if chip == "7x":  # 64 MiB physical: the 100 MiB limit is capped; the largest tiles only.
        tiles = [t for t in tiles if t.count(2048) >= 2]
    for limit in LIMITS[chip]:
        at = f"limit {limit // MiB} MiB" if limit else "no limit (default)"
        for (bm, bn, bk), buffering in itertools.product(tiles, (2, 1)):
            if _windows_mib(bm, bn, bk, buffering) < 20:
                continue
            out.append(Case(group=f"matmul 4096^3 bf16 | {at}",
                            label=f"{bm},{bn},{bk} buffering={buffering}", fn=matmul.fn,
                            args=(x, x), kwargs=dict(bm=bm, bn=bn, bk=bk, buffering=buffering,
                                                     semantics=SEM, vmem_limit_bytes=limit)))
        for bm, bn, bk in (t for t in tiles if _windows_mib(*t, 2) >= 20):
            out.append(Case(group=f"jax ops.tpu.matmul 4096^3 bf16 | {at}",
                            label=f"block_shape=({bm}, {bn}) block_k={bk}",
                            fn=upstream_matmul_limited, args=(x, x),
                            kwargs=dict(bm=bm, bn=bn, bk=bk, limit=limit)))
    return out


CASES: dict[str, Callable[[str], list[Case]]] = {
    "rules": rule_cases, "calibration": calibration_cases, "heldout": heldout_cases,
    "limits": limit_cases}
