"""The model shape sets in search_spaces/: loadable, consistent with their kernels, traceable."""

from __future__ import annotations

import os
import re

import pytest

from pallas_tune import cli
from pallas_tune.feasibility import inspect as _inspect
from pallas_tune.space import _spaces_dir, load_space

MODEL_SETS = ["paged_attention", "ragged_paged_attention", "mamba2_ssd", "hstu_attention",
              "llama3_matmul", "mixtral_grouped_matmul", "llama3_flash_attention"]
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
