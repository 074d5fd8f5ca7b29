"""Old served turns, exported then pruned (``[retention] trajectories_max_age_s``), so that a
server that learns for weeks keeps its store bounded.

Which turns may go. A served turn (a ``served`` row and its trajectory) goes when all of this holds:

* it was stored more than ``retention.trajectories_max_age_s`` seconds ago, on the server's clock;
* no feedback can make it trainable any more: the setting is at least
  ``learner.max_feedback_age_s`` (:func:`selfrl.config.serve.check_retention` refuses less), so by
  the age rule (:mod:`selfrl.serve.late_feedback`) feedback on it is ``too_old``, a pending turn
  is left out of every update, and a skipped one never comes back;
* no update holds it: a pass runs in the learner's thread after an update, under the learner's
  lock, so never while an update is under way;
* it is not the newest trained turn of a family in ``[[families]]``: that turn is what makes the
  family learned, and the no-forgetting gate judges every candidate on a learned family.

The gate's own records are not turns, and retention touches none of them: a held-out set is
drawn again from its environment and seed, each version's per-task results are in the store's
``evaluations`` and its success in the version ledger. Versions, metrics and events stay too.

How. A pass reads at most ``retention.trajectories_per_pass`` of the oldest such turns (under the
store's lock, one query), writes them to ``trajectories-<UTC time>.jsonl`` in the export folder
(``<run_dir>/exports`` by default) with a ``.sha256`` sidecar (``sha256sum -c`` checks it),
fsyncs both, reads the file back and checks it, and only then deletes the turns, their feedback
messages and reward rows in one transaction (:func:`selfrl.record.served.delete_turns`); a kept
turn that continued a deleted one loses the link in its ``served`` row, not in its record. A
``prune_turns`` event records the rows, the file and its SHA-256.

A failure anywhere (the export's disk is full, the store is locked, feedback reached one of the
turns while the file was written) deletes nothing: the partial export is removed, a
``retention_failed`` event (when the store can still be written) and a log line say why, and the
next pass tries again. Serving and learning go on. The store's file does not shrink: SQLite
reuses the freed pages for new turns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrl.config.base import ConfigError
from selfrl.config.serve import RetentionSettings, ServeConfig
from selfrl.record import served as records
from selfrl.record.retention import ExportResult, export_then_prune
from selfrl.record.storage_errors import classify
from selfrl.record.store import Store
from selfrl.record.versions import EventKind

log = logging.getLogger("selfrl.serve")
Event = Callable[[EventKind, str, dict], None]


def export_dir(settings: RetentionSettings, run_dir: str | Path) -> Path:
    """Where the exports go: ``trajectories_export_dir`` (a relative path is under ``run_dir``),
    else ``<run_dir>/exports``."""
    return Path(run_dir) / (settings.trajectories_export_dir or "exports")


def check_turn_retention(cfg: ServeConfig, learns: bool) -> None:
    """Refuse ``retention.trajectories_max_age_s`` on a server that does not learn (it prunes after
    the learner's updates), and an export folder that cannot be created, before anything starts.

    Raises:
        selfrl.config.ConfigError: the message says what to change.
    """
    if not learns:
        raise ConfigError("retention.trajectories_max_age_s needs the background learner (it prunes after each "
                          "update), but this server does not learn (--no-learn): drop --no-learn, or set "
                          "retention.trajectories_max_age_s = 0")
    where = export_dir(cfg.retention, cfg.run_dir)
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"retention.trajectories_export_dir: cannot create {where} ({e.strerror or e}); choose a "
                          "folder this user may write") from e


@dataclass
class PassResult:
    """One pass: the turns exported and deleted (0 when none was old enough), the file, its
    SHA-256 (hex), or the ``error`` that stopped it (then nothing was deleted)."""

    rows: int
    path: Path | None = None
    sha256: str | None = None
    error: str | None = None


class TurnRetention:
    """The turn retention of one server (see the module docstring).

    Args:
        store: the server's store (shared; it takes its own lock).
        settings: ``[retention]`` (``trajectories_max_age_s`` > 0).
        run_dir: the run directory (the default export folder is under it).
        families: the ``[[families]]`` names whose newest trained turn is kept.
        event: ``event(kind, message, data)`` records an event (the ledger's).
        clock: the server's clock, seconds (turn ages are on it).

    Raises:
        OSError: the export folder cannot be created.
    """

    def __init__(self, store: Store, settings: RetentionSettings, run_dir: str | Path, families: tuple[str, ...],
                 event: Event, clock: Callable[[], float] = time.time):
        self.store, self.settings, self.run_dir, self.families = store, settings, Path(run_dir), families
        self.event, self.clock = event, clock
        self.dir = export_dir(settings, run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.pruned = 0  # turns this process exported and deleted
        self.last: PassResult | None = None

    def run_pass(self) -> PassResult:
        """Export, then delete, the oldest turns that may go (at most ``trajectories_per_pass``).
        Never raises: a failure is the result's ``error``, with an event and a log line."""
        rc = self.settings
        cutoff = self.clock() - rc.trajectories_max_age_s
        path = None
        try:
            rows, last_feedback = records.old_turns(self.store, cutoff, rc.trajectories_per_pass, self.families)
            if not rows:
                self.last = PassResult(0)
                return self.last
            path = self._new_path()
            res = export_then_prune(rows, cutoff, path, self._deleter(last_feedback, path))
        except Exception as e:
            self.last = PassResult(0, error=self._failed(e))
            return self.last
        self.pruned += res.deleted
        self.last = PassResult(res.deleted, res.path, res.sha256)
        where = self._shown(res.path)
        log.info("selfrl: retention exported %d turns to %s and deleted them", res.deleted, where)
        self._record(EventKind.PRUNE_TURNS, f"{res.deleted} served turns older than "
                     f"{rc.trajectories_max_age_s:g} s exported to {where} (SHA-256 {res.sha256[:12]}...) and deleted",
                     {"rows": res.deleted, "path": where, "sha256": res.sha256, "cutoff": cutoff,
                      "oldest": rows[0]["created_at"], "newest": rows[-1]["created_at"]})
        return self.last

    def status(self) -> dict[str, Any]:
        """For ``GET /admin/status``: turns this process pruned, the export folder, the last pass."""
        last = self.last
        return {"turns_pruned": self.pruned, "export_dir": str(self.dir), "last_pass": None if last is None else
                {"rows": last.rows, "path": None if last.path is None else str(last.path), "error": last.error}}

    def _deleter(self, last_feedback: int, path: Path) -> Callable[[list[Any]], int]:
        def delete(ids: list[Any]) -> int:
            try:
                return records.delete_turns(self.store, ids, last_feedback)
            except BaseException:  # one transaction, rolled back: every turn is still stored, the file repeats them
                for leftover in (path, Path(f"{path}.sha256")):
                    leftover.unlink(missing_ok=True)
                raise
        return delete

    def _new_path(self) -> Path:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self.clock()))
        path, n = self.dir / f"trajectories-{stamp}.jsonl", 1
        while path.exists():
            n += 1
            path = self.dir / f"trajectories-{stamp}-{n}.jsonl"
        return path

    def _shown(self, path: Path) -> str:
        """``path`` relative to the run directory when it is inside it (a run directory can move)."""
        try:
            return str(path.resolve().relative_to(self.run_dir.resolve()))
        except ValueError:
            return str(path.resolve())

    def _failed(self, e: Exception) -> str:
        fault = classify(e, self.dir)
        why = fault.message if fault is not None else f"{type(e).__name__}: {e}"
        log.warning("selfrl: retention deleted no turn this pass (the next pass tries again): %s", why,
                    exc_info=fault is None and not isinstance(e, records.ChangedSinceRead))
        self._record(EventKind.RETENTION_FAILED, f"retention deleted no turn: {why}; the next pass tries again",
                     {"code": fault.kind.value if fault else type(e).__name__})
        return why

    def _record(self, kind: EventKind, message: str, data: dict) -> None:
        try:
            self.event(kind, message, data)
        except Exception as e:  # the store itself may be what is full: the log line says it
            log.warning("selfrl: retention could not record its %s event: %s", kind.value, e)
