"""Is a kernel's forward program unchanged since an earlier revision of its module?

A cache entry records the code fingerprint of the kernel it was tuned on; a change to the
module (here: adding a backward) makes the entries "stale" even where the forward program did
not change. This lowers, for TPU v6e (deviceless), the forward at every shipped cache entry's
shape and config twice: with the module as it is now (the decorated kernel, through its
gradient wrapper, and its bare function) and with the module at REV (loaded from git into a
module of its own), and compares the StableHLO text without debug information (source
locations differ between the two files, in the StableHLO and in the Mosaic kernel's
``debug_locations``). Where every entry's program is byte-identical,
``--restamp`` rewrites those entries' recorded fingerprint to the current one and records in
their provenance what was checked (``fingerprint_restamped``). A parameter the kernel declares
now and the entries lack (a new tuning dimension, e.g. matmul's ``vmem_limit_bytes``) is lowered
at its declared default, and ``--restamp`` adds it to their configs at that default (recorded
as ``filled_defaults``); nothing else changes.

    python benchmarks/profiles/forward_unchanged.py --kernel flash_attention --rev 46edcf0
        [--restamp]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the first entry only; ``--restamp`` writes to the smoke
folder, not ``caches/``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import sys

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

import pallas_tune as pt  # noqa: E402
from pallas_tune.cli.shapes import build_call  # noqa: E402


def _old_module(kernel: str, rev: str):
    """The kernel module at REV, declared with its search-space files at REV too (a space that
    gained a parameter since would not fit the old function)."""
    source = bench.git_show(rev, f"kernels/{kernel}.py")
    tmp = bench.scratch("pt-forward-unchanged-")
    for name in sorted(set(re.findall(r'space="(\w+)"', source))):
        space_path = os.path.join(tmp, f"{name}.toml")
        with open(space_path, "w") as f:
            f.write(bench.git_show(rev, f"search_spaces/{name}.toml"))
        source = source.replace(f'space="{name}"', f"space={space_path!r}")
    path = os.path.join(tmp, f"old_{kernel}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"old_{kernel}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# Mosaic's source locations (file and line of each op, which move when code is moved or
# edited) ride in the kernel's backend_config beside its body: left out of the comparison.
_DEBUG_LOCATIONS = re.compile(r'\\22debug_locations\\22: \\22[^\\]*\\22')


def _lowered(fn, args, kwargs, config) -> str:
    with pt.target("v6e"):
        text = (jax.jit(functools.partial(fn, **kwargs, **config)).trace(*args)
                .lower(lowering_platforms=("tpu",)).as_text(debug_info=False))
    return _DEBUG_LOCATIONS.sub("debug_locations: <dropped>", text)


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
                          root=bench.CACHES)
    data = json.load(open(path))
    same = True
    default = dict(new.space.default or {})
    filled: dict[str, dict] = {}
    if bench.SMOKE:
        data["entries"] = dict(list(data["entries"].items())[:1])
    for key, entry in data["entries"].items():
        args, kwargs = build_call(new, key)
        config = entry["config"]
        added = {n: default[n] for n in new.space.names if n not in config and n in default}
        now = {**config, **added}
        want = _lowered(old.fn, args, kwargs, config)
        bare, wrapped = (_lowered(new.fn, args, kwargs, now), _lowered(new, args, kwargs, now))
        ok = want == bare == wrapped
        same &= ok
        filled[key] = added
        print(f"{'same' if ok else 'DIFFERENT':9s} {key} {config}"
              f"{f' + defaults {added}' if added else ''} ({len(want)} chars)")
    recorded_fps = sorted({str((e.get("provenance") or {}).get("kernel_fingerprint"))
                           for e in data["entries"].values()})
    print(f"fingerprints: the entries record {recorded_fps}, the kernel is now {new.fingerprint}")
    if not same or not a.restamp:
        return 0 if same else 1
    from pallas_tune import _kernel_hash

    entries = {}
    for key, entry in data["entries"].items():
        prov = dict(entry.get("provenance") or {})
        recorded, _ = _kernel_hash.recorded(prov)
        # Defaults filled in by an earlier restamp stay recorded (the trials still lack them).
        earlier = (prov.get("fingerprint_restamped") or {}).get("filled_defaults") or {}
        filled[key] = {**earlier, **filled[key]}
        prov["fingerprint_restamped"] = {
            "from": recorded, "to": new.fingerprint, "rev": a.rev,
            "checked": "forward lowered for TPU v6e (StableHLO, no debug info) byte-identical "
                       f"to the tuned code's at this entry's shape and config: "
                       f"{bench.script(__file__)}"}
        prov[_kernel_hash.FIELD] = new.fingerprint
        config = dict(entry["config"])
        if filled[key]:
            prov["fingerprint_restamped"]["filled_defaults"] = filled[key]
            config.update({n: list(v) if isinstance(v, tuple) else v
                           for n, v in filled[key].items() if n not in config})
        entries[key] = {**entry, "config": config, "provenance": prov}
    from pallas_tune.cache import TuningCache

    root = bench.output(bench.CACHES)
    written = TuningCache(root, use_shipped=False).write_many(
        "tpu_v6e", new.name, entries, kind="estimate")
    print(f"restamped {len(entries)} entries in {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
