"""estimate_fidelity's run: every key's figures (libtpu's estimate of the proxy on its stand-in,
checked as a tune checks one; the roofline model; the correction) ranked against the real
winner, and the JSON dump the report is re-rendered from."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import _common as bench  # noqa: E402

from estimate_fidelity_qmm import (  # noqa: E402
    config, corrected_figures, operands, proxy_parts, roofline_figures, tpu_inference_version,
    unmodified_abort, unmodified_qmm)
from estimate_fidelity_space import (  # noqa: E402
    CHIP, MISS_DEFAULT, Blocks, Key, KeyVerdict, blocks_text, space, verdict)

REPORTED_KEYS, REPORTED_MAX_COST = 10, 400.0  # The defaults: the sample results report.
STANDIN_TOLERANCE = 0.05  # As pallas-tune's tunes (standin_verdict): beyond it, full compiles.


@dataclasses.dataclass
class KeyRun:
    key: Key
    winner: Blocks
    configs: int  # The powers-of-two space.
    configs_div: int  # The divisors space (which holds it).
    proxy: KeyVerdict
    roofline: KeyVerdict
    proxy_div: KeyVerdict
    roofline_div: KeyVerdict
    proxy_failures: dict[str, int]  # Over the divisors space.
    winner_proxy_kind: str  # "ok" or why the real winner has no proxy estimate.
    winner_without_flag: str  # For a winner the proxy lost: its compile without the flag.
    standin_check: str
    wall_s: float
    proxy_top: list[tuple[Blocks, float]]  # The proxy's best few in the pow2 space, est ms.
    winner_largest: tuple[bool, bool, bool]  # The winner's value is its dimension's largest.
    proxy_ms: dict[Blocks, float] = dataclasses.field(default_factory=dict)  # Divisors space.
    corrected: KeyVerdict | None = None  # The proxy plus measure.correction, pow2 space.
    corrected_div: KeyVerdict | None = None

    def with_correction(self, narrow: Sequence[Blocks]) -> KeyRun:
        """This run with its corrected verdicts (from ``proxy_ms``; ``narrow``: the powers-of-two
        space)."""
        fig = corrected_figures(self.key, self.proxy_ms)
        return dataclasses.replace(
            self, corrected=verdict({b: v for b, v in fig.items() if b in set(narrow)},
                                    self.winner),
            corrected_div=verdict(fig, self.winner))


def run_key(est: Any, key: Key, table: Mapping[Key, Blocks], clock_hz: float) -> KeyRun:
    """Both figures for every config of the key's divisors space (which holds the powers-of-two
    space), on the stand-in, which is checked on one config as a tune does and dropped for
    full compiles where it is off by more than 5%."""
    import collections

    from pallas_tune.feasibility import compile as _compile

    t0 = time.perf_counter()
    winner = table[key]
    blocks = space(key, table, divisors=True)
    narrow = space(key, table)
    roof = roofline_figures(key, blocks)
    results = dict(zip(blocks, est.map(proxy_parts(), operands(key), {},
                                       [config(b) for b in blocks], CHIP), strict=True))
    scaled = sorted((r.scale, b) for b, r in results.items() if r.ok and r.scale > 1)
    check = "no config needed a stand-in"
    if scaled:
        scale, b = scaled[0]
        (full,) = est.map(proxy_parts(), operands(key), {}, [config(b)], CHIP, standin=False)
        if full.ok and full.cycles:
            err = (results[b].cycles - full.cycles) / full.cycles
            check = f"{blocks_text(b)} x{scale:g}: {err:+.2%} vs full compile"
            if abs(err) > STANDIN_TOLERANCE:
                redo = [c for _, c in scaled if c != b]
                results.update(zip(redo, est.map(proxy_parts(), operands(key), {},
                                                 [config(c) for c in redo], CHIP,
                                                 standin=False), strict=True))
                results[b] = full
                check += f"; beyond 5%: all {len(scaled)} scaled configs compiled in full"
        else:
            check = (f"{blocks_text(b)} x{scale:g}: full compile failed ({full.kind}); "
                     "stand-in used unverified")
    proxy = {b: r.cycles / clock_hz * 1e3 for b, r in results.items() if r.ok and r.cycles}
    failures = collections.Counter(r.kind for r in results.values() if not (r.ok and r.cycles))
    w = results[winner]
    winner_kind = "ok" if winner in proxy else f"{w.kind}: {w.message.splitlines()[0][:160]}"
    without_flag = ""
    if winner not in proxy and w.kind != "worker_crashed":
        plain = _compile.compile_deviceless(unmodified_qmm, operands(key), config(winner),
                                            chip=CHIP)
        without_flag = (f"compiles without the profile flag ({plain.compile_s:.0f} s, scoped "
                        f"VMEM {(plain.scoped_vmem_bytes or 0) / 2**20:.1f} MiB)" if plain.ok
                        else f"fails without the flag too ({plain.kind})")

    def only(figures: Mapping[Blocks, float]) -> dict[Blocks, float]:
        return {b: v for b, v in figures.items() if b in set(narrow)}

    largest = tuple(winner[i] == max(b[i] for b in narrow if b != MISS_DEFAULT)
                    for i in range(3))
    return KeyRun(key=key, winner=winner, configs=len(narrow), configs_div=len(blocks),
                  proxy=verdict(only(proxy), winner), roofline=verdict(only(roof), winner),
                  proxy_div=verdict(proxy, winner), roofline_div=verdict(roof, winner),
                  proxy_failures=dict(failures), winner_proxy_kind=winner_kind,
                  winner_without_flag=without_flag, standin_check=check,
                  wall_s=time.perf_counter() - t0,
                  proxy_top=sorted(only(proxy).items(), key=lambda kv: kv[1])[:3],
                  winner_largest=largest, proxy_ms=proxy  # type: ignore[arg-type]
                  ).with_correction(narrow)


def run_sample(keys: Sequence[Key], table: Mapping[Key, Blocks], *, workers: int,
               timeout_s: float) -> tuple[list[KeyRun], dict[str, Any]]:
    """Every key's run, and the report's metadata (versions, the abort note, wall time)."""
    import jax

    from pallas_tune.chips import chip_spec
    from pallas_tune.measure.estimate import Estimator

    versions = {"libtpu": bench.version("libtpu"), "jax": jax.__version__,
                "jaxlib": bench.version("jaxlib"), "tpu-inference": tpu_inference_version(),
                "pallas-tune": bench.version("pallas-tune"),
                "python": platform.python_version()}
    clock = chip_spec(CHIP).clock_hz
    runs: list[KeyRun] = []
    t0 = time.perf_counter()
    with Estimator(min(2, workers), timeout_s=timeout_s) as est:
        abort_note = unmodified_abort(est, keys[0])
        print("unmodified kernel:", abort_note, flush=True)
        for k in keys:
            r = run_key(est, k, table, clock)
            runs.append(r)
            print(f"{k} winner {r.winner}: " + "; ".join(
                f"{name} rank {v.winner_rank}/{v.ranked} pick {v.pick} ratio "
                f"{ratio_text(v.ratio)}" for name, v in (
                    ("proxy", r.proxy), ("corrected", r.corrected), ("roofline", r.roofline),
                    ("wider proxy", r.proxy_div), ("wider corrected", r.corrected_div)))
                + f"; {r.wall_s:.0f} s; failures {r.proxy_failures}; winner "
                  f"{r.winner_proxy_kind[:80]} {r.winner_without_flag}; stand-in "
                  f"{r.standin_check}", flush=True)
    return runs, {"versions": versions, "abort_note": abort_note,
                  "total_s": time.perf_counter() - t0, "date": bench.today()}



def ratio_text(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def dump(path: str, runs: Sequence[KeyRun], meta: Mapping[str, Any]) -> None:
    """Every key's run (its verdicts, and every config's proxy figure in ms) and the report's
    metadata, as JSON: ``--from-dump`` re-renders the report from it, and the correction's
    fitting sample is read from one."""
    import json

    def plain(r: KeyRun) -> dict[str, Any]:
        d = dataclasses.asdict(r)
        d["proxy_ms"] = [[list(b), v] for b, v in sorted(r.proxy_ms.items())]
        d.pop("corrected"), d.pop("corrected_div")  # Recomputed on load.
        return d

    path = bench.output(path)  # Smoke runs: under the smoke folder.
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"meta": dict(meta), "chip": CHIP, "runs": [plain(r) for r in runs]}, f,
                  indent=None, separators=(",", ":"))


def load_dump(path: str, table: Mapping[Key, Blocks]) -> tuple[list[KeyRun], dict[str, Any]]:
    """The runs and metadata :func:`dump` wrote, the corrected verdicts recomputed with the
    correction as it is now."""
    import json

    with open(path, encoding="utf-8") as f:
        data = json.load(f)

    def blocks(v: Any) -> Blocks | None:
        return None if v is None else tuple(v)  # type: ignore[return-value]

    def kv(d: Mapping[str, Any]) -> KeyVerdict:
        return KeyVerdict(**{**d, "pick": blocks(d["pick"])})

    runs = []
    for d in data["runs"]:
        key = blocks(d["key"])
        run = KeyRun(**{**d, "key": key, "winner": blocks(d["winner"]),
                        **{a: kv(d[a]) for a in ("proxy", "roofline", "proxy_div",
                                                 "roofline_div")},
                        "proxy_top": [(blocks(b), ms) for b, ms in d["proxy_top"]],
                        "winner_largest": tuple(d["winner_largest"]),
                        "proxy_ms": {blocks(b): v for b, v in d["proxy_ms"]}})
        runs.append(run.with_correction(space(key, table)))  # type: ignore[arg-type]
    return runs, data["meta"]

