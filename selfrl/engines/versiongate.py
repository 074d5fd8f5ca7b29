"""The version gate of an engine that samples from several threads at once: every request
holds a shared ticket from submission to completion, and a swap of adapter weights takes
the gate exclusively, so that each generation runs on exactly one version.

>>> g = VersionGate()
>>> g.acquire_shared(); g.in_flight
1
>>> g.release_shared(); g.in_flight
0
"""

from __future__ import annotations

import threading

__all__ = ["VersionGate"]


class VersionGate:
    """A shared/exclusive lock: requests hold shared tickets (released from any thread),
    a swap holds it exclusively. A waiting swap blocks new tickets (no starvation);
    the thread that holds it exclusively may still take tickets (to sample on the
    version it just loaded). ``with gate:`` takes it exclusively, reentrantly."""

    def __init__(self):
        self._cond = threading.Condition()
        self._tickets = 0
        self._owner: int | None = None
        self._depth = 0
        self._waiting = 0

    def acquire_shared(self) -> None:
        with self._cond:
            me = threading.get_ident()
            while self._owner not in (None, me) or (self._waiting and self._owner != me):
                self._cond.wait()
            self._tickets += 1

    def release_shared(self) -> None:
        with self._cond:
            self._tickets -= 1
            self._cond.notify_all()

    def __enter__(self):
        with self._cond:
            me = threading.get_ident()
            if self._owner == me:
                self._depth += 1
                return self
            self._waiting += 1
            while self._owner is not None or self._tickets:
                self._cond.wait()
            self._waiting -= 1
            self._owner, self._depth = me, 1
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self._tickets
