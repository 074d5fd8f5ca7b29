"""The slot engine's steps: its queue, one step (admit, prefill, decode), and each request settled.

One thread at a time runs the steps: the engine's worker thread (``driver="thread"``:
:meth:`SlotSteps._work`), or a thread that waits for results (``driver="caller"``:
:class:`selfrl.engines.slotdriver.CallerDriven`). A step (:meth:`SlotSteps._step`) drops the
cancelled rows, admits queued requests into free slots (their prefill, and first tokens, packed
with the running rows' decoding pass when it can: :mod:`selfrl.engines.slotprefill`), then
decodes one token (or a few drafted ones) for every active row (:mod:`selfrl.engines.slotdecode`).
A failed step fails the requests in flight, never the engine. Every request holds a ticket of the
engine's :class:`~selfrl.engines.versiongate.VersionGate` from :meth:`SlotSteps._enqueue` until
:meth:`SlotSteps._finish` settles it, exactly once.

A mixin of :class:`selfrl.engines.slots.SlotEngine`, whose attributes it uses (``_queue``,
``_rows``, ``_cond``, ``lock``, ``cache``, ``max_slots``, ...).
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import InvalidStateError

import torch

from selfrl.engines.base import Generation
from selfrl.engines.kvcache import SlotCache
from selfrl.engines.slotrequest import Request


class SlotSteps:
    """The steps of a slot engine: :meth:`_enqueue`, the worker's loop, :meth:`_step`, :meth:`_finish`."""


    def _enqueue(self, reqs: list[Request]) -> None:
        me = threading.get_ident()
        in_step = me == self._stepping or (self._worker is not None and self._worker.ident == me)
        # at once: a swap never waits between two of them; from inside a step (a callback submitting a
        # follow-up) not behind a waiting swap, which waits for this step's own requests
        self.lock.acquire_shared(len(reqs), behind_swap=not in_step)
        try:
            with self._cond:
                if self._closed:
                    raise RuntimeError("the slot engine is closed")
                if self._stopped:
                    raise RuntimeError(self._stopped)
                for r in reqs:
                    r.version = self.version
                self._queue.extend(reqs)
                self._cond.notify_all()
        except BaseException:
            for _ in reqs:
                self.lock.release_shared()
            raise

    def _work(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # never leave a caller waiting on a worker that is gone
            with self._cond:
                self._stopped = f"the slot engine's worker stopped: {e!r}"
            self._error = self._stopped
            self._fail_all(RuntimeError(self._stopped))
            raise

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._give_back_idle_cache()
                while not self._queue and not self._rows and not self._closed:
                    self._cond.wait()
                if self._closed:
                    self._fail_all(RuntimeError("the slot engine is closed"))
                    return
            self._guarded_step()

    def _give_back_idle_cache(self) -> None:
        """With no row queued or active, replace a cache over ``idle_cache_bytes`` by a small one (hold ``_cond``)."""
        if not self._queue and not self._rows and self.cache.nbytes > self.idle_cache_bytes:
            self.cache = SlotCache(slots=min(8, self.max_slots), layers=self._layers)

    def _guarded_step(self) -> None:
        """One :meth:`_step`; a failure goes to every request in flight, and the engine goes on."""
        try:
            with torch.no_grad():
                self._step()
        except Exception as e:
            self._error = f"last step failed: {e!r}"
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            pending = self._rows + self._admitting + list(self._queue)
            self._rows, self._admitting, self._queue = [], [], deque()
        for r in pending:
            self._finish(r, error=error)

    def _finish(self, r: Request, gen: Generation | None = None, error: BaseException | None = None) -> None:
        """Settle ``r``: its result (or ``error``) and its version ticket back, exactly once (a
        later call for the same request does nothing: a failure may reach a row that already
        finished in the same step)."""
        if r.settled:
            return
        r.settled = True
        try:
            if error is not None:
                r.future.set_exception(error)
            else:
                r.future.set_result(gen)
        except InvalidStateError:  # cancelled by its owner (Future.cancel) while queued: nothing to deliver
            pass
        finally:
            self.lock.release_shared()

    def _step(self) -> None:
        """Admit queued requests (prefill, first token: streamed at once, so a new request's
        time to first token is one prefill, not a decoding step more), then one decoding
        step for every active row, the new ones included."""
        if self.model.training:
            self.model.eval()
        self._drop_cancelled()
        with self._cond:
            room = self.max_slots - len(self._rows)
            new = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
        cancelled = [r for r in new if not r.future.set_running_or_notify_cancel()]
        for _ in cancelled:
            self.lock.release_shared()
        new = [r for r in new if r not in cancelled]
        self._admitting = new  # neither queued nor active while prefilled: an interrupt must still fail them
        decoded = False
        if new:
            old = self._rows
            # while rows decode, their pass and the new rows' prefill run as one packed forward pass
            decode = self._decode_pass(old) if old and self.pack_passes and self._packs() else None
            try:
                logits, old_logits = self._prefill(new, decode)  # (b, V); the old rows' (B, V), (B, T, V) or None
            except Exception as e:  # the admitted requests get the error; the running rows go on
                self._error = f"last prefill failed: {e!r}"
                for r in new:
                    self._finish(r, error=e)
                new = []
            else:
                self._rows = self._rows + new
                if old_logits is not None:  # the old rows first: every length is counted before rows move
                    self._decode_chosen(old, decode, old_logits)
                    decoded = True
                self._sample(new, logits)
        self._admitting = []
        if self._rows and not decoded:  # one decoding pass for the active rows
            self._decode()

    def _drop_cancelled(self) -> None:
        """Finish every queued or running request whose cancel event is set (``cancelled=True``,
        the ids sampled so far) and free the slots of the running ones."""
        with self._cond:
            gone = [r for r in self._queue if r.cancel is not None and r.cancel.is_set()]
            for r in gone:
                self._queue.remove(r)
        for r in gone:
            if r.future.set_running_or_notify_cancel():
                self._finish(r, r.result(False, cancelled=True))
            else:
                self.lock.release_shared()
        done = [i for i, r in enumerate(self._rows) if r.cancel is not None and r.cancel.is_set()]
        for i in done:
            self._finish(self._rows[i], self._rows[i].result(False, cancelled=True))
        self.rows_cancelled += len(gone) + len(done)
        self._release(done)
