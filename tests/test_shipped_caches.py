"""Every cache file shipped in caches/ parses, matches the schema and says how it was made."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import pytest
from conftest import REPO

import pallas_tune as pt
from pallas_tune.cache import kernel_filename, ledger, read_file
from pallas_tune.cache.entries import entry_problem

FILES = sorted(glob.glob(os.path.join(REPO, "caches", "*", "*.json")))


def _history(path, data, key, entry):
    """The trials of an entry: in the ledger beside the file (schema 2) or in it (schema 1)."""
    if data["schema"] == 1:
        return entry["trials"]
    records, bad = ledger.read(os.path.join(os.path.dirname(path), data["ledger"]), key=key)
    assert records and bad == 0, key
    # The latest run's; a rewrite that ran no trials (recheck-xla) keeps the run's evidence.
    return next(r["trials"] for r in reversed(records) if r["trials"])


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(p, REPO) for p in FILES])
def test_shipped_cache_is_valid_and_labelled(path):
    text = open(path, encoding="utf-8").read()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not standard JSON"))
    data = read_file(path)
    assert data["schema"] in (1, 2)
    kind = "estimate" if path.endswith(".estimate.json") else "measured"
    assert data["kind"] == kind and data["chip"] == os.path.basename(os.path.dirname(path))
    assert os.path.basename(path).startswith(kernel_filename(data["kernel"]) + ".")
    for key, entry in data["entries"].items():
        assert entry_problem(entry) is None, key
        prov = entry["provenance"]
        assert prov["kind"] == kind, key
        assert prov["timer"] and prov["versions"]["jax"] and prov["date"]
        if kind == "estimate":
            assert "estimate" in prov["timing_note"].lower()
        # A parameter added to the kernel since the trials ran, filled in at its default where
        # the program was checked unchanged (benchmarks/profiles/forward_unchanged.py --restamp).
        filled = (prov.get("fingerprint_restamped") or {}).get("filled_defaults") or {}
        assert any(t["outcome"] == "ok" and {**t["config"], **filled} == entry["config"]
                   for t in _history(path, data, key, entry))


def _shipped_kernels() -> dict:
    """Every @tunable kernel the package ships, by its cache name (names may be custom)."""
    import importlib
    import pkgutil

    import pallas_tune.kernels as pkg

    found = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        module = importlib.import_module(f"pallas_tune.kernels.{info.name}")
        for obj in vars(module).values():
            if isinstance(obj, pt.TunableKernel):
                found[obj.name] = obj
    return found


@pytest.mark.parametrize("path", FILES, ids=[os.path.relpath(p, REPO) for p in FILES])
def test_shipped_entries_are_valid_configs_of_their_kernels(path):
    """Every shipped entry passes the check the dispatcher applies (names, types, space)."""
    data = read_file(path)
    kernel = _shipped_kernels()[data["kernel"]]
    for key, entry in data["entries"].items():
        assert kernel.entry_problems(entry) == [], key


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
