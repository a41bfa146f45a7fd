"""The scoped VMEM limit as a tuning dimension: the feasibility model reads the limit a traced
call sets (``vmem_limit_bytes`` in its compiler params), capped at the chip's physical VMEM, and
the shipped matmul's default leaves its program as it was before the limit was tunable."""

import functools

import jax
import jax.numpy as jnp
import pytest

import pallas_tune as pt
from pallas_tune.chips import chip_spec
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.feasibility.model import check_feasible, model_calls
from pallas_tune.kernels.matmul import matmul

MiB = 2**20
SEM = ("parallel", "parallel", "arbitrary")
X = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
# Windows 2 x (8 + 8) MiB, output 2 x 8 MiB, accumulator 16 MiB, temporaries: 59.2 MiB.
BIG = dict(bm=2048, bn=2048, bk=1024, buffering=2, semantics=SEM)


def test_model_reads_the_limit_the_call_declares():
    calls = _inspect.find_pallas_calls(matmul.fn, (X, X), {**BIG, "vmem_limit_bytes": 64 * MiB})
    assert calls[0].vmem_limit_bytes == 64 * MiB
    (kernel,) = model_calls(calls, chip_spec("v6e"))
    assert kernel.limit_bytes == kernel.requested_limit_bytes == 64 * MiB
    default = _inspect.find_pallas_calls(matmul.fn, (X, X), {**BIG, "vmem_limit_bytes": 0})
    assert default[0].vmem_limit_bytes is None  # 0: the call sets no limit at all.
    assert model_calls(default, chip_spec("v6e"))[0].limit_bytes == 32 * MiB


def test_a_tile_refused_at_the_default_fits_a_raised_limit_but_not_past_physical_vmem():
    at = {lim: check_feasible(matmul, X, X, chip="v6e", vmem_limit_bytes=lim * MiB, **BIG)
          for lim in (0, 64, 100)}
    assert not at[0].ok and at[0].detail == "vmem_scoped_oom" and at[0].limit_bytes == 32 * MiB
    assert at[64].status == "uncertain" and at[64].limit_bytes == 64 * MiB  # The compiler decides.
    assert at[100].status == "ok" and at[100].limit_bytes == 100 * MiB
    # 7x has 64 MiB of VMEM: a 100 MiB limit is capped there, and the need overflows the chip.
    v7 = check_feasible(matmul, X, X, chip="7x", vmem_limit_bytes=100 * MiB,
                        **{**BIG, "bk": 2048})
    usable = chip_spec("7x").vmem_usable_bytes
    assert not v7.ok and v7.detail == "vmem_physical_oom" and v7.limit_bytes == usable
    assert "physical VMEM" in v7.reason
    # Above v6e's 128 MiB: no limit makes it fit (windows 96 MiB + accumulator 64 MiB).
    x8 = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
    huge = check_feasible(matmul, x8, x8, chip="v6e", vmem_limit_bytes=200 * MiB,
                          **{**BIG, "bm": 4096, "bn": 4096, "bk": 2048})
    assert not huge.ok and huge.detail == "vmem_physical_oom"
    assert huge.limit_bytes == chip_spec("v6e").vmem_usable_bytes


def test_the_matmul_space_declares_the_limit_with_the_default_unset():
    assert matmul.space["vmem_limit_bytes"].choices == (0, 64 * MiB, 100 * MiB)
    assert matmul.space.default["vmem_limit_bytes"] == 0


def _lowered(fn, **config):
    with pt.target("v6e"):
        return (jax.jit(functools.partial(fn, **config)).trace(X, X)
                .lower(lowering_platforms=("tpu",)).as_text(debug_info=False))


def _matmul_before(x, y, *, bm, bn, bk, buffering, semantics):
    """kernels/matmul.py's pallas_call as it was before vmem_limit_bytes (commit 811feeb), at
    shapes that every block divides."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from pallas_tune.kernels.matmul import _kernel

    (m, k), n = x.shape, y.shape[1]
    buffered = functools.partial(pl.BlockSpec, pipeline_mode=pl.Buffered(buffering))
    return pl.pallas_call(
        functools.partial(_kernel, k_tail=k % bk),
        out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
        grid=(pl.cdiv(m, bm), pl.cdiv(n, bn), pl.cdiv(k, bk)),
        in_specs=[buffered((bm, bk), lambda i, j, kk: (i, kk)),
                  buffered((bk, bn), lambda i, j, kk: (kk, j))],
        out_specs=pl.BlockSpec((bm, bn), lambda i, j, kk: (i, j)),
        scratch_shapes=[pltpu.VMEM((bm, bn), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=tuple(semantics)),
        name=f"matmul_{bm}x{bn}x{bk}",
    )(x, y)


_matmul_before.__name__ = _matmul_before.__qualname__ = "matmul"  # The module's name.


def test_default_lowering_is_unchanged_and_a_raised_limit_reaches_the_program():
    config = dict(matmul.space.default)
    before = _lowered(_matmul_before, **{k: v for k, v in config.items()
                                        if k != "vmem_limit_bytes"})
    assert _lowered(matmul.fn, **config) == before
    assert _lowered(matmul, **config) == before  # Through the tunable wrapper too.
    raised = _lowered(matmul.fn, **{**config, "vmem_limit_bytes": 64 * MiB})
    assert raised != before and str(64 * MiB) in raised


@pytest.mark.libtpu
def test_the_compiler_agrees_at_each_limit():
    """Deviceless compiles (v6e): refused at the default 32 MiB, compiles at 100 MiB."""
    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    refused = check_feasible(matmul, x, x, chip="v6e", compile=True, vmem_limit_bytes=0, **BIG)
    assert not refused.ok and refused.detail == "vmem_scoped_oom"
    fits = check_feasible(matmul, x, x, chip="v6e", compile=True, vmem_limit_bytes=100 * MiB,
                          **BIG)
    assert fits.ok and fits.stage == "compiler" and 32 * MiB < fits.vmem_bytes < 100 * MiB
