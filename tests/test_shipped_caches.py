"""Every cache file shipped in caches/ parses, matches the schema and says how it was made."""

import glob
import os

import jax
import jax.numpy as jnp
import pytest

import pallas_tune as pt
from conftest import REPO
from pallas_tune.cache import read_file

FILES = sorted(glob.glob(os.path.join(REPO, "caches", "*", "*.json")))


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(p, REPO) for p in FILES])
def test_shipped_cache_is_valid_and_labelled(path):
    data = read_file(path)
    kind = "estimate" if path.endswith(".estimate.json") else "measured"
    assert data["kind"] == kind and data["chip"] == os.path.basename(os.path.dirname(path))
    for key, entry in data["entries"].items():
        prov = entry["provenance"]
        assert prov["kind"] == kind, key
        assert prov["timer"] and prov["versions"]["jax"] and prov["date"]
        if kind == "estimate":
            assert "estimate" in prov["timing_note"].lower()
        assert any(t["outcome"] == "ok" and t["config"] == entry["config"]
                   for t in entry["trials"])


def test_shipped_v6e_estimates_serve_lookups(cache_dir):
    if not any(p.endswith("matmul.matmul.estimate.json") for p in FILES):
        pytest.skip("no shipped v6e matmul estimates")
    from pallas_tune.kernels.matmul import matmul

    x = jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16)
    matmul._memo.clear()
    with pt.target("v6e"):
        cfg = matmul.config_for(x, x)
    matmul._memo.clear()
    assert cfg.source == "cache" and cfg.origin.endswith(".estimate.json")
