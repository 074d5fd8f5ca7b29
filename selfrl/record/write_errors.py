"""A write that the machine refused, said in one line: what happened, where, and what to do.

Any write of a run can fail for a reason that is the machine's, not the input's: a full
disk (``ENOSPC``), a spent quota (``EDQUOT``), a read-only file system (``EROFS``), a
permission refused (``EACCES``, ``EPERM``), an I/O error (``EIO``). Python raises
``OSError`` with the errno; SQLite raises ``sqlite3.OperationalError`` with its own text
("database or disk is full", "attempt to write a readonly database", "disk I/O error");
safetensors and other native writers raise their own exception with the OS error in its
text. :func:`write_failure` recognises all three, following ``__cause__`` and
``__context__``; the console script turns it into ``selfrl: error: disk full at PATH:
free space and run with --resume RUN_DIR`` and exit code 1 (``selfrl.cli``).

Nothing is lost by stopping there: each store write is one SQLite transaction and each
adapter version is renamed into place only once complete (``selfrl.record.adapters``), so the
last good version and every stored trajectory are intact, and ``--resume`` goes on.
"""

from __future__ import annotations

import errno
import sqlite3
from dataclasses import dataclass
from pathlib import Path

# errno -> (what happened, what to do)
CAUSES = {
    errno.ENOSPC: ("disk full", "free space"),
    errno.EDQUOT: ("disk quota exceeded", "free space or raise the quota"),
    errno.EROFS: ("read-only file system", "make it writable (or copy the run directory to a writable disk)"),
    errno.EACCES: ("permission denied", "give this user write access"),
    errno.EPERM: ("operation not permitted", "give this user write access"),
    errno.EIO: ("I/O error", "check the disk"),
}

# SQLite's text for the same causes (sqlite3.OperationalError carries no errno)
SQLITE_TEXT = {
    "database or disk is full": errno.ENOSPC,
    "readonly database": errno.EROFS,
    "disk i/o error": errno.EIO,
    "unable to open database file": errno.EACCES,
}

# the OS's text, as native writers (safetensors' "Os { code: 28, ... }", tensorboard) pass it on
OS_TEXT = {
    "no space left on device": errno.ENOSPC,
    "disk quota exceeded": errno.EDQUOT,
    "read-only file system": errno.EROFS,
    "permission denied": errno.EACCES,
}


@dataclass(frozen=True)
class WriteFailure:
    """A write refused by the machine: the errno (one of :data:`CAUSES`) and where."""

    errno: int
    path: str

    def message(self, then: str) -> str:
        """One line: ``"disk full at PATH: free space and <then>"``."""
        what, fix = CAUSES[self.errno]
        return f"{what} at {self.path}: {fix} and {then}"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def write_failure(exc: BaseException, where: str | Path, store: str | Path | None = None) -> WriteFailure | None:
    """The write failure behind ``exc``, or None when it is something else.

    Args:
        exc: any exception.
        where: the path to name when the error names none (the run directory).
        store: the SQLite file to name for an SQLite error (default: ``where/selfrl.db``).
    """
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in CAUSES:
            return WriteFailure(e.errno, str(e.filename or where))
        if isinstance(e, sqlite3.Error):
            text = str(e).lower()
            for phrase, code in SQLITE_TEXT.items():
                if phrase in text:
                    return WriteFailure(code, str(store or Path(where) / "selfrl.db"))
        if not isinstance(e, (OSError, sqlite3.Error)):
            text = str(e).lower()
            for phrase, code in OS_TEXT.items():
                if phrase in text:
                    return WriteFailure(code, str(where))
    return None
