"""Every shipped kernel lowers for TPU at every shape of its shape sets, for every config of its
space that the block rules allow (the real Mosaic kernel: `tpu_custom_call`).

Every config is judged by `violations`; configs that differ only in a parameter that reaches the
compiler's settings and not the Mosaic program (COMPILER_ONLY) are one program and are lowered
once each, the lowered value rotating so that every value is lowered somewhere.
``PALLAS_TUNE_LOWER_ALL=1`` lowers every config."""

import glob
import os

import jax
import pytest

import pallas_tune as pt
from conftest import REPO
from pallas_tune import cli
from pallas_tune.space import load_space

pytestmark = pytest.mark.slow

# Ragged paged attention's VMEM limit: a compiler parameter of the call, the same kernel body.
COMPILER_ONLY = frozenset({"vmem_limit_bytes"})
LOWER_ALL = os.environ.get("PALLAS_TUNE_LOWER_ALL", "") not in ("", "0")

CASES = []
for path in sorted(glob.glob(os.path.join(REPO, "search_spaces", "*.toml"))):
    if os.path.basename(path).startswith("gpu_"):
        continue
    if "_training_" in os.path.basename(path):
        # Training sets: their forward shapes differ from the model sets' above only in the
        # token count; their backward kernels lower in tests/test_kernel_grads.py.
        continue
    loaded = load_space(path)
    for i, shape in enumerate(loaded["shapes"]):
        CASES.append(pytest.param(loaded["kernel"], cli._spec_items(shape),
                                  id=f"{os.path.basename(path)[:-5]}-{i}"))


@pytest.mark.parametrize("kernel_ref,shapes", CASES)
def test_lowers_for_every_rule_abiding_config(kernel_ref, shapes):
    kernel = cli._load_kernel(kernel_ref)
    args, kwargs = cli.build_call(kernel, shapes)
    programs: dict[str, list[dict]] = {}
    with pt.target("v6e"):
        for config in kernel.space:
            if kernel.violations(config, args, kwargs):
                continue
            program = repr([(k, v) for k, v in config.items()
                            if LOWER_ALL or k not in COMPILER_ONLY])
            programs.setdefault(program, []).append(dict(config))
        assert programs
        for i, configs in enumerate(programs.values()):
            config = configs[i % len(configs)]
            text = jax.jit(lambda *a, _c=config: kernel(*a, **kwargs, **_c)).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text, config
