"""One writer per run directory: an advisory lock that a second process cannot take.

Two writers on one run directory store the same iterations twice, collide on version
folders and interleave two lineages in one ledger; two ``selfrl serve`` would each run a
background learner and disagree on the pin. So every process that writes a run directory
holds this lock for as long as it writes: ``selfrl run`` (fresh, ``--resume``, with
``--warm-start`` or ``--ray``), ``selfrl serve`` (not a ``--replica``, which follows the
owner) and ``selfrl report`` when it writes its report into the run directory. Readers
(``selfrl report --out``, ``selfrl compare``) take no lock: the store serves them
read-only while a writer runs.

The lock is ``fcntl.flock`` on ``RUN_DIR/selfrl.lock``: the kernel drops it when the
holder exits, however it exits (kill -9 included), so a crash never leaves a stale lock;
the file's content (the holder's pid and command) is only there to name it in a refusal.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

LOCK_FILE = "selfrl.lock"


class RunDirLocked(RuntimeError):
    """Another process holds the run directory; the message names it and what to do."""


def holder(path: Path) -> str:
    """Who holds the lock at ``path``, as its file says: ``"selfrl run (pid 1234)"``, or
    ``"pid unknown"`` while the holder has not written itself there yet."""
    try:
        text = path.read_text()
    except OSError:
        return "pid unknown"
    try:
        info = json.loads(text)
        return f"{info['command']} (pid {info['pid']})"
    except (ValueError, KeyError, TypeError):  # a lock file written by an older selfrl: the pid alone
        return f"pid {text.strip()}" if text.strip().isdigit() else "pid unknown"


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


class RunDirLock:
    """Hold ``run_dir``'s lock until :meth:`release` (or process exit).

    Args:
        run_dir: the run directory (it must exist).
        command: what holds it, named to whoever is refused (``"selfrl run"``).
        instead: what a refused process may do instead, for its message.

    Raises:
        RunDirLocked: another process (or another open lock in this one) holds it.
        OSError: the lock file cannot be created or written (a read-only or full disk).
    """

    def __init__(self, run_dir: Path, command: str = "selfrl", instead: str = "choose another run directory"):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None
        while self._fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                who = holder(self.path)
                pid = who.rsplit("pid ", 1)[-1].rstrip(")")
                stop = f"wait for it to end or stop it (kill {pid})" if pid.isdigit() else "wait for it to end"
                raise RunDirLocked(f"{run_dir} is in use by another selfrl process, {who}, which holds "
                                   f"{self.path}; {stop}, or {instead}") from None
            if _same_file(fd, self.path):
                self._fd = fd
            else:  # the file was removed (a run that never started) after we opened it: take the new one
                os.close(fd)
        try:
            os.ftruncate(self._fd, 0)
            os.write(self._fd, json.dumps({"pid": os.getpid(), "command": command, "since": time.time()}).encode())
        except OSError:
            self.release()
            raise

    def release(self) -> None:
        """Let another process take the run directory (idempotent). The holder's name is wiped
        first, so that a process refused by the next holder never reads this one's."""
        if getattr(self, "_fd", None) is not None:
            try:
                os.ftruncate(self._fd, 0)
            except OSError:  # a disk turned read-only: the next holder writes over it
                pass
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a lock whose owner was dropped without release (a build that failed)
        self.release()
