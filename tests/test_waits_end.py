"""Every wait ends: a failure reaches whoever waits on it, and the component serves the next.

The slot engine's own failures are in ``tests/test_engine_failures.py``. These tests inject a
failure into each other place where a caller waits on another thread, process or future (the
server's batcher, a stream, the pipelined rollout, the browser's driver thread, the sandbox's
child) and check that the waiter gets a clear error within a bound, that nothing is left
holding a slot, a row or a process, and that the next request is served in full. On the code
before these fixes each of them hung (the tests' own bounds turn that into a failure) or leaked.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from selfrl.engines.base import Generation
from selfrl.serve import batcher as batcher_mod
from selfrl.serve.batcher import Batcher, Job

BOUND_S = 10.0  # no waiter below waits longer than this on the fixed code


class ListEngine:
    """A stand-in batch engine: row ``i`` of a call samples ``[prompt[0] + 1, ..., + max_new_tokens]``.

    ``drop``: return one generation fewer than the rows it was given (a backend bug).
    ``die``: raise this (a ``BaseException``) from ``generate``.
    """

    version = 3
    eos_token_ids = [0]

    def __init__(self):
        self.drop, self.die, self.calls = False, None, 0

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, on_step=None, stop=None):
        self.calls += 1
        if self.die is not None:
            raise self.die
        gens = [Generation([p[0] + k for k in range(1, max_new_tokens + 1)], [-0.5] * max_new_tokens, False,
                           self.version) for p in prompts]
        return gens[:-1] if self.drop else gens


def settle(fut: Future, timeout: float = BOUND_S):
    """``fut``'s result (or its exception, returned); fails the test when it never settles."""
    try:
        return fut.result(timeout=timeout)
    except TimeoutError:
        raise AssertionError(f"the future did not settle within {timeout} s: its waiter would hang") from None
    except BaseException as e:
        return e


def test_a_batch_the_engine_answers_short_fails_its_jobs_and_the_next_batch_is_served():
    engine = ListEngine()
    b = Batcher(engine, lambda v, fn: fn(), window_s=0.2)
    engine.drop = True
    first = [b.submit(Job([10], 2, greedy=True)), b.submit(Job([20], 2, greedy=True))]
    errors = [settle(f) for f in first]
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert str(errors[1]) == "the engine returned 1 generation(s) for a batch of 2 rows"
    engine.drop = False
    g = settle(b.submit(Job([30], 3, greedy=True)))
    assert g.token_ids == [31, 32, 33] and g.logprobs == [-0.5] * 3 and g.adapter_version == 3
    assert b.pending == 0 and b.error is None and b.batches == 1 and b.rows == 1
    b.close()


def test_a_job_whose_bookkeeping_raises_fails_alone_and_the_worker_goes_on(monkeypatch):
    real = batcher_mod.cut

    def cut(gen, limit, eos):  # the batcher's own step after the engine call raises for one row
        if gen.token_ids[0] == 21:
            raise ValueError("row 20 cannot be cut")
        return real(gen, limit, eos)

    monkeypatch.setattr(batcher_mod, "cut", cut)
    b = Batcher(ListEngine(), lambda v, fn: fn(), window_s=0.2)
    bad, good = b.submit(Job([20], 2, greedy=True)), b.submit(Job([40], 2, greedy=True))
    e = settle(bad)
    assert isinstance(e, ValueError) and str(e) == "row 20 cannot be cut"
    assert settle(good).token_ids == [41, 42]
    assert settle(b.submit(Job([50], 1, greedy=True))).token_ids == [51]  # the worker is alive
    assert b._thread.is_alive() and b.error is None
    b.close()


class Stop(BaseException):
    """Something that ends a thread (as ``SystemExit`` would), not an ``Exception``."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the point
def test_a_worker_that_dies_fails_what_it_held_and_what_was_queued_and_refuses_new_jobs():
    engine = ListEngine()
    gate = threading.Event()
    real = engine.generate

    def generate(*a, **k):
        gate.wait(BOUND_S)  # holds the worker while more jobs queue up behind this batch
        return real(*a, **k)

    engine.generate = generate
    engine.die = Stop("the engine pulled the plug")
    b = Batcher(engine, lambda v, fn: fn(), window_s=0.0)
    held = b.submit(Job([1], 2, greedy=True))
    time.sleep(0.2)
    queued = b.submit(Job([2], 2, temperature=0.7))
    gate.set()
    assert isinstance(settle(held), Stop)
    e = settle(queued)
    assert isinstance(e, RuntimeError)
    assert str(e) == "the batcher stopped before this request ran: its worker died: Stop: the engine pulled the plug"
    b._thread.join(BOUND_S)
    with pytest.raises(RuntimeError, match="the batcher takes no more requests: its worker died: Stop"):
        b.submit(Job([3], 1))
    assert b.pending == 0


def test_jobs_submitted_after_close_are_refused_not_queued_forever():
    b = Batcher(ListEngine(), lambda v, fn: fn())
    assert settle(b.submit(Job([5], 1, greedy=True))).token_ids == [6]
    b.close()
    with pytest.raises(RuntimeError, match="the batcher takes no more requests: it was closed"):
        b.submit(Job([6], 1))
