"""Clients that go away mid-generation.

When a client disconnects before its response is complete (a closed stream, or a
non-streaming request whose connection closed while it waited), the server:

1. sets the cancel event of each of the request's jobs: a job still queued never
   starts, and a running row stops at the engine's next step (engines with
   ``supports_cancel``; the slot is free for other requests);
2. once the jobs have resolved, records the partial turn as any other turn
   (``Service.finish``), then marks it cut off (:func:`selfrl.record.served.mark_cut_off`):
   ``truncated``, ``error = "client disconnected"`` and served status ``skipped``, so
   the learner never trains on it and it still shows in the store.

Recording happens in a thread of its own (the event loop may be cancelling the
request's task; the batcher's worker must not wait on the store), which the exit waits for
(at most :data:`selfrl.core.threads_at_exit.JOIN_TIMEOUT_S`).

A request one of whose jobs fails (an engine error) is answered with that error at once
(:func:`generation_failed`: a 500, or a 400 ``invalid_schema`` when its own grammar failed;
an error event in a stream that has started), and its other jobs are
cancelled the same way: nothing decodes on for a request already answered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable

from selfrl.core.threads_at_exit import join_at_exit
from selfrl.record import served as records

REASON = "client disconnected"


def generation_failed(jobs: list, e: BaseException):
    """Cancel ``jobs`` (a request's, one of which failed with ``e``) and return the
    :class:`selfrl.serve.errors.ApiError` its client gets: 500, ``server_error``, with the
    engine's reason; but 400 ``invalid_schema`` naming ``tools`` or ``response_format`` when
    the request's own grammar failed mid-generation (a :class:`selfrl.chat.constrain.ConstraintError`:
    its schema has no finite value along the path sampled, which no check before generation
    reached)."""
    from selfrl.chat.constrain import ConstraintError
    from selfrl.serve.errors import ApiError

    for j in jobs:
        j.cancel.set()
    if isinstance(e, ConstraintError):
        kind = next((j.constraint.kind for j in jobs if j.constraint is not None), "json")
        param = getattr(e, "param", None) or ("response_format" if kind == "json" else "tools")
        return ApiError(400, f"{param}: the schema failed during generation: {e} (a schema with no finite "
                             "value: a \"$ref\" cycle through required properties, say)", param, "invalid_schema")
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", code="generation_failed",
                    type_="server_error")


def cut_off(service, prepared, jobs: list, started: float) -> None:
    """Cancel ``jobs`` and, when all have resolved, record ``prepared``'s turns as cut off.

    Args:
        service: the :class:`selfrl.serve.service.Service`.
        prepared: the request's ``Prepared``.
        jobs: its batcher jobs.
        started: ``time.perf_counter()`` when they were submitted.
    """
    for j in jobs:
        j.cancel.set()
    once = threading.Lock()
    done: list[bool] = []

    def record() -> None:
        gens = []
        for j in jobs:
            if j.future.cancelled() or j.future.exception() is not None:
                return  # an engine error is the request's error, not a cut-off turn
            gens.append(j.future.result())
        try:
            if prepared.req.record:
                service.finish(prepared, gens, time.perf_counter() - started)
                with service.store.lock:
                    records.mark_cut_off(service.store, prepared.response_id, REASON)
            service.event("disconnect", f"{prepared.response_id}: the client disconnected; "
                          f"{sum(len(g.token_ids) for g in gens)} tokens recorded as cut off, not trained on")
        except Exception as e:  # nobody waits for this turn: a storage fault is reported, not raised
            if service.storage.failed(e) is None:
                raise

    def when_resolved(_) -> None:
        with once:
            if done or not all(j.future.done() for j in jobs):
                return
            done.append(True)
        thread = threading.Thread(target=record, name="selfrl-cut-off", daemon=True)
        join_at_exit(thread)  # a store write cut off at exit is lost: the exit waits for it (bounded)
        thread.start()

    for j in jobs:
        j.future.add_done_callback(when_resolved)


async def await_jobs(service, prepared, jobs: list, started: float,
                     is_disconnected: Callable[[], Awaitable[bool]] | None, poll_s: float = 0.1) -> list | None:
    """The jobs' generations, or None when the client disconnected first (then the jobs
    are cut off, see :func:`cut_off`).

    Args:
        is_disconnected: ``Request.is_disconnected`` of the HTTP request, or None to just wait.
        poll_s: how often to ask it (seconds).

    Raises:
        ApiError: 500 when a job failed (:func:`generation_failed`; the others are cancelled).
    """
    gathered = asyncio.gather(*[asyncio.wrap_future(j.future) for j in jobs])
    try:
        if is_disconnected is None:
            return await gathered
        while True:
            finished, _ = await asyncio.wait([gathered], timeout=poll_s)
            if finished:
                return gathered.result()
            if await is_disconnected():
                cut_off(service, prepared, jobs, started)
                gathered.add_done_callback(lambda g: g.cancelled() or g.exception())  # consumed: no warning
                return None
    except asyncio.CancelledError:
        cut_off(service, prepared, jobs, started)
        raise
    except Exception as e:
        raise generation_failed(jobs, e) from e
