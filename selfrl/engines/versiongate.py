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
from collections.abc import Callable

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

    def acquire_shared(self, n: int = 1, behind_swap: bool = True) -> None:
        """Take ``n`` tickets at once (one per request of a batch: taken one by one, a swap that
        starts waiting between two of them would wait for the first while the second waits for it).

        ``behind_swap=False``: do not queue behind a swap that waits, only behind one that holds the
        gate. For a request made while the caller's own tickets keep that swap waiting (a streaming
        callback of an engine step that submits a follow-up): queued behind it, it would wait for a
        swap that waits for it. It runs on the version in place, and the swap waits for it too."""
        with self._cond:
            me = threading.get_ident()
            while self._owner not in (None, me) or (behind_swap and self._waiting and self._owner != me):
                self._cond.wait()
            self._tickets += n

    def release_shared(self) -> None:
        with self._cond:
            self._tickets -= 1
            self._cond.notify_all()

    def __enter__(self):
        self.acquire_exclusive()
        return self

    def acquire_exclusive(self, progress: Callable[[], None] | None = None) -> None:
        """Take the gate exclusively (what ``with gate:`` does; release with ``__exit__``). New
        tickets wait from the moment this call starts. While tickets are in flight,
        ``progress()`` is called again and again outside the gate's lock, if given: an engine
        whose requests finish only while someone steps it (a caller-driven slot engine) steps
        there; without it, the call sleeps until the last ticket is released."""
        with self._cond:
            me = threading.get_ident()
            if self._owner == me:
                self._depth += 1
                return
            self._waiting += 1
            try:
                while self._owner is not None or self._tickets:
                    if progress is None:
                        self._cond.wait()
                        continue
                    self._cond.release()
                    try:
                        progress()
                    finally:
                        self._cond.acquire()
            finally:
                self._waiting -= 1
                self._cond.notify_all()  # tickets waiting behind a swap that gave up may go on
            self._owner, self._depth = me, 1

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    @property
    def in_flight(self) -> int:
        return self._tickets
