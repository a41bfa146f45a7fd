"""estimate_fidelity's default run (issue 55): the stratified sample of
:mod:`estimate_fidelity_strata`, run key by key with the JSON dump and the Markdown report
rewritten after every key, so that a run stopped at any point leaves a report of the keys done
(it says how many of how many planned)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import estimate_fidelity_strata as st  # noqa: E402
from estimate_fidelity_qmm import (  # noqa: E402
    TPU_INFERENCE_DIR, model_figures, tpu_inference_version)
from estimate_fidelity_space import TABLE_FILE, Key, parse_table  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "estimate_fidelity.py")
RESULTS = bench.result("estimate_fidelity.md")
DUMP = bench.result("data", "estimate_fidelity_strata.json")
SEED = 55
PER_STRATUM = {"v6e": 2, "7x": 1}  # 15 v6e strata x 2 + 12 v7 strata x 1 = 42 keys.


def tables(root: str) -> dict[str, dict[Key, Any]]:
    with open(os.path.join(root, TABLE_FILE), encoding="utf-8") as f:
        raw = parse_table(f.read())
    return {chip: st.chip_table(raw, chip) for chip in st.CHIPS}


def plan(tabs: Mapping[str, Mapping[Key, Any]], per_stratum: Mapping[str, int], seed: int,
         keys: int | None) -> list[st.Entry]:
    entries = st.draw(tabs, per_stratum, seed)
    return entries if keys is None else entries[:keys]


def metadata(argv: Sequence[str] | None, a: argparse.Namespace,
             planned: Sequence[st.Entry]) -> dict[str, Any]:
    import jax

    command = bench.command(SCRIPT, argv, env="PALLAS_TUNE_TPU_LOGS=off")
    return {"command": command, "complete_command": command,
            "date": bench.today(), "host": bench.host(), "workers": a.workers,
            "seed": a.seed, "rivals": a.rivals, "per_stratum": dict(PER_STRATUM),
            "versions": {"libtpu": bench.version("libtpu"), "jax": jax.__version__,
                         "jaxlib": bench.version("jaxlib"),
                         "tpu-inference": tpu_inference_version(),
                         "pallas-tune": bench.version("pallas-tune"),
                         "python": platform.python_version()},
            "caps": {"mac_cap": st.MAC_CAP, "step_cap": st.STEP_CAP,
                     "min_steps": st.MIN_STEPS, "check_cap_s": st.CHECK_CAP_S},
            "planned": [{"chip": e.chip, "key": list(e.key), "winner": list(e.winner),
                         "stratum": e.stratum} for e in planned]}


def save(path: str, meta: Mapping[str, Any], runs: Sequence[Mapping[str, Any]]) -> None:
    path = bench.output(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".part"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"meta": dict(meta), "runs": list(runs)}, f, separators=(",", ":"))
    os.replace(tmp, path)


def render(path: str, data: Mapping[str, Any]) -> None:
    from estimate_fidelity_strata_report import report

    bench.write(path, report(data), echo=False)


def retrace_models(runs: Sequence[dict[str, Any]], tabs: Mapping[str, Mapping[Key, Any]],
                   meta: Mapping[str, Any], *, all_runs: bool) -> int:
    """The model figures (roofline, fitted, public; ms) of every drawn config, and of the whole
    space where the run has it, traced again (never compiled) with the models as they are
    now: in every run (``all_runs``, ``--retrace-models``) or in runs made before the public
    fit (no ``public_ms``); how many runs were traced. The contenders the new figures admit
    are compiled by ``--two-point``."""
    done = 0
    for r in runs:
        if not all_runs and "public_ms" in r:
            continue
        _, dtypes, spec_name = st.CHIPS[r["chip"]]
        entry = st.Entry(r["chip"], tuple(r["key"]), tuple(r["winner"]), r["stratum"])
        blocks, _ = st.drawn_space(entry, tabs[r["chip"]], meta["rivals"], meta["seed"])
        parts = [(r, blocks)]
        if r.get("whole"):  # The key's whole space too, where the run ranked it.
            parts.append((r["whole"], st.strata_space(entry.key, tabs[r["chip"]])[0]))
        for part, space in parts:
            figs = model_figures(entry.key, space, spec_name, dtypes[1])
            for name, f in zip(("roofline_ms", "fitted_ms", "public_ms"), figs, strict=True):
                part[name] = st.rows(f, 1e3)
        done += 1
    return done


def done_before(path: str, seed: int, rivals: int) -> list[dict[str, Any]]:
    """``--resume``: the runs a dump of the same seed and rivals holds (none if it is absent)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if (data["meta"].get("seed"), data["meta"].get("rivals")) != (seed, rivals):
        raise SystemExit(f"--resume: {path} was run with another --seed or --rivals "
                         f"({data['meta'].get('seed')}, {data['meta'].get('rivals')}); give "
                         "the same, or another --dump")
    return data["runs"]


def run(entries: Sequence[st.Entry], tabs: Mapping[str, Mapping[Key, Any]],
        meta: dict[str, Any], a: argparse.Namespace) -> list[dict[str, Any]]:
    """Every entry's run, in order (``--resume``: after those the dump holds), completed over
    its whole space (:mod:`estimate_fidelity_complete`); the dump and the report rewritten
    after each."""
    import estimate_fidelity_complete as ec
    import estimate_fidelity_twopoint as tp
    from pallas_tune.measure.estimate import Estimator

    runs: list[dict[str, Any]] = done_before(a.dump, a.seed, a.rivals) if a.resume else []
    done = {(r["chip"], tuple(r["key"])) for r in runs}
    entries = [e for e in entries if (e.chip, e.key) not in done]
    meta["total_s_before"] = sum(r["wall_s"] for r in runs)
    t0 = time.perf_counter()
    limit = int(a.memory_gb * 2**30)
    with (Estimator(a.workers, timeout_s=a.timeout_s, memory_limit_bytes=limit) as est,
          Estimator(1, timeout_s=a.timeout_s, memory_limit_bytes=limit, profile=False) as plain):
        for r in runs:  # Resumed from a dump made before runs were completed as they went.
            if "whole" not in r:
                r["whole"] = ec.complete_run(est, plain, r, tabs[r["chip"]])
        for i, e in enumerate(entries, 1):
            r = st.run_entry(est, e, tabs[e.chip], a.rivals, a.seed, plain)
            r["whole"] = ec.complete_run(est, plain, r, tabs[e.chip])
            tp.refine_run(est, plain, r)
            runs.append(r)
            meta["total_s"] = meta["total_s_before"] + time.perf_counter() - t0
            if a.dump:
                save(a.dump, meta, runs)
            try:  # The dump is what counts; a report is re-rendered from it (--from-dump).
                render(a.out, {"meta": meta, "runs": runs})
            except Exception as exc:  # noqa: BLE001
                print(f"report not rendered: {exc!r}", file=sys.stderr, flush=True)
            print(f"[{i}/{len(entries)}] {e.chip} {e.key} ({e.stratum}) winner {e.winner}: "
                  f"{len(r['proxy_ms'])}/{r['configs']} estimated, failures {r['failures']}, "
                  f"winner {r['winner_kind'][:60]}; stand-in {r['standin_check']}; "
                  f"{len(r['whole']['contenders'])} contenders of {r['space']}; two-point: "
                  f"{len(r['two_point']['records'])} cut, {len(tp.checks(r))} "
                  f"compiled in full; {r['wall_s']:.0f} s", flush=True)
    return runs


def over_dump(a: argparse.Namespace, flag: str, todo_of: Any, step: Any) -> int:
    """``step(est, plain, run, meta)`` (a line to print) on each run of ``--dump`` that
    ``todo_of`` picks, the dump and the report rewritten after each key."""
    from pallas_tune.measure.estimate import Estimator

    if not a.dump or not os.path.exists(a.dump):
        raise SystemExit(f"{flag} works on the runs of --dump; {a.dump!r} is no dump")
    with open(a.dump, encoding="utf-8") as f:
        data = json.load(f)
    todo = [r for r in data["runs"] if todo_of(r)]
    if bench.SMOKE:
        todo = todo[:1]
    print(f"{len(todo)} of {len(data['runs'])} keys to do ({flag})", flush=True)
    limit = int(a.memory_gb * 2**30)
    with (Estimator(a.workers, timeout_s=a.timeout_s, memory_limit_bytes=limit) as est,
          Estimator(1, timeout_s=a.timeout_s, memory_limit_bytes=limit, profile=False) as plain):
        for i, r in enumerate(todo, 1):
            line = step(est, plain, r, data["meta"])
            save(a.dump, data["meta"], data["runs"])
            render(a.out, data)
            print(f"[{i}/{len(todo)}] {r['chip']} {tuple(r['key'])}: {line}", flush=True)
    return 0


def complete(tabs: Mapping[str, Mapping[Key, Any]], a: argparse.Namespace,
             argv: Sequence[str] | None) -> int:
    """``--complete``: every run of ``--dump`` without whole-space figures gets them
    (:mod:`estimate_fidelity_complete`: the models over the whole space, libtpu's figure of
    the contenders)."""
    import estimate_fidelity_complete as ec

    def step(est: Any, plain: Any, r: dict[str, Any], meta: dict[str, Any]) -> str:
        r["whole"] = w = ec.complete_run(est, plain, r, tabs[r["chip"]])
        meta["complete_command"] = bench.command(SCRIPT, argv, env="PALLAS_TUNE_TPU_LOGS=off")
        meta["complete_s"] = meta.get("complete_s", 0.0) + w["wall_s"]
        return (f"{len(w['contenders'])} contenders of {w['space']}, {len(w['proxy_ms'])} "
                f"estimated, failures {w['failures']}; {w['wall_s']:.0f} s")

    return over_dump(a, "--complete", lambda r: "whole" not in r, step)


def stale(run: Mapping[str, Any]) -> bool:
    """Whether the run's whole-space contenders miss some its figures now admit (the models
    retraced since: ``--retrace-models``)."""
    import estimate_fidelity_twopoint as tp

    return bool(run.get("whole")) and bool(tp.missing_contenders(run))


def two_point(a: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``--two-point``: every completed run of ``--dump`` not yet refined (or whose contenders
    are stale) gets full and two-point figures (:mod:`estimate_fidelity_twopoint`)."""
    import estimate_fidelity_twopoint as tp

    def step(est: Any, plain: Any, r: dict[str, Any], meta: dict[str, Any]) -> str:
        before = r.get("two_point", {}).get("wall_s", 0.0)
        tp.refine_run(est, plain, r)
        t = r["two_point"]
        meta["two_point_command"] = bench.command(SCRIPT, argv, env="PALLAS_TUNE_TPU_LOGS=off")
        meta["two_point_run"] = f"{bench.today()}, {bench.versions('libtpu', 'jax')}"
        meta["two_point_s"] = meta.get("two_point_s", 0.0) + t["wall_s"] - before
        return (f"{len(t['records'])} cut, {len(tp.checks(r))} compiled in full, "
                f"{len(t.get('added_contenders', []))} contenders added; {t['wall_s']:.0f} s")

    return over_dump(a, "--two-point",
                     lambda r: not tp.refined(r) or stale(r), step)


def main(argv: Sequence[str] | None, parser: argparse.ArgumentParser) -> int:
    """The stratified run's options (added to ``parser``), then the run or a re-render."""
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--keys", type=int, default=bench.smoke(None, 1),
                        help="run only the first N keys of the plan (default: all 42)")
    parser.add_argument("--rivals", type=int, default=bench.smoke(st.RIVALS, 3),
                        help=f"configs drawn per key beside the winner (default {st.RIVALS})")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="a compile worker past this much memory is stopped")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--dump", default=DUMP, help="'' for none")
    parser.add_argument("--from-dump", metavar="JSON", help="re-render a dump; compile nothing")
    parser.add_argument("--retrace-models", action="store_true",
                        help="with --from-dump: trace every drawn config again for the model "
                             "figures as the models are now (kept in the dump)")
    parser.add_argument("--complete", action="store_true",
                        help="rank over each key's whole space: trace the models there and "
                             "compile the configs a tune's figure could put ahead of the "
                             "winner (kept in --dump's runs; see estimate_fidelity_complete)")
    parser.add_argument("--two-point", action="store_true",
                        help="libtpu's figures of cut configs extrapolated from two stand-ins "
                             "(kept in --dump's runs; see estimate_fidelity_twopoint)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--resume", action="store_true",
                        help="keep the keys --dump holds (same --seed and --rivals), run the rest")
    a = parser.parse_args(argv)
    if TPU_INFERENCE_DIR is None:
        print("tpu-inference is not installed: pip install --no-deps tpu-inference==0.32.0 "
              "(its vLLM dependency is not needed). Nothing to compare against.",
              file=sys.stderr)
        return 2
    if a.from_dump:
        with open(a.from_dump, encoding="utf-8") as f:
            data = json.load(f)
        tabs = tables(TPU_INFERENCE_DIR)
        if retrace_models(data["runs"], tabs, data["meta"], all_runs=a.retrace_models):
            save(a.from_dump, data["meta"], data["runs"])  # Traced only: kept in the dump.
        render(a.out, data)
        return 0
    tabs = tables(TPU_INFERENCE_DIR)
    if a.complete:
        return complete(tabs, a, argv) if bench.have_libtpu(stream=sys.stderr) else 2
    if a.two_point:
        return two_point(a, argv) if bench.have_libtpu(stream=sys.stderr) else 2
    entries = plan(tabs, PER_STRATUM, a.seed, None if bench.SMOKE else a.keys)
    if bench.SMOKE:  # The cheapest keys only.
        entries = sorted(entries, key=lambda e: st.predicted_cost_s(
            e, tabs[e.chip], a.rivals, a.seed))[:a.keys]
    cost = sum(st.predicted_cost_s(e, tabs[e.chip], a.rivals, a.seed) for e in entries)
    print(f"{len(entries)} keys (stratified, seed {a.seed}), predicted {cost:.0f} CPU s:")
    for e in entries:
        blocks, n = st.drawn_space(e, tabs[e.chip], a.rivals, a.seed)
        print(f"  {e.chip} {e.key} {e.stratum}: winner {e.winner}, {len(blocks)} of {n} "
              f"configs, predicted {st.predicted_cost_s(e, tabs[e.chip], a.rivals, a.seed):.0f}"
              " s")
    if a.dry_run:
        return 0
    if not bench.have_libtpu(stream=sys.stderr):
        return 2
    run(entries, tabs, metadata(argv, a, entries), a)
    return 0
