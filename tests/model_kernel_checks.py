"""Checks shared by the model-kernel tests (HSTU, Mamba-2 SSD, decode adapters)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

import pallas_tune as pt


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
