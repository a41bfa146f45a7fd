"""Every benchmark script runs, at a tiny size, so that none rots unseen (issue 53, item 16).

Each script under ``benchmarks/`` runs in a fresh process in smoke mode
(``PALLAS_TUNE_BENCH_SMOKE=1``: ``benchmarks/_common.py``'s ``smoke()`` sizes, its whole path at
the smallest size that still exercises it, and every write that would go under the repository
sent to a temporary folder); each must exit 0 and print its table (a header or row below, not
only an exit code), and must leave the committed results, landscapes and caches as they were.
A script added without an entry here fails :func:`test_every_script_has_a_smoke_entry`.

Scripts that compile for a TPU need libtpu (``@pytest.mark.libtpu``); those that need a
package outside the test extras (tune-jax, tpu-inference) skip naming it. None reads
``../shared``: the search benchmarks replay ``benchmarks/landscapes`` in smoke mode.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, subprocess_env

BENCHMARKS = os.path.join(REPO, "benchmarks")
# Imported by the scripts, never run: no smoke of their own (they run inside the scripts').
HELPERS = {"_common.py", "search/search_harness.py", "feasibility/feasibility_cases.py",
           "kernels/xla_gradient.py", "profiles/llo_profile.py", "steps/layers.py",
           "steps/render.py", "steps/upstream.py", "steps/sharded_layers.py",
           "steps/collectives.py", "steps/sharded_render.py"}
HELPERS |= {f"estimates/estimate_fidelity_{m}.py" for m in ("space", "qmm", "run", "report",
                                                           "strata", "strata_report",
                                                           "stratified", "complete", "twopoint")}
HELPERS.add("estimates/fallback_public_report.py")
STEP_ROWS = "benchmarks/results/data/step_tuning_2026-11-25/mamba2.512.json"


@dataclasses.dataclass(frozen=True)
class Smoke:
    expect: tuple[str, ...]  # Lines of its table it must print (substrings of the output).
    args: tuple[str, ...] = ()  # "{tmp}" is the test's temporary folder.
    libtpu: bool = False  # Compiles deviceless for a TPU.
    needs: tuple[str, ...] = ()  # Modules outside the test extras; skipped, named, without.
    git: bool = False  # Reads the kernels at a git revision (HEAD).
    note: str = ""  # What the smoke leaves out.


SMOKES = {
    "runtime/dispatch_overhead.py": Smoke(("µs per call", "first lookup in a process")),
    "runtime/cache_scale.py": Smoke(("lookup ms", "     20 after")),
    "runtime/interpret_modes.py": Smoke(("HLO interp ms", "matmul 256^3 f32")),
    "search/search_efficiency.py": Smoke(("| default | 1 |", "Default against the best peer"),
                                         note="GPU landscapes (../shared), KT:* without "
                                              "kernel_tuner, the AM score without its package"),
    "search/surrogate_quality.py": Smoke(("| landscapes/matmul_2048_bf16_v6e_estimate | 128 |",
                                          "n=20: rank")),
    "search/search_settings.py": Smoke(("Leave one kernel out", "| matmul | v")),
    "search/search_noise.py": Smoke(("| landscapes/matmul_2048_bf16_v6e_estimate | 1 |",
                                     "noise-free @10")),
    "search/proposal_time.py": Smoke(("| as found | 0 |", "| one | 1 |")),
    "search/loop_efficiency.py": Smoke(("asked evaluated", "matmul 256^2            after "),
                                       note="'before' (needs an old checkout), "
                                            "'after-workers', tune-jax's whole space"),
    "search/tuning_walltime.py": Smoke(("wall s", "pallas-tune gp, 3 trials"),
                                       needs=("tune_jax",)),
    "sweeps/sweep_overhead.py": Smoke(("memory     sampler wall", "sqlite     reads (trials)"),
                                      note="postgres"),
    "sweeps/sweep_workers.py": Smoke(("configs/min", "      1 "), args=("throughput",),
                                     needs=("pgserver", "psycopg"),
                                     note="`loops` (its scenarios: tests/test_sweep_workers.py)"),
    "sweeps/tpu_log_volume.py": Smoke(("| after (default: bounded, 64 MiB) |",), libtpu=True,
                                      note="the run with PALLAS_TUNE_TPU_LOGS=off"),
    "feasibility/feasibility_accuracy.py": Smoke(("rules: 2/2", "## The uncertain band"),
                                                 libtpu=True, note="the limits part"),
    "estimates/attention_standin.py": Smoke(("| forward | 8/1 | 1024 |", "| backward | 8/1 |"),
                                            libtpu=True),
    "estimates/splash_standin.py": Smoke(("| 512 | 256/256 |", "Splash at MaxText's blocks"),
                                         libtpu=True),
    "estimates/splash_query_cut.py": Smoke(("| forward | (512, 512, 512) |",), libtpu=True,
                                           note="the backward configs"),
    "estimates/splash_grid.py": Smoke(('"kind": "forward"', '"kind": "adapter'), libtpu=True,
                                      args=("512", "2", "1", "{tmp}/grid.json", "maxtext")),
    "estimates/tpu_estimate.py": Smoke(("== matmul_256_bf16", "exhaustive optimum"),
                                       libtpu=True),
    "estimates/model_fidelity.py": Smoke(("| matmul |",)),
    "estimates/rpa_fidelity.py": Smoke(("| 8/1 | 32 | 512 | 128 | (4, 64) |", "| K95 | top 1 |"),
                                       libtpu=True, note="one (heads, page size) group, two "
                                                         "keys, four configs"),
    "estimates/estimate_fidelity.py": Smoke(("keys (stratified, seed 55)",
                                             "[1/1] ", " contenders of ", "two-point: "),
                                            libtpu=True,
                                            needs=("tpu_inference",)),
    "estimates/fallback_public_fit.py": Smoke(("## The constants", "| 7x | 3 |",
                                               "## Validation: the table's other keys",
                                               "The same keys per n_batch band:"),
                                              needs=("tpu_inference",)),
    "estimates/scale_rule_selection.py": Smoke(("| the larger of libtpu's and the calibrated "
                                                "model's (the rule) |", "2 v6e int8 keys"),
                                               needs=("tpu_inference",)),
    "estimates/estimate_correction_fit.py": Smoke(("fitting sample",),
                                                  needs=("tpu_inference",)),
    "estimates/xla_footing.py": Smoke(("## The footing pallas-tune decides on",),
                                      args=("--from-json",
                                            "benchmarks/results/xla_footing.json"),
                                      note="the estimates (need Tokamax's wheel): "
                                           "re-rendered from the committed JSON"),
    "kernels/kernels.py": Smoke(("XLA model", "rms_norm          x=512x4096"), libtpu=True),
    "kernels/model_shapes.py": Smoke(("| matmul | x=1024x1024:bfloat16",), libtpu=True),
    "kernels/training_shapes.py": Smoke(("| matmul | forward |", "| matmul | backward |"),
                                        libtpu=True),
    "kernels/serving_shapes.py": Smoke(("## Weight-quantized matmul", "## MoE grouped matmul")),
    "kernels/grouped_xla.py": Smoke(("| lhs=512x256:bfloat16, rhs=4x256x256:bfloat16",),
                                    libtpu=True),
    "kernels/ragged.py": Smoke(("| matmul | bm=256, bn=256, bk=256, buffering=2 |",),
                               libtpu=True),
    "kernels/collective_matmul.py": Smoke(("bn=128 bk=256 streamed |", "bn=128 bk=256 resident |",
                                           "XLA collective matmul (post_spmd)"), libtpu=True),
    "kernels/gpu_adapters.py": Smoke(("| jax.ops.gpu.softmax | `x=16x256:float32` |",),
                                     args=("--allow-cpu",), note="a GPU (interpret mode)"),
    "profiles/flash_profile.py": Smoke(("working tree    128x128",), libtpu=True,
                                       note="--rev"),
    "profiles/hstu_profile.py": Smoke(("working tree   256    128x128",), libtpu=True),
    "profiles/mamba2_profile.py": Smoke(("working tree   1x256   128x4",), libtpu=True,
                                        note="--errors"),
    "profiles/flash_bwd_profile.py": Smoke(("256x256:fused",), libtpu=True),
    "profiles/flash_numerics.py": Smoke(("working tree   1.0   True  128x128",)),
    "profiles/attention_mxu_floor.py": Smoke(("     qk+pv   256", "  qkT+vTpT   256"),
                                             libtpu=True),
    "profiles/matmul_vmem_probe.py": Smoke(("256x256x256  tiles 256x256x256",), libtpu=True),
    "profiles/dividing_shapes_unchanged.py": Smoke(("2/2 lowerings at dividing shapes",),
                                                   args=("--base", "HEAD"), git=True),
    "profiles/forward_unchanged.py": Smoke(("same      x=", "restamped 1 entries"), git=True,
                                           args=("--kernel", "matmul", "--rev", "HEAD",
                                                 "--restamp")),
    "steps/step_tuning.py": Smoke(("| matmul |",), args=("--combine", STEP_ROWS),
                                  note="tuning a layer (minutes): its rows re-rendered"),
    "steps/attention_long.py": Smoke(("XLA reference, forward + VJP",), libtpu=True),
    "steps/sharded_step.py": Smoke(("| tiny (smoke) | TP8", "all-reduce x"), libtpu=True,
                                   note="a tiny layer at 256 tokens, all-XLA and tuned; no "
                                        "upstream (splash's stand-in), no per-chip compile"),
    "steps/glue_footing.py": Smoke(("Llama-3.1-8B step glue, 128 tokens",), libtpu=True,
                                   args=("128", "unprofiled")),
}


def _scripts() -> set[str]:
    out = set()
    for root, _, files in os.walk(BENCHMARKS):
        for f in files:
            if f.endswith(".py"):
                out.add(os.path.relpath(os.path.join(root, f), BENCHMARKS).replace(os.sep, "/"))
    return out


def test_every_script_has_a_smoke_entry():
    scripts = _scripts()
    missing = sorted(scripts - set(SMOKES) - HELPERS)
    assert not missing, (
        f"benchmark script(s) {missing} have no smoke entry: add one to SMOKES in "
        "tests/test_benchmarks_smoke.py (its smallest real path under "
        "PALLAS_TUNE_BENCH_SMOKE=1, and a line of its table), or to HELPERS if it is imported, "
        "never run")
    gone = sorted((set(SMOKES) | HELPERS) - scripts)
    assert not gone, f"entries for scripts that no longer exist: {gone}"
    runnable = sorted(h for h in HELPERS
                      if "__main__" in open(os.path.join(BENCHMARKS, h), encoding="utf-8").read())
    assert not runnable, f"helper modules {runnable} are run as scripts: give them smoke entries"


def _committed() -> dict[str, tuple[int, int]]:
    """What a smoke run must not touch: every file of the committed results, landscapes and
    caches, by modification time and size."""
    seen = {}
    for top in ("benchmarks/results", "benchmarks/landscapes", "caches"):
        for root, _, files in os.walk(os.path.join(REPO, top)):
            for f in files:
                st = os.stat(os.path.join(root, f))
                seen[os.path.join(root, f)] = (st.st_mtime_ns, st.st_size)
    return seen


def _marks(name: str, smoke: Smoke) -> list:
    marks = [pytest.mark.libtpu] if smoke.libtpu else []
    missing = [m for m in smoke.needs if importlib.util.find_spec(m) is None]
    if missing:
        marks.append(pytest.mark.skip(reason=f"{name} needs {', '.join(missing)} (not in the "
                                             "test extras: pip install 'pallas-tune[bench]', "
                                             "or as its docstring says)"))
    return marks


def _git_head() -> bool:
    r = subprocess.run(["git", "-C", REPO, "rev-parse", "--verify", "HEAD"],
                       capture_output=True, check=False)
    return r.returncode == 0


@pytest.mark.parametrize("name", [pytest.param(n, marks=_marks(n, s), id=n)
                                  for n, s in SMOKES.items()])
def test_smoke(name, tmp_path):
    smoke = SMOKES[name]
    if smoke.git and not _git_head():
        pytest.skip(f"{name} reads kernels/ at a git revision: this is not a git checkout")
    args = [a.replace("{tmp}", str(tmp_path)) for a in smoke.args]
    env = subprocess_env(PALLAS_TUNE_BENCH_SMOKE=1,
                         PALLAS_TUNE_BENCH_SMOKE_DIR=tmp_path / "smoke",
                         PALLAS_TUNE_CACHE_DIR=tmp_path / "cache")
    before = _committed()
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, os.path.join(BENCHMARKS, name), *args], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600, check=False)
    seconds = time.perf_counter() - t0
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"{name} exited {r.returncode} after {seconds:.0f} s:\n{out[-4000:]}"
    for line in smoke.expect:
        assert line in out, f"{name} did not print {line!r}:\n{out[-4000:]}"
    changed = sorted(p for p, v in _committed().items() if before.get(p) != v)
    assert not changed, f"{name} wrote committed files in smoke mode: {changed}"
