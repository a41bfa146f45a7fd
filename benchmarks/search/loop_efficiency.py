"""What the tuning loop spends: configs asked, distinct programs, programs timed, wall time.

Cases: the shipped matmul (its space of 128, f32) at 512^2 and 2048^2, and the shipped flash
attention (space of 25; q 1x4xSx128, k/v 1x1xSx128, f32, causal) at S=512 and S=1024. Tuners:
- ``before``: pallas-tune at commit b871a4e (the loop before issue 13), run from a checkout
  given by --before (``git worktree add /tmp/loop-before b871a4e``);
- ``after``: this checkout (default: in-process on a CPU host), and ``after, workers``
  (isolate=True: every candidate in a worker process);
- ``tune-jax``: tune-jax 0.8 ``tune`` over the same space (exhaustive; it skips programs it
  finds identical, as we do).
pallas-tune runs use trials=32, seed=0 and the other defaults; every run is a fresh process.
"distinct programs" counts the configs' lowered programs by this checkout's fingerprint
(:mod:`pallas_tune.measure.fingerprint`); "programs timed" counts the candidates whose program
was timed (for ``before``, every measured trial; for tune-jax, what its log says it timed, each
in 5 profiler sessions, after running every candidate once). Winners are re-timed together,
interleaved, in this process.

Runs longer than --cap-min minutes are stopped; their row says so and counts what was logged
until then. Without an accelerator these are CPU wall-clock timings of Pallas interpret mode:
they measure the tuners' overheads and search, not TPU kernel speed.

    python benchmarks/search/loop_efficiency.py --before /tmp/loop-before

Smoke mode (PALLAS_TUNE_BENCH_SMOKE=1): matmul 256^2, 3 trials, this checkout in-process (and
tune-jax where it is installed, over the first two values of each parameter).
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

CASES = {
    "matmul 512^2": ("matmul", 512),
    "matmul 2048^2": ("matmul", 2048),
    "flash attention S=512": ("flash", 512),
    "flash attention S=1024": ("flash", 1024),
}
SMOKE_CASE = "matmul 256^2"
CASES_ALL = {**CASES, SMOKE_CASE: ("matmul", 256)}
TUNERS = ("before", "after", "after-workers", "tune-jax")
TRIALS = bench.smoke(32, 3)


def _smoke_tuners() -> str:
    import importlib.util

    return ",".join(["after"]
                    + (["tune-jax"] if importlib.util.find_spec("tune_jax") else []))


def _problem(case: str):
    import jax
    import jax.numpy as jnp

    kind, n = CASES_ALL[case]
    key = jax.random.key(0)
    if kind == "matmul":
        from pallas_tune.kernels.matmul import matmul

        x = jax.random.normal(key, (n, n), jnp.float32)
        y = jax.random.normal(jax.random.fold_in(key, 1), (n, n), jnp.float32)
        return matmul, (x, y), {}
    from pallas_tune.kernels.flash_attention import flash_attention

    q = jax.random.normal(key, (1, 4, n, 128), jnp.float32)
    k = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, n, 128), jnp.float32)
    v = jax.random.normal(jax.random.fold_in(key, 2), (1, 1, n, 128), jnp.float32)
    return flash_attention, (q, k, v), {"causal": True}


# ---- one run, in a child process -------------------------------------------------------------

def _child(tuner: str, case: str, log_path: str) -> None:
    import pallas_tune

    kernel, args, kwargs = _problem(case)
    log = open(log_path, "a", buffering=1)  # noqa: SIM115 - one JSON line per event.
    log.write(json.dumps({"code": pallas_tune.__file__}) + "\n")
    if tuner == "tune-jax":
        _child_tune_jax(kernel, args, kwargs, log)
        return
    import optuna

    asked = [0]
    ask = optuna.study.Study.ask

    def counting_ask(self, *a, **k):
        asked[0] += 1
        return ask(self, *a, **k)

    optuna.study.Study.ask = counting_ask
    opts = dict(trials=TRIALS, seed=0, write=False)
    if tuner == "before":
        opts["verbose"] = True  # Its per-trial lines are how a stopped run is counted.
    else:
        def record(rec, progress):
            del progress
            log.write(json.dumps({"config": _plain(rec.config), "timed": rec.spent_device_time,
                                  "outcome": rec.outcome.value}) + "\n")

        opts["callbacks"] = [record]
        if tuner == "after-workers":
            opts["isolate"] = True
    t0 = time.perf_counter()
    res = kernel.tune(*args, **kwargs, **opts)
    wall = time.perf_counter() - t0
    if tuner == "before":
        for r in res.records:
            log.write(json.dumps({"config": _plain(r.config), "timed": r.measurement is not None,
                                  "outcome": r.outcome.value}) + "\n")
    asked_n = asked[0] or len(res.records)  # The exhaustive path asks no sampler.
    log.write(json.dumps({"done": True, "wall_s": wall, "asked": asked_n,
                          "winner": _plain(res.best)}) + "\n")


def _child_tune_jax(kernel, args, kwargs, log) -> None:
    import logging

    import jax
    import tune_jax
    from jax._src import config as jax_config

    class Counts(logging.Handler):
        def emit(self, record):
            m = re.search(r"Down to (\d+) distinct programs", record.getMessage())
            if m:
                log.write(json.dumps({"tune_jax_distinct": int(m.group(1))}) + "\n")

    tune_jax.logger.setLevel(logging.DEBUG)
    tune_jax.logger.addHandler(Counts())
    space = {p.name: list(p.choices) for p in kernel.space.params}
    if bench.SMOKE:  # Smoke: the first two values of each parameter (tune-jax tries them all).
        space = {k: v[:2] for k, v in space.items()}
    names = list(space)

    def f(*a, **hp):
        return kernel.fn(*a, **kwargs, **hp)

    jax_config.pallas_tpu_interpret_mode_context_manager.set_global(True)
    t0 = time.perf_counter()
    g = tune_jax.tune(_with_kwonly(f, names), hyperparams=space)
    jax.block_until_ready(g(*args))
    wall = time.perf_counter() - t0
    n = math.prod(len(v) for v in space.values()) if bench.SMOKE else kernel.space.size
    log.write(json.dumps({"done": True, "wall_s": wall, "asked": n, "all_configs": True,
                          "space": space if bench.SMOKE else None,
                          "winner": _plain(dict(g.optimal_hyperparams))}) + "\n")


def _with_kwonly(f, names):
    """A function whose tunable keywords have defaults (tune-jax binds them by name)."""
    src = ", ".join(f"{n}=None" for n in names)
    scope = {"f": f}
    exec(f"def tuned(*a, {src}):\n    return f(*a, {', '.join(f'{n}={n}' for n in names)})",
         scope)
    return scope["tuned"]


def _plain(config):
    return {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()}


# ---- the parent: run, count, tabulate ---------------------------------------------------------

def _run(tuner: str, case: str, before: str | None, cap_s: float, keep: str | None) -> dict:
    """One run in a fresh process; with ``keep``, its result is stored there and reused."""
    saved = os.path.join(keep, re.sub(r"\W+", "_", f"{case}-{tuner}") + ".json") if keep else None
    if saved and os.path.exists(saved):
        with open(saved) as f:
            return json.load(f)
    result = _run_fresh(tuner, case, before, cap_s)
    if saved:
        os.makedirs(keep, exist_ok=True)
        with open(saved, "w") as f:
            json.dump(result, f)
    return result


def _run_fresh(tuner: str, case: str, before: str | None, cap_s: float) -> dict:
    fd, log_path = tempfile.mkstemp(prefix="loop-eff-", suffix=".jsonl")
    os.close(fd)
    env = dict(os.environ)
    if tuner == "before":
        env["PYTHONPATH"] = before or ""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tuner, case, log_path]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=cap_s)
        stopped = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        stopped = True
    lines = [json.loads(line) for line in open(log_path) if line.strip()]
    os.unlink(log_path)
    done = next((e for e in lines if e.get("done")), None)
    configs = [(e["config"], e["timed"]) for e in lines if "config" in e]
    if tuner == "before" and not done:  # Stopped: count its printed trials.
        configs = [(ast.literal_eval(m.group(1)), m.group(2) in ("ok", "mismatch"))
                   for m in re.finditer(r"\]\s+(\{.*\}) -> (\w+)", out)]
    if not done and not stopped:
        print(f"{tuner} on {case} failed:\n{out[-3000:]}", file=sys.stderr)
    code = next((e["code"] for e in lines if "code" in e), "?")
    return {"tuner": tuner, "case": case, "stopped": stopped, "code": code,
            "failed": not done and not stopped,
            "wall_s": done["wall_s"] if done else time.perf_counter() - t0,
            "asked": done["asked"] if done else len(configs), "configs": configs,
            "all_configs": bool(done and done.get("all_configs")),
            "space": done.get("space") if done else None,
            "tune_jax_distinct": next((e["tune_jax_distinct"] for e in lines
                                       if "tune_jax_distinct" in e), None),
            "winner": done["winner"] if done else None}


def _fingerprints(case: str, configs: list[dict]) -> list[str]:
    import jax

    from pallas_tune import chips
    from pallas_tune.measure import fingerprint as fp

    kernel, args, kwargs = _problem(case)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    out = []
    for c in configs:
        c = {k: tuple(v) if isinstance(v, list) else v for k, v in c.items()}
        with chips.interpret_mode():
            out.append(fp.digest(fp.lower(fp.trace(kernel.fn, abstract, {**kwargs, **c}))))
    return out


def _row(r: dict) -> dict:
    kernel, _, _ = _problem(r["case"])
    configs = [c for c, _ in r["configs"]]
    if r["all_configs"] and r.get("space"):  # Smoke: the part of the space tune-jax ran.
        configs = [dict(zip(r["space"], v, strict=True))
                   for v in itertools.product(*r["space"].values())]
    elif r["all_configs"]:
        configs = [dict(c) for c in kernel.space]
    prints = _fingerprints(r["case"], configs)
    timed = (r["tune_jax_distinct"] or len(configs)) if r["tuner"] == "tune-jax" else sum(
        t for _, t in r["configs"])
    return {**r, "evaluated": len(configs), "distinct": len(set(prints)), "timed": timed}


def _retime(case: str, winners: list[dict], rounds: int) -> list[float]:
    from pallas_tune.measure.timing import retime_interleaved

    kernel, args, kwargs = _problem(case)
    configs = [{k: tuple(v) if isinstance(v, list) else v for k, v in w.items()} for w in winners]
    times = retime_interleaved(kernel.fn, args, kwargs, configs, interpret=True, rounds=rounds)
    return [statistics.median(t) for t in times]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", help="a checkout of b871a4e (git worktree add ... b871a4e)")
    p.add_argument("--cases", default=bench.smoke(",".join(CASES), SMOKE_CASE))
    p.add_argument("--tuners", default=bench.smoke(",".join(TUNERS), None))
    p.add_argument("--cap-min", type=float, default=15.0)
    p.add_argument("--keep", help="a folder keeping each run's result, reused when present")
    p.add_argument("--out", default=bench.result("loop_efficiency.txt"))
    a = p.parse_args()
    tuners = [t for t in (a.tuners or _smoke_tuners()).split(",") if t != "before" or a.before]
    rows = []
    print(HEADER)
    for case in a.cases.split(","):
        runs = [_row(_run(t, case, a.before, a.cap_min * 60, a.keep)) for t in tuners]
        winners = []
        for r in runs:
            if r["winner"] and r["winner"] not in winners:
                winners.append(r["winner"])
        rounds = bench.smoke(5 if "2048" in case else 15, 2)
        medians = _retime(case, winners, rounds=rounds) if winners else []
        best = min(medians, default=float("nan"))
        for r in runs:
            ms = medians[winners.index(r["winner"])] if r["winner"] else float("nan")
            rows.append({**r, "winner_ms": ms, "vs_best": ms / best})
            print(_fmt(rows[-1]), flush=True)
    _write(a, rows)


COLUMNS = ("{case:<23} {tuner:<15} {asked:>6} {evaluated:>9} {distinct:>8} {timed:>6} "
           "{wall:>9} {winner_ms:>10.4g} {vs_best:>7.3f}  {winner}")
HEADER = COLUMNS.replace(":>10.4g", ":>10").replace(":>7.3f", ":>7").format(
    case="case", tuner="tuner", asked="asked", evaluated="evaluated", distinct="distinct",
    timed="timed", wall="wall s", winner_ms="winner ms", vs_best="vs best", winner="winner")


def _fmt(r: dict) -> str:
    wall = f">{r['wall_s']:.0f}*" if r["stopped"] else f"{r['wall_s']:.1f}"
    if r.get("failed"):
        wall = "failed"
    winner = r["winner"] or "(stopped: no winner)"
    if isinstance(winner, dict):
        winner = {k: v for k, v in winner.items() if k != "semantics"}
    return COLUMNS.format(**{**r, "wall": wall, "winner": winner})


def _write(a: argparse.Namespace, rows: list[dict]) -> None:
    import jax

    header = [
        f"# $ {bench.command(__file__)}   ({bench.today()})",
        f"# host: {bench.host()}, shared with other engineers' jobs (timings taken under that "
        "load); no accelerator; jax " + jax.__version__ + ".",
        "# CPU interpret-mode wall clock: tuner overhead and search, not TPU kernel speed.",
        "# asked: configs asked of the sampler (or enumerated); evaluated: configs given a "
        "trial; distinct: distinct lowered programs among them; timed: programs timed.",
        "# wall: tuning wall time in s (* = stopped at the cap, counts up to then); winner ms: "
        "the winners re-timed together, interleaved.",
        HEADER,
    ]
    bench.write(a.out, "\n".join(header + [_fmt(r) for r in rows]) + "\n", echo=False)
    print(f"wrote {bench.output(a.out)}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:5])
    else:
        main()
