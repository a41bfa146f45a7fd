"""Every shipped kernel lowers for TPU at every shape of its shape sets, for every config of its
space that the block rules allow (the real Mosaic kernel: `tpu_custom_call`)."""

import glob
import os

import jax
import pytest

import pallas_tune as pt
from conftest import REPO
from pallas_tune import cli
from pallas_tune.space import load_space

pytestmark = pytest.mark.slow

CASES = []
for path in sorted(glob.glob(os.path.join(REPO, "search_spaces", "*.toml"))):
    if os.path.basename(path).startswith("gpu_"):
        continue
    loaded = load_space(path)
    for i, shape in enumerate(loaded["shapes"]):
        CASES.append(pytest.param(loaded["kernel"], cli._spec_items(shape),
                                  id=f"{os.path.basename(path)[:-5]}-{i}"))


@pytest.mark.parametrize("kernel_ref,shapes", CASES)
def test_lowers_for_every_rule_abiding_config(kernel_ref, shapes):
    kernel = cli._load_kernel(kernel_ref)
    args, kwargs = cli.build_call(kernel, shapes)
    lowered = 0
    with pt.target("v6e"):
        for config in kernel.space:
            if kernel.violations(config, args, kwargs):
                continue
            text = jax.jit(lambda *a, _c=config: kernel(*a, **kwargs, **_c)).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text, config
            lowered += 1
    assert lowered > 0
