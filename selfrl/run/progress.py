"""What the user sees while a run goes: progress bars (rich) and log lines.

The loop talks to a :class:`Progress`; :class:`PlainProgress` prints lines (tests,
pipes), :class:`RichProgress` draws bars for rollouts, updates and validation.
:class:`ProgressLog` wraps either and also writes every line to ``RUN_DIR/progress.log``
(a ``logging.handlers.RotatingFileHandler``, flushed line by line), with a heartbeat line
whenever ``heartbeat_s`` pass without one, so that a long validation shows life in the
file, and on the screen when it is not a terminal (rich draws no bars there).
"""

from __future__ import annotations

import logging
import logging.handlers
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

PROGRESS_LOG = "progress.log"  # in the run directory
HEARTBEAT_S = 60.0  # a line at least this often while a phase runs
LOG_MAX_BYTES, LOG_BACKUPS = 10 * 2**20, 3  # progress.log, progress.log.1 .. .3


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

    interactive = False  # prints no bars: a heartbeat line is useful here too (ProgressLog)

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

    @property
    def interactive(self) -> bool:
        """Whether the bars are drawn (a terminal); rich draws none into a file or a pipe."""
        return self.bars.console.is_terminal

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


class ProgressLog:
    """A :class:`Progress` that passes everything to ``inner`` and writes every log line to
    ``path`` too, with the time, flushed at once (``logging`` with a ``RotatingFileHandler``:
    ``LOG_MAX_BYTES`` a file, ``LOG_BACKUPS`` kept). While a phase runs, a heartbeat line
    (``"validation (version 0): 64 of 128 done, 95 s"``) follows whenever ``heartbeat_s`` pass without
    a line, from a daemon thread; it goes to ``inner`` as well when ``inner`` draws no bars
    (``interactive`` false: output to a file or a pipe). The file is opened at the first line
    (after the run directory's lock is held) and appended to, so a resumed run continues it.
    Call :meth:`close` at the end.

    Args:
        inner: the display (:class:`RichProgress`, :class:`PlainProgress`).
        path: the log file, e.g. ``RUN_DIR/progress.log``.
        heartbeat_s: seconds without a line before a heartbeat (> 0).
        clock: seconds, monotonic (tests pass their own).

    Raises:
        ValueError: ``heartbeat_s`` is not > 0.
    """

    def __init__(self, inner: Progress, path: str | Path, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic):
        if not heartbeat_s > 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s!r}")
        self.inner, self.path, self.heartbeat_s, self.clock = inner, Path(path), heartbeat_s, clock
        self.lock = threading.Lock()
        self.logger: logging.Logger | None = None
        self.handler: logging.Handler | None = None
        self.description, self.total, self.done = None, 0, 0
        self.phase_start = self.last_line = clock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        if hasattr(inner, "iteration_done"):  # the loop looks for it (the overall bar)
            self.iteration_done = inner.iteration_done

    def _write(self, message: str) -> None:
        if self.logger is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.handler = logging.handlers.RotatingFileHandler(self.path, maxBytes=LOG_MAX_BYTES,
                                                                backupCount=LOG_BACKUPS, encoding="utf-8")
            self.handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
            # a logger of its own, not in logging's registry (which keeps every named logger for
            # good), that never passes records to the root logger's handlers
            self.logger = logging.Logger(f"selfrl.progress.{self.path}")
            self.logger.propagate = False
            self.logger.setLevel(logging.INFO)
            self.logger.addHandler(self.handler)
        self.logger.info(message)  # the handler flushes after each record
        self.last_line = self.clock()

    def log(self, message: str) -> None:
        with self.lock:
            self._write(message)
        self.inner.log(message)

    def phase(self, description: str, total: int) -> None:
        with self.lock:
            self.description, self.total, self.done = description, total, 0
            self.phase_start = self.clock()
        self.inner.phase(description, total)
        if self.thread is None:
            # not joined at exit (selfrl.core.threads_at_exit): it only writes a log file, no torch, no store
            self.thread = threading.Thread(target=self._beat_loop, name="selfrl-progress-log", daemon=True)
            self.thread.start()

    def advance(self, steps: int = 1) -> None:
        with self.lock:
            self.done += steps
        self.inner.advance(steps)

    def beat(self) -> str | None:
        """Write a heartbeat line if ``heartbeat_s`` passed without a line during a phase; return it."""
        with self.lock:
            now = self.clock()
            if self.description is None or now - self.last_line < self.heartbeat_s:
                return None
            # "64 of 128 done", not "64/128": a validation's count reads as correct answers otherwise
            line = f"{self.description}: {self.done} of {self.total} done, {now - self.phase_start:.0f} s"
            self._write(line)
        if not getattr(self.inner, "interactive", True):  # no bar shows it: say it there too
            self.inner.log(line)
        return line

    def _beat_loop(self) -> None:
        while not self.stop.wait(min(self.heartbeat_s, 1.0)):
            self.beat()  # a failed write is logging's to report (Handler.handleError), never this thread's end

    def close(self) -> None:
        """Stop the heartbeat and close the file."""
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        with self.lock:
            if self.handler is not None:
                self.logger.removeHandler(self.handler)
                self.handler.close()
                self.logger = self.handler = None
