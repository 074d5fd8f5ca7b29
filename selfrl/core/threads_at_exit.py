"""Threads that run torch, stopped before the interpreter finalises.

At exit CPython ends a daemon thread the moment it next takes the GIL; one inside a torch
operator is unwound through C++ frames that do not allow it, and the process aborts
("terminate called without an active exception", exit status -6 / 134) after its work is done.
The slot engine's worker, a background rollout batch and the served learner are such threads.
Each registers here; at exit the threads that loop until told are told to stop first (the served
learner: it ends after its update, or between two batches of its gate), then the engines close (a
worker ends after the step in progress, queued requests fail), then the remaining threads are
joined (they end once their engine refuses the next step).

Registration holds weak references: an object collected before exit is skipped.
"""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable

JOIN_TIMEOUT_S = 60.0  # per engine and thread at exit; one still busy after it is left (and may abort the exit)

_engines: weakref.WeakSet = weakref.WeakSet()
_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # thread -> what asks it to end, or None


def close_at_exit(engine) -> None:
    """Call ``engine.close(timeout_s)`` at interpreter exit unless it was collected before
    (``close`` must be idempotent and wait at most ``timeout_s`` seconds)."""
    _engines.add(engine)


def join_at_exit(thread: threading.Thread, stop: Callable[[], None] | None = None) -> None:
    """Join ``thread`` (at most :data:`JOIN_TIMEOUT_S`) at interpreter exit, after the engines closed.

    Args:
        stop: for a thread that runs until told: called first, before any engine closes; it must
            only ask the thread to end, not wait for it, and must not hold a reference to
            ``thread`` (a bound method of the thread would keep it from being collected).
    """
    _threads[thread] = stop


def stop_all(join_timeout_s: float = JOIN_TIMEOUT_S, log: Callable[[str], None] | None = None) -> None:
    """Ask every registered thread that loops until told to stop, close every registered engine,
    then join every registered thread (what runs at exit). A stop or close that raises is reported
    to ``log`` (default: none) and the rest still run."""
    for thread, stop in list(_threads.items()):
        if stop is not None and thread.is_alive():
            try:
                stop()
            except Exception as e:  # at exit nothing can be done about it; the others still stop
                if log is not None:
                    log(f"stopping thread {thread.name} at exit failed: {e!r}")
    for engine in list(_engines):
        try:
            engine.close(join_timeout_s)
        except Exception as e:  # at exit nothing can be done about it; the other engines still close
            if log is not None:
                log(f"closing {type(engine).__name__} at exit failed: {e!r}")
    for thread in list(_threads):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(join_timeout_s)


atexit.register(stop_all)
