"""What the user sees while a run goes: progress bars (rich) and log lines.

The loop talks to a :class:`Progress`; :class:`PlainProgress` prints lines (tests,
pipes), :class:`RichProgress` draws bars for rollouts, updates and validation.
"""

from __future__ import annotations

from typing import Protocol


class Progress(Protocol):
    """The loop's view of the display."""

    def log(self, message: str) -> None:
        """Print one line above the bars."""

    def phase(self, description: str, total: int) -> None:
        """Start a phase of ``total`` steps (replaces the previous phase's bar)."""

    def advance(self, steps: int = 1) -> None:
        """Advance the current phase."""


class PlainProgress:
    """Prints log lines only."""

    def log(self, message: str) -> None:
        print(message, flush=True)

    def phase(self, description: str, total: int) -> None:
        pass

    def advance(self, steps: int = 1) -> None:
        pass


class RichProgress:
    """Two rich bars: iterations overall, and the current phase. Use as a context manager.

    Each bar shows its elapsed time and an estimate of the time left. Log lines carry the
    time but not the source line that printed them (rich's ``log_path``, which only named
    this module). The default console writes to stderr.
    """

    # Iterations take minutes: the estimate of the time left averages over the whole run,
    # not over rich's default 30 s window, which would often hold one step and show no estimate.
    SPEED_WINDOW_S = 24 * 3600.0

    def __init__(self, iterations: int, console=None):
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        if console is None:
            console = Console(stderr=True, log_path=False)
        self.bars = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(),
            console=console, transient=False, speed_estimate_period=self.SPEED_WINDOW_S,
        )
        self.iterations = iterations
        self.overall = None
        self.current = None

    def __enter__(self) -> "RichProgress":
        return self  # the bars start with the first phase, so an early error prints alone

    def __exit__(self, *exc) -> None:
        if self.overall is not None:
            self.bars.__exit__(*exc)

    def _start(self) -> None:
        if self.overall is None:
            self.bars.__enter__()
            self.overall = self.bars.add_task("iterations", total=self.iterations)

    def log(self, message: str) -> None:
        from rich.markup import escape

        self.bars.console.log(escape(message))  # "[task] options" is text, not rich markup

    def phase(self, description: str, total: int) -> None:
        self._start()
        if self.current is not None:
            self.bars.remove_task(self.current)
        self.current = self.bars.add_task(description, total=total)

    def advance(self, steps: int = 1) -> None:
        if self.current is not None:
            self.bars.advance(self.current, steps)

    def iteration_done(self, iteration: int) -> None:
        """Set the overall bar to ``iteration + 1`` completed."""
        self._start()
        self.bars.update(self.overall, completed=iteration + 1)
