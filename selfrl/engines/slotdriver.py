"""Who runs the slot engine's decoding steps when it has no worker thread (``driver="caller"``):
the threads that wait for results, one at a time (docs/concepts/engines.md, "Which thread steps").

:class:`CallerDriven` is a part of :class:`selfrl.engines.slots.SlotEngine`; it uses the
engine's queue, rows, lock, condition, ``_guarded_step`` and ``_give_back_idle_cache``.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future

DRIVERS = ("thread", "caller")  # which thread runs the decoding steps (selfrl.engines.make_engine's ``driver``)
WAIT_POLL_S = 0.05  # driver "caller": the longest a thread waiting for another's steps sleeps before looking again


class CallerDriven:
    """The stepping of a slot engine by its callers: :meth:`wait`, and ``_drive`` behind
    ``generate``, a :class:`~selfrl.engines.slotrequest.DrivenFuture`'s ``result()`` and a waiting swap."""

    def wait(self, futures: Iterable[Future], timeout: float | None = None,
             return_when: str = FIRST_COMPLETED) -> tuple[set[Future], set[Future]]:
        """:func:`concurrent.futures.wait` for futures of :meth:`submit`; with ``driver="caller"``
        the calling thread runs decoding steps meanwhile (for every queued row, not only these),
        so that the futures finish. ``timeout`` (seconds) is honoured between steps.

        Raises:
            ValueError: ``return_when`` is not FIRST_COMPLETED or ALL_COMPLETED (FIRST_EXCEPTION
                is not offered).
            RuntimeError: called from inside a step (a callback of this engine).
        """
        futures = list(futures)
        if return_when not in (FIRST_COMPLETED, concurrent.futures.ALL_COMPLETED):
            raise ValueError(f"return_when must be FIRST_COMPLETED or ALL_COMPLETED, got {return_when!r}")
        if not all(f.done() for f in futures):  # (from a callback it would wait for itself)
            self._refuse_in_step()
        start = time.monotonic()
        if self.driver == "caller":
            test = any if return_when == FIRST_COMPLETED else all
            self._drive(lambda: not futures or test(f.done() for f in futures), timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - start))
        return concurrent.futures.wait(futures, timeout=left, return_when=return_when)

    def _drive(self, done: Callable[[], bool], timeout: float | None = None) -> None:
        """With ``driver="caller"``: run steps in this thread until ``done()`` (or ``timeout``
        seconds), one driving thread at a time; a thread that finds another driving waits for
        it (woken after each of its steps) and takes over if its own rows are still unfinished
        when that one leaves. With a worker thread: nothing (the worker steps).

        Raises:
            RuntimeError: called from inside a step (an ``on_tokens`` or ``on_step`` callback),
                where waiting for the engine would wait for itself.
            BaseException: an interrupt (KeyboardInterrupt) while stepping, after every request
                in flight has failed with a RuntimeError (the engine stays usable).
        """
        if self.driver != "caller":
            return
        self._refuse_in_step()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not done() and (deadline is None or time.monotonic() < deadline):
            if not self._driving.acquire(blocking=False):
                with self._cond:  # another thread steps (our rows too): woken after its next step
                    self._cond.wait(timeout=WAIT_POLL_S)
                continue
            self._stepping = threading.get_ident()
            try:
                while not done() and (deadline is None or time.monotonic() < deadline):
                    with self._cond:
                        if self._closed or (not self._queue and not self._rows):
                            break
                    self._guarded_step()
                    with self._cond:
                        self._cond.notify_all()
                with self._cond:
                    closed, idle = self._closed, not self._queue and not self._rows
                    self._give_back_idle_cache()
                if closed:
                    self._fail_all(RuntimeError("the slot engine is closed"))
            except BaseException:  # an interrupt mid-step: the cache rows are forgotten with the requests
                self._error = "interrupted while stepping"
                self._fail_all(RuntimeError("the slot engine was interrupted while stepping"))
                raise
            finally:
                self._stepping = None
                self._driving.release()
                with self._cond:
                    self._cond.notify_all()
            if closed or idle:
                return

    def _refuse_in_step(self) -> None:
        """Raise RuntimeError in a thread that is inside a step (a callback of this engine)."""
        me = threading.get_ident()
        if me == self._stepping or (self._worker is not None and self._worker.ident == me):
            raise RuntimeError("a slot engine callback (on_tokens, on_step) cannot wait for the same engine: it runs "
                               "inside a step; submit() and return, or wait from another thread")

    def _progress(self) -> None:
        """What a swap does while requests are in flight (driver "caller"): step them, or, when
        another thread is admitting them or they are being queued, wait a moment."""
        with self._cond:
            idle = not self._queue and not self._rows
        if idle:
            time.sleep(0.002)
        else:
            self._drive(lambda: not self._queue and not self._rows, WAIT_POLL_S)
