"""Is a kernel's forward program unchanged since an earlier revision of its module?

A cache entry records the code fingerprint of the kernel it was tuned on; a change to the
module (here: adding a backward) makes the entries "stale" even where the forward program did
not change. This lowers, for TPU v6e (deviceless), the forward at every shipped cache entry's
shape and config twice: with the module as it is now (the decorated kernel, through its
gradient wrapper, and its bare function) and with the module at REV (loaded from git into a
module of its own), and compares the StableHLO text without debug information (source
locations differ between the two files). Where every entry's program is byte-identical,
``--restamp`` rewrites those entries' recorded fingerprint to the current one and records in
their provenance what was checked (``fingerprint_restamped``); nothing else changes.

    python benchmarks/forward_unchanged.py --kernel flash_attention --rev 46edcf0 [--restamp]
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

import jax

import pallas_tune as pt
from pallas_tune.cli.shapes import build_call

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _old_module(kernel: str, rev: str):
    source = subprocess.run(["git", "-C", REPO, "show", f"{rev}:kernels/{kernel}.py"],
                            check=True, capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(), f"old_{kernel}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"old_{kernel}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _lowered(fn, args, kwargs, config) -> str:
    with pt.target("v6e"):
        return (jax.jit(functools.partial(fn, **kwargs, **config)).trace(*args)
                .lower(lowering_platforms=("tpu",)).as_text(debug_info=False))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kernel", required=True, help="module name under kernels/, e.g. matmul")
    p.add_argument("--rev", required=True, help="the git revision the entries were tuned on")
    p.add_argument("--restamp", action="store_true")
    a = p.parse_args()
    jax.config.update("jax_traceback_in_locations_limit", 0)
    new_module = importlib.import_module(f"pallas_tune.kernels.{a.kernel}")
    new = getattr(new_module, a.kernel)
    old = getattr(_old_module(a.kernel, a.rev), a.kernel)
    path = new.cache.path("tpu_v6e", new.name, kind="estimate",
                          root=os.path.join(REPO, "caches"))
    data = json.load(open(path))
    same = True
    for key, entry in data["entries"].items():
        args, kwargs = build_call(new, key)
        config = entry["config"]
        want = _lowered(old.fn, args, kwargs, config)
        bare, wrapped = (_lowered(new.fn, args, kwargs, config),
                         _lowered(new, args, kwargs, config))
        ok = want == bare == wrapped
        same &= ok
        print(f"{'same' if ok else 'DIFFERENT':9s} {key} {config} ({len(want)} chars)")
    print(f"fingerprints: tuned on {old.fingerprint}, now {new.fingerprint}")
    if not same or not a.restamp:
        return 0 if same else 1
    from pallas_tune import _kernel_hash

    entries = {}
    for key, entry in data["entries"].items():
        prov = dict(entry.get("provenance") or {})
        recorded, _ = _kernel_hash.recorded(prov)
        prov["fingerprint_restamped"] = {
            "from": recorded, "to": new.fingerprint, "rev": a.rev,
            "checked": "forward lowered for TPU v6e (StableHLO, no debug info) byte-identical "
                       "to the tuned code's at this entry's shape and config: "
                       "benchmarks/forward_unchanged.py"}
        prov[_kernel_hash.FIELD] = new.fingerprint
        entries[key] = {**entry, "provenance": prov}
    from pallas_tune.cache import TuningCache

    TuningCache(os.path.join(REPO, "caches"), use_shipped=False).write_many(
        "tpu_v6e", new.name, entries, kind="estimate")
    print(f"restamped {len(entries)} entries in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
