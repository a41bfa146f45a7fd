"""What :func:`pallas_tune.autotune` returns: every call of the program with its config
(:class:`TunedCall`), as a context manager that applies them (:class:`AutotuneResult`), kept as
strict JSON (a time not measured is ``null``) and written to the user cache on request."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from pallas_tune import chips
from pallas_tune.cache.files import sanitize
from pallas_tune.config import Config
from pallas_tune.runtime.tunable import resolution_hook

__all__ = ["AutotuneResult", "TunedCall", "ms_text"]


@dataclasses.dataclass(frozen=True)
class TunedCall:
    """A call of the program and the config it runs with. ``source``: ``"cache"`` (an entry
    existed: not tuned again), ``"tuned"`` (tuned here), ``"untuned"`` (its tuning failed,
    ``error`` says why; the result does not apply a config to it), or the fallback that served
    when tuning was not asked for. Times are those of the tuning run (NaN where not measured here),
    ``default_ms`` and ``best_ms`` from the same final ranking."""

    kernel: str
    key: str
    chip: str
    config: dict[str, Any]
    source: str
    implementation: str = "pallas"
    default_ms: float = math.nan
    best_ms: float = math.nan
    xla_ms: float = math.nan
    timer: str = ""
    xla_partial: int = 0  # Estimates: the reference's ops without an estimate (a lower bound).
    effective: dict[str, Any] | None = None  # What ``config`` runs as, where clamped.
    error: str = ""  # ``source == "untuned"``: why tuning failed (the call runs as it did).
    mesh: str = ""  # The mesh the call runs split over ("data=2,model=2"): its key is a shard's.

    def as_config(self) -> Config:
        return Config(self.config, source="tuned" if self.source == "tuned" else "cache",
                      origin="autotune", implementation=self.implementation)


class AutotuneResult:
    """What :func:`autotune` returns: the program's calls and their configs (see the module
    docstring). ``step_ms``: the whole program's time with each kernel's default config, with
    the tuned configs and with XLA for every kernel that has a reference, when asked for;
    ``step_timer`` says how it was obtained (wall clock, or a compiler ESTIMATE); under
    ``tpu-estimate``, ``step_detail`` holds per setting the cycles, the ops without an estimate
    and whether the figure is ``partial`` (a lower bound); see :mod:`pallas_tune.step.figures`."""

    def __init__(self, calls: Sequence[TunedCall], *, step_ms: Mapping[str, float] | None = None,
                 step_timer: str = "", results: Mapping[tuple[str, str], Any] | None = None,
                 step_detail: Mapping[str, Any] | None = None):
        self.calls = list(calls)
        self.step_ms = dict(step_ms or {})
        self.step_timer = step_timer
        self.step_detail = dict(step_detail or {})
        self._results = dict(results or {})
        self._by = {(c.chip, c.kernel, c.key): c for c in self.calls}
        self._hooks: list[Any] = []

    def __repr__(self) -> str:
        tuned = sum(c.source == "tuned" for c in self.calls)
        failed = sum(c.source == "untuned" for c in self.calls)
        xla = sum(c.implementation == "xla" for c in self.calls)
        return (f"AutotuneResult({len(self.calls)} calls: {tuned} tuned, "
                f"{len(self.calls) - tuned - failed} from the cache"
                + (f", {failed} could not be tuned" if failed else "") + f"; {xla} run XLA)")

    def __str__(self) -> str:
        """One row per call: kernel, key, where its config came from, what runs, its config
        and times (``-`` where not measured here), then the step's figures when asked for."""
        lines = [repr(self)]
        for c in self.calls:
            what = c.error if c.source == "untuned" else " ".join(
                f"{k}={v}" for k, v in (c.effective or c.config).items())
            lines.append(f"  {c.kernel.rsplit('.', 1)[-1]:<24} {c.source:<8} "
                         f"{c.implementation:<6} default {ms_text(c.default_ms)} ms, tuned "
                         f"{ms_text(c.best_ms)} ms, XLA {ms_text(c.xla_ms)} ms  {c.key}"
                         + (f" (a shard over {c.mesh})" if c.mesh else "") + f"  {what}")
        if self.step_ms:
            figures = ", ".join(f"{k} {ms_text(v)} ms" for k, v in self.step_ms.items())
            meshes = sorted({c.mesh for c in self.calls if c.mesh})  # A sharded step's.
            where = f" on the mesh {' and '.join(meshes)}" if meshes else ""
            lines.append(f"  step{where} ({self.step_timer}): {figures}")
        return "\n".join(lines)

    # ---- applying ----------------------------------------------------------------------------

    def __enter__(self) -> AutotuneResult:
        def apply(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Config | None:
            call = self._by.get((chips.current_chip(), kernel.name,
                                 kernel.cache_key(*args, **kwargs)))
            return call.as_config() if call is not None and call.source != "untuned" else None

        hook = resolution_hook(apply)
        _forget_traces()
        hook.__enter__()
        self._hooks.append(hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.pop().__exit__(*exc)
        _forget_traces()

    # ---- keeping -----------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """A JSON-safe form (strict JSON: a time not measured is ``null``, never ``NaN``)."""
        return sanitize({"schema": 1, "step_ms": self.step_ms, "step_timer": self.step_timer,
                        "step_detail": self.step_detail,
                        "calls": [dataclasses.asdict(c) for c in self.calls]})

    def dump(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1, default=str, allow_nan=False)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AutotuneResult:
        """A result from :meth:`to_json`'s form; raises ValueError naming what is wrong."""
        calls = data.get("calls") if isinstance(data, Mapping) else None
        if not isinstance(calls, list):
            raise ValueError("not an autotune result: no `calls` list")
        fields = {f.name for f in dataclasses.fields(TunedCall)}
        out = []
        for i, c in enumerate(calls):
            if not isinstance(c, dict) or not {"kernel", "key", "chip", "config",
                                               "source"} <= set(c):
                raise ValueError(f"call {i} is not an object with kernel, key, chip, config "
                                 "and source")
            if not isinstance(c["config"], dict):
                raise ValueError(f"call {i}: config is not an object")
            times = {k: math.nan for k in _TIMES if c.get(k) is None}  # null: not measured.
            out.append(TunedCall(**{**{k: v for k, v in c.items() if k in fields}, **times}))
        step_ms = data.get("step_ms") if isinstance(data.get("step_ms"), dict) else {}
        detail = data.get("step_detail") if isinstance(data.get("step_detail"), dict) else {}
        return cls(out, step_ms=step_ms, step_timer=str(data.get("step_timer", "")),
                   step_detail=detail)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> AutotuneResult:
        with open(path, encoding="utf-8") as f:
            return cls.from_json(json.load(f))

    @classmethod
    def merge(cls, *results: AutotuneResult) -> AutotuneResult:
        """One result of several (later results win for the same chip, kernel and key)."""
        by: dict[tuple[str, str, str], TunedCall] = {}
        for r in results:
            by.update({(c.chip, c.kernel, c.key): c for c in r.calls})
        return cls(list(by.values()))

    def write(self) -> list[str]:
        """Writes the calls tuned here to the user cache (their full tuning results, trials
        included); returns the files written."""
        from pallas_tune.tuning import finish

        paths = []
        for (name, key), (kernel, result) in self._results.items():
            del name, key  # Keyed for lookups; the result carries both.
            paths.append(finish.write(kernel, result).cache_path)
            with kernel._lock:  # Lookups in this process see the new entries.
                kernel._memo.clear()
        return paths


_TIMES = ("default_ms", "best_ms", "xla_ms")


def ms_text(v: Any) -> str:
    """A time for people: 4 significant digits, ``-`` where it was not measured."""
    return f"{v:.4g}" if isinstance(v, int | float) and math.isfinite(v) else "-"


def _forget_traces() -> None:
    """JAX caches traces (``jax.jit``, ``make_jaxpr``) by function and shapes, not by the
    configs our calls resolve to: entering or leaving a result clears them, so a program
    jitted before is traced again with the configs now in force (and compiled again)."""
    import jax

    jax.clear_caches()
