"""One scale for every figure a tpu-estimate run ranks.

libtpu's static estimate gives most candidates their figure; a fallback model
(``--estimate-fallback``) gives one to those libtpu cannot figure (its profiler aborts, or only
the profiling flag puts them out of VMEM). The two are different scales: on 7x the fitted
model runs 0.54 to 2.73 times libtpu's figure, so ranked raw, whether a model-figured config
wins is an accident of scale. :func:`scale_figures` is the rule, on plain figures, so that a
benchmark scores exactly what a tune ranks by; :func:`one_scale` applies it to a run's records.

The rule, where the run has model figures:

* the model is calibrated on libtpu's best ``MAX_PAIRS`` configs: its figure times the median
  of libtpu/model over those with both (at least ``MIN_PAIRS`` of them);
* with the fitted model (``bound``), every candidate is ranked by the larger of libtpu's figure
  and the calibrated model's. libtpu leaves out costs a real chip pays (at large batch, per
  grid step), and the model, fitted to real-TPU winners, counts them; chosen on the keys a fit
  or selection may use, it ranked the real winner better than or as well as libtpu's figure on
  every count (benchmarks/results/scale_rule_selection.md);
* where libtpu figured fewer than ``MIN_PAIRS`` candidates (fp8 on 7x: its profiler aborts on
  most), there is nothing to calibrate on and libtpu's few figures are too few to pick from:
  every candidate is ranked by the model's own figure, one scale, the model's;
* otherwise, with too few configs with both figures, model-figured candidates are ranked apart:
  kept out of the pick, their figure kept in their error.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Final

from pallas_tune.measure.loops import NOT_ESTIMABLE
from pallas_tune.measure.records import Outcome

__all__ = ["MAX_PAIRS", "MIN_PAIRS", "Scaled", "one_scale", "scale_figures"]

MIN_PAIRS: Final = 3  # Configs with both figures needed to calibrate a model onto libtpu's.
MAX_PAIRS: Final = 16  # libtpu's best this many are given a model figure to calibrate on.

# What a candidate's ranked figure is (Scaled.figures).
LIBTPU, CALIBRATED, BOUND, MODEL = "libtpu", "calibrated", "bound", "model"


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A run's figures on one scale. ``figures``: candidate -> (ms, what it is: ``LIBTPU``;
    ``CALIBRATED``, the model's calibrated, libtpu had none; ``BOUND``, the calibrated model's,
    larger than libtpu's; ``MODEL``, the model's own); a candidate absent is ranked apart.
    ``how``: ``libtpu`` (nothing changed), ``calibrated``, ``model`` or ``apart``."""

    figures: dict[Hashable, tuple[float, str]]
    how: str
    pairs: int = 0
    ratio: float | None = None


def scale_figures(libtpu: Mapping[Hashable, float], model: Mapping[Hashable, float | None], *,
                  bound: bool) -> Scaled:
    """The rule of this module on plain figures (ms). ``libtpu``: the candidates libtpu
    figured; ``model``: the model's figure of the candidates libtpu did not (each has one) and
    of those of libtpu's it was asked for (its best ``MAX_PAIRS``, or all with ``bound``; None
    where the model has none)."""
    own = {k: v for k, v in model.items() if k not in libtpu and v is not None}
    kept = {k: (v, LIBTPU) for k, v in libtpu.items()}
    if not own and not bound:
        return Scaled(kept, "libtpu")
    if not libtpu:
        return Scaled({k: (v, MODEL) for k, v in own.items()}, "model")
    base = sorted(libtpu, key=libtpu.__getitem__)[:MAX_PAIRS]
    pairs = [libtpu[k] / m for k in base if (m := model.get(k)) is not None and m > 0]
    if len(pairs) >= MIN_PAIRS:
        ratio = statistics.median(pairs)
        figures = {**kept, **{k: (v * ratio, CALIBRATED) for k, v in own.items()}}
        if bound:
            figures.update({k: (m * ratio, BOUND) for k, v in libtpu.items()
                            if (m := model.get(k)) is not None and m * ratio > v})
        return Scaled(figures, "calibrated", len(pairs), ratio)
    if not own:
        return Scaled(kept, "libtpu", len(pairs))
    if len(libtpu) < MIN_PAIRS:
        return Scaled({k: (m, MODEL) for k, m in model.items() if m is not None and m > 0},
                      "model", len(pairs))
    return Scaled(kept, "apart", len(pairs))


def one_scale(records: Sequence[Any], model_ms: Callable[[list], list[float | None]], *,
              timer: str, bound: bool) -> tuple[list[Any], dict[str, Any]]:
    """:func:`scale_figures` on a run's records. ``model_ms(configs)``: the model's figures
    (ms) of configs libtpu figured; ``timer``: the model's name (MODEL_TIMERS); ``bound``: rank
    by the larger of libtpu's figure and the calibrated model's. Returns the records that
    changed and what the figures are (``figure``: the entry's timer; ``note``; ``calibration``
    where the model was calibrated)."""
    ranked = [r for r in records if r.outcome is Outcome.OK and r.duplicate_of is None
              and r.measurement is not None]
    modelled = [r for r in ranked if r.measurement.timer == timer]
    libtpu = sorted((r for r in ranked if r.measurement.timer != timer),
                    key=lambda r: r.median_ms)
    if not ranked or (not modelled and not bound):
        return [], {}
    asked = libtpu if bound else libtpu[:MAX_PAIRS]
    model = dict(zip((r.number for r in asked), model_ms([r.config for r in asked]),
                     strict=True))
    model.update({r.number: r.median_ms for r in modelled})
    s = scale_figures({r.number: r.median_ms for r in libtpu}, model, bound=bound)
    changed = [_rescaled(r, s, timer, model.get(r.number)) for r in (*libtpu, *modelled)]
    changed = [r for r in changed if r is not None]
    return changed, _figures_note(s, timer, len(modelled), len(libtpu), bound)


def _rescaled(r: Any, s: Scaled, timer: str, model: float | None) -> Any | None:
    """``r`` as ``s`` ranks it, or None where it is unchanged."""
    got = s.figures.get(r.number)
    libtpu = r.measurement.timer != timer
    if got is not None and (got[1] == LIBTPU or (got[1] == MODEL and not libtpu)):
        return None  # Its own figure, labelled as it was.
    if got is None:
        why = (f"{timer} figure {r.median_ms:.4g} ms, on another scale than libtpu's, and "
               f"{s.pairs} config(s) have both figures ({MIN_PAIRS} needed to calibrate it)"
               if not libtpu else f"libtpu's figure {r.median_ms:.4g} ms, and the {timer} "
               "figure that ranks the others is missing")
        return dataclasses.replace(
            r, outcome=Outcome.COMPILE_ERROR, detail=NOT_ESTIMABLE, measurement=None,
            error=f"not ranked: {why}" + (f"; {r.detail}" if r.detail else ""))
    ms, what = got
    if what == MODEL:
        detail = (f"the {timer} figure, not calibrated: libtpu figured fewer than {MIN_PAIRS} "
                  f"candidates of the run (its own {r.median_ms:.4g} ms)")
        new_timer = timer
    elif what == CALIBRATED:
        detail = (f"{timer} figure {r.median_ms:.4g} ms calibrated on {s.pairs} configs with "
                  f"both (x{s.ratio:.3g}, the median of libtpu/model)")
        new_timer = f"{timer} calibrated"
    else:
        detail = (f"libtpu's figure {r.median_ms:.4g} ms; the {timer} figure {model:.4g} ms "
                  f"calibrated on {s.pairs} configs with both (x{s.ratio:.3g}) is larger, "
                  "and ranks it")
        new_timer = f"{timer} calibrated"
    return dataclasses.replace(
        r, measurement=dataclasses.replace(r.measurement, times_ms=(ms,), timer=new_timer),
        detail=detail + (f": {r.detail}" if r.detail else ""))


def _figures_note(s: Scaled, timer: str, modelled: int, libtpu: int, bound: bool
                  ) -> dict[str, Any]:
    """What the run's figures are: the entry's timer and a note."""
    if s.how == "model":
        return {"figure": timer, "note": (
            f"every ranked candidate by the {timer} figure, one scale, the model's: "
            + (f"libtpu figured {libtpu} of the run's candidates, fewer than {MIN_PAIRS} to "
               "calibrate on or pick from" if libtpu else "none has a libtpu estimate"))}
    if s.how == "apart":
        return {"figure": "tpu-estimate", "note": (
            f"{modelled} candidate(s) with only a {timer} figure ranked apart, not in the "
            f"pick: {s.pairs} config(s) have both figures, {MIN_PAIRS} are needed to "
            "calibrate the model onto libtpu's scale")}
    if s.how == "libtpu":
        return {} if not bound else {"figure": "tpu-estimate", "note": (
            f"libtpu's figures alone: {s.pairs} config(s) have a {timer} figure too, "
            f"{MIN_PAIRS} are needed to calibrate the model that bounds them")}
    by = sum(1 for _, what in s.figures.values() if what == BOUND)
    note = f"the {timer} figure calibrated on {s.pairs} configs with both (x{s.ratio:.3g})"
    if modelled:
        note += f"; {modelled} candidate(s) libtpu could not figure ranked by it"
    if bound:
        note += (f"; every candidate by the larger of libtpu's figure and the calibrated "
                 f"model's ({by} of {libtpu} libtpu-figured by the model's)")
    figure = (f"max(tpu-estimate, {timer} calibrated)" if bound
              else f"tpu-estimate+{timer} calibrated")
    return {"figure": figure, "note": note,
            "calibration": {"pairs": s.pairs, "ratio": s.ratio}}
