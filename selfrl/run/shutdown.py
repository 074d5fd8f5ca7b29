"""Stopping on a signal: SIGTERM and SIGHUP stop ``selfrl`` as Ctrl-C does.

systemd, Docker and Kubernetes stop a process with SIGTERM (then SIGKILL after a grace
period); a closed terminal sends SIGHUP. Python's default for both is to die at once,
with no message, no report and an open store. Here every stop signal takes the Ctrl-C
path instead:

* ``selfrl run``: the first signal raises :class:`StopRequested` (a ``KeyboardInterrupt``)
  in the main thread, so the loop stops where Ctrl-C would stop it: stored trajectories
  and versions are kept, the best version is put back, the report is written and the
  store closed (``selfrl.run.loop``); continue with ``--resume``.
* ``selfrl serve`` and ``selfrl sampler`` (uvicorn): :func:`server` stops accepting
  requests, lets those in flight finish, then runs the app's shutdown (serve: the
  background learner stops, the store closes, the run directory's lock is released).

A second stop signal during the graceful stop ends the process at once (``os._exit``);
SQLite's journal and the atomic adapter saves (``selfrl.record.adapters``) make that as safe as
a kill. Exit codes follow the shell's 128 + signal number: 130 after Ctrl-C (SIGINT),
143 after SIGTERM, 129 after SIGHUP, for the graceful stop and the prompt one alike.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_code(signum: int) -> int:
    """The exit code after stopping on ``signum``: 128 + its number (SIGTERM: 143)."""
    return 128 + int(signum)


def _say(text: str) -> None:
    try:
        os.write(sys.stderr.fileno(), f"selfrl: {text}\n".encode())
    except (OSError, ValueError, AttributeError):  # no usable stderr: stop anyway
        pass


def _second(signum: int) -> None:
    _say(f"{signal.Signals(signum).name} again: stopping now, without finishing the graceful stop")
    os._exit(exit_code(signum))


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived; handled wherever Ctrl-C is (it is a ``KeyboardInterrupt``).

    Attributes:
        signum: the signal's number.
    """

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


class GracefulStop:
    """While entered (in the main thread), SIGINT, SIGTERM and SIGHUP raise
    :class:`StopRequested` in the main thread; a second one ends the process at once.

    Attributes:
        received: the first stop signal's number, or None.

    >>> with GracefulStop() as stop:
    ...     pass
    >>> stop.received is None
    True
    """

    def __init__(self, what: str = "the run stops as on Ctrl-C"):
        self.what, self.received, self._previous = what, None, {}

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            _second(signum)
        self.received = signum
        _say(f"{signal.Signals(signum).name}: {self.what} (a second signal stops at once)")
        raise StopRequested(signum)

    @property
    def exit_code(self) -> int | None:
        """:func:`exit_code` of the received signal; None when none came."""
        return None if self.received is None else exit_code(self.received)


def server(config, announce: str | None = None, what: str = "stopping: requests in flight finish, then shutdown"):
    """A ``uvicorn.Server`` for ``config`` that stops gracefully on SIGINT, SIGTERM and SIGHUP
    (uvicorn alone handles the first two, then re-raises them, and SIGHUP kills it), prints
    ``announce`` once it listens, and ends at once on a second signal. After ``run``, its
    ``stop_signal`` is the signal that stopped it (None otherwise)."""
    import uvicorn

    class Server(uvicorn.Server):
        stop_signal: int | None = None

        def capture_signals(self):  # uvicorn's, with SIGHUP, and without re-raising afterwards
            from contextlib import contextmanager

            @contextmanager
            def capture():
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {s: signal.signal(s, self.handle_exit) for s in STOP_SIGNALS}
                try:
                    yield
                finally:
                    for s, handler in previous.items():
                        signal.signal(s, handler)

            return capture()

        def handle_exit(self, sig: int, frame) -> None:
            if self.stop_signal is not None:
                _second(sig)
            self.stop_signal = sig
            _say(f"{signal.Signals(sig).name}: {what} (a second signal stops at once)")
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            if announce and self.started and not self.should_exit:
                print(announce, file=sys.stderr, flush=True)

    return Server(config)
