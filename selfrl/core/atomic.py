"""Atomic small-file writes: a crash leaves the old file or the new one, never half of one; and the
directory fsync that makes a rename or a new entry durable."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` via a temporary file, fsync, then rename over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """fsync the directory ``path``, so that a rename into it or an entry made in it survives a power loss.

    Raises:
        OSError: ``path`` cannot be opened (it does not exist, or is not readable).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
