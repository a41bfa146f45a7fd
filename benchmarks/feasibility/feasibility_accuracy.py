"""How well do the block rules and the VMEM model agree with the real TPU compiler? (needs libtpu)

Every verdict here is checked against a deviceless libtpu compile (the real Pallas lowering,
Mosaic and XLA:TPU compiler, no TPU attached). Three parts:

``rules``: the block rules on ragged shapes (array dims no tile divides), f32/bf16/int8, rank 1
  to 3, squeezed dims, pl.Buffered(3), grids past the array, the shipped matmul and RMS norm on
  ragged problems, on v5e, v6e and 7x. Agreement of ``block_rule_violations(calls, spec=chip)``
  with the compiler, and of the two-stage filter (model verdict; "uncertain" compiled).
``calibration``: the VMEM model on the kernels it was built from (pallas-tune's matmul, flash
  attention, RMS norm): each candidate is compiled at the default limit (the truth) and, where
  that runs out, again with the scoped limit raised, so that every candidate reports the VMEM it
  needs. The model's error near the limit gives the "uncertain" band (model.BAND_*).
``heldout``: the same on kernels the model was not built from: JAX's own
  ``jax.experimental.pallas.ops.tpu.matmul`` and ``...ops.tpu.flash_attention``.
``limits``: the model at declared scoped limits: matmul tiles to 2048 compiled with no
  ``vmem_limit_bytes`` (v6e's default 32 MiB), 64 MiB and 100 MiB in the call's compiler params
  (the shipped matmul's ``vmem_limit_bytes``; JAX's ops.tpu matmul, not fitted on, with the limit
  added to its ``pltpu.CompilerParams``) on v6e, and at 100 MiB on 7x (64 MiB physical: capped).
  The model reads the limit from the traced call. A candidate's need is the VMEM the compiler
  allocated at whichever limit it compiled (the need does not depend on the limit).

Targets: >= 99% agreement of the model (point estimate) with the compiler; 0 false passes (the
two-stage filter lets through a candidate the compiler rejects).

    python benchmarks/feasibility/feasibility_accuracy.py
        [--parts rules calibration heldout limits]
        [--threads 2]
        [--csv rows.csv] [--compiler-rows earlier.csv [--stale-groups GROUP ...]]

``--compiler-rows``: take each candidate's compiler outcome (kind, VMEM used and needed) from an
earlier run's ``--csv`` made with the same libtpu, and recompute only the rules and the model's
verdicts: a changed model judged against the compiler's recorded truth, without recompiling.
Candidates the file lacks are compiled as usual. A recorded row stands only for the program it
was recorded for: rows carry a hash of the traced program (kernel bodies included), and a row
whose hash differs is left out as stale (and counted as such); for recordings made before rows
had the hash, ``--stale-groups`` names the case groups whose kernel has changed since.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import functools
import os
import sys
import threading
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402
import feasibility_cases as cases  # noqa: E402

from pallas_tune.chips import chip_spec  # noqa: E402
from pallas_tune.feasibility import compile as _compile  # noqa: E402
from pallas_tune.feasibility import inspect as _inspect  # noqa: E402
from pallas_tune.feasibility import model as feasibility  # noqa: E402

MiB = 2**20
REJECTS = (*_compile.OOM_KINDS, _compile.BLOCK_RULE)


@dataclasses.dataclass(kw_only=True)
class Row:
    part: str
    chip: str
    group: str
    label: str
    status: str = "trace_error"  # Model verdict status.
    model_ok: bool = False  # Rules pass and the point estimate fits.
    rules: list[str] = dataclasses.field(default_factory=list)
    native: list[str] = dataclasses.field(default_factory=list)
    est: int = 0
    limit: int = 0
    kind: str = ""  # Compiler outcome at the default limit.
    message: str = ""
    used: int | None = None  # Scoped VMEM the compiler allocated (default limit).
    need: int | None = None  # Scoped VMEM needed (from a raised-limit compile where needed).
    program: str = ""  # Hash of the traced program (kernel bodies included): what was compiled.

    @property
    def compiles(self) -> bool:
        return self.kind == "ok"

    @property
    def two_stage_ok(self) -> bool:
        return self.status == "ok" or (self.status == "uncertain" and self.compiles)

    @property
    def runtime_only(self) -> bool:
        """Rejected only by the in-bounds rule, which no compiler checks (run-time failure)."""
        return bool(self.rules) and all("in bounds" in p for p in self.rules)


ROWS_OUT: list[str] = []  # --rows-out: a CSV each row is appended to as it is compiled.
_ROWS_LOCK = threading.Lock()
RECORDED_ONLY = False  # --recorded-only: report the recorded rows, compile nothing.
RECORDED: dict[tuple[str, str, str], dict[str, Any]] = {}  # (part, chip, label) -> CSV row.


STALE_GROUPS: set[str] = set()


def load_recorded(path: str) -> None:
    import math

    import pandas as pd

    for r in pd.read_csv(path, keep_default_na=False).to_dict("records"):
        for k in ("used", "need"):
            v = r.get(k)
            r[k] = None if v in ("", None) or (isinstance(v, float) and math.isnan(v)) else int(float(v))
        # The group too: several groups hold the same config labels (matmul 2048^3 and 4096^3).
        RECORDED[(r["part"], r["chip"], r["group"], r["label"])] = r


def program_hash(case: cases.Case) -> str:
    """What the compiler is given, kernel bodies included: a recorded row stands for this case
    only while the hash is unchanged."""
    import hashlib

    text = str(jax.make_jaxpr(functools.partial(case.fn, **case.kwargs))(*case.args))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_stale(recorded: dict, row: Row) -> bool:
    """Rows recorded with a program hash are stale when it differs; older recordings (no
    hash) only for the groups named by --stale-groups."""
    if recorded.get("program"):
        return recorded["program"] != row.program
    return row.group in STALE_GROUPS


def evaluate(part: str, chip: str, case: cases.Case, *, need: bool) -> Row:
    spec = chip_spec(chip)
    row = Row(part=part, chip=spec.name, group=case.group, label=case.label)
    try:
        calls = _inspect.find_pallas_calls(case.fn, case.args, case.kwargs)
    except Exception as e:  # noqa: BLE001 - reported, not counted.
        row.message = f"{type(e).__name__}: {e}"[:300]
        return row
    v = feasibility.model_verdict(calls, spec)
    row.status, row.model_ok, row.est, row.limit = v.status, v.ok, v.vmem_bytes, v.limit_bytes
    row.rules = _inspect.block_rule_violations(calls, spec=spec)
    row.native = _inspect.block_rule_violations(calls, spec=spec, native_tiling=True)
    row.program = program_hash(case)
    recorded = RECORDED.get((part, row.chip, row.group, row.label))
    if recorded is not None and is_stale(recorded, row):
        # The compiler's figures were for another program: left out of every count, and not
        # compiled again (run without --compiler-rows for that).
        row.message = "stale: recorded for an earlier version of the kernel"
        return row
    if recorded is None and RECORDED_ONLY:
        row.message = "not compiled: absent from --compiler-rows (--recorded-only)"
        return row  # No kind: left out of every count.
    if recorded is not None:
        row.kind, row.message = recorded["kind"], str(recorded["message"])
        row.used, row.need = recorded["used"], recorded["need"]
        return row
    res = _compile.compile_deviceless(case.fn, case.args, case.kwargs, chip=spec.name)
    row.kind, row.used = res.kind, res.scoped_vmem_bytes
    row.message = res.message.splitlines()[0][:300] if res.message else ""
    row.need = res.scoped_vmem_bytes
    if need and res.kind in _compile.OOM_KINDS:
        raised = (spec.vmem_usable_bytes // MiB - 1) * MiB
        again = _compile.compile_deviceless(case.fn, case.args, case.kwargs, chip=spec.name,
                                            scoped_limit_bytes=raised)
        row.need = again.scoped_vmem_bytes if again.ok else None
    return row


def fill_needs(rows: list[Row]) -> None:
    """Limits part: a candidate's need is what the compiler allocated where it compiled (at
    another limit, if not at this one); its kernel and tiles are the group's head and label."""
    used = {(r.chip, r.group.split(" | ")[0], r.label): r.used for r in rows if r.compiles}
    for r in rows:
        r.need = used.get((r.chip, r.group.split(" | ")[0], r.label), r.need)


def run_part(part: str, chips: list[str], threads: int) -> list[Row]:
    jobs = [(chip, c) for chip in chips for c in cases.CASES[part](chip)]
    # Smoke runs: the first two candidates of the first chip, the part's whole path.
    jobs = bench.smoke(jobs, [j for j in jobs if j[0] == chips[0]][:2])
    print(f"[{part}] compiling {len(jobs)} candidates deviceless with {threads} threads ...",
          file=sys.stderr, flush=True)
    done = [0]

    def one(job: tuple[str, cases.Case]) -> Row:
        row = _one(job)
        if ROWS_OUT:  # Each row as it comes: a run stopped early keeps what it compiled.
            import csv

            with _ROWS_LOCK, open(ROWS_OUT[0], "a", newline="") as f:
                fields = [fl.name for fl in dataclasses.fields(Row)]
                w = csv.DictWriter(f, fieldnames=fields)
                if f.tell() == 0:
                    w.writeheader()
                w.writerow(dataclasses.asdict(row))
        return row

    def _one(job: tuple[str, cases.Case]) -> Row:
        # The raised-limit compile that measures a need applies only to calls that set no
        # limit: the limits part takes its needs from its own compiles (fill_needs).
        row = evaluate(part, job[0], job[1], need=part in ("calibration", "heldout"))
        done[0] += 1
        if done[0] % 10 == 0:
            print(f"[{part}] {done[0]}/{len(jobs)}", file=sys.stderr, flush=True)
        return row

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        rows = list(pool.map(one, jobs))
    if part == "limits":
        fill_needs(rows)
    return rows


def _pct(a: int, n: int) -> str:
    return f"{a / n:.2%}" if n else "-"


def report_rules(rows: list[Row]) -> None:
    print("## Block rules on ragged shapes: block_rule_violations(calls, spec=chip) vs the compiler")
    print("rejected = Pallas lowering/Mosaic rejected the block (kind block_rule); runtime-only = "
          "only the in-bounds rule fails (compiles, then reads/writes out of bounds)\n")
    print(f"{'chip':8s} {'group':34s} {'n':>4s} {'compiles':>8s} {'rejected':>8s} {'rules':>6s} "
          f"{'agree':>7s} {'FP':>3s} {'FN':>3s} {'rt-only':>7s} {'other':>5s} | two-stage FP | "
          f"native-tiling extra rejects (compile ok)")
    tot = dict(n=0, agree=0, fp=0, fn=0, fp2=0, rt=0, other=0, native=0)
    for chip in dict.fromkeys(r.chip for r in rows):
        for group in dict.fromkeys(r.group for r in rows):
            rs = [r for r in rows if r.chip == chip and r.group == group and r.kind]
            if not rs:
                continue
            judged = [r for r in rs if not r.runtime_only]
            rej = [r for r in judged if r.kind == _compile.BLOCK_RULE]
            fp = sum(not r.rules and r.kind == _compile.BLOCK_RULE for r in judged)
            fn = sum(bool(r.rules) and r.kind != _compile.BLOCK_RULE for r in judged)
            other = sum(r.kind not in ("ok", _compile.BLOCK_RULE) for r in rs)
            fp2 = sum(r.two_stage_ok and not r.compiles for r in rs)
            rt = sum(r.runtime_only for r in rs)
            native = sum(bool(r.native) and not r.rules and r.compiles for r in rs)
            agree = len(judged) - fp - fn
            print(f"{chip:8s} {group[:34]:34s} {len(rs):4d} {sum(r.compiles for r in rs):8d} "
                  f"{len(rej):8d} {sum(bool(r.rules) for r in judged):6d} "
                  f"{_pct(agree, len(judged)):>7s} {fp:3d} {fn:3d} {rt:7d} {other:5d} | "
                  f"{fp2:12d} | {native}")
            for k, v in dict(n=len(judged), agree=agree, fp=fp, fn=fn, fp2=fp2, rt=rt,
                             other=other, native=native).items():
                tot[k] += v
    skipped = sum(not r.kind for r in rows)
    print(f"\nrules: {tot['agree']}/{tot['n']} = {_pct(tot['agree'], tot['n'])} agreement with the "
          f"compiler ({tot['fp']} false passes, {tot['fn']} false rejects); {tot['rt']} grids "
          f"past the array rejected by the in-bounds rule (the compiler accepts them); "
          f"{tot['other']} other compiler rejections; {skipped} cases not traceable")
    print(f"two-stage filter: {tot['fp2']} candidates passed that the compiler rejects (target 0)")
    print(f"native_tiling=True would also reject {tot['native']} candidates the compiler "
          f"accepts (why it is opt-in)")
    for r in rows:
        if r.kind and not r.runtime_only and bool(r.rules) != (r.kind == _compile.BLOCK_RULE):
            print(f"  disagreement {r.chip} {r.group} {r.label}: rules {r.rules[:1]} compiler "
                  f"{r.kind} {r.message[:160]}")
        if r.kind not in ("", "ok", _compile.BLOCK_RULE):
            print(f"  other rejection {r.chip} {r.group} {r.label}: {r.kind} {r.message[:160]}")


def near_limit(r: Row) -> bool:
    hi = max(r.est, r.need or 0)
    return r.need is not None and r.est > 0 and 0.5 * r.limit <= hi <= 2 * r.limit


def error_stats(rows: list[Row]) -> tuple[list[float], str]:
    errs = sorted(r.need / r.est - 1 for r in rows if near_limit(r))
    if not errs:
        return errs, "no candidates near the limit"
    q = np.quantile(errs, [0, 0.05, 0.5, 0.95, 1])
    return errs, (f"n={len(errs)} need/estimate-1: min {q[0]:+.1%} p5 {q[1]:+.1%} median "
                  f"{q[2]:+.1%} p95 {q[3]:+.1%} max {q[4]:+.1%}")


def report_vmem(title: str, rows: list[Row]) -> None:
    print(f"## {title}")
    print(f"{'chip':8s} {'case':42s} {'n':>4s} | model: {'agree':>6s} {'FP':>3s} {'FN':>3s} | "
          f"verdicts: {'ok':>4s} {'unc':>4s} {'inf':>4s} | two-stage: {'FP':>3s} {'FN':>3s} | "
          f"error near limit")
    tot = dict(n=0, agree=0, fp2=0, fn2=0, unc=0, compilable=0)
    for chip in dict.fromkeys(r.chip for r in rows):
        for group in dict.fromkeys(r.group for r in rows):
            rs = [r for r in rows if r.chip == chip and r.group == group and r.kind]
            if not rs:
                continue
            fp = sum(r.model_ok and not r.compiles for r in rs)
            fn = sum(not r.model_ok and r.compiles for r in rs)
            fp2 = sum(r.two_stage_ok and not r.compiles for r in rs)
            fn2 = sum(not r.two_stage_ok and r.compiles for r in rs)
            counts = [sum(r.status == s for r in rs) for s in ("ok", "uncertain", "infeasible")]
            _, stats = error_stats(rs)
            print(f"{chip:8s} {group[:42]:42s} {len(rs):4d} | {'':7s}"
                  f"{_pct(len(rs) - fp - fn, len(rs)):>6s} {fp:3d} {fn:3d} | {'':10s}"
                  f"{counts[0]:4d} {counts[1]:4d} {counts[2]:4d} | {'':11s}{fp2:3d} {fn2:3d} | "
                  f"{stats}")
            tot["n"] += len(rs)
            tot["agree"] += len(rs) - fp - fn
            tot["fp2"] += fp2
            tot["fn2"] += fn2
            tot["unc"] += counts[1]
            tot["compilable"] += sum(r.compiles for r in rs)
    _, stats = error_stats(rows)
    print(f"\nmodel alone: {tot['agree']}/{tot['n']} = {_pct(tot['agree'], tot['n'])} agreement "
          f"(target >= 99%)")
    print(f"two-stage filter: {tot['fp2']} compiler-rejected candidates passed (target 0), "
          f"{tot['fn2']}/{tot['compilable']} compilable candidates rejected; "
          f"{tot['unc']}/{tot['n']} were uncertain (compiled, or tried without libtpu)")
    print(f"model error near the limit (estimate or need within 0.5x-2x of it): {stats}")
    misses = [r for r in rows if r.kind and (r.model_ok != r.compiles or r.status == "uncertain"
                                             and not r.compiles)]
    failed_below = [r for r in rows if r.kind in _compile.OOM_KINDS and r.need
                    and r.need <= r.limit]
    for r in misses:
        need = f"{r.need / MiB:7.2f}" if r.need else "      -"
        print(f"  {r.chip:8s} {r.group[:26]:26s} {r.label[:58]:58s} {r.status:10s} est "
              f"{r.est / MiB:7.2f} need {need} limit {r.limit / MiB:5.1f} MiB -> {r.kind}")
    if failed_below:
        print(f"  ran out although the need fit the limit: "
              f"{[(r.label, r.need / MiB) for r in failed_below]}")
    print()


def band_report(calibration: list[Row], heldout: list[Row]) -> None:
    errs, stats = error_stats(calibration)
    print("## The uncertain band")
    for name, rows in (("calibration", calibration), ("held-out", heldout)):
        stale = collections.Counter(r.group for r in rows if r.message.startswith("stale:"))
        if stale:
            print(f"left out as stale ({name}: their compiler figures were recorded for an "
                  f"earlier version of the kernel; re-record them with a compile run): "
                  f"{dict(stale)}")
    if errs:
        print(f"measured on the calibration kernels: the compiler needed up to {max(errs):+.2%} "
              f"more and up to {-min(errs):.2%} less than the estimate ({stats})")
    print(f"shipped (pallas_tune.feasibility.model): BAND_UNDER={feasibility.BAND_UNDER:.2%} "
          f"(need above the estimate), BAND_OVER={feasibility.BAND_OVER:.2%} (below)")
    if errs and (max(errs) > feasibility.BAND_UNDER or -min(errs) > feasibility.BAND_OVER):
        print("WARNING: the calibration error exceeds the shipped band; update BAND_* in model.py")
    h_errs, h_stats = error_stats(heldout)
    if h_errs:
        out = sum(e > feasibility.BAND_UNDER or -e > feasibility.BAND_OVER for e in h_errs)
        print(f"held-out (upstream kernels, not used to set the band): {h_stats}; {out}/"
              f"{len(h_errs)} outside the shipped band")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["rules", "calibration", "heldout"],
                   choices=["rules", "calibration", "heldout", "limits"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--csv")
    p.add_argument("--compiler-rows")
    p.add_argument("--recorded-only", action="store_true",
                   help="with --compiler-rows: report only the recorded candidates (e.g. a "
                        "stopped run's --rows-out), compiling nothing")
    p.add_argument("--rows-out", help="append each row to this CSV as it is compiled (the "
                                      "--csv format; a stopped run's rows can be reported "
                                      "with --compiler-rows)")
    p.add_argument("--stale-groups", nargs="*", default=[],
                   help="case groups whose kernel changed since --compiler-rows were recorded "
                        "(for recordings made before rows carried a program hash)")
    a = p.parse_args()
    STALE_GROUPS.update(a.stale_groups)
    if a.rows_out:
        ROWS_OUT.append(a.rows_out)
    global RECORDED_ONLY
    RECORDED_ONLY = a.recorded_only
    if a.compiler_rows:
        load_recorded(a.compiler_rows)
    if not bench.have_libtpu("compare"):
        return
    print(f"# $ {bench.command(__file__, env='JAX_PLATFORMS=cpu')}"
          f"\n# {bench.today()}, shared {os.cpu_count()}-core CPU host (no TPU); jax "
          f"{jax.__version__}, libtpu {bench.version('libtpu', '?')}. Every verdict is checked "
          "against a deviceless compile; only agreement counts and VMEM sizes are reported, no "
          "times.\n")
    rows: dict[str, list[Row]] = {}
    for part in a.parts:
        rows[part] = run_part(part, cases.CHIPS[part], a.threads)
        if part == "rules":
            report_rules(rows[part])
            print()
        else:
            report_vmem({"calibration": "VMEM model on the kernels it was built from "
                                        "(calibration)",
                         "heldout": "VMEM model on held-out upstream JAX kernels",
                         "limits": "VMEM model at declared vmem_limit_bytes (read from the "
                                   "traced call, capped at physical VMEM)"}[part],
                        rows[part])
    if "calibration" in rows:
        band_report(rows["calibration"], rows.get("heldout", []))
    if a.csv:
        import pandas as pd

        pd.DataFrame([dataclasses.asdict(r) for rs in rows.values() for r in rs]).to_csv(
            a.csv, index=False)
        print(f"wrote {a.csv}")


if __name__ == "__main__":
    main()
