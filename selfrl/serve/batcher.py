"""Batching concurrent requests into engine calls.

Requests that arrive while the engine is busy, or within ``window_s`` of each other,
are run together in one ``Engine.generate`` call when they sample alike (same
temperature, ``top_p``, greedy or not, and adapter version). Rows keep their own
token limit: the batch runs to the largest one and each row is cut at its own, which
changes nothing for the kept tokens (decoding is left to right).

One worker thread runs every engine call, so a swap (``Engine.swap`` takes the
engine's lock) always falls between two batches: a request finishes on the version
it started with.

With a continuous-batching engine (one with ``submit``, e.g.
:class:`selfrl.engines.slots.SlotEngine`) there is no batch to collect: each request
is handed to the engine as it arrives and joins the batch already decoding, with
its own sampling settings, token limit, grammar, cancel event and top logprobs; the
engine's version gate keeps each request on one version. Requests that name a version other than the served one
still go through ``run_on_version`` one group at a time.

Every job's future is settled, whatever fails: an engine call that raises, or returns a
generation fewer than it was given rows, fails the jobs of that call only (the worker
goes on with the next); a worker that dies all the same (a ``BaseException``) fails every
job still queued, and :meth:`Batcher.submit` then refuses new ones with the reason.

At interpreter exit the worker (an engine call runs torch in it) ends after its batch in
progress, the jobs still queued fail, and it is joined (:mod:`selfrl.core.threads_at_exit`).
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from selfrl.core.threads_at_exit import join_at_exit
from selfrl.engines.base import Generation, SamplingEngine

EXITING = "the process is exiting"  # the batcher's error once the exit stopped its worker


@dataclass
class Job:
    """One continuation to sample.

    Attributes:
        prompt: token ids of the prompt.
        max_new_tokens: this row's token limit.
        temperature: > 0 when sampling; ignored when ``greedy``.
        top_p: nucleus (1.0 = off).
        greedy: argmax decoding (temperature 0 requests).
        version: adapter version to run on, or None for whatever is being served.
        stop: strings that end the row (cut right after the token that completes one).
        on_tokens: streaming callback, called from the worker thread with the ids so far, or
            (with ``step_logprobs``) with the ids, their logprobs and the top alternatives
            (a list per token of ``(id, logprob)``, or None).
        top_logprobs: how many alternatives per token to return (0-20; not part of the
            batch key: a batch computes the most any of its jobs asks for).
        constraint: a :class:`selfrl.chat.constrain.Constraint` for this row, or None; rows
            with and without one share a batch (the engine masks per row).
        cancel: set it when the client went away: a job not started yet resolves with an
            empty cancelled :class:`Generation`; a running row stops at the next step on
            an engine with ``supports_cancel`` (and runs to its end on one without).
        future: resolved with the :class:`Generation`, or with the exception.
    """

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False
    version: int | None = None
    stop: tuple[str, ...] = ()
    on_tokens: Callable[[list[int]], None] | None = None
    top_logprobs: int = 0
    step_logprobs: bool = False
    constraint: object | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    future: Future = field(default_factory=Future)

    @property
    def key(self) -> tuple:
        return (self.greedy, None if self.greedy else self.temperature, self.top_p, self.version, self.stop)


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _fail(jobs: list[Job], e: BaseException) -> None:
    """Settle each of ``jobs`` not settled yet with ``e`` (a job is settled exactly once); an ``e`` that
    is no ``Exception`` (it ends threads: ``SystemExit``) reaches them as a ``RuntimeError`` caused by it."""
    if not isinstance(e, Exception):
        cause, e = e, RuntimeError(f"the batcher's worker died: {type(e).__name__}: {e}")
        e.__cause__ = cause
    for j in jobs:
        try:
            j.future.set_exception(e)
        except InvalidStateError:  # settled already (its result, an earlier error) or cancelled
            pass


def _grammar_failed(gen: Generation, job: Job, tokenizer) -> Exception:
    """The error a job whose grammar failed mid-generation (``gen.grammar_error``) settles
    with: a :class:`selfrl.chat.constrain.ConstraintError` whose ``param`` names the request field
    whose schema failed: ``response_format`` for a JSON answer, ``tools`` for a tool call
    (where either was allowed, the one the sampled text had begun)."""
    from selfrl.chat.constrain import ConstraintError
    from selfrl.chat.toolcall import TOOL_CALL_OPEN

    e = ConstraintError(gen.grammar_error)
    kind = getattr(job.constraint, "kind", "json")
    if kind == "tool_call_or_json":
        called = tokenizer.decode(gen.token_ids, skip_special_tokens=False).lstrip().startswith(TOOL_CALL_OPEN)
        e.param = "tools" if called else "response_format"
    else:
        e.param = "response_format" if kind == "json" else "tools"
    return e


def cut(gen: Generation, limit: int, eos_ids: list[int]) -> Generation:
    """``gen`` cut to ``limit`` tokens; ``finished`` only when an EOS lies within the limit.

    >>> cut(Generation([5, 6, 2], [-1., -2., -3.], True, 0), 2, [2])
    Generation(token_ids=[5, 6], logprobs=[-1.0, -2.0], finished=False, adapter_version=0, stopped=False, constrained=None, cancelled=False, top_logprobs=None, grammar_error=None)
    """
    if len(gen.token_ids) <= limit:
        return gen
    ids = gen.token_ids[:limit]
    top = None if gen.top_logprobs is None else gen.top_logprobs[:limit]
    return Generation(ids, gen.logprobs[:limit], bool(ids) and ids[-1] in eos_ids, gen.adapter_version,
                      constrained=None if gen.constrained is None else gen.constrained[:limit], cancelled=gen.cancelled,
                      top_logprobs=top)


class Batcher:
    """Runs :class:`Job` s on an engine from one worker thread.

    Args:
        engine: the serving engine.
        run_on_version: ``run_on_version(version, fn)`` runs ``fn()`` with that adapter
            version loaded (and the served one restored after); used for requests that
            name a version other than the served one.
        max_batch: rows per engine call.
        window_s: how long the worker waits for more requests before starting a batch (seconds).
    """

    def __init__(self, engine: SamplingEngine, run_on_version: Callable[[int, Callable], object],
                 max_batch: int = 32, window_s: float = 0.01):
        self.engine, self.run_on_version = engine, run_on_version
        self.max_batch, self.window_s = max_batch, window_s
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.batches = 0  # engine calls so far (requests handed over, with a continuous engine)
        self.rows = 0  # rows sampled so far
        self.continuous = callable(getattr(engine, "submit", None))
        self.error: str | None = None  # why the worker stopped, once it has (closed, or died)
        self._halt = threading.Event()  # set at exit: the worker ends after its batch in progress
        self._thread = threading.Thread(target=self._work, name="selfrl-batcher", daemon=True)
        join_at_exit(self._thread, stop=lambda halt=self._halt, q=self.queue: (halt.set(), q.put(None)))
        self._thread.start()

    def submit(self, job: Job) -> Future:
        """Queue a job; returns its future.

        Raises:
            RuntimeError: the worker has stopped (closed, or died: the message says why).
        """
        if self.error is not None:
            raise RuntimeError(f"the batcher takes no more requests: {self.error}")
        self.queue.put(job)
        if self.error is not None:  # it stopped while this one was put: fail it, never leave it queued
            self._fail_queued()
        return job.future

    def close(self) -> None:
        """Stop the worker after the jobs already queued."""
        self.queue.put(None)
        self._thread.join(timeout=60)
        if not self._thread.is_alive():  # else it drains the queue itself when its batch ends
            self.error = self.error or "it was closed"
            self._fail_queued()

    def _fail_queued(self) -> None:
        """Fail every job still in the queue with :attr:`error` (after the worker stopped)."""
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            self._refuse(job)

    def _refuse(self, job: Job | None) -> None:
        """Fail ``job`` (unless None or cancelled) with :attr:`error`: it never ran."""
        if job is not None and job.future.set_running_or_notify_cancel():
            job.future.set_exception(RuntimeError(f"the batcher stopped before this request ran: {self.error}"))

    @property
    def pending(self) -> int:
        return self.queue.qsize()

    def supports(self, option: str) -> bool:
        """Whether the engine takes ``option`` (``top_logprobs``, ``step_logprobs``) on every
        path a job may take (``generate``, and ``submit`` for a continuous engine)."""
        fns = [self.engine.generate] + ([self.engine.submit] if self.continuous else [])
        return all(_accepts(fn, option) for fn in fns)

    def _collect(self, first: Job) -> tuple[list[Job], bool]:
        jobs, stop = [first], False
        deadline = time.monotonic() + self.window_s
        while len(jobs) < self.max_batch:
            try:
                nxt = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if nxt is None:
                stop = True
                break
            jobs.append(nxt)
        return jobs, stop

    def _work(self) -> None:
        try:
            while True:
                first = self.queue.get()
                if self._halt.is_set():  # the exit, after the batch in progress: no other starts
                    self.error = EXITING
                    self._refuse(first)  # and those still queued (finally)
                    return
                if first is None:
                    return
                jobs, stop = [first], False
                try:
                    if self.continuous and not self._pinned(first):
                        self._guarded([first], self._hand_over, first)
                        continue
                    jobs, stop = self._collect(first)
                    groups: dict[tuple, list[Job]] = {}
                    for j in jobs:
                        if self.continuous and not self._pinned(j):
                            self._guarded([j], self._hand_over, j)
                            continue
                        groups.setdefault(j.key, []).append(j)
                    for group in groups.values():
                        self._guarded(group, self._run, group)
                except Exception as e:  # these jobs get the error; the worker goes on
                    _fail(jobs, e)
                except BaseException as e:  # the worker dies: none of its jobs is left waiting
                    _fail(jobs, e)
                    raise
                if stop:
                    return
        except BaseException as e:
            self.error = f"its worker died: {type(e).__name__}: {e}"
            raise
        finally:
            self.error = self.error or "it was closed"
            self._fail_queued()

    @staticmethod
    def _guarded(jobs: list[Job], fn: Callable, *args) -> None:
        """``fn(*args)``; an exception fails those of ``jobs`` not settled yet (then is raised
        again if it is no ``Exception``: the worker dies, see :meth:`_work`)."""
        try:
            fn(*args)
        except Exception as e:
            _fail(jobs, e)
        except BaseException as e:
            _fail(jobs, e)
            raise

    def _pinned(self, job: Job) -> bool:
        return job.version is not None and job.version != self.engine.version

    def _hand_over(self, job: Job) -> None:
        """Give one job to a continuous engine; its future resolves when the engine's does.
        Its grammar, cancel event, top logprobs and streamed logprobs go with it; an engine
        that cannot take one of them fails the job (never samples it without)."""
        if not job.future.set_running_or_notify_cancel():
            return
        if job.cancel.is_set():  # the client left before its turn came
            job.future.set_result(Generation([], [], False, self.engine.version, cancelled=True))
            return
        extra = {"cancel": job.cancel}
        if job.constraint is not None:
            extra["constraint"] = job.constraint
        if job.top_logprobs:
            extra["top_logprobs"] = job.top_logprobs
        if job.step_logprobs and job.on_tokens is not None:
            extra["step_logprobs"] = True
        missing = [k for k in extra if not _accepts(self.engine.submit, k)]
        if "constraint" in missing or "top_logprobs" in missing:  # never sample a row without what it asked for
            job.future.set_exception(RuntimeError(f"this engine's submit takes no {' or '.join(missing)}"))
            return
        for k in missing:  # cancel: the row runs to its end; step_logprobs: the stream gets them at the end
            extra.pop(k)
        try:
            fut = self.engine.submit(job.prompt, job.max_new_tokens, job.temperature, greedy=job.greedy,
                                     top_p=job.top_p, stop=list(job.stop) or None, on_tokens=job.on_tokens, **extra)
        except Exception as e:
            job.future.set_exception(e)
            return
        self.batches += 1
        self.rows += 1

        def resolve(f: Future) -> None:
            if f.exception() is not None:
                job.future.set_exception(f.exception())
            elif f.result().grammar_error is not None:  # the row's grammar failed mid-generation
                job.future.set_exception(_grammar_failed(f.result(), job, self.engine.tokenizer))
            else:
                job.future.set_result(f.result())

        fut.add_done_callback(resolve)

    def _run(self, jobs: list[Job]) -> None:
        live = [j for j in jobs if j.future.set_running_or_notify_cancel()]
        for j in [j for j in live if j.cancel.is_set()]:  # the client left before its turn came
            j.future.set_result(Generation([], [], False, self.engine.version, cancelled=True))
        live = [j for j in live if not j.cancel.is_set()]
        if not live:
            return
        head = live[0]
        limit = max(j.max_new_tokens for j in live)
        streams = [j for j in live if j.on_tokens is not None]

        def on_step(ids, logps=None, top=None):  # (B, k) ids sampled so far; (B, k) their logprobs
            for i, j in enumerate(live):
                if j.on_tokens is None:
                    continue
                n = j.max_new_tokens
                if not j.step_logprobs:
                    j.on_tokens(ids[i, :n].tolist())
                    continue
                alts = None
                if top is not None and j.top_logprobs:
                    alts = [list(zip(a[:j.top_logprobs], b[:j.top_logprobs])) for a, b in
                            zip(top[0][i, :n].tolist(), top[1][i, :n].tolist())]
                j.on_tokens(ids[i, :n].tolist(), logps[i, :n].tolist(), alts)

        k = max(j.top_logprobs for j in live)
        extra = {"top_logprobs": k} if k else {}  # Service.prepare refused it where unsupported
        if any(j.step_logprobs for j in streams) and _accepts(self.engine.generate, "step_logprobs"):
            extra["step_logprobs"] = True  # else the stream gets its logprobs with the result

        # only a constrained batch passes ``constraints``: a backend without them never sees one
        if any(j.constraint for j in live):
            extra["constraints"] = [j.constraint for j in live]
        if getattr(self.engine, "supports_cancel", False) and _accepts(self.engine.generate, "cancel"):
            extra["cancel"] = [j.cancel for j in live]

        def call():
            return self.engine.generate([j.prompt for j in live], limit, head.temperature, greedy=head.greedy,
                                        top_p=head.top_p, on_step=on_step if streams else None,
                                        stop=list(head.stop) or None, **extra)

        try:
            if head.version is None or head.version == self.engine.version:
                gens = call()
            else:
                gens = self.run_on_version(head.version, call)
        except Exception as e:  # every waiting request gets the error; the worker goes on
            _fail(live, e)
            return
        if len(gens) != len(live):
            raise RuntimeError(f"the engine returned {len(gens)} generation(s) for a batch of {len(live)} rows")
        self.batches += 1
        self.rows += len(live)
        for j, g in zip(live, gens):
            if g.grammar_error is not None:  # this row's grammar failed; the batch's other rows keep theirs
                _fail([j], _grammar_failed(g, j, self.engine.tokenizer))
                continue
            try:
                if g.top_logprobs is not None:  # each job gets the k it asked for
                    g.top_logprobs = [alts[:j.top_logprobs] for alts in g.top_logprobs] if j.top_logprobs else None
                j.future.set_result(cut(g, j.max_new_tokens, self.engine.eos_token_ids))
            except Exception as e:  # this row's error; the batch's other rows keep their results
                _fail([j], e)
