"""Shows that the ragged-shape fixes leave the program at dividing shapes untouched.

Lowers every shipped kernel (and the upstream adapters) for TPU v6e from a CPU host
(``lowering_platforms=("tpu",)`` under ``pallas_tune.target("v6e")``) twice: with the kernel
files of a base commit (default: the merge-base with ``main``) and with the working tree's. At
shapes every tile divides the two lowered modules must be identical, Mosaic kernel body
included; source locations (file and line numbers, which move when code is edited) are left
out: the modules are lowered with no traceback locations and printed without debug information
(as ``forward_unchanged.py`` does; with JAX 0.10 the locations sit in the Mosaic body itself),
and a ``debug_locations`` field, where one is printed, is dropped. At ragged shapes they
differ (the tail masks), which shows the comparison can fail.

    python benchmarks/profiles/dividing_shapes_unchanged.py [--base REF]

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): the matmul's cases, one config each.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

# (kernel module, kernel name, args as (shape, dtype), static kwargs, configs, divides).
_MM = dict(buffering=2, semantics=("parallel", "parallel", "arbitrary"))
CASES = [
    ("matmul", "matmul", [((1024, 1024), "bfloat16"), ((1024, 1024), "bfloat16")], {},
     [dict(bm=256, bn=256, bk=256, **_MM), dict(bm=1024, bn=512, bk=1024, **_MM),
      dict(bm=128, bn=1024, bk=512, buffering=1, semantics=_MM["semantics"])], True),
    ("matmul", "matmul", [((512, 2048), "float32"), ((2048, 256), "float32")], {},
     [dict(bm=512, bn=256, bk=512, **_MM)], True),
    ("flash_attention", "flash_attention",
     [((1, 32, 2048, 128), "bfloat16"), ((1, 8, 2048, 128), "bfloat16"),
      ((1, 8, 2048, 128), "bfloat16")], {"causal": True},
     [dict(bq=512, bkv=512), dict(bq=256, bkv=1024), dict(bq=2048, bkv=2048)], True),
    ("flash_attention", "flash_attention",
     [((2, 4, 1024, 64), "float32"), ((2, 4, 1024, 64), "float32"),
      ((2, 4, 1024, 64), "float32")], {"causal": False},
     [dict(bq=128, bkv=256), dict(bq=1024, bkv=512)], True),
    ("grouped_matmul", "grouped_matmul",
     [((2048, 1024), "bfloat16"), ((8, 1024, 2048), "bfloat16"), ((8,), "int32")], {},
     [dict(tm=128, tk=128, tn=128), dict(tm=512, tk=1024, tn=1024)], True),
    ("linear_attention", "linear_attention",
     [((1, 16, 2048, 128), "bfloat16")] * 3, {"decay": 0.96875},
     [dict(chunk=64), dict(chunk=256), dict(chunk=1024)], True),
    ("rms_norm", "rms_norm", [((8192, 4096), "bfloat16"), ((4096,), "bfloat16")], {},
     [dict(block_rows=8), dict(block_rows=256)], True),
    ("upstream", "flash_attention", [((1, 8, 2048, 128), "bfloat16")] * 3, {"causal": True},
     [dict(block_q=128, block_k_major=512, block_k=256)], True),
    ("upstream", "splash_attention", [((1, 8, 2048, 128), "bfloat16")] * 3, {"causal": True},
     [dict(block_q=256, block_kv=512, block_kv_compute=256)], True),
    ("upstream", "megablox_gmm",
     [((2048, 1024), "bfloat16"), ((8, 1024, 2048), "bfloat16"), ((8,), "int32")], {},
     [dict(tm=128, tk=256, tn=512)], True),
    # Ragged: the fixed kernels must differ here (tail masks); the base may fail to lower.
    ("matmul", "matmul", [((1000, 1000), "bfloat16"), ((1000, 1000), "bfloat16")], {},
     [dict(bm=256, bn=256, bk=256, **_MM)], False),
    ("flash_attention", "flash_attention", [((1, 8, 1000, 128), "bfloat16")] * 3,
     {"causal": True}, [dict(bq=256, bkv=256)], False),
    ("linear_attention", "linear_attention", [((1, 4, 1000, 128), "bfloat16")] * 3,
     {"decay": 0.96875}, [dict(chunk=128)], False),
    ("grouped_matmul", "grouped_matmul",
     [((1000, 1000), "bfloat16"), ((4, 1000, 1000), "bfloat16"), ((4,), "int32")], {},
     [dict(tm=128, tk=256, tn=256)], False),
]

if bench.SMOKE:
    CASES = [(m, n, args, kw, configs[:1], div) for m, n, args, kw, configs, div in CASES
             if m == "matmul"]

# Runs in a fresh process per side: imports the kernel modules from KERNELS_DIR and lowers CASES.
_CHILD = r"""
import json, os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
jax.config.update("jax_traceback_in_locations_limit", 0)
import pallas_tune as pt
import pallas_tune.kernels as K
K.__path__[:] = [os.environ["KERNELS_DIR"]]
import importlib
cases = json.loads(sys.stdin.read())
out = []
for i, (module, name, args, kwargs, config) in enumerate(cases):
    mod = importlib.import_module("pallas_tune.kernels." + module)
    assert os.path.dirname(mod.__file__) == os.environ["KERNELS_DIR"], mod.__file__
    kernel = getattr(mod, name)
    specs = [jax.ShapeDtypeStruct(tuple(s), d) for s, d in args]
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    try:
        with pt.target("v6e"):
            text = jax.jit(lambda *a: kernel(*a, **kwargs, **cfg)).trace(*specs).lower(
                lowering_platforms=("tpu",)).as_text(debug_info=False)
        out.append({"ok": True, "text": text})
    except Exception as e:
        out.append({"ok": False, "text": f"{type(e).__name__}: {str(e)[:300]}"})
print(json.dumps(out))
"""

_DEBUG_LOCATIONS = re.compile(r'\\22debug_locations\\22: \\22[^\\]*\\22')


def _lower_all(kernels_dir: str, jobs: list) -> list:
    return bench.run_json([sys.executable, "-c", _CHILD], input=json.dumps(jobs),
                          env={"KERNELS_DIR": kernels_dir, "JAX_PLATFORMS": "cpu"})


def _normalise(text: str) -> str:
    return _DEBUG_LOCATIONS.sub("debug_locations: <dropped>", text)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", default=None, help="git ref of the base (default: merge-base "
                   "of HEAD and main)")
    a = p.parse_args()
    base = a.base or bench.git("merge-base", "HEAD", "main")
    base_sha = bench.git("rev-parse", base)
    head_sha = bench.git("rev-parse", "HEAD")
    dirty = bool(bench.git("status", "--porcelain", "kernels"))
    jobs, labels = [], []
    for module, name, args, kwargs, configs, divides in CASES:
        for config in configs:
            jobs.append((module, name, args, kwargs, config))
            shapes = ",".join("x".join(map(str, s)) + ":" + d for s, d in args)
            labels.append((f"{module}.{name}" if module != name else name, shapes,
                           kwargs, config, divides))
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = os.path.join(tmp, "kernels")
        os.makedirs(base_dir)
        archive = subprocess.run(["git", "archive", base_sha, "kernels"], cwd=bench.REPO,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        before = _lower_all(base_dir, jobs)
    after = _lower_all(os.path.join(bench.REPO, "kernels"), jobs)

    print(f"# $ {bench.command(__file__, ['--base', base])}   ({bench.today()}, "
          f"{bench.versions('jax')})")
    print(f"# base {base_sha[:10]} (kernels/ as committed there) vs head {head_sha[:10]}"
          f"{' + uncommitted kernels/ changes' if dirty else ''}; lowered for TPU v6e "
          "(lowering_platforms=('tpu',)); compared as text with debug_locations dropped.")
    n_same = n_div = 0
    bad = []
    for (kernel, shapes, kwargs, config, divides), b, h in zip(labels, before, after):
        same = b["ok"] and h["ok"] and _normalise(b["text"]) == _normalise(h["text"])
        digest = hashlib.sha256(_normalise(h["text"]).encode()).hexdigest()[:12]
        if divides:
            n_div += 1
            n_same += same
            verdict = "identical" if same else "DIFFERENT"
            if not same:
                bad.append(kernel)
        else:
            verdict = ("differs (tail mask)" if not same else "IDENTICAL (mask missing?)")
            if not b["ok"]:
                verdict += f"; base failed to lower: {b['text'][:80]}"
            if not h["ok"]:
                verdict = f"HEAD FAILED TO LOWER: {h['text'][:200]}"
                bad.append(kernel)
        kw = ",".join(f"{k}={v}" for k, v in kwargs.items())
        cfg = ",".join(f"{k}={v}" for k, v in config.items() if k not in ("semantics",))
        print(f"{'divides' if divides else 'ragged ':7s} {kernel:33s} {shapes} {kw} [{cfg}]"
              f"  sha256 {digest}  {verdict}")
    n_loc = sum(bool(_DEBUG_LOCATIONS.search(h["text"])) for h in after if h["ok"])
    print(f"\n{n_same}/{n_div} lowerings at dividing shapes identical to the base (the Mosaic "
          f"kernel body is in the text, as serialized bytecode); debug_locations found and "
          f"dropped in {n_loc}/{sum(h['ok'] for h in after)} head lowerings.")
    if bad:
        sys.exit(f"unexpected: {bad}")


if __name__ == "__main__":
    main()
