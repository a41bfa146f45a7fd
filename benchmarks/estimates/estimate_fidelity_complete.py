"""estimate_fidelity's whole-space ranks (``--complete``): the drawn sample's rank estimate
(1 + rivals ahead / rivals drawn x the space) says "1st" whenever no drawn rival is ahead, and
10 drawn configs of a space of up to 294 rarely hold the winner's near rivals. The models are
cheap (a trace per config), so their rank is taken over the key's whole space. A tune's figure
(the larger of libtpu's and the model's calibrated onto it) is never below the calibrated
model's, so only the configs whose calibrated model figure lies below the winner's tune figure
(or the drawn pick's) can be ahead of the winner or be the pick: those "contenders" are compiled
as the drawn configs were (same stand-in, same profiler-abort and flag-only-OOM handling), and
the tune's rank over the whole space is then exact. The calibration is the drawn sample's (a
random sample, as an early tune holds). libtpu's own figure has no such bound: its rank stays
the drawn estimate, and the report says so.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

import estimate_fidelity_strata as st
from estimate_fidelity_qmm import config, model_figures, operands

Blocks = tuple[int, ...]


def by_blocks(rows: Any) -> dict[Blocks, float]:
    """A dump's [[blocks, figure], ...] rows as a dict."""
    return {tuple(b): v for b, v in rows}


def drawn_scale(run: Mapping[str, Any], model: str = "") -> Any:
    """The tune's rule (``pallas_tune.measure.scale.scale_figures``, ``bound``: the larger of
    libtpu's figure and the calibrated model's) on the drawn configs, with ``model``'s figures
    (default: ``public`` where the run has them, else ``fitted``): configs whose profile
    aborted, or ran out of VMEM only under the profiling flag, get the model's figure."""
    from pallas_tune.measure.scale import scale_figures

    model = model or ("public" if "public_ms" in run else "fitted")
    lib, fit = by_blocks(run["proxy_ms"]), by_blocks(run[f"{model}_ms"])
    aborted = {tuple(b) for b in (*run["aborted"], *run.get("flag_only_oom", ()))}
    figs = {**{b: fit[b] for b in aborted if b in fit}, **{b: fit.get(b) for b in lib}}
    return scale_figures(lib, figs, bound=True)


def _drawn(run: Mapping[str, Any]) -> set[Blocks]:
    """Every config the drawn sample compiled (whatever came of it)."""
    return ({tuple(b) for b, _ in (*run["proxy_ms"], *run.get("public_ms", ()))}
            | {tuple(b) for b in run["aborted"]})


def drawn_tune(run: Mapping[str, Any], model: str = "") -> dict[Blocks, float]:
    """What a tune ranks the drawn configs by (ms): :func:`drawn_scale`'s figures."""
    return {b: ms for b, (ms, _) in drawn_scale(run, model).figures.items()}


def contenders(run: Mapping[str, Any], whole_public: Mapping[Blocks, float]) -> list[Blocks]:
    """The configs of the whole space, not drawn, whose calibrated model figure lies below the
    winner's tune figure or the drawn pick's, whichever is larger; none where the tune ranks by
    the model alone (its rank is then the model's) or is not calibrated."""
    s = drawn_scale(run)
    tune = {b: ms for b, (ms, _) in s.figures.items()}
    winner = tuple(run["winner"])
    if s.how != "calibrated" or winner not in tune:
        return []
    threshold = max(tune[winner], min(tune.values()))
    drawn = _drawn(run)
    return sorted(b for b, v in whole_public.items()
                  if b not in drawn and v * s.ratio < threshold)


def whole_tune(run: Mapping[str, Any]) -> dict[Blocks, float] | None:
    """The tune's figure of every config of the whole space the models figure (ms), exact
    where it can decide the winner's rank or the pick (drawn and contenders), the calibrated
    model's lower bound elsewhere; None where the run has no whole-space data or the tune's
    figure over the whole space cannot be bounded (libtpu alone ranks)."""
    whole = run.get("whole")
    if not whole:
        return None
    s = drawn_scale(run)
    public = by_blocks(whole["public_ms"])
    if s.how == "model":
        return public
    if s.how != "calibrated":
        return None
    out = drawn_tune(run)
    lib = by_blocks(whole["proxy_ms"])
    modelled = {tuple(b) for b in (*whole["aborted"], *whole["flag_only_oom"])}
    compiled = {tuple(b) for b in whole["contenders"]}
    drawn = _drawn(run)
    for b, m in public.items():
        if b in drawn:
            continue  # The drawn sample's figure (or none: its compile failed).
        cal = m * s.ratio
        if b in lib:
            out[b] = max(lib[b], cal)
        elif b in modelled or b not in compiled:
            out[b] = cal  # The tune's own figure, or (not a contender) its lower bound.
    return out


def complete_run(est: Any, plain: Any, run: dict[str, Any], table: Mapping[Blocks, Blocks]
                 ) -> dict[str, Any]:
    """The run's ``whole`` record: the models over the key's whole space, and libtpu's figure
    of its contenders (with why a contender has none)."""
    t0 = time.perf_counter()
    _, dtypes, chip = st.CHIPS[run["chip"]]
    full, _ = st.strata_space(tuple(run["key"]), table)
    roof, fitted, public = model_figures(tuple(run["key"]), full, chip, dtypes[1])
    public_ms = {b: v * 1e3 for b, v in public.items()}
    todo = contenders(run, public_ms)
    return {"space": len(full), "roofline_ms": st.rows(roof, 1e3),
            "fitted_ms": st.rows(fitted, 1e3), "public_ms": st.rows(public_ms),
            "contenders": [list(b) for b in todo],
            **estimate(est, plain, run, todo), "wall_s": time.perf_counter() - t0}


def estimate(est: Any, plain: Any, run: Mapping[str, Any], todo: list[Blocks]
             ) -> dict[str, Any]:
    """libtpu's figure (ms, the capped stand-in's) of configs ``todo`` of ``run``'s key, as the
    drawn ones got theirs: ``proxy_ms``, ``aborted``, ``flag_only_oom``, ``failures``."""
    from pallas_tune.chips import chip_spec

    _, dtypes, chip = st.CHIPS[run["chip"]]
    entry = st.Entry(run["chip"], tuple(run["key"]), tuple(run["winner"]), run["stratum"])
    results = dict(zip(todo, est.map(st.proxy_parts(), operands(entry.key, dtypes[1]), {},
                                     [config(b) for b in todo], chip), strict=True))
    clock = chip_spec(chip).clock_hz
    proxy = {b: r.cycles / clock * 1e3 for b, r in results.items() if r.ok and r.cycles}
    aborts = {b: st.abort_of(r) for b, r in results.items() if st.abort_of(r)}
    flag_only = st.flag_only_oom(plain, entry, results, dtypes[1])
    failures = collections.Counter(("profiler abort" if b in aborts else r.kind)
                                   for b, r in results.items() if b not in proxy)
    return {"proxy_ms": st.rows(proxy), "aborted": [list(b) for b in sorted(aborts)],
            "flag_only_oom": [list(b) for b in sorted(flag_only)], "failures": dict(failures)}
