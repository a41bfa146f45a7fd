"""Every shipped kernel lowers for TPU at every shape of its shape sets, for every config of its
space that the block rules allow (the real Mosaic kernel: `tpu_custom_call`).

Every config is judged by `violations`; configs that differ only in a parameter that reaches the
compiler's settings and not the Mosaic program (COMPILER_ONLY) are one program and are lowered
once each, the lowered value rotating so that every value is lowered somewhere.

Under the ``ci`` profile (CI's default, ``HYPOTHESIS_PROFILE``) each shape judges a fixed sample
of at most SAMPLE configs of its space (seeded; judging every config traced each one and took a
fifth of CI's time) and lowers a covering set of the programs that pass: every value of every
parameter among them in at least one lowered program, with the largest and the smallest
blocks. ``HYPOTHESIS_PROFILE=long`` lowers every program, and
``PALLAS_TUNE_LOWER_ALL=1`` every config."""

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
COVER = not LOWER_ALL and os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"
SAMPLE = 120  # Configs judged per shape under the ci profile.


def covering(configs: list[dict]) -> list[dict]:
    """A subset of ``configs`` in which every (parameter, value) the set holds appears, with
    the configs of the largest and the smallest product of integer values (the biggest and the
    smallest blocks), chosen greedily in the given order (deterministic)."""
    def size(c):
        out = 1
        for v in c.values():
            out *= v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 1
        return out

    chosen = [max(configs, key=size), min(configs, key=size)]
    seen = {(k, repr(v)) for c in chosen for k, v in c.items()}
    for c in configs:
        new = {(k, repr(v)) for k, v in c.items()} - seen
        if new:
            chosen.append(c)
            seen |= new
    out = []
    for c in chosen:
        if c not in out:
            out.append(c)
    return out

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
    space = list(kernel.space)
    if COVER and len(space) > SAMPLE:
        import random

        space = random.Random(f"{kernel_ref}:{shapes}").sample(space, SAMPLE)
    with pt.target("v6e"):
        for config in space:
            if kernel.violations(config, args, kwargs):
                continue
            program = repr([(k, v) for k, v in config.items()
                            if LOWER_ALL or k not in COMPILER_ONLY])
            programs.setdefault(program, []).append(dict(config))
        assert programs
        picked = [configs[i % len(configs)] for i, configs in enumerate(programs.values())]
        if COVER:
            picked = covering(picked)
        for config in picked:
            text = jax.jit(lambda *a, _c=config: kernel(*a, **kwargs, **_c)).trace(*args).lower(
                lowering_platforms=("tpu",)).as_text()
            assert "tpu_custom_call" in text, config


def test_the_covering_set_holds_every_value_and_both_extremes():
    configs = [{"a": a, "b": b, "c": c} for a in (128, 256, 512) for b in (1, 2) for c in ("x", "y")]
    got = covering(configs)
    assert {(k, v) for c in got for k, v in c.items()} == {
        (k, v) for c in configs for k, v in c.items()}
    assert {"a": 512, "b": 2, "c": "x"} in got and {"a": 128, "b": 1, "c": "x"} in got
    assert len(got) < len(configs)
