"""The version ledger: every adapter version's row, its lifecycle, and the champion.

``selfrl run`` and ``selfrl serve`` both keep their versions through one
:class:`Ledger`; nothing else writes ``adapter_versions`` rows. A version's life:

    ensure_base -> save_candidate -> record_validation -> promote | reject | corrupt
                                                     \\-> roll_back_collapse (candidates since the champion)
    roll_back_to (an admin's rollback, serve) ... latest_servable (restart / resume)

At a restart, :meth:`Ledger.latest_servable` checks the folder of every base and promoted
version. A folder that is not there is *missing* (a run directory moved or copied without
it, a disk not mounted): said, and not served by this process, its row left as it is, so
it serves again once the folder is back. A folder that is there but incomplete or damaged
is *corrupt*: marked ``rolled_back`` with the reason, never served again.

The *champion* is the version both ends fall back to: the best validated version,
its held-out success and its LoRA tensors (:class:`Champion`). Every step records
the same row change and the same event (kind from :class:`EventKind`, the same
message) whichever end calls it; ``tests/test_versions.py`` runs one sequence of
candidates through ``run`` and ``serve`` and compares the rows, events and champion.

The ledger takes the store's lock around each step, so the server's threads (HTTP
handlers, the background learner) may share it.

Every event is also one ``INFO`` record of the standard library's :mod:`logging`, on the
logger ``selfrl.events.<kind>`` (``selfrl.events.promote``, ...) with the event's message:
``selfrl serve`` writes them to ``serve.log`` and shows the version lifecycle's on the console
(:mod:`selfrl.serve.logfile`); where nothing is configured (``selfrl run``, which prints its own
lines to ``progress.log``) they go nowhere.
"""

from __future__ import annotations

import enum
import logging
import math
import shutil
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrl.record import adapters
from selfrl.record.store import Store


class EventKind(str, enum.Enum):
    """Every kind of event the store records (``events.kind``), defined once."""

    PROMOTE = "promote"  # a validated candidate became the champion
    REJECT = "reject"  # the gate turned a candidate down; the champion serves again
    CORRUPT_VERSION = "corrupt_version"  # a version folder is incomplete: never served, marked
    MISSING_VERSION = "missing_version"  # a version folder is not there: not served by this process, row kept
    COLLAPSE = "collapse"  # a collapse rule fired: the candidates since the champion are rolled back
    COLLAPSE_STOP = "collapse_stop"  # collapse.max_rollbacks is set and spent: learning stops for good
    STEP_BACK = "step_back"  # a stable stretch after a collapse: one backoff level back toward the configured setting
    ROLLBACK = "rollback"  # an admin rolled the server back to an earlier version
    SKIP = "skip"  # an update was skipped (UpdateResult.reason says why); no version made
    EXPIRE = "expire"  # pending served turns past the age rule were marked skipped before an update (only recorded)
    REVIVE = "revive"  # served turns the age rule had left out are within it again (the learner's weights went back)
    RECOVER = "recover"  # a stray folder left by a killed save was moved aside, or the base re-saved
    RESUME = "resume"  # a run continued after a stop
    HACKING = "hacking"  # a reward-hacking detector fired
    SWAP = "swap"  # the server swapped a new version in
    PIN = "pin"
    UNPIN = "unpin"
    LATE_FEEDBACK = "late_feedback"  # feedback reached a turn that was already trained or skipped
    LEARNER_ERROR = "learner_error"  # the background learner stopped
    LEARNER_RESUMED = "learner_resumed"  # the background learner went on after a pause on a storage fault
    DISCONNECT = "disconnect"  # a client left before its response was complete (selfrl.serve.disconnect)
    SWAP_CHECK = "swap_check"  # a swapped-in version matched its stored weights (selfrl.safety.swap_check)
    SWAP_CHECK_FAILED = "swap_check_failed"
    PREFLIGHT = "preflight"  # the pre-flight signal check on a run's first batch (selfrl.run.signal)
    NO_SIGNAL = "no_signal"  # an iteration gave no learning signal; the event names the cause and the fix
    WORKER_LOST = "worker_lost"  # a Ray rollout worker died or timed out; its jobs were redone (selfrl.run.ray)
    AGENT_CONFLICT = "agent_conflict"  # a candidate hurt one agent beyond its tolerance (selfrl.run.agents)
    DISTRIBUTED = "distributed"  # a distributed run's totals: jobs, stale groups dropped, workers lost
    WARM_START = "warm_start"  # the warm start's phases and numbers: sampled, kept, fine-tuned, gated (selfrl.run.warm_start)
    ENGINE = "engine"  # the sampling backend a session runs on (engine = "auto" resolves by device)
    PRUNE = "prune"  # retention moved (or deleted) a version's folder; never served or rolled back to
    PRUNE_TURNS = "prune_turns"  # retention exported old served turns (a JSONL file, checksummed), then deleted them
    RETENTION_FAILED = "retention_failed"  # a retention pass failed (a full disk, ...): nothing was deleted


EVENT_LOGGER = "selfrl.events"  # the parent of one logger per kind


def event_logger(kind: EventKind) -> logging.Logger:
    """The logger an event of ``kind`` is logged on: ``selfrl.events.<kind>``.

    >>> event_logger(EventKind.PROMOTE).name
    'selfrl.events.promote'
    """
    return logging.getLogger(f"{EVENT_LOGGER}.{EventKind(kind).value}")


def passes_gate(candidate: float, best: float, tolerance: float) -> bool:
    """True when ``candidate >= best - tolerance`` (success rates in 0..1).

    >>> passes_gate(0.50, 0.51, 0.02), passes_gate(0.40, 0.51, 0.02)
    (True, False)
    """
    return candidate >= best - tolerance


class VersionStatus(str, enum.Enum):
    """The ``adapter_versions.status`` values (the store's CHECK constraint holds the same set)."""

    BASE = "base"
    CANDIDATE = "candidate"
    PROMOTED = "promoted"
    REJECTED = "rejected"
    ROLLED_BACK = "rolled_back"


SERVABLE = (VersionStatus.BASE, VersionStatus.PROMOTED)


@dataclass(frozen=True)
class VersionRecord:
    """One row of ``adapter_versions``."""

    version: int
    parent: int | None
    path: str | None
    status: VersionStatus
    metrics: dict[str, Any]
    created_at: float

    @property
    def val_success(self) -> float | None:
        """Held-out success (0..1) when validated, else None."""
        return self.metrics.get("val/success")

    @property
    def servable(self) -> bool:
        return self.status in SERVABLE

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> "VersionRecord":
        return cls(row["version"], row["parent"], row["path"], VersionStatus(row["status"]), row["metrics"],
                   row["created_at"])


@dataclass
class Champion:
    """The version both ends fall back to: its number, held-out success (None until
    validated) and a copy of its LoRA tensors."""

    version: int
    success: float | None
    state: dict


@dataclass(frozen=True)
class Verdict:
    """What the gate decided for a validated candidate (:meth:`Ledger.judge`)."""

    outcome: str  # "promoted" | "rejected" | "corrupt" | "collapse"
    message: str


class Ledger:
    """The run directory's adapter versions, kept in ``store``.

    Args:
        store: the run's store (its lock is taken around every step).
        run_id: the session's run id (events are recorded under it).
        run_dir: where ``adapters/vNNNNNN`` folders live.
    """

    def __init__(self, store: Store, run_id: int, run_dir: str | Path):
        self.store, self.run_id, self.run_dir = store, run_id, Path(run_dir)
        self.lock = store.lock  # held by every step; hold it to make several steps one
        self.champion: Champion | None = None
        self.missing: dict[int, str] = {}  # version -> why this process does not serve it (its folder is not there)
        # serve's gate.eval_every: the unvalidated candidate whose weights the learner holds, trained on between
        # two validations (selfrl.serve.chain); None: the learner holds the champion's (the age rule reads it)
        self.chain_head: int | None = None

    # -- reading -----------------------------------------------------------------------

    def get(self, version: int) -> VersionRecord | None:
        """The row of ``version``, or None."""
        row = self.store.version(version)
        return None if row is None else VersionRecord.from_row(row)

    def all(self) -> list[VersionRecord]:
        """Every row, in version order."""
        return [VersionRecord.from_row(v) for v in self.store.versions()]

    def servable(self) -> list[VersionRecord]:
        """The versions this process serves, oldest first: base and promoted, their folder not
        missing, not pruned."""
        return [v for v in self.all() if v.servable and v.version not in self.missing and not v.metrics.get("pruned")]

    def reference_evaluations(self) -> dict[int, dict[str, bool]]:
        """Per-task held-out results ``{version: {task id: solved}}`` of the versions a gate may
        compare a candidate with: the base and every promoted version (their folders may be
        pruned: the results stay facts). Rejected, rolled-back and candidate versions never are
        (the no-forgetting rule, :mod:`selfrl.safety.families`)."""
        with self.store.lock:
            return {v.version: self.store.evaluation(v.version) for v in self.all() if v.servable}

    def mark_pruned(self, version: int, where: str) -> None:
        """Record that retention moved ``version``'s folder to ``where`` (or deleted it): the row
        keeps its status with ``pruned`` in its metrics, and a ``prune`` event."""
        rec = self.get(version)
        if rec is None:
            raise KeyError(f"adapter version {version} does not exist")
        self._set(version, rec.status, {"pruned": True, "pruned_to": where})
        self.event(EventKind.PRUNE, f"version {version} ({rec.status.value}) pruned by retention: {where}",
                   {"version": version, "status": rec.status.value, "to": where})

    def event(self, kind: EventKind, message: str, data: dict[str, Any] | None = None) -> None:
        """Record an event of ``kind`` in the store, then log ``message`` at ``INFO`` on the
        logger ``selfrl.events.<kind>`` (:func:`event_logger`).

        Raises:
            ValueError: ``kind`` is no :class:`EventKind`.
            sqlite3.Error: the store could not write it (nothing is logged then).
        """
        kind = EventKind(kind)
        self.store.log_event(self.run_id, kind.value, message, data)
        event_logger(kind).info(message, extra={"event_data": data or {}})  # (serve.log groups repeats by it)

    def load_state(self, version: int) -> dict:
        """The LoRA tensors of ``version``, checked against their checksums.

        Raises:
            KeyError: no such version, or it was never saved.
            adapters.CorruptVersionError: its folder is not complete.
        """
        rec = self.get(version)
        if rec is None or not rec.path:
            raise KeyError(f"adapter version {version} does not exist")
        return adapters.load_version_state(Path(rec.path))

    # -- writing -----------------------------------------------------------------------

    def _set(self, version: int, status: VersionStatus, metrics: dict[str, Any] | None = None) -> None:
        self.store.set_version_status(version, VersionStatus(status).value, metrics)

    def ensure_base(self, model) -> VersionRecord:
        """Record version 0 from ``model``'s adapter unless it is recorded; a base folder
        that is missing or incomplete is moved aside and saved again (the freshly built
        policy is the base), with a ``recover`` event when it had been recorded."""
        rec = self.get(0)
        path = adapters.version_dir(self.run_dir, 0)
        reason = adapters.verify_version(path) if path.exists() else "folder missing"
        if reason is not None:
            if path.exists():
                adapters.quarantine(path)
            path = adapters.save_version(model, self.run_dir, 0)
            if rec is not None:
                self.event(EventKind.RECOVER, f"base version 0 was damaged ({reason}); saved again")
        if rec is None:
            self.store.add_version(0, None, str(path), VersionStatus.BASE.value, {})
        return self.get(0)

    def recover_strays(self) -> list[Path]:
        """Move aside what a killed save left (temporary folders, unrecorded versions),
        with a ``recover`` event each; returns where they went."""
        recorded = {v.version for v in self.all()}
        out = []
        for path in adapters.stray_dirs(self.run_dir, recorded):
            dest = adapters.quarantine(path)
            self.event(EventKind.RECOVER, f"{path.name} was left by an interrupted save and never recorded; "
                       f"moved to {dest}")
            out.append(dest)
        return out

    def save_candidate(self, model, parent: int) -> VersionRecord:
        """Save ``model``'s adapter as the next version, a candidate trained from ``parent``.
        When its row cannot be written (a full disk, say), the folder is deleted again, so
        that the number is free for the next try; the exception is raised."""
        with self.store.lock:
            version = self.store.next_version()
            path = adapters.save_version(model, self.run_dir, version)
            try:
                self.store.add_version(version, parent, str(path), VersionStatus.CANDIDATE.value, {})
            except sqlite3.OperationalError:  # not written (disk full, locked): nothing refers to the folder
                shutil.rmtree(path, ignore_errors=True)
                raise
        return self.get(version)

    def record_validation(self, version: int, success: float, degenerate: float,
                          results: list[tuple[str, bool, str | None]]) -> None:
        """Store a validation of ``version`` (per task, and its success and degenerate share)."""
        rec = self.get(version)
        with self.store.lock:
            self.store.add_evaluation(version, results)
            self.store.set_version_status(version, rec.status.value, {"val/success": success,
                                                                       "val/degenerate": degenerate})

    def set_champion(self, version: int, state: dict) -> Champion:
        """Make ``version`` (with its stored held-out success) the champion."""
        rec = self.get(version)
        self.champion = Champion(version, None if rec is None else rec.val_success,
                                 {k: v.detach().clone() for k, v in state.items()})
        return self.champion

    def judge(self, version: int, success: float, tolerance: float, alarms: list, veto: str | None = None,
              veto_data: dict[str, Any] | None = None) -> Verdict:
        """The gate for a validated candidate, recorded: a collapse alarm rolls the chain back
        (the caller's :class:`selfrl.safety.collapse.CollapseGuard` does it), an incomplete folder
        is rejected as corrupt, a success within ``tolerance`` of the champion's is promoted,
        anything else rejected. Promote and reject write the row and the event here; the
        caller then serves the champion (promoted: the candidate, with :meth:`set_champion`).
        A candidate trained from a version rolled back meanwhile (an admin's rollback; its parent,
        or, through a chain of unvalidated candidates, the version the chain started from) is rejected.
        ``veto`` (several agents: the conflicts of their gates) rejects an intact candidate,
        with the veto as the reason and ``veto_data`` in its ``reject`` event's data."""
        champ = self.champion
        best = champ.success if champ.success is not None else 0.0
        rec = self.get(version)
        parent = self.get(rec.parent) if rec.parent is not None else None
        while parent is not None and parent.status == VersionStatus.CANDIDATE and parent.parent is not None:
            parent = self.get(parent.parent)  # a chain of unvalidated candidates: where it was trained from
        if parent is not None and parent.status == VersionStatus.ROLLED_BACK:  # an admin rolled back meanwhile
            whose = (f"its parent version {parent.version}" if parent.version == rec.parent
                     else f"version {parent.version}, which its chain was trained from,")
            msg = f"version {version} rejected: {whose} was rolled back; serving version {champ.version}"
            self._set(version, VersionStatus.REJECTED, {"parent_rolled_back": parent.version})
            self.event(EventKind.REJECT, msg, {"version": version})
            return Verdict("rejected", msg)
        if alarms:
            return Verdict("collapse", "; ".join(a.message for a in alarms))
        broken = adapters.verify_version(Path(rec.path)) if rec.path else "never saved"
        if broken is not None:
            msg = f"version {version} not promoted: {broken}; serving version {champ.version} again"
            self._set(version, VersionStatus.REJECTED, {"corrupt": broken})
            self.event(EventKind.CORRUPT_VERSION, msg, {"version": version})
            return Verdict("corrupt", msg)
        if veto is not None:
            msg = (f"version {version} rejected: {veto}; held-out {success:.3f} overall (best {best:.3f}); "
                   f"serving version {champ.version} again")
            self._set(version, VersionStatus.REJECTED, {"val/success": success, "veto": veto})
            self.event(EventKind.REJECT, msg, {"version": version, **(veto_data or {})})
            return Verdict("rejected", msg)
        if passes_gate(success, best, tolerance):
            msg = f"version {version} promoted: held-out {success:.3f} (best was {best:.3f})"
            self._set(version, VersionStatus.PROMOTED, {"val/success": success})
            self.event(EventKind.PROMOTE, msg, {"version": version})
            return Verdict("promoted", msg)
        msg = (f"version {version} rejected: held-out {success:.3f} < best {best:.3f} - {tolerance:g}; "
               f"serving version {champ.version} again")
        self._set(version, VersionStatus.REJECTED, {"val/success": success})
        self.event(EventKind.REJECT, msg, {"version": version})
        return Verdict("rejected", msg)

    def reject_unverified(self, version: int, reason: str, mean_abs_diff: float) -> bool:
        """A candidate whose swap check failed (the sampler does not serve it): marked ``rejected``
        with the check's reason and mean |dlogp|, never promoted. The ``swap_check_failed`` event
        is the caller's (:mod:`selfrl.run.sampler_sync`). Returns whether it was a candidate (the base
        or a promoted version keeps its status)."""
        rec = self.get(version)
        if rec is None or rec.status != VersionStatus.CANDIDATE:
            return False
        diff = mean_abs_diff if math.isfinite(mean_abs_diff) else None
        self._set(version, VersionStatus.REJECTED, {"swap_check": reason, "swap_check/mean_abs_diff": diff})
        return True

    def promote(self, version: int, state: dict, success: float) -> None:
        """After a ``promoted`` verdict: the candidate becomes the champion (its success
        becomes the best, which never falls)."""
        best = self.champion.success if self.champion and self.champion.success is not None else -math.inf
        self.champion = Champion(version, max(success, best), {k: v.detach().clone() for k, v in state.items()})

    def roll_back_collapse(self, rule: str) -> list[int]:
        """Mark every candidate after the champion ``rolled_back`` (rule recorded); returns them.
        The caller records the ``collapse`` event (it holds the alarms and the new setting)."""
        bad = [v.version for v in self.all()
               if v.status == VersionStatus.CANDIDATE and v.version > self.champion.version]
        for v in bad:
            self._set(v, VersionStatus.ROLLED_BACK, {"collapse": rule})
        return bad

    def roll_back_to(self, version: int) -> list[int]:
        """An admin's rollback: ``version`` (base, promoted, or rolled back earlier: promoted
        again) becomes the champion; the promoted versions after it are marked ``rolled_back``.
        Returns those. Raises KeyError / ValueError for a version that cannot be rolled back to."""
        with self.lock:
            return self._roll_back_to(version)

    def _roll_back_to(self, version: int) -> list[int]:
        rec = self.get(version)
        if rec is None:
            raise KeyError(f"adapter version {version} does not exist")
        if rec.metrics.get("pruned"):
            raise ValueError(f"adapter version {version} was pruned by retention ({rec.metrics.get('pruned_to')}); "
                             "roll back to a version that is kept (GET /v1/models lists them)")
        if rec.status not in (*SERVABLE, VersionStatus.ROLLED_BACK):
            raise ValueError(f"adapter version {version} is {rec.status.value} (never validated); roll back to "
                             "the base or a promoted version")
        state = self.load_state(version)
        if rec.status == VersionStatus.ROLLED_BACK:
            self._set(version, VersionStatus.PROMOTED)
        later = [v.version for v in self.all() if v.version > version and v.status == VersionStatus.PROMOTED]
        for v in later:
            self._set(v, VersionStatus.ROLLED_BACK)
        self.champion = Champion(version, rec.val_success, state)
        self.event(EventKind.ROLLBACK, f"rolled back to version {version} on an admin's request; versions {later} "
                   "marked rolled_back",
                   {"version": version, "rolled_back": later})
        return later

    def latest_servable(self) -> VersionRecord:
        """Check the folder of every base and promoted version and return the latest complete one.

        A folder that is not there is *missing*: recorded in :attr:`missing` (this process does not
        serve it) with a ``missing_version`` event, its row left as it is. A version that retention
        pruned (``pruned`` in its metrics) is neither checked nor said missing. One that is there but not
        complete is *corrupt*: marked ``rolled_back`` (reason kept) with a ``corrupt_version`` event.

        Raises:
            adapters.CorruptVersionError: no base or promoted version is complete.
        """
        good = None
        for rec in reversed(self.all()):
            if not rec.servable or rec.metrics.get("pruned"):  # retention removed it on purpose: not missing
                continue
            if rec.path and not Path(rec.path).exists():
                reason = (f"version {rec.version}'s folder {rec.path} is missing: not served by this process "
                          "(its record is kept; put the folder back and restart to serve it again)")
                self.missing[rec.version] = reason
                self.event(EventKind.MISSING_VERSION, reason, {"version": rec.version, "path": rec.path})
                continue
            self.missing.pop(rec.version, None)
            reason = adapters.verify_version(Path(rec.path)) if rec.path else "never saved"
            if reason is None:
                good = good or rec
                continue
            self._set(rec.version, VersionStatus.ROLLED_BACK, {"corrupt": reason})
            self.event(EventKind.CORRUPT_VERSION, f"version {rec.version} is not served: {reason}",
                       {"version": rec.version})
        if good is None:
            missing = "; ".join(self.missing.values())
            raise adapters.CorruptVersionError(f"no complete adapter version to serve in {self.run_dir}"
                                               + (f" ({missing})" if missing else ""))
        return good
