"""A phase-by-phase progress display: a rich bar on a terminal, one line per phase otherwise.

Long phases report through the small :class:`Progress` protocol, so they know
nothing about rich and a benchmark can pass :class:`Silent` instead.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as RichProgress

__all__ = ["Bar", "Progress", "Silent"]


class Progress(Protocol):
    def phase(self, name: str, total: float | None) -> None:
        """Start a phase (the previous one ends); ``total`` units, or None if unknown."""

    def advance(self, amount: float = 1) -> None: ...

    def update(self, completed: float) -> None: ...

    def done(self) -> None:
        """End the current phase."""


class Silent:
    """No output (benchmarks and tests)."""

    def phase(self, name: str, total: float | None) -> None:
        return None

    def advance(self, amount: float = 1) -> None:
        return None

    def update(self, completed: float) -> None:
        return None

    def done(self) -> None:
        return None


class Bar:
    """rich progress bars on a terminal; a "phase … done in N s" line when piped."""

    def __init__(self, console: Console) -> None:
        self._console = console
        self._live = console.is_terminal
        self._rich = RichProgress(
            TextColumn("{task.description:<12}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not self._live,
        )
        self._task: TaskID | None = None
        self._name = ""
        self._started = 0.0

    def __enter__(self) -> Bar:
        self._rich.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.done()
        self._rich.stop()

    def phase(self, name: str, total: float | None) -> None:
        self.done()
        self._name = name
        self._started = time.perf_counter()
        self._task = self._rich.add_task(name, total=total)

    def advance(self, amount: float = 1) -> None:
        if self._task is not None:
            self._rich.advance(self._task, amount)

    def update(self, completed: float) -> None:
        if self._task is not None:
            self._rich.update(self._task, completed=completed)

    def done(self) -> None:
        if self._task is None:
            return
        task = self._rich.tasks[self._task]
        if task.total is not None:
            self._rich.update(self._task, completed=task.total)
        if not self._live:
            elapsed = time.perf_counter() - self._started
            self._console.print(f"{self._name}: done in {elapsed:.1f} s")
        self._task = None
