"""A sweep you can watch: a live display on a terminal (rich, when installed), plain flushed
lines otherwise, nothing with ``-q``. Fed by ``TuneOptions.callbacks``."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

__all__ = ["SweepProgress"]


def _ms(v: float) -> str:
    return f"{v:.4g} ms" if math.isfinite(v) else "-"


class SweepProgress:
    """One per shape: ``callback`` is a ``TuneOptions`` callback; ``close`` ends the display.

    Shows trials done of the total, outcome counts, the best so far against the kernel's
    default config (once the default has been timed) and an ETA from the time per trial."""

    def __init__(self, *, label: str, total: int, default: dict[str, Any] | None,
                 mode: str = "auto", stream: TextIO | None = None, verbose: bool = False):
        self.label = label
        self.total = total
        self.default = default
        self.stream = stream or sys.stdout
        self.verbose = verbose
        self.seen: list[tuple[str, bool]] = []  # (outcome, duplicate) per trial: the tally.
        self.default_ms = math.nan
        self.started = time.perf_counter()
        self._live = None
        if mode == "auto":
            mode = "live" if self.stream.isatty() else "lines"
        self.mode = mode
        if mode == "live":
            try:
                self._start_live()
            except ImportError:  # rich is optional: plain lines instead.
                self.mode = "lines"

    def _start_live(self) -> None:
        """The label (a key can be long) on a line of its own, then a row of the bar and the
        columns that must not shrink (done/total, elapsed, ETA), then the status folded on a
        line of its own: it reads at 80 columns as at 200."""
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        from rich.table import Column

        from rich.text import Text

        class _TwoLines(Progress):  # The row, then the status folded below it.
            def get_renderables(self) -> Any:
                yield self.make_tasks_table(self.tasks)
                for task in self.tasks:
                    yield Text(str(task.fields.get("status", "")), overflow="fold")

        console = Console(file=self.stream)
        console.print(self.label, overflow="fold", highlight=False, markup=False)
        fixed = {"no_wrap": True}
        self._live = _TwoLines(
            BarColumn(bar_width=None), MofNCompleteColumn(table_column=Column(**fixed)),
            TimeElapsedColumn(table_column=Column(**fixed)), TextColumn("ETA"),
            TimeRemainingColumn(table_column=Column(**fixed)),
            console=console, transient=False, expand=True)
        self._task = self._live.add_task(self.label, total=self.total, status="")
        self._live.start()

    def callback(self, record: Any, progress: Any) -> None:
        self.seen.append((record.outcome.value, record.duplicate_of is not None))
        if (self.default is not None and record.config == self.default
                and record.outcome.timed and record.duplicate_of is None):
            self.default_ms = record.median_ms
        done = min(progress.timed + getattr(progress, "from_storage", 0), self.total)
        status = self.status(progress)
        if self.mode == "live" and self._live is not None:
            self._live.update(self._task, completed=done, status=status)
            if self.verbose:
                self._live.console.print(self.trial_line(record))
        elif self.mode == "lines":
            elapsed = time.perf_counter() - self.started
            eta = (elapsed / done * (self.total - done)) if done else math.nan
            eta_text = f"ETA {eta:.0f}s" if math.isfinite(eta) else "ETA ?"
            line = f"  {self.label}: {done}/{self.total} timed, {eta_text}, {status}"
            if self.verbose:
                line = self.trial_line(record) + "\n" + line
            print(line, file=self.stream, flush=True)

    def status(self, progress: Any) -> str:
        from pallas_tune.measure.records import describe_tally, tally

        counts = describe_tally(tally(self.seen))
        best = f"search best {_ms(progress.best_ms)}"  # One run each; the final line re-times.
        if math.isfinite(self.default_ms) and math.isfinite(progress.best_ms):
            best += f" vs default {_ms(self.default_ms)} ({self.default_ms / progress.best_ms:.2f}x)"
        return f"{best}; {counts}"

    @staticmethod
    def trial_line(record: Any) -> str:
        from pallas_tune.cli.options import _fmt_config

        if record.duplicate_of is not None:
            what = f"same program as trial {record.duplicate_of}"
        elif record.outcome.timed:
            what = f"{record.outcome.value} {record.median_ms:.4g} ms"
        else:
            first = record.error.splitlines()[0][:120] if record.error else ""
            what = f"{record.outcome.value} ({first})"
        return f"  [{record.number:3d}] {_fmt_config(record.config)} -> {what}"

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
