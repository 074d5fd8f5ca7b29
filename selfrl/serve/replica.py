"""Serve replicas: several ``selfrl serve`` processes on one machine share one learner.

One process *owns* the run directory: it holds the run lock (``selfrl.record.runlock``), runs
the background learner and writes the adapter versions. Any number of *replicas*
(``selfrl serve --replica``, same ``run_dir``) serve traffic beside it, with the least
machinery we could find: nothing but the run directory is shared.

* **Trajectories**: a replica records every turn (and the feedback on it) in the same
  SQLite store, opened in WAL mode, as the owner does; the owner's learner takes every
  pending turn of the store, whoever served it (``selfrl.record.served.ready``). So a
  replica's traffic trains the one learner, and a turn is trained once.
* **Versions**: a replica follows the version ledger. Every ``follow_s`` seconds
  :class:`Follower` reads the newest servable version (the base or the latest promoted
  one whose folder verifies) and swaps it in, as the owner's ``publish`` does (between
  two batches, under the engine lock). A rollback on the owner marks later versions
  ``rolled_back``, so replicas follow it back too. A response names the version that
  served it (``adapter_version``, ``system_fingerprint``), on a replica as on the owner.
* **What a replica never does**: train, validate, save or mark versions, move stray
  folders aside (the owner may be mid-save), pin, unpin or roll back (those are the
  owner's, refused on a replica with HTTP 409). A replica needs the owner to have
  recorded the base version first, and refuses to start otherwise.

Not done: replicas on other machines (they would need the store on a shared disk that
SQLite locking trusts, which network file systems often are not; Ray's object store
would be the next step, as ``selfrl run --ray`` does for rollouts).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from selfrl.record import adapters
from selfrl.record.versions import Ledger, VersionRecord

if TYPE_CHECKING:
    from selfrl.serve.service import Service


class NoOwner(ValueError):
    """A replica was started on a run directory whose owner never recorded a base version."""


def newest_servable(ledger: Ledger) -> VersionRecord | None:
    """The newest base or promoted version whose folder verifies, read only (a replica never
    marks a version, unlike :meth:`selfrl.record.versions.Ledger.latest_servable`); None when none is."""
    for rec in reversed(ledger.all()):
        if rec.servable and rec.path and adapters.verify_version(Path(rec.path)) is None:
            return rec
    return None


class Follower(threading.Thread):
    """Swaps each version the owner promotes into a replica's engine (see the module docstring).

    Args:
        service: the replica's service (its ledger, engine and ``publish``).
        every_s: seconds between two looks at the ledger.
    """

    def __init__(self, service: "Service", every_s: float):
        super().__init__(name="selfrl-follower", daemon=True)
        self.service, self.every_s = service, every_s
        self._halt = threading.Event()
        self.swaps = 0
        self.error: str | None = None

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                self.follow()
            except Exception as e:  # keep serving the version we hold; the failure is visible in status
                self.error = f"{type(e).__name__}: {e}"

    def follow(self) -> int | None:
        """Serve the owner's newest servable version if it is not the one served; returns it
        when it was swapped in, else None."""
        svc = self.service
        rec = newest_servable(svc.ledger)
        if rec is None or rec.version == svc.engine.version:
            return None
        state = svc.ledger.load_state(rec.version)
        if svc.publish(rec.version, state, "followed the owner's ledger") is None:
            return None
        self.swaps += 1
        self.error = None
        return rec.version

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=60)
