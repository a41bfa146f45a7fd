"""What a tuning run returns (:class:`TuningResult`) and what callbacks see (:class:`Progress`)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from pallas_tune.measure.records import TrialRecord

if TYPE_CHECKING:
    import pandas as pd

    from pallas_tune.tuning.options import TuneOptions

__all__ = ["Progress", "TuningResult"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Progress:
    """Where a run stands, passed to ``callbacks`` with every trial record.

    ``asked``: candidates asked of the sampler; ``evaluated``: trials recorded this run;
    ``timed``: trials that spent device time (distinct programs run); ``duplicates``: trials
    whose program was already evaluated; ``budget``: the ``trials`` option; ``best_ms`` and
    ``best``: the best ``ok`` trial so far (search-phase median); ``from_storage``: timed trials
    of the stored study not run here (a resumed run, other workers)."""

    asked: int
    evaluated: int
    timed: int
    duplicates: int
    budget: int
    best_ms: float
    best: dict[str, Any] | None
    elapsed_s: float
    from_storage: int = 0  # Timed trials this run took from the stored study (a resume, or
    #                        other workers on it): timed + from_storage is the study's count.


@dataclasses.dataclass(frozen=True, kw_only=True)
class TuningResult:
    """What :func:`pallas_tune.tune` returns.

    ``best``/``best_record``: the winner. ``best_ms``, ``best_spread_ms``: the median and
    interquartile range of its runs in the final paired re-ranking (``ranking``: the
    ``retime_top`` best re-timed interleaved), or of its search-phase runs where there was no
    re-ranking. Each trial's own search-phase median stays in ``records`` and ``trials``.
    ``study``: the Optuna study (real parameter values; plots and optuna-dashboard work on it).
    ``provenance``: how the figures were obtained (chip, timer, versions, counts, ...).
    ``backward``: with ``grad=True``, the result of tuning the kernel's backward kernel (None
    otherwise, and for a ``"xla"`` backward); ``backward_backend``: ``"pallas"``, ``"xla"`` or
    None (the kernel declares no backward).
    """

    kernel: str
    chip: str
    key: str
    records: tuple[TrialRecord, ...]
    best_record: TrialRecord
    best_ms: float
    best_spread_ms: float
    ranking: tuple[dict[str, Any], ...]
    provenance: dict[str, Any]
    options: TuneOptions
    study: Any = None
    cache_path: str | None = None
    backward: TuningResult | None = None
    backward_backend: str | None = None

    @property
    def best(self) -> dict[str, Any]:
        """The winning config."""
        return dict(self.best_record.config)

    @property
    def counts(self) -> dict[str, int]:
        """Trials asked of the sampler, evaluated, distinct programs, device timings spent."""
        return dict(self.provenance.get("counts", {}))

    @property
    def trials(self) -> pd.DataFrame:
        """One row per trial: the parameters, ``outcome``, ``median_ms``, ``error`` and more."""
        import pandas as pd

        rows = []
        for r in self.records:
            m = r.measurement
            rows.append({
                "number": r.number, **{k: _cell(v) for k, v in r.config.items()},
                "outcome": r.outcome.value, "median_ms": r.median_ms,
                "spread_ms": m.spread_ms if m else math.nan,
                "compile_ms": m.compile_ms if m else math.nan,
                "runs": len(m.times_ms) if m else 0,
                "max_abs_err": r.max_abs_err if r.max_abs_err is not None else math.nan,
                "duplicate_of": r.duplicate_of if r.duplicate_of is not None else pd.NA,
                "fingerprint": r.fingerprint, "phase": r.phase, "seconds": r.seconds,
                "detail": r.detail, "error": r.error})
        return pd.DataFrame(rows)

    def to_entry(self) -> dict[str, Any]:
        """The cache entry: the winner, its re-ranked time, every trial, the provenance."""
        return {
            "key": self.key,
            "config": self.best,
            "median_ms": self.best_ms,
            "spread_ms": self.best_spread_ms,
            "search_median_ms": self.best_record.median_ms,
            "provenance": self.provenance,
            "trials": [r.to_json() for r in self.records],
        }


def _cell(v: Any) -> Any:
    return str(v) if isinstance(v, tuple) else v
