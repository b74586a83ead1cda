"""Progress of a run: phase messages, and counted steps (ranks traced, calls proven) for a display.

`verify` takes any `progress(message)` callable; one that also has `show_count(what, done, total,
reused)` (RichProgress) is told counted steps too, through `count` below.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn

SHOW_AFTER = 2.0  # seconds: quicker runs print nothing


def count(progress: Callable[[str], None], what: str, done: int, total: int, reused: int = 0) -> None:
    """Tell `progress` how far a counted step is, if it shows counts."""
    show: Any = getattr(progress, "show_count", None)
    if show is not None:
        show(what, done, total, reused)


class RichProgress:
    """A live display on stderr, shown once a run has taken `SHOW_AFTER` seconds: one bar per
    counted step (done / total, memo hits, ETA) under the current phase."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.started = time.perf_counter()
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[reused]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=True,
        )
        self.tasks: dict[str, TaskID] = {}
        self.phase = self.bars.add_task("starting", total=None, reused="")
        self.live = False

    def __call__(self, message: str) -> None:
        self.bars.update(self.phase, description=message)
        self._show()

    def show_count(self, what: str, done: int, total: int, reused: int = 0) -> None:
        if what not in self.tasks:
            self.tasks[what] = self.bars.add_task(what, total=total, reused="")
        hits = f"{reused} memo hits" if reused else ""
        self.bars.update(self.tasks[what], completed=done, total=total, reused=hits)
        self._show()

    def _show(self) -> None:
        if not self.live and time.perf_counter() - self.started >= SHOW_AFTER:
            self.bars.start()
            self.live = True

    def close(self) -> None:
        if self.live:
            self.bars.stop()
