"""Storage faults: which OS and SQLite errors mean that the run directory cannot be
written now (the disk is full, the quota spent, the file system read-only, the store
locked by another process, ...), and what to tell the user about each.

A storage fault is an operator's problem, not a bug: the answer to a client is a 507
(no space) or a 503 (anything else) that says what happened and what to do, never a
500 carrying SQLite's or the OS's text (that goes to the log only); a background job
pauses and retries once :func:`probe_writable` succeeds again.

Mapping (:func:`classify`; the exception, its ``__cause__`` and its ``__context__`` are
looked at, so an error wrapped by another is still found):

* ``disk_full`` (507): ``ENOSPC``; ``SQLITE_FULL``;
* ``quota_exceeded`` (507): ``EDQUOT``;
* ``read_only`` (503): ``EROFS``; ``SQLITE_READONLY``;
* ``permission_denied`` (503): ``EACCES``, ``EPERM``; ``SQLITE_PERM``;
* ``database_locked`` (503): ``SQLITE_BUSY``, ``SQLITE_LOCKED``;
* ``too_many_open_files`` (503): ``EMFILE``, ``ENFILE``;
* ``io_error`` (503): ``EIO``; ``SQLITE_IOERR``, ``SQLITE_CANTOPEN``.

SQLite's result code is read from ``sqlite_errorcode`` (its primary code, the low 8 bits);
an exception without one (raised by hand) is matched by SQLite's message instead.
"""

from __future__ import annotations

import enum
import errno
import os
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from selfrl.record.write_errors import OS_TEXT


class FaultKind(str, enum.Enum):
    """What is wrong with the storage; the ``code`` of the error a client gets."""

    DISK_FULL = "disk_full"
    QUOTA_EXCEEDED = "quota_exceeded"
    READ_ONLY = "read_only"
    PERMISSION_DENIED = "permission_denied"
    DATABASE_LOCKED = "database_locked"
    TOO_MANY_OPEN_FILES = "too_many_open_files"
    IO_ERROR = "io_error"


_ERRNO = {errno.ENOSPC: FaultKind.DISK_FULL, errno.EDQUOT: FaultKind.QUOTA_EXCEEDED, errno.EROFS: FaultKind.READ_ONLY,
          errno.EACCES: FaultKind.PERMISSION_DENIED, errno.EPERM: FaultKind.PERMISSION_DENIED,
          errno.EMFILE: FaultKind.TOO_MANY_OPEN_FILES, errno.ENFILE: FaultKind.TOO_MANY_OPEN_FILES,
          errno.EIO: FaultKind.IO_ERROR}
# SQLite's primary result codes (https://www.sqlite.org/rescode.html)
_SQLITE = {13: FaultKind.DISK_FULL, 8: FaultKind.READ_ONLY, 3: FaultKind.PERMISSION_DENIED,
           5: FaultKind.DATABASE_LOCKED, 6: FaultKind.DATABASE_LOCKED, 10: FaultKind.IO_ERROR, 14: FaultKind.IO_ERROR}
_SQLITE_TEXT = [("database or disk is full", FaultKind.DISK_FULL), ("is locked", FaultKind.DATABASE_LOCKED),
                ("readonly database", FaultKind.READ_ONLY), ("disk i/o error", FaultKind.IO_ERROR),
                ("unable to open database", FaultKind.IO_ERROR)]

_WHAT = {  # what happened, and what to do next; "{where}" is the folder
    FaultKind.DISK_FULL: "the disk that holds {where} is full: free space on it (old run directories, "
                         "adapters/.recovered)",
    FaultKind.QUOTA_EXCEEDED: "the disk quota of the user that runs selfrl is spent on {where}: free space or "
                              "raise the quota",
    FaultKind.READ_ONLY: "the file system that holds {where} is read-only (remounted after a disk error?): make "
                         "it writable",
    FaultKind.PERMISSION_DENIED: "selfrl may not write to {where}: give the user that runs it write access to "
                                 "the folder and every file in it",
    FaultKind.DATABASE_LOCKED: "the store selfrl.db in {where} is locked by another process (a backup, a shell, "
                               "a second writer): let it finish",
    FaultKind.TOO_MANY_OPEN_FILES: "selfrl ran out of file descriptors writing to {where}: raise the limit "
                                   "(ulimit -n) if it persists",
    FaultKind.IO_ERROR: "the disk that holds {where} reported an I/O error: check the disk (the system log says "
                        "more)",
}
_RETRY_AFTER_S = {FaultKind.DATABASE_LOCKED: 1, FaultKind.TOO_MANY_OPEN_FILES: 5}


@dataclass(frozen=True)
class StorageFault:
    """A storage fault, classified.

    Attributes:
        kind: what is wrong.
        where: the folder (or file) that could not be written.
        detail: the OS's or SQLite's own text (for the server log, never for clients).
    """

    kind: FaultKind
    where: str
    detail: str

    @property
    def status(self) -> int:
        """The HTTP status: 507 Insufficient Storage for no space, 503 Service Unavailable otherwise."""
        return 507 if self.kind in (FaultKind.DISK_FULL, FaultKind.QUOTA_EXCEEDED) else 503

    @property
    def retry_after_s(self) -> int:
        """Seconds a client should wait before it retries (the ``Retry-After`` header)."""
        return _RETRY_AFTER_S.get(self.kind, 30)

    @property
    def transient(self) -> bool:
        """Whether a retry within seconds may succeed (a lock, file descriptors); a full disk,
        a quota, a read-only or unwritable folder and an I/O error wait for an operator."""
        return self.kind in _RETRY_AFTER_S

    @property
    def message(self) -> str:
        """What happened and what to do next, in one sentence a user can act on."""
        return _WHAT[self.kind].format(where=self.where)


class StorageFaultError(Exception):
    """Raised to refuse work while a known storage fault lasts (:func:`classify` returns its fault)."""

    def __init__(self, fault: StorageFault):
        super().__init__(fault.message)
        self.fault = fault


def _kind(e: BaseException) -> FaultKind | None:
    if isinstance(e, OSError) and e.errno in _ERRNO:
        return _ERRNO[e.errno]
    if isinstance(e, sqlite3.Error):
        code = getattr(e, "sqlite_errorcode", None)
        if code is not None:
            return _SQLITE.get(code & 0xFF)
        text = str(e).lower()
        return next((kind for needle, kind in _SQLITE_TEXT if needle in text), None)
    if not isinstance(e, OSError):  # a native writer's error (safetensors' SafetensorError) carries only the OS's text
        text = str(e).lower()
        code = next((c for needle, c in OS_TEXT.items() if needle in text), None)
        return _ERRNO.get(code) if code is not None else None
    return None


def classify(e: BaseException, where: str | Path = "the run directory") -> StorageFault | None:
    """The storage fault behind ``e``, or None when ``e`` is none (see the module's table).

    Args:
        e: any exception; its ``__cause__`` and ``__context__`` chain is searched too.
        where: the folder the caller was writing to (an ``OSError``'s own file name is
            not shown to clients; it goes into ``detail``).

    >>> f = classify(OSError(28, "No space left on device"), "/runs/a")
    >>> f.kind.value, f.status, f.message.split(":")[0]
    ('disk_full', 507, 'the disk that holds /runs/a is full')
    >>> classify(sqlite3.OperationalError("database is locked")).status
    503
    >>> classify(ValueError("no")) is None
    True
    >>> classify(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")).status
    507
    """
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, StorageFaultError):
            return cur.fault
        kind = _kind(cur)
        if kind is not None:
            detail = f"{type(cur).__name__}: {cur}"
            return StorageFault(kind, str(where), detail[:500])
        cur = cur.__cause__ or cur.__context__
    return None


def is_storage_error(e: BaseException) -> bool:
    """Whether ``e`` is an OS or SQLite error, classified or not (its text is not for clients)."""
    return isinstance(e, (OSError, sqlite3.Error))


PROBE_BYTES = 1 << 20  # what probe_writable writes: enough for a few pages of SQLite and a small file


def free_space_error(folder: str | Path, need_bytes: int = PROBE_BYTES) -> OSError | None:
    """What ``statvfs`` says about ``folder``'s file system without writing to it: an
    ``OSError(EROFS)`` when it is mounted read-only, an ``OSError(ENOSPC)`` when fewer than
    ``need_bytes`` are free (for root, the blocks reserved for root count as free: root may
    write them), else None (also when ``statvfs`` itself fails: nothing is known). A quota
    is not seen here; a write that meets it is."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, "the file system is mounted read-only (statvfs)")
    free = (st.f_bfree if os.geteuid() == 0 else st.f_bavail) * st.f_frsize
    if free < need_bytes:
        return OSError(errno.ENOSPC, f"{free} bytes free, fewer than {need_bytes} (statvfs)")
    return None


def probe_writable(folder: str | Path, nbytes: int = PROBE_BYTES) -> None:
    """Write ``nbytes`` to a hidden file in ``folder``, fsync it and delete it.

    Raises:
        OSError: the write failed (:func:`classify` says why); nothing is left behind.
    """
    path = Path(folder) / f".selfrl-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        with open(path, "wb") as f:
            block = b"\0" * min(nbytes, 1 << 16)
            left = nbytes
            while left > 0:
                left -= f.write(block[:left])
            f.flush()
            os.fsync(f.fileno())
    finally:
        try:
            path.unlink()
        except OSError:
            pass
