"""`pallas-tune feasibility` prints each candidate whole: rows that differ only in a parameter
past the 60th column used to print the same."""

from __future__ import annotations

import re

WIDE = '''
import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

import pallas_tune as pt


@pt.tunable(rows_per_block_of_the_input=[8, 16], columns_per_block_of_the_input=[128, 256],
            pipeline_buffer_depth=[1, 2], semantics=[("parallel", "parallel")])
def wide(x, *, rows_per_block_of_the_input, columns_per_block_of_the_input,
         pipeline_buffer_depth, semantics):
    br, bc = rows_per_block_of_the_input, columns_per_block_of_the_input
    spec = pl.BlockSpec((br, bc), lambda i, j: (i, j),
                        pipeline_mode=pl.Buffered(pipeline_buffer_depth))
    return pl.pallas_call(
        lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=(x.shape[0] // br, x.shape[1] // bc), in_specs=[spec],
        out_specs=pl.BlockSpec((br, bc), lambda i, j: (i, j)),
        compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
    )(x)
'''


def test_feasibility_prints_every_config_whole(tmp_path, capsys, cache_dir):
    from pallas_tune.cli import main

    (tmp_path / "wide_kernels.py").write_text(WIDE)
    assert main(["feasibility", "wide_kernels:wide", "--path", str(tmp_path), "--chip", "v6e",
                 "--shapes", "x=64x512:float32"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if re.search(r"\b(ok|fits|tight|over)\b", ln)
            and "=" in ln]
    assert len(rows) == 8, out
    configs = [ln.split("  ")[1] for ln in rows]  # The config column, as printed.
    assert len(set(configs)) == 8, out  # No two rows look the same.
    for text in configs:  # Every parameter that varies, with its value, on every row.
        for name in ("rows_per_block_of_the_input", "columns_per_block_of_the_input",
                     "pipeline_buffer_depth"):
            assert re.search(rf"\b{name}=\d+\b", text), (name, text)
        assert "semantics" not in text  # One choice: said once, above the table.
    assert "same in every config: semantics=(parallel,parallel)" in out
