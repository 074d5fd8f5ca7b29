"""A slot-engine row that holds the engine's worker at a known id, so that a test can queue
requests while the row is surely still decoding (polling ``engine.steps`` races on a busy
machine: the row can finish, or the worker admit one request of several alone, in between)."""

from __future__ import annotations

import threading


class HeldRow:
    """``on_tokens`` for :meth:`selfrl.engines.slots.SlotEngine.submit`: the worker waits inside it
    once the row has ``at`` ids, until :meth:`release` (at most ``timeout_s`` seconds)."""

    def __init__(self, at: int = 3, timeout_s: float = 60.0):
        self.at, self.timeout_s = at, timeout_s
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, ids: list[int]) -> None:
        if len(ids) == self.at and not self.go.is_set():
            self.reached.set()
            self.go.wait(self.timeout_s)

    def wait(self) -> bool:
        """Whether the worker reached the held id within ``timeout_s`` seconds."""
        return self.reached.wait(self.timeout_s)

    def release(self) -> None:
        self.go.set()
