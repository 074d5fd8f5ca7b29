"""Threads that run torch, stopped before the interpreter finalises.

At exit CPython ends a daemon thread the moment it next takes the GIL; one inside a torch
operator is unwound through C++ frames that do not allow it, and the process aborts
("terminate called without an active exception", exit status -6 / 134) after its work is done.
A store write cut off the same way is lost. The slot engine's worker, a background rollout batch,
the served learner, the serve batcher's worker, a swap or swap check still under way past its
deadline and the recording of a cut-off turn are such threads. Each registers here; at exit the
threads that loop until told are told to stop first (the served learner: it ends after its update,
or between two batches of its gate; the batcher: after its batch in progress), then the engines
close (a worker ends after the step in progress, queued requests fail), then the remaining threads
are joined (they end once their engine refuses the next step, or their call returns).

The wait is bounded: each engine's close, then all the joins together, wait at most
:data:`JOIN_TIMEOUT_S` (a swap hung on a sampler delays exit by that, then the exit goes on).

Registration holds weak references: an object collected before exit is skipped.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable

JOIN_TIMEOUT_S = 60.0  # per engine, and for all threads together, at exit; one still busy after it is left

_engines: weakref.WeakSet = weakref.WeakSet()
_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # thread -> what asks it to end, or None
_lock = threading.Lock()  # threads register from any thread, also while the exit reads the registry


def close_at_exit(engine) -> None:
    """Call ``engine.close(timeout_s)`` at interpreter exit unless it was collected before
    (``close`` must be idempotent and wait at most ``timeout_s`` seconds)."""
    with _lock:
        _engines.add(engine)


def join_at_exit(thread: threading.Thread, stop: Callable[[], None] | None = None) -> None:
    """Join ``thread`` at interpreter exit, after the engines closed (all threads together wait at
    most :data:`JOIN_TIMEOUT_S`); a thread not started, or ended, is skipped (register before ``start``:
    no moment unregistered).

    Args:
        stop: for a thread that runs until told: called first, before any engine closes; it must
            only ask the thread to end, not wait for it, and must not hold a reference to
            ``thread`` (a bound method of the thread would keep it from being collected).
    """
    with _lock:
        _threads[thread] = stop


def stop_all(join_timeout_s: float | None = None, log: Callable[[str], None] | None = None) -> None:
    """Ask every registered thread that loops until told to stop, close every registered engine,
    then join every registered thread (what runs at exit). A stop or close that raises, and a
    thread still alive when the joins' time is up, is reported to ``log`` (default: none) and the
    rest still run.

    Args:
        join_timeout_s: seconds each engine's close may take, and all the joins together
            (None: :data:`JOIN_TIMEOUT_S`, read when called).
    """
    if join_timeout_s is None:
        join_timeout_s = JOIN_TIMEOUT_S
    with _lock:
        threads, engines = list(_threads.items()), list(_engines)
    for thread, stop in threads:
        if stop is not None and thread.is_alive():
            try:
                stop()
            except Exception as e:  # at exit nothing can be done about it; the others still stop
                if log is not None:
                    log(f"stopping thread {thread.name} at exit failed: {e!r}")
    for engine in engines:
        try:
            engine.close(join_timeout_s)
        except Exception as e:  # at exit nothing can be done about it; the other engines still close
            if log is not None:
                log(f"closing {type(engine).__name__} at exit failed: {e!r}")
    deadline = time.monotonic() + join_timeout_s  # one bound for all: N hung threads do not wait N times
    with _lock:  # and those registered since (a cut-off turn's recording, started by a failed request)
        threads = list(_threads)
    for thread in threads:
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive() and log is not None:
                log(f"thread {thread.name} still running {join_timeout_s:g} s into the exit; left")


atexit.register(stop_all)
