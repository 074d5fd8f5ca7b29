"""The requests of the slot engine (:mod:`selfrl.engines.slots`): one :class:`Request` per
continuation to sample, the rows of one ``generate`` call (:class:`Call`), and each row's own
seeded generator (:func:`row_generator`), and the future of a caller-driven engine
(:class:`DrivenFuture`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from selfrl.engines.base import Generation
from selfrl.engines.rowgrammar import RowGrammar


@dataclass(eq=False)
class Request:
    """One continuation to sample (see :meth:`SlotEngine.submit`)."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    greedy: bool = False
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    on_tokens: Callable[[list[int]], None] | None = None  # called from the worker with the ids so far
    prefix_hint: int = 0  # leading tokens shared with other queued requests (encode once)
    generator: torch.Generator | None = None  # this row's own sampling generator
    top_logprobs: int = 0  # most likely ids kept per position (0 = none)
    step_logprobs: bool = False  # on_tokens(ids, logprobs, top) instead of on_tokens(ids)
    grammar: RowGrammar | None = None  # this row's grammar (constrained decoding)
    cancel: threading.Event | None = None  # set: the row stops before the next step
    future: Future = field(default_factory=Future)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    constrained: list[bool] | None = None  # per id, the grammar removed ids from its distribution
    top: list[list[tuple[int, float]]] | None = None  # per id, the top_logprobs most likely (id, logprob)
    version: int = 0
    length: int = 0  # tokens of this row in the cache
    generation: int = -1  # the weights' generation (WeightWatch) when the row was prefilled
    call: "Call | None" = None
    settled: bool = False  # its future has its result or error and its ticket is released
    shared: tuple | None = None  # (keys, values, length): the stored prefix its prompt starts with, when admitted

    def result(self, finished: bool, stopped: bool = False, cancelled: bool = False,
               grammar_error: str | None = None) -> Generation:
        return Generation(self.token_ids, self.logprobs, finished, self.version, stopped=stopped,
                          constrained=self.constrained, cancelled=cancelled, top_logprobs=self.top,
                          grammar_error=grammar_error)

    def report(self) -> None:
        """Call ``on_tokens`` with the ids so far (and their logprobs, with ``step_logprobs``)."""
        if self.on_tokens is None:
            return
        if self.step_logprobs:
            self.on_tokens(list(self.token_ids), list(self.logprobs), None if self.top is None else list(self.top))
        else:
            self.on_tokens(list(self.token_ids))


def row_generator(seed: int | None) -> torch.Generator:
    """A generator for one row: seeded with ``seed``, or with a draw from the global one."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    return torch.Generator().manual_seed(seed)


class Call:
    """The rows of one ``generate`` call, for its ``on_step`` hook."""

    def __init__(self, requests: list[Request], on_step: Callable[..., None], pad: int, step_logprobs: bool = False):
        self.requests, self.on_step, self.pad, self.step_logprobs = requests, on_step, pad, step_logprobs

    def emit(self) -> None:
        """``on_step(ids)`` (B, k), or with ``step_logprobs`` ``on_step(ids, logprobs, top)``:
        (B, k) logprobs and a pair of (B, k, n) tensors (ids, logprobs) or None; rows that
        ended hold padding (id ``pad``, logprob 0) after their end.

        ``k`` is the fewest ids of a row still running (one admitted later, or drafted fewer ids:
        rows do not advance together), so that a running row never shows padding that a later id
        replaces: each row's first ``k`` ids are its final ones. A row ahead is shown up to ``k``;
        once every row has ended, ``k`` is the most ids of a row. Nothing is called while ``k`` is 0."""
        running = [len(r.token_ids) for r in self.requests if not r.settled]
        k = min(running) if running else max(len(r.token_ids) for r in self.requests)
        if k == 0:
            return
        B = len(self.requests)
        ids = torch.full((B, k), self.pad, dtype=torch.long)  # (B, k)
        logps = torch.zeros(B, k)  # (B, k)
        n = max(r.top_logprobs for r in self.requests)
        top = (torch.full((B, k, n), self.pad, dtype=torch.long), torch.zeros(B, k, n)) if n else None  # (B, k, n)
        for i, r in enumerate(self.requests):
            n_i = min(k, len(r.token_ids))
            if n_i:
                ids[i, :n_i] = torch.tensor(r.token_ids[:n_i])
                logps[i, :n_i] = torch.tensor(r.logprobs[:n_i])
            if top is not None and r.top and n_i:
                top[0][i, :n_i] = torch.tensor([[t for t, _ in alts] for alts in r.top[:n_i]])
                top[1][i, :n_i] = torch.tensor([[lp for _, lp in alts] for alts in r.top[:n_i]])
        if self.step_logprobs:
            self.on_step(ids, logps, top)
        else:
            self.on_step(ids)


class WorkerFuture(Future):
    """A future of a slot engine stepped by its own worker thread: waiting on it from inside a step
    (a callback, which runs on the worker) raises RuntimeError (``refuse``) instead of waiting for a
    worker that waits for it."""

    def __init__(self, refuse: Callable[[], None]):
        super().__init__()
        self._refuse = refuse

    def result(self, timeout: float | None = None):
        if not self.done():
            self._refuse()
        return super().result(timeout)

    def exception(self, timeout: float | None = None):
        if not self.done():
            self._refuse()
        return super().exception(timeout)


class DrivenFuture(Future):
    """A future of a caller-driven :class:`selfrl.engines.slots.SlotEngine`: ``result()`` and ``exception()`` run
    the engine's steps in the waiting thread until it is done (or ``timeout`` seconds)."""

    def __init__(self, drive: Callable[[Callable[[], bool], float | None], None]):
        super().__init__()
        self._drive_steps = drive

    def result(self, timeout: float | None = None):
        self._drive_steps(self.done, timeout)
        return super().result(timeout=None if self.done() else 0)

    def exception(self, timeout: float | None = None):
        self._drive_steps(self.done, timeout)
        return super().exception(timeout=None if self.done() else 0)
