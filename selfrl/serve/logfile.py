"""The server's log: ``RUN_DIR/serve.log``, rotated by size so that weeks of serving keep
at most ``log_max_bytes * (log_backups + 1)`` bytes of it, and the lines on the console.

What goes to the file: every record of the ``selfrl`` loggers at INFO and above, with its time:
every event the store records (logged by :meth:`selfrl.record.versions.Ledger.event` on
``selfrl.events.<kind>``: a promotion with the candidate's held-out success and the champion's,
a rejection with its reason, a collapse with its rollback and back-off, ...), the background
learner's pauses, resumes and errors, refused requests. What goes to stderr, with the time:
WARNING and above, and the events in :data:`CONSOLE_EVENTS`, the version lifecycle a person
watching the server wants to see as it happens. uvicorn's own messages stay on the console
(uvicorn configures its loggers itself when it starts). The rotation is the standard library's
:class:`logging.handlers.RotatingFileHandler` (``serve.log`` -> ``serve.log.1`` -> ..., the
oldest deleted).

Events a client can repeat as often as it likes (:data:`REPEATED_EVENTS`: late feedback, per
response) are written once a :data:`REPEAT_WINDOW_S` per response: the first line, then a count
of those not written one by one (:class:`Repeats`), at the next line of the log after the window
or when the log is closed. The store's ``events`` table keeps every one.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from logging.handlers import RotatingFileHandler
from pathlib import Path

from selfrl.record.versions import EventKind, event_logger

LOG_NAME = "serve.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
CONSOLE_FORMAT = "%(asctime)s selfrl: %(message)s"
CONSOLE_TIME = "%Y-%m-%d %H:%M:%S"  # local wall-clock time, to the second

# the events shown on the console as well as in the file: versions promoted, rejected, rolled
# back (a collapse, or an admin), the back-off stepping back, a stop, pins, alerts at restart
# and from the detectors; the routine ones (swap, skip, late feedback, disconnect, prune, ...)
# are in the file only; the learner's pauses, resumes and errors are WARNING lines of their own
CONSOLE_EVENTS = frozenset({
    EventKind.PROMOTE, EventKind.REJECT, EventKind.CORRUPT_VERSION, EventKind.MISSING_VERSION,
    EventKind.COLLAPSE, EventKind.COLLAPSE_STOP, EventKind.STEP_BACK, EventKind.ROLLBACK, EventKind.PIN,
    EventKind.UNPIN, EventKind.RECOVER, EventKind.HACKING, EventKind.SWAP_CHECK_FAILED})


REPEAT_WINDOW_S = 60.0  # seconds in which one response's repeated events are written once
REPEATED_EVENTS = {EventKind.LATE_FEEDBACK: "response_id"}  # kind -> the event data's key they are grouped by


class Repeats:
    """Which records of :data:`REPEATED_EVENTS` the file writes. Per (kind, response): the first is
    written; the next ones within ``window`` seconds of it are counted, not written; once the window
    has passed, one line says how many were not written (:meth:`due`, at the next record of the log, or
    :meth:`flush` at close), and the next one is written again. Counts are never lost: a key leaves
    only with its line."""

    def __init__(self, window: float = REPEAT_WINDOW_S):
        self.window = window
        self.keys = {event_logger(kind).name: (kind.value, field) for kind, field in REPEATED_EVENTS.items()}
        self.open: dict[tuple[str, str, str], list] = {}  # (logger, kind, id) -> [time of its written line, not written]
        self.swept = 0.0

    def admit(self, record: logging.LogRecord) -> bool:
        """Whether to write ``record`` (False: counted in its window)."""
        if record.name not in self.keys:
            return True
        kind, field = self.keys[record.name]
        value = (getattr(record, "event_data", None) or {}).get(field)
        if value is None:
            return True
        window = self.open.get((record.name, kind, str(value)))
        if window is None:
            self.open[(record.name, kind, str(value))] = [record.created, 0]
            return True
        window[1] += 1
        return False

    def due(self, now: float) -> list[logging.LogRecord]:
        """The count lines of the windows that passed by ``now`` (checked at most once a second)."""
        if now - self.swept < 1.0:
            return []
        self.swept = now
        return self._close([k for k, (t, _) in self.open.items() if now - t >= self.window], now)

    def flush(self, now: float) -> list[logging.LogRecord]:
        """The count lines of every open window (the log is closing)."""
        return self._close(list(self.open), now)

    def _close(self, keys: list, now: float) -> list[logging.LogRecord]:
        out = []
        for key in keys:
            name, kind, value = key
            since, n = self.open.pop(key)
            field = self.keys[name][1]
            if n:
                out.append(logging.makeLogRecord({
                    "name": name, "levelno": logging.INFO, "levelname": "INFO", "created": now,
                    "msg": f"{n} more {kind} events on {field} {value} in the {now - since:.0f} s since the line "
                           "above for it, not written one by one (the store's events table holds each)"}))
        return out


class ConsoleFilter(logging.Filter):
    """Passes WARNING and above, and the records of the events in ``kinds``."""

    def __init__(self, kinds=CONSOLE_EVENTS):
        super().__init__()
        self.names = frozenset(event_logger(k).name for k in kinds)

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name in self.names


class LogFile(RotatingFileHandler):
    """The rotated file, quiet when its disk refuses a write: the standard handler prints a
    traceback to stderr for every record it cannot write, and a full disk (which the server
    answers with 507s and the learner waits out) would fill the console with them. The first
    failure is one line on stderr; the records that fail are lost from the file only (the
    console keeps its own); the first record written again says how many were lost."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lost = 0  # records not written since the last failure began
        self._failed = False
        self.repeats = Repeats()

    def emit(self, record: logging.LogRecord) -> None:
        for line in self.repeats.due(record.created):
            self._emit(line)
        if self.repeats.admit(record):
            self._emit(record)

    def close(self) -> None:
        self.acquire()
        try:
            for line in self.repeats.flush(time.time()):  # the counts of the open windows
                self._emit(line)
        finally:
            self.release()
        super().close()

    def _emit(self, record: logging.LogRecord) -> None:
        if self.lost and self._write(logging.makeLogRecord({
                "name": "selfrl", "levelno": logging.WARNING, "levelname": "WARNING",
                "msg": f"{self.lost} lines of this log were lost while it could not be written"})):
            self.lost = 0
        if not self._write(record):
            self.lost += 1

    def _write(self, record: logging.LogRecord) -> bool:
        self._failed = False
        super().emit(record)  # the standard emit catches the error and calls handleError
        return not self._failed

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not self.lost and not self._failed:
            print(f"selfrl: {self.baseFilename} cannot be written ({error}); its lines are lost until it can",
                  file=sys.stderr, flush=True)
        self._failed = True


@dataclass
class ServeLog:
    """What :func:`open_log` attached to the ``selfrl`` logger: the file (None without one) and the console."""

    file: LogFile | None
    console: logging.Handler


def open_log(run_dir: str | Path, max_bytes: int, backups: int, name: str = LOG_NAME,
             stream=None) -> ServeLog:
    """Attach ``run_dir/<name>`` (``serve.log``; a replica writes its own file, since two processes
    must not rotate one; rotated at ``max_bytes``, ``backups`` old files kept; ``max_bytes = 0``:
    no file) and a console handler on ``stream`` (None: stderr; :class:`ConsoleFilter`) to the
    ``selfrl`` logger, and let its INFO records through. :func:`close_log` detaches them.

    Raises:
        OSError: the log file cannot be opened (a read-only run directory).
    """
    ours = logging.getLogger("selfrl")
    file = None
    if max_bytes:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        file = LogFile(Path(run_dir) / name, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        file.setFormatter(logging.Formatter(FORMAT))
        file.setLevel(logging.INFO)
        ours.addHandler(file)
    console = logging.StreamHandler(sys.stderr if stream is None else stream)
    console.setFormatter(logging.Formatter(CONSOLE_FORMAT, CONSOLE_TIME))
    console.setLevel(logging.INFO)
    console.addFilter(ConsoleFilter())
    ours.addHandler(console)
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    return ServeLog(file, console)


def close_log(handlers: ServeLog) -> None:
    """Detach and close what :func:`open_log` attached."""
    ours = logging.getLogger("selfrl")
    for h in (handlers.file, handlers.console):
        if h is not None:
            ours.removeHandler(h)
            h.close()
