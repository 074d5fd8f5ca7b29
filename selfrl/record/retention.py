"""Retention for weeks of running: which adapter versions to prune, and old trajectories exported, then pruned.

A service that learns for days saves a candidate adapter per update; the paper selfrl
follows ran for 240 hours. Disk stays bounded only if old versions and old trajectories
go. The rules, in the spirit of ART's ``local/checkpoints.py`` (keep the last N step
folders) but stricter, because a version folder here may be served again:

* :func:`versions_to_remove` keeps the newest ``keep_newest`` versions, the ``base``, every
  ``promoted`` version (any of them can be rolled back to) or only the newest ``keep_promoted``
  of them, every pinned version, the served one, and never removes a folder that a kept row
  also points to. ``rolled_back``, ``rejected`` and ``candidate`` versions outside the newest N
  go; pin one to keep it.
* :func:`prune_versions` applies it to a run directory: each folder is moved into
  ``adapters/.pruned/`` (one rename, so a crash leaves it whole in one of two places),
  the caller's ``mark_pruned`` callback records it in the ledger, and only then, if asked,
  the folder is deleted. A failing callback moves the folder back.
* :func:`export_then_prune` writes trajectory rows older than a cutoff to a JSONL file
  with a SHA-256 sidecar (``sha256sum -c`` format), reads it back and checks it, and only
  then calls the caller's ``delete`` with the exported ids.

No store import: the caller passes rows and callbacks, so the same rules serve any ledger.
Times are seconds on the caller's clock; paths in rows are relative to the run directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from selfrl.core.atomic import fsync_dir

PRUNED = ".pruned"  # under <run_dir>/adapters


@dataclass(frozen=True)
class VersionRow:
    """One ledger row: its number, its status (``selfrl.record.versions.VersionStatus`` values) and
    its folder relative to the run directory (None when it has none)."""

    version: int
    status: str
    path: str | None


def versions_to_remove(versions: Sequence[VersionRow], keep_newest: int, pinned: Iterable[int] = (),
                       served: int | None = None, keep_promoted: int = 0) -> list[int]:
    """The versions whose folders may go, ascending.

    Args:
        versions: every row of the ledger.
        keep_newest: keep this many of the highest version numbers, whatever their status (>= 1).
        pinned: versions a user asked to keep (and the caller's champion).
        served: the version served now.
        keep_promoted: keep only the newest this many promoted versions (beside the newest
            ``keep_newest``, the pinned and the served ones); 0 keeps every promoted version. A
            server that promotes every few minutes for weeks needs a bound here: each version's
            folder is a few MB to hundreds.

    Raises:
        ValueError: ``keep_newest`` < 1, a duplicate version, or a pinned or served version not in ``versions``.

    >>> rows = [VersionRow(0, "base", "adapters/v000000"), VersionRow(1, "rejected", "adapters/v000001"),
    ...         VersionRow(2, "promoted", "adapters/v000002"), VersionRow(3, "candidate", "adapters/v000003")]
    >>> versions_to_remove(rows, keep_newest=1)
    [1]
    >>> rows += [VersionRow(4, "promoted", "adapters/v000004"), VersionRow(5, "promoted", "adapters/v000005")]
    >>> versions_to_remove(rows, keep_newest=1, keep_promoted=2)
    [1, 2, 3]
    """
    if keep_newest < 1:
        raise ValueError(f"keep_newest must be >= 1 (the newest version is the learner's), got {keep_newest}")
    numbers = [r.version for r in versions]
    if len(set(numbers)) != len(numbers):
        raise ValueError(f"duplicate version numbers in {sorted(numbers)}")
    pinned = set(pinned)
    unknown = sorted(pinned - set(numbers)) + ([served] if served is not None and served not in numbers else [])
    if unknown:
        raise ValueError(f"pinned or served versions {unknown} are not in the ledger; check the version numbers")
    if keep_promoted < 0:
        raise ValueError(f"keep_promoted must be >= 0 (0: keep every promoted version), got {keep_promoted}")
    newest = set(sorted(numbers)[-keep_newest:])
    statuses = {r.version: r.status for r in versions}
    promoted = sorted(v for v, status in statuses.items() if status == "promoted")
    kept_promoted = set(promoted[-keep_promoted:]) if keep_promoted else set(promoted)
    keep = {v for v, status in statuses.items() if v in newest or v in pinned or v == served
            or status == "base" or v in kept_promoted}
    kept_paths = {r.path for r in versions if r.version in keep and r.path}
    return sorted(r.version for r in versions if r.version not in keep and r.path and r.path not in kept_paths)


def prune_versions(run_dir: Path, versions: Sequence[VersionRow], remove: Iterable[int],
                   mark_pruned: Callable[[int], None], delete: bool = False) -> list[Path]:
    """Move the folders of ``remove`` into ``<run_dir>/adapters/.pruned/`` and mark each.

    Every path is checked before anything moves. A folder already gone is only marked.
    Returns the folders under ``.pruned`` (deleted when ``delete``).

    Raises:
        ValueError: a version not in ``versions``, without a folder, or whose folder is not
            directly under ``<run_dir>/adapters``.
        Exception: whatever ``mark_pruned`` raises, after its folder was moved back.
    """
    root = (Path(run_dir) / "adapters").resolve()
    rows = {r.version: r for r in versions}
    plan: list[tuple[int, Path]] = []
    for v in remove:
        row = rows.get(v)
        if row is None or not row.path:
            raise ValueError(f"version {v} has no folder in the ledger; nothing to prune")
        src = (Path(run_dir) / row.path).resolve()  # an absolute row.path stays as it is
        if src.parent != root or src.name.startswith("."):
            raise ValueError(f"version {v}'s folder {row.path} is not a version folder under {root}; not touched")
        plan.append((v, src))
    out = []
    for v, src in plan:
        if not src.exists():  # moved by an earlier, interrupted prune, or deleted by hand
            mark_pruned(v)
            continue
        dest = root / PRUNED / src.name
        dest.parent.mkdir(exist_ok=True)
        if dest.exists():
            dest = dest.with_name(f"{src.name}-{time.time_ns()}")
        os.rename(src, dest)
        fsync_dir(root)
        try:
            mark_pruned(v)
        except BaseException:
            os.rename(dest, src)
            fsync_dir(root)
            raise
        if delete:
            shutil.rmtree(dest)
        out.append(dest)
    return out


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_then_prune` did: the JSONL file (None when no row was old enough),
    the rows written, its SHA-256 (hex) and the rows the caller deleted."""

    path: Path | None
    rows: int
    sha256: str | None
    deleted: int


def verify_export(path: Path) -> int:
    """Check a JSONL export against its ``.sha256`` sidecar; the number of rows.

    Raises:
        ValueError: the checksum differs or a line is not JSON.
        FileNotFoundError: the file or its sidecar is missing.
    """
    path = Path(path)
    want = Path(f"{path}.sha256").read_text().split()[0]
    data = path.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise ValueError(f"{path}: SHA-256 {got} differs from the recorded {want}; the export is damaged")
    lines = data.splitlines()
    for i, line in enumerate(lines):
        try:
            json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from e
    return len(lines)


def export_then_prune(rows: Iterable[Mapping[str, Any]], cutoff: float, out_path: Path,
                      delete: Callable[[list[Any]], int], time_key: str = "created_at",
                      id_key: str = "id") -> ExportResult:
    """Export the rows with ``row[time_key] < cutoff`` to ``out_path`` (JSONL, one row a line,
    keys sorted), verify the file, then ``delete(ids)``; newer rows are left alone.

    Raises:
        FileExistsError: ``out_path`` exists (an export is never overwritten).
        ValueError: a row lacks ``time_key`` or ``id_key``; the file read back differs.
        OSError: the file cannot be written (a full disk: ``ENOSPC``).
        RuntimeError: ``delete`` reports another count than the rows exported (the file is kept).
        In the first three cases ``delete`` is not called, and what was written is removed.
    """
    out_path = Path(out_path)
    if out_path.exists():
        raise FileExistsError(f"{out_path} exists; choose a new file name for this export")
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    sidecar = Path(f"{out_path}.sha256")
    h, ids = hashlib.sha256(), []
    try:
        with open(tmp, "wb") as f:
            for row in rows:
                if time_key not in row or id_key not in row:
                    raise ValueError(f"a row lacks {time_key!r} or {id_key!r}: keys {sorted(row)}")
                if row[time_key] < cutoff:
                    line = (json.dumps(dict(row), sort_keys=True) + "\n").encode()
                    h.update(line)
                    f.write(line)
                    ids.append(row[id_key])
            f.flush()
            os.fsync(f.fileno())
        if not ids:
            tmp.unlink()
            return ExportResult(None, 0, None, 0)
        os.rename(tmp, out_path)
        digest = h.hexdigest()
        with open(sidecar, "w") as f:
            f.write(f"{digest}  {out_path.name}\n")
            f.flush()
            os.fsync(f.fileno())  # on disk before any row is deleted, as the export itself
        fsync_dir(out_path.parent)
        n = verify_export(out_path)
        back = [json.loads(line)[id_key] for line in out_path.read_bytes().splitlines()]
        if n != len(ids) or back != ids:
            raise ValueError(f"{out_path} holds {n} rows read back, {len(ids)} written; nothing deleted")
    except BaseException:  # nothing is deleted yet: a partial or unverified export is removed (a full disk)
        for leftover in (tmp, out_path, sidecar):
            leftover.unlink(missing_ok=True)
        raise
    deleted = delete(ids)
    if deleted != len(ids):
        raise RuntimeError(f"{deleted} rows deleted of {len(ids)} exported to {out_path}; the export is kept, "
                           "check the store before pruning again")
    return ExportResult(out_path, len(ids), digest, deleted)
