"""The model shape sets in search_spaces/: loadable, consistent with their kernels, traceable."""

from __future__ import annotations

import os
import re

import pytest

from pallas_tune import cli
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.space import _spaces_dir, load_space

TRAINING_SETS = ["llama3_training_matmul", "mixtral_training_grouped_matmul",
                 "llama3_training_attention"]
MODEL_SETS = ["paged_attention", "ragged_paged_attention", "mamba2_ssd", "hstu_attention",
              "llama3_matmul", "mixtral_grouped_matmul", "llama3_flash_attention",
              *TRAINING_SETS]
SOURCE = re.compile(r"config\.json|vllm|generative-recommenders|tpu-inference", re.I)


@pytest.mark.parametrize("name", MODEL_SETS)
def test_shape_set_fits_its_kernel(name):
    loaded = load_space(name)
    kernel = cli._load_kernel(loaded["kernel"])
    # The sweep tunes the kernel's own space: a file's [params] must not pretend otherwise.
    declared = {p.name: p.choices for p in kernel.space.params}
    for p in loaded["space"].params:
        assert declared[p.name] == p.choices, (name, p.name)
    assert loaded["shapes"], name
    default = dict(kernel.space.default)
    for shape in loaded["shapes"]:
        args, kwargs = cli.build_call(kernel, cli._spec_items(shape))
        calls = _inspect.find_pallas_calls(kernel.fn, args, {**kwargs, **default})
        assert calls, (name, shape)


@pytest.mark.parametrize("name", MODEL_SETS)
def test_shape_sets_name_their_sources(name):
    text = open(os.path.join(_spaces_dir(), f"{name}.toml"), encoding="utf-8").read()
    head = text.split("[[shapes]]")[0]
    comments = [ln for ln in head.splitlines() if ln.lstrip().startswith("#")]
    assert any(SOURCE.search(c) for c in comments), f"{name}.toml names no source for its shapes"


@pytest.mark.parametrize("name", TRAINING_SETS)
def test_training_sets_trace_their_backward_kernel(name):
    """`sweep --space NAME --grad` tunes each shape's backward too: its kernel is a Pallas one,
    and the backward arguments made from each shape (abstractly: no large array is built)
    trace to pallas_calls with the backward's default config."""
    import jax

    from pallas_tune.tuning.grad import backward_call

    loaded = load_space(name)
    kernel = cli._load_kernel(loaded["kernel"])
    assert kernel.backward_backend == "pallas"
    default = dict(kernel.backward.space.default)
    for shape in loaded["shapes"]:
        args, kwargs = cli.build_call(kernel, cli._spec_items(shape))
        bwd_args, bwd_kwargs = backward_call(kernel, args, kwargs, 0)
        assert all(isinstance(a, jax.ShapeDtypeStruct) for a in bwd_args), (name, shape)
        calls = _inspect.find_pallas_calls(kernel.backward.fn, bwd_args,
                                           {**bwd_kwargs, **default})
        assert calls, (name, shape)
