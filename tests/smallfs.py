"""A small file system to fill: a tmpfs of a given size, mounted for a disk-full test.

Mounting needs root and ``mount``; where either is missing, :class:`SmallFs` raises
:class:`SmallFsUnavailable` with the reason, and the ``small_fs`` fixture
(``tests/conftest.py``) skips the test with it. The fault suite
(``scripts/fault_runs.py``) mounts its own the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


class SmallFsUnavailable(RuntimeError):
    """No tmpfs can be mounted here; the message says why."""


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SmallFsUnavailable(f"mount {' '.join(args)} failed: {proc.stderr.strip() or proc.returncode}")


class SmallFs:
    """A tmpfs of ``size_kib`` KiB mounted at ``path`` (created), until :meth:`unmount`.

    Raises:
        SmallFsUnavailable: not root, no ``mount`` command, or the mount was refused.
    """

    def __init__(self, path: Path, size_kib: int):
        if os.geteuid() != 0:
            raise SmallFsUnavailable("mounting a tmpfs needs root")
        if shutil.which("mount") is None:
            raise SmallFsUnavailable("no mount command")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        _mount("-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(self.path))
        self.mounted = True

    def resize(self, size_kib: int) -> None:
        """Grow (or shrink) the file system, keeping its files: the disk freed."""
        _mount("-o", f"remount,size={size_kib}k", str(self.path))

    def read_only(self, on: bool = True) -> None:
        """Make the file system read-only (``on``) or writable again."""
        _mount("-o", f"remount,{'ro' if on else 'rw'}", str(self.path))

    def unmount(self) -> None:
        """Unmount (lazily if a file is still open); its files are gone."""
        if self.mounted:
            if subprocess.run(["umount", str(self.path)], capture_output=True, check=False).returncode != 0:
                subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
            self.mounted = False
