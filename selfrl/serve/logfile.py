"""The server's log file: ``RUN_DIR/serve.log``, rotated by size so that weeks of serving keep
at most ``log_max_bytes * (log_backups + 1)`` bytes of it.

What goes there: every record of the ``selfrl`` loggers at INFO and above (the background
learner's pauses, resumes and errors, among them), with its time. The console keeps what it
showed before: WARNING and above on stderr (uvicorn's own messages stay on the console: uvicorn
configures its loggers itself when it starts). The rotation is the standard
library's :class:`logging.handlers.RotatingFileHandler` (``serve.log`` -> ``serve.log.1`` -> ...,
the oldest deleted).
"""

from __future__ import annotations

import logging
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path

LOG_NAME = "serve.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def open_log(run_dir: str | Path, max_bytes: int, backups: int, name: str = LOG_NAME) -> RotatingFileHandler | None:
    """Attach ``run_dir/<name>`` (``serve.log``; a replica writes its own file, since two processes
    must not rotate one; rotated at ``max_bytes``, ``backups`` old files kept) to the
    server's loggers, and a WARNING handler on stderr to ``selfrl`` (which had none: Python's
    last-resort handler printed its warnings). Returns the file handler (None with ``max_bytes = 0``:
    no file); :func:`close_log` detaches it.

    Raises:
        OSError: the log file cannot be opened (a read-only run directory).
    """
    if max_bytes == 0:
        return None
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    handler = RotatingFileHandler(Path(run_dir) / name, maxBytes=max_bytes, backupCount=backups,
                                  encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.setLevel(logging.INFO)
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    handler.console = console  # detached with it
    ours = logging.getLogger("selfrl")
    ours.addHandler(console)
    ours.addHandler(handler)
    if ours.getEffectiveLevel() > logging.INFO:
        ours.setLevel(logging.INFO)
    return handler


def close_log(handler: RotatingFileHandler | None) -> None:
    """Detach and close what :func:`open_log` attached."""
    if handler is None:
        return
    ours = logging.getLogger("selfrl")
    ours.removeHandler(handler)
    ours.removeHandler(handler.console)
    handler.close()
