"""One writer per run directory: an advisory lock that a second process cannot take.

Two ``selfrl serve`` processes on one run directory would each run a background learner
on the same store and adapter folders, and their pins and served versions would disagree.
The lock is ``fcntl.flock`` on ``RUN_DIR/selfrl.lock``: the kernel drops it when the
holder exits, however it exits (kill -9 included), so a crash never leaves a stale lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class RunDirLocked(RuntimeError):
    """Another process holds the run directory."""


class RunDirLock:
    """Hold ``run_dir``'s lock until :meth:`release` (or process exit).

    Raises:
        RunDirLocked: another process (or another open lock in this one) holds it.
    """

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "selfrl.lock"
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise RunDirLocked(f"{run_dir} is in use by another selfrl process (it holds {self.path}); "
                               "stop it, or choose another --run-dir") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, str(os.getpid()).encode())

    def release(self) -> None:
        """Let another process take the run directory (idempotent)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
