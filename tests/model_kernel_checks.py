"""Checks shared by the kernel tests (property tests, HSTU, Mamba-2 SSD, decode adapters)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import pallas_tune as pt
from pallas_tune.measure.timing import compare


def oracle(reference: Any, *args: Any, **kwargs: Any) -> Any:
    """``reference(*args, **kwargs)`` compiled as one program. Run op by op, a reference compiles
    each of its ops again for every new shape, seconds per drawn example; the values are the
    reference's all the same (keyword arguments are fixed as constants)."""
    return jax.jit(functools.partial(reference, **kwargs))(*args)


def assert_matches_reference(out: Any, ref: Any) -> None:
    """Same shape and dtype, a finite reference, no NaN/Inf in the output (counted: any comparison
    with NaN is False), and a match within the dtype's tolerance (``timing.compare``)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape,
                                                               ref.dtype)
    assert np.isfinite(np.asarray(ref, np.float32)).all(), "the reference itself is not finite"
    bad = int(np.sum(~np.isfinite(np.asarray(out, np.float32))))
    assert bad == 0, f"{bad} NaN/Inf values in the kernel output"
    ok, _, why = compare(out, ref)
    assert ok, why


def assert_every_config_lowers_for_tpu(kernel: Any, args: Sequence[Any]) -> None:
    """Every config of the kernel's space is valid for ``args`` and lowers to a Mosaic kernel."""
    with pt.target("v6e"):
        for cfg in kernel.space:
            assert not kernel.violations(cfg, args, {}), cfg
            text = jax.jit(lambda *a, _c=cfg: kernel(*a, **_c)).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text, cfg


def estimate_sweep(kernel_ref: str, shapes: str, capsys: Any, *, trials: int = 2
                   ) -> tuple[int, str, str]:
    """Runs `pallas-tune sweep` with the v6e compiler estimate; returns (rc, stdout, stderr)."""
    from pallas_tune import cli

    rc = cli.main(["sweep", kernel_ref, "--shapes", shapes, "--chip", "v6e", "--timer",
                   "tpu-estimate", "--trials", str(trials), "--workers", "1"])
    out, err = capsys.readouterr()
    return rc, out, err


def assert_cotangents_close(grads: Sequence[Any], ref: Sequence[Any], args: Sequence[Any],
                            names: Sequence[str], f32_tol: float = 1e-5) -> None:
    """One cotangent per name, each of its argument's shape and dtype, finite (NaN/Inf
    counted), and close to the f32 reference: ``f32_tol`` (float32 inputs) or 3% (bfloat16,
    as the first argument says) of each gradient's largest magnitude."""
    assert len(grads) == len(names)
    low = args[0].dtype == jnp.bfloat16
    for name, g, r, a in zip(names, grads, ref, args[:len(names)], strict=True):
        g32, r32 = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == a.shape and g.dtype == a.dtype, (name, g.shape, g.dtype)
        bad = int(np.sum(~np.isfinite(g32)))
        assert bad == 0, f"{name}: {bad} NaN/Inf values"
        tol = (3e-2 if low else f32_tol) * max(1e-3, float(np.abs(r32).max()))
        np.testing.assert_allclose(g32, r32, atol=tol, rtol=0, err_msg=name)
