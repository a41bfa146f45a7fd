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
    re-ranking. Each trial's own search-phase median stays in ``records`` (and in ``trials``
    as ``search_median_ms``; ``trials``' ``median_ms`` is the figure stated for its config).
    ``study``: the Optuna study (real parameter values; plots and optuna-dashboard work on it).
    ``provenance``: how the figures were obtained (chip, timer, versions, counts, ...).
    ``default_ms``: the default config's median in the same re-ranking as ``best_ms`` (the
    declared default, else the space's first point; NaN when it did not run), so ``speedup``
    (default over best) compares like with like. ``effective``: what ``best`` runs as for
    the call's shapes, where the kernel clamps values larger than a dimension (else None).
    ``xla_ms``: the kernel's reference (XLA) timed in the same final ranking (NaN when not);
    ``implementation``: ``"xla"`` when it beat the best config, and calls then run it. Under
    ``tpu-estimate`` both are compiler estimates; ``xla_partial``: how many of the reference's
    ops libtpu gave no estimate (``xla_ms`` is then a lower bound, and never makes XLA win).
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
    default_ms: float = math.nan
    effective: dict[str, Any] | None = None  # What ``best`` runs as, where clamped; else None.
    xla_ms: float = math.nan  # The reference (XLA) in the same final ranking; NaN: not timed.
    implementation: str = "pallas"  # What calls will run: "xla" where the reference won.
    xla_partial: int = 0  # Estimates: ops of the reference with no estimate (xla_ms: a bound).
    backward: TuningResult | None = None
    backward_backend: str | None = None

    def __repr__(self) -> str:
        speed = f", {self.speedup:.2f}x the default" if math.isfinite(self.speedup) else ""
        best = _config_text(self.best)  # As the table writes it: br=64 bc=256.
        if self.provenance.get("clamped"):
            speed += f"; {self.provenance['clamped']}"
        if math.isfinite(self.xla_ms):
            speed += (f"; XLA {self.xla_ms:.4g} ms, "
                      f"{'XLA runs' if self.implementation == 'xla' else 'Pallas runs'}")
        if self.backward is not None:
            speed += f"; backward {self.backward.best_ms:.4g} ms"
        if self.within_noise:
            speed += "; within noise"  # str() / .table() say which and why.
        return (f"TuningResult({self.kernel} {self.key} on {self.chip}: best {best} "
                f"{self.best_ms:.4g} ms{speed}; {self.counted()}, "
                f"{self.provenance.get('timer', '?')})")

    def __str__(self) -> str:
        """The final ranking as a table, then what it can claim (see :meth:`table`)."""
        return self.table()

    def table(self) -> str:
        """The result for people: the final ranking (the re-timed configs, interleaved, with
        the default and XLA where they ran; else the search's best), each row's median, spread
        and time over the winner's, and one line saying what these runs support: the winner,
        its speed-up over the default, or that the timings are within noise."""
        head = (f"{self.kernel} {self.key} on {self.chip} ({self.provenance.get('timer', '?')}; "
                f"{self.counted()})")
        rows = [r for r in self.ranking if r.get("median_ms") is not None]
        if not rows:  # No re-ranking: the search's best ok trials.
            ok = sorted((r for r in self.records if r.outcome.value == "ok"
                         and r.duplicate_of is None), key=lambda r: r.median_ms)[:5]
            rows = [{"trial": r.number, "config": dict(r.config), "median_ms": r.median_ms,
                     "spread_ms": r.measurement.spread_ms if r.measurement else math.nan}
                    for r in ok]
        notes = [self.provenance.get(k) for k in ("stopped", "not_searched")]
        lines = [head, *(f"  {n[0].upper()}{n[1:]}" for n in notes if n),
                 f"  {'rank':>4}  {'median ms':>10}  {'spread ms':>10}  {'x best':>6}  config"]
        for i, row in enumerate(rows, 1):
            what = ("XLA (the reference)" if row.get("implementation") == "xla"
                    else _config_text(row["config"]) + ("  [default]" if row.get("default")
                                                        else ""))
            ratio = row["median_ms"] / self.best_ms if self.best_ms > 0 else math.nan
            lines.append(f"  {i:>4}  {row['median_ms']:>10.4g}  {row.get('spread_ms', 0):>10.3g}"
                         f"  {ratio:>6.2f}  {what}")
        verdict = self.provenance.get("ranking_noise") or {}
        clamped = self.provenance.get("clamped")
        claim = (f"best: {_config_text(self.best)}{f' ({clamped})' if clamped else ''}, "
                 f"{self.best_ms:.4g} ms")
        if rows and rows[0].get("default"):
            claim += ": the default (no config beat it)"
        elif math.isfinite(self.speedup) and verdict.get("default_ahead_by") is not False:
            claim += f", {self.speedup:.2f}x the default"
        if self.implementation == "xla":
            claim += "; calls run XLA (it beat every config)"
        lines.append(claim)
        if "note" in verdict:
            lines.append("NOISE: " + verdict["note"])
        if self.cache_path:
            lines.append(f"cache: {self.cache_path}")
        return "\n".join(lines)

    def counted(self) -> str:
        """The trials, each counted once and said what it is: ``17 trials: 12 timed
        (trials=12; 3 stopped early as slow, over 2x the best so far), 5 duplicates (an
        earlier trial's program: not run again)``."""
        t = self.tally
        slow = sum(r.outcome.value == "slow" and r.duplicate_of is None for r in self.records)
        factor = getattr(self.options, "slow_factor", None)
        timed = [f"trials={self.options.trials}"] if self.options is not None else []
        if slow:
            timed.append(f"{slow} stopped early as slow"
                         + (f", over {factor:g}x the best so far" if factor else ""))
        words = {"timed": f" ({'; '.join(timed)})" if timed else "",
                 "infeasible": " (refused before running)",
                 "failed": " (compile or run errors, wrong results, time-outs)",
                 "duplicates": " (an earlier trial's program: not run again)"}
        parts = [f"{t[k]} {k[:-1] if k == 'duplicates' and t[k] == 1 else k}{words[k]}"
                 for k in words if t.get(k)]
        n = t["trials"]
        return f"{n} trial{'' if n == 1 else 's'}" + (": " + ", ".join(parts) if parts else "")

    @property
    def within_noise(self) -> bool:
        """Whether the final ranking could not tell the winner from the runner-up or the
        default (see :mod:`pallas_tune.tuning.noise`)."""
        verdict = self.provenance.get("ranking_noise") or {}
        return "note" in verdict

    @property
    def speedup(self) -> float:
        """The default's time over the winner's, from the same runs (NaN when unknown)."""
        if math.isfinite(self.default_ms) and self.best_ms > 0:
            return self.default_ms / self.best_ms
        return math.nan

    @property
    def best(self) -> dict[str, Any]:
        """The winning config."""
        return dict(self.best_record.config)

    @property
    def counts(self) -> dict[str, int]:
        """Trials asked of the sampler, evaluated, distinct programs, device timings spent."""
        return dict(self.provenance.get("counts", {}))

    @property
    def tally(self) -> dict[str, int]:
        """The trials counted as everywhere else (timed, infeasible, failed, duplicates; see
        :func:`pallas_tune.measure.records.tally`)."""
        from pallas_tune.measure.records import tally

        return tally((r.outcome.value, r.duplicate_of is not None) for r in self.records)

    @property
    def trials(self) -> pd.DataFrame:
        """One row per trial: the parameters, ``outcome``, ``median_ms``, ``error`` and more.
        ``median_ms`` is the figure this result states for the trial's program, as
        :meth:`table` and ``best_ms`` do: the final re-ranking's median where it was re-timed
        there, else its search-phase median (``figure``: ``"re-ranking"`` or ``"search"``);
        ``search_median_ms`` is always the search phase's."""
        import pandas as pd

        ranked = {row["trial"]: row["median_ms"] for row in self.ranking if "trial" in row}
        rows = []
        for r in self.records:
            m = r.measurement
            program = r.number if r.duplicate_of is None else r.duplicate_of
            rows.append({
                "number": r.number, **{k: _cell(v) for k, v in r.config.items()},
                "outcome": r.outcome.value, "median_ms": ranked.get(program, r.median_ms),
                "figure": "re-ranking" if program in ranked else "search",
                "search_median_ms": r.median_ms,
                "spread_ms": m.spread_ms if m else math.nan,
                "compile_ms": m.compile_ms if m else math.nan,
                "runs": len(m.times_ms) if m else 0,
                "max_abs_err": r.max_abs_err if r.max_abs_err is not None else math.nan,
                "duplicate_of": r.duplicate_of if r.duplicate_of is not None else pd.NA,
                "fingerprint": r.fingerprint, "phase": r.phase, "seconds": r.seconds,
                "detail": r.detail, "error": r.error})
        return pd.DataFrame(rows)

    def to_entry(self) -> dict[str, Any]:
        """The cache entry: the winner, its re-ranked time, every trial, the provenance; an
        estimate's shortlist (its best K, for --confirm-top) beside the provenance, so that
        the winners file keeps it whole."""
        provenance = dict(self.provenance)
        shortlist = provenance.pop("shortlist", None)
        return {
            "key": self.key,
            "config": self.best,
            "median_ms": self.best_ms,
            "spread_ms": self.best_spread_ms,
            "search_median_ms": self.best_record.median_ms,
            **({"default_ms": self.default_ms} if math.isfinite(self.default_ms) else {}),
            **({"effective": self.effective} if self.effective else {}),
            **xla_fields(self.xla_ms, self.best_ms, self.xla_partial, self.implementation),
            "provenance": provenance,
            **({"shortlist": shortlist} if shortlist else {}),
            "trials": [r.to_json() for r in self.records],
        }


def xla_fields(xla_ms: float, best_ms: float, partial: int, implementation: str
               ) -> dict[str, Any]:
    """A cache entry's fields on XLA: its time and the winner's margin over it (where it was
    timed or estimated), the ops it has without an estimate, and ``implementation: "xla"``
    where the call runs XLA."""
    return {
        **({"xla_ms": xla_ms, "margin_over_xla": xla_ms / best_ms}
           if math.isfinite(xla_ms) and best_ms > 0 else {}),
        **({"xla_partial": partial} if partial else {}),
        **({"implementation": "xla"} if implementation == "xla" else {}),
    }


def _config_text(config: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in dict(config).items())


def _cell(v: Any) -> Any:
    return str(v) if isinstance(v, tuple) else v
