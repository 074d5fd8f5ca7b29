"""The run directory: one folder that holds a run whole, and may be moved or copied.

    RUN_DIR/selfrl.db         the store (selfrl.record.store)
    RUN_DIR/selfrl.lock       held by the one process that writes the run (selfrl.record.runlock)
    RUN_DIR/config.json       the settings, written at every start
    RUN_DIR/adapters/v<N>/    adapter versions (selfrl.record.adapters.version_dir)
    RUN_DIR/metrics.jsonl, tensorboard/, report.md, plots/

Nothing inside names the folder itself: every path the run stores is relative to it.
Version folders are the one kind of path the store keeps (``adapter_versions.path``);
they are stored as ``adapters/v<N>`` and resolved against where the store is now, so
``mv run run2; selfrl run --resume run2`` serves the same versions. Rows written by
older selfrl hold the folder as it was given (absolute, or relative to the working
directory then); they follow the same layout and are read, and migrated, the same way.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

VERSIONS = "adapters"  # the folder of the version folders
VERSION_FOLDER = re.compile(r"v\d+")  # a version folder's name (selfrl.record.adapters.version_dir: v000003)


class NotAFolder(ValueError):
    """A path given for a folder (a run directory, an output folder) is a file, or lies under one."""


def check_folder(path: str | Path) -> None:
    """Refuse a folder path that is a file, or that lies under a file (``FILE/sub``); a missing
    folder passes (it is created later). Call it before any work, so nothing is left half-done.

    Raises:
        NotAFolder: the message names the file and says to give a folder path.
    """
    for p in (Path(path), *Path(path).parents):
        if p.exists():
            if not p.is_dir():
                where = "" if p == Path(path) else f" ({path} lies under it)"
                raise NotAFolder(f"{p} is a file, not a folder{where}: give a folder path")
            return


def run_relative(stored: str) -> str | None:
    """The relative form ``adapters/v<N>`` of a stored version path that follows the run
    directory's layout (absolute, relative to the run directory, or relative to the working
    directory it was written from), else None.

    >>> run_relative("/home/u/runs/a/adapters/v000003"), run_relative("runs/a/adapters/v000003")
    ('adapters/v000003', 'adapters/v000003')
    >>> run_relative("/ckpt/1") is None
    True
    """
    p = Path(stored)
    if p.parent.name == VERSIONS and VERSION_FOLDER.fullmatch(p.name):
        return f"{VERSIONS}/{p.name}"
    return None


def resolve_version_path(stored: str | None, root: Path) -> str | None:
    """Where the stored version path ``stored`` points now, for a store in the folder ``root``:
    the layout ``.../adapters/v<N>`` inside ``root`` (wherever the run directory was when
    the row was written), another relative path under ``root``, an absolute one as stored."""
    if stored is None:
        return None
    if (rel := run_relative(stored)) is not None:
        return str(root / rel)
    return stored if Path(stored).is_absolute() else str(root / stored)


def storable_path(path: str | Path, root: Path) -> str:
    """How ``path`` is stored for a store in ``root``: relative to ``root`` when inside it
    (posix separators), else absolute."""
    full, base = os.path.abspath(path), os.path.abspath(root)
    if os.path.commonpath([full, base]) == base:
        return Path(os.path.relpath(full, base)).as_posix()
    return full
