"""The simulator's clocks: simulated seconds, and how they relate to real ones.

A clock is called for the simulated time now (``clock() -> float``, seconds since the
epoch, as ``time.time`` gives), and ``clock.wait_until(t)`` lets simulated time reach
``t``. Two kinds:

* :class:`FakeClock`: time moves only when the simulator says so; ``wait_until`` jumps at
  once, so days pass without waiting. A test gives the same object to the server's
  ``Service`` (which reads time by calling its clock), so that a judgement sent three
  simulated days after its turn is three days old for the server too.
* :class:`ScaledClock`: simulated time runs ``86400 / day_s`` times faster than real time
  (``day_s`` real seconds per simulated day), and ``wait_until`` sleeps the real time
  that stands for the wait. For a live server, whose own clock is real: a delay of ``d``
  simulated seconds reaches it ``d * day_s / 86400`` real seconds later.
"""

from __future__ import annotations

import threading
import time

DAY_S = 86400.0


class FakeClock:
    """Simulated time that only moves forward when told to (thread-safe).

    >>> c = FakeClock(100.0)
    >>> c(), c.wait_until(3 * 86400.0 + 100.0), c()
    (100.0, None, 259300.0)
    >>> c.wait_until(5.0); c()  # never backwards
    259300.0
    """

    def __init__(self, start: float = 1_700_000_000.0):
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def wait_until(self, t: float) -> None:
        """Move the time to ``t`` (no wait; a time in the past leaves it where it is)."""
        with self._lock:
            self._now = max(self._now, float(t))

    def advance(self, seconds: float) -> None:
        """Move the time ``seconds`` forward."""
        self.wait_until(self() + seconds)


class ScaledClock:
    """Simulated time that runs ``DAY_S / day_s`` times as fast as real time, from ``start``.

    Args:
        day_s: real seconds one simulated day lasts (> 0); 86400 is real time.
        start: the simulated time at creation (default: the real time now).
        sleep, monotonic: injectable for tests (``time.sleep``, ``time.monotonic``).

    Raises:
        ValueError: ``day_s`` is not above 0.
    """

    def __init__(self, day_s: float, start: float | None = None, sleep=time.sleep, monotonic=time.monotonic):
        if not day_s > 0:
            raise ValueError(f"day_s must be > 0 real seconds per simulated day, got {day_s!r}")
        self.speed = DAY_S / day_s  # simulated seconds per real second
        self._start = time.time() if start is None else float(start)
        self._t0 = monotonic()
        self._sleep, self._monotonic = sleep, monotonic

    def __call__(self) -> float:
        return self._start + (self._monotonic() - self._t0) * self.speed

    def real_seconds_until(self, t: float) -> float:
        """Real seconds before simulated time reaches ``t`` (0 when it has)."""
        return max(0.0, (t - self()) / self.speed)

    def wait_until(self, t: float) -> None:
        """Sleep until simulated time reaches ``t``."""
        wait = self.real_seconds_until(t)
        if wait > 0:
            self._sleep(wait)
