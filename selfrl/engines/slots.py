"""The slot engine: continuous batching over the Hugging Face model's own forward pass,
with a preallocated key/value cache and shared prefixes encoded once.

How it departs from :class:`selfrl.engines.reference.Engine` (the reference backend):

- **Continuous batching.** One thread at a time runs the steps: the engine's worker
  thread (``driver="thread"``, a server's), or whichever thread waits for results
  (``driver="caller"``, ``selfrl run``'s: all torch work in one thread). Every request takes a
  slot (a row of :class:`~selfrl.engines.kvcache.SlotCache`); at each step the
  worker decodes one token for every active row, and a row that ends (EOS, a stop
  string, its own token limit) frees its slot at once for a queued request, which is
  prefilled and joins the running batch. A step admits first: the new rows' prompts
  are prefilled and their first tokens sampled and streamed in the step's own forward
  pass (packed with the running rows' decoding pass, :mod:`selfrl.engines.packedattention`,
  or before it), so a request's time to first token is the rest of the step in progress
  plus one pass, never a wait for other rows to finish (the steps: :mod:`selfrl.engines.slotsteps`). Nothing waits for the longest row, and a
  multi-turn rollout that submits each trajectory's next turn as soon as its tools
  have answered (:meth:`SlotEngine.submit`) never holds the batch while a tool runs.
- **No cache concatenation.** Keys and values are written in place (column =
  position) and read as views; rows are kept contiguous by moving the last row into
  a freed slot.
- **Shared prefixes.** A prefix common to a ``generate`` call (the system prompt and
  demonstration of every rollout), or the prompt of an earlier request, is encoded
  once and its keys and values are copied into each new row that starts with it;
  only the rest of the prompt is prefilled.
- **Drafts.** A pass of few rows is bound by reading the weights, so it feeds each row a few ids
  looked up in its own context after its last one and keeps those the model chooses itself
  (:mod:`selfrl.engines.slotdecode`, :mod:`selfrl.engines.drafts`): exact, several ids a pass.
- **Per-row sampling settings**: rows with different temperatures, ``top_p`` or
  greedy decoding share a batch, and each row samples from its own seeded generator, so
  what a row samples does not depend on which rows share its steps (which depends on
  thread timing): a seeded run repeats.
- **What the server needs, per row**: a grammar (:class:`~selfrl.engines.rowgrammar.RowGrammar`,
  the reference's rules: the masked distribution's logprob is recorded and the step
  flagged in ``Generation.constrained``), a cancel event (checked before every step: a
  cancelled row frees its slot at once and returns what it sampled with
  ``cancelled=True``), the ``k`` most likely ids per position (``top_logprobs``), and
  logprobs streamed as decoding goes (``step_logprobs``).

Logprobs are exact as in the reference: ``log_softmax(logits / temperature)`` at the
sampled id (:func:`~selfrl.engines.sampling.sample_tokens`), tested against a
full recomputation within 1e-5 in fp32 (``tests/test_engine_conformance.py``).

Versions: every request holds a ticket of the :class:`VersionGate` from submission
to completion, and :meth:`SlotEngine.swap` takes the gate exclusively (waiting for
the requests in flight; new ones wait for it), so each generation runs on exactly
one version, as in the reference.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from selfrl.core.threads_at_exit import close_at_exit
from selfrl.engines.reference import Engine
from selfrl.engines.base import AdapterSource, EngineHealth, Generation, check_generate_args, model_context
from selfrl.engines.kvcache import ContinuationStore, PrefixStore, SlotCache
from selfrl.engines.mergedpolicy import MergedPolicy
from selfrl.engines.rowgrammar import RowGrammar
from selfrl.engines.drafts import DRAFT_BUDGET, DRAFT_IDS
from selfrl.engines.slotdecode import SlotDecode
from selfrl.engines.slotdriver import DRIVERS, CallerDriven
from selfrl.engines.slotprefill import SlotPrefill
from selfrl.engines.slotsteps import SlotSteps
from selfrl.engines.slotattention import slot_attention
from selfrl.engines.slotrequest import Call, DrivenFuture, Request, WorkerFuture, row_generator
from selfrl.engines.versiongate import VersionGate
from selfrl.engines.weightwatch import WeightWatch
from selfrl.engines.sharedattention import attention_layers
from selfrl.model.prefix import MIN_SHARED_PREFIX, shared_prefix_len

__all__ = ["DrivenFuture", "Request", "SlotEngine", "VersionGate", "row_generator"]

IDLE_CACHE_BYTES = 2 * 2**30  # an idle engine keeps a cache up to this size; a larger one is freed
CONTINUATION_BYTES = 2**30  # finished rows' keys and values kept for their next turn (a 64-row demo batch: ~0.85 GB)


class SlotEngine(SlotSteps, CallerDriven, SlotPrefill, SlotDecode):
    """Continuous-batching backend of :class:`selfrl.engines.base.SamplingEngine`.

    This class is the interface (``generate``, ``submit``, ``swap``, ``health``, ``close``) and
    the engine's state; its parts are mixins, one per seam of the module docstring: the steps
    and the queue (:class:`~selfrl.engines.slotsteps.SlotSteps`), stepping by the waiting
    threads (:class:`~selfrl.engines.slotdriver.CallerDriven`), admission and prefill
    (:class:`~selfrl.engines.slotprefill.SlotPrefill`), and decoding with drafts
    (:class:`~selfrl.engines.slotdecode.SlotDecode`).

    Args:
        model: the policy (usually a ``peft.PeftModel``), shared with the learner in
            ``selfrl run``: an update made in place is sampled from at the next step (the
            merged view merges again, :class:`~selfrl.engines.weightwatch.WeightWatch`).
        tokenizer: its tokenizer; ``pad_token_id`` must be set.
        version: the adapter version in the weights.
        max_slots: rows decoded together at most (requests beyond wait for a slot).
        share_prefix: encode common prefixes once (see the module docstring).
        prefix_entries: how many encoded prefixes are kept (least recently used dropped).
        continuation_bytes: with ``share_prefix``, the keys and values of finished rows kept for
            the requests that continue them (a multi-turn rollout's next turn: only the tool's
            reply and the next header are prefilled), at most this many bytes, least recently
            used dropped (:class:`~selfrl.engines.kvcache.ContinuationStore`); 0: none kept.
        merge_lora: sample from :class:`~selfrl.engines.mergedpolicy.MergedPolicy`, a view of
            ``model`` with each LoRA merged into its weight (merged again whenever the LoRA
            changes) and small batches' products arranged for the CPU: 1.2-2.0x faster decoding
            steps at 1-8 rows on this machine, for a second copy of the targeted weights
            (docs/results/benchmarks.md, "Merged LoRA and the small-batch product"). False: the peft
            model's own forward pass.
        shared_prefix_attention: with ``share_prefix`` and ``merge_lora``, a decoding pass whose rows all
            start with one stored prefix (a batch's system prompt) attends to that prefix's keys and
            values once for all rows, instead of each row reading its own copy
            (:mod:`selfrl.engines.sharedattention`; models whose attention layers all take it: Llama,
            Mistral without a sliding window, Qwen2, Qwen3 on SDPA in fp32 or fp64). False: every row
            attends to its own columns.
        draft_ids, draft_budget: speculative decoding from each row's own context
            (:mod:`selfrl.engines.drafts`): a decoding pass of rows without a grammar feeds each row
            up to ``draft_ids`` ids looked up in its prompt and completion, with rows x (1 + drafted)
            at most ``draft_budget`` ids (passes of more rows draft nothing), and keeps those the
            model chooses itself: exact, the same ids and logprobs as one pass an id up to rounding.
            0 turns it off.
        pack_passes: a step that admits rows while others decode runs the new rows' prefill and the
            others' decoding pass as one forward pass, their tokens end to end without padding
            (:mod:`selfrl.engines.packedattention`; where the merged view attends with its own attention:
            ``merge_lora`` and the models ``shared_prefix_attention`` takes); the running rows draft as
            in a pass of their own. False: two passes, the prefill first.
        idle_cache_bytes: an engine with no row queued or running keeps its key/value cache up to
            this size, so that the next batch writes into it as it is; a larger cache is freed and
            the next batch allocates and zero-fills its own (the demo's 64 rows x 384 columns: 1.08 GB,
            0.3-1.4 s of a 5-9 s rollout batch on this machine; docs/results/benchmarks.md). vLLM likewise
            keeps its cache for the server's life. 0: always freed.
        driver: who runs the decoding steps. ``"thread"``: a worker thread of the engine's
            own, which decodes while nobody waits (a server's streams). ``"caller"``: the
            threads that wait on results (``generate``, :meth:`wait`, a future's
            ``result()``), one at a time, so that a process that also trains (``selfrl run``)
            runs all its torch work in one thread. This matters on the CPU: each thread that
            runs torch operators gets its own OpenMP team, and with more OpenMP threads than
            cores libgomp stops spinning at its barriers and sleeps in the kernel instead;
            a slot engine's worker beside a learner in the main thread then decoded 20-40 %
            slower (docs/results/benchmarks.md, "One thread for torch"). With ``"caller"``, a future
            from :meth:`submit` makes progress only while someone waits on it: wait with
            :meth:`wait` or its ``result()``, never ``concurrent.futures.wait`` alone.

    Raises:
        ValueError: ``max_slots`` < 1, ``draft_ids`` or ``draft_budget`` < 0, an unknown ``driver``, or
            attention other than SDPA or eager (:func:`~selfrl.engines.slotattention.slot_attention`);
            :meth:`generate` and :meth:`submit` refuse a request longer than the model's sliding window
            plus one (:attr:`context`), which the engine's masks do not apply.
    """

    name = "slots"
    supports_constraints = True  # honours generate(..., constraints=...) and submit(..., constraint=...)
    supports_cancel = True  # honours cancel events: a cancelled row frees its slot before the next step

    def __init__(self, model, tokenizer, version: int = 0, max_slots: int = 64, share_prefix: bool = True,
                 prefix_entries: int = 4, driver: str = "thread", merge_lora: bool = True,
                 continuation_bytes: int = CONTINUATION_BYTES, shared_prefix_attention: bool = True,
                 draft_ids: int = DRAFT_IDS, draft_budget: int = DRAFT_BUDGET, pack_passes: bool = True,
                 idle_cache_bytes: int = IDLE_CACHE_BYTES):
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        if continuation_bytes < 0:
            raise ValueError(f"continuation_bytes must be >= 0, got {continuation_bytes}")
        if idle_cache_bytes < 0:
            raise ValueError(f"idle_cache_bytes must be >= 0, got {idle_cache_bytes}")
        if draft_ids < 0 or draft_budget < 0:
            raise ValueError(f"draft_ids and draft_budget must be >= 0, got {draft_ids} and {draft_budget}")
        if driver not in DRIVERS:
            raise ValueError(f"driver must be one of {', '.join(DRIVERS)}, got {driver!r}")
        self.attention, self.sliding_window = slot_attention(model)  # (refuses what its masks cannot express)
        self._ref = Engine(model, tokenizer, version=version, share_prefix=share_prefix)  # swap and checks
        self.model, self.tokenizer = model, tokenizer
        self.watch = WeightWatch(model)  # what changed in the weights since stored prefixes, merges
        self.merged = MergedPolicy(model, self.watch) if merge_lora else None  # what _forward runs, if set
        self.eos_token_ids = self._ref.eos_token_ids
        self.pad_token_id = tokenizer.pad_token_id
        self.max_slots, self.share_prefix, self.prefix_entries = max_slots, share_prefix, prefix_entries
        self.shared_prefix_attention = shared_prefix_attention
        self.draft_ids, self.draft_budget = draft_ids, draft_budget
        self.pack_passes = pack_passes
        self.idle_cache_bytes = idle_cache_bytes
        self.packed_passes = 0  # forward passes that ran a step's prefill and decoding pass together
        self.draft_passes = 0  # decoding passes that fed drafted ids
        self.drafted_ids = 0  # ids drafted in them
        self.accepted_ids = 0  # drafted ids kept (each one a decoding pass saved)
        self.lock = VersionGate()
        # the cache's layers: one a decoder layer (a bare cache would learn them on its first forward pass)
        self._layers = len({m.layer_idx for m in attention_layers(model)}) or None
        self.cache = SlotCache(slots=min(8, max_slots), layers=self._layers)
        self._eos = set(self.eos_token_ids)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self._queue: deque[Request] = deque()
        self._rows: list[Request] = []  # active rows; index = slot
        self._prefixes = PrefixStore(prefix_entries, MIN_SHARED_PREFIX)
        self._continuations = ContinuationStore(continuation_bytes if share_prefix else 0, MIN_SHARED_PREFIX)
        self._prefix_generation = self.watch.generation  # the weights' generation the stored prefixes are of
        self._cond = threading.Condition()
        self._closed = False
        self._stopped: str | None = None  # why the worker thread ended, if it did (requests are refused)
        self._error: str | None = None
        self.steps = 0  # decoding steps so far
        self.shared_prefix_passes = 0  # forward passes that attended to a shared prefix once for all rows
        self.rows_done = 0  # requests completed so far
        self.rows_cancelled = 0  # requests cancelled (queued or running) so far
        self.driver = driver
        self._driving = threading.Lock()  # held by the thread running steps (driver "caller")
        self._stepping: int | None = None  # that thread's ident while it steps
        self._admitting: list[Request] = []  # rows taken from the queue and being prefilled
        self._worker = None
        if driver == "thread":
            self._worker = threading.Thread(target=self._work, name="selfrl-slot-engine", daemon=True)
            self._worker.start()
        close_at_exit(self)  # a worker (or a caller's thread) mid-step at exit would abort the process

    # ------------------------------------------------------------------ the interface

    @property
    def version(self) -> int:
        return self._ref.version

    @version.setter
    def version(self, value: int) -> None:
        self._ref.version = value
        self._prefixes.clear()
        self._continuations.clear()

    @property
    def sampling_model(self):
        """The module whose forward pass the engine runs: :attr:`merged`'s view, or ``model``. The
        view shares the policy's hook registries: a hook registered on it is the policy's too."""
        return self.merged.view if self.merged is not None and not self.merged.passthrough else self.model

    def synced_model(self):
        """:attr:`sampling_model` brought up to date with the policy (a deep look of
        :attr:`watch`): what a swap check should score, the weights this engine samples with."""
        if self.merged is not None:
            self.merged.sync(deep=True)
        return self.sampling_model

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
                 greedy: bool = False, top_p: float = 1.0, on_step: Callable[..., None] | None = None,
                 stop: list[str] | None = None, top_logprobs: int = 0, step_logprobs: bool = False,
                 constraints: list | None = None, cancel: list[threading.Event | None] | None = None,
                 ) -> list[Generation]:
        """Sample one continuation per prompt (see :meth:`SamplingEngine.generate` and, for
        ``top_logprobs``, ``step_logprobs``, ``constraints`` and ``cancel``,
        :meth:`selfrl.engines.reference.Engine.generate`); the rows join whatever batch is running,
        and the call returns when all of them are done.

        A cancelled row stops before the next step: it returns the ids sampled until then
        (none when it was cancelled before it started) with ``cancelled=True``.

        Raises:
            ValueError: bad arguments (:func:`~selfrl.engines.base.check_generate_args`), or
                ``constraints`` / ``cancel`` not one per prompt.
            selfrl.chat.constrain.ConstraintError: a grammar that does not compile.
            RuntimeError: the engine is closed.
        """
        check_generate_args(prompts, max_new_tokens, temperature, greedy, top_p, self._ref.num_embeddings)
        self._check_window(prompts, max_new_tokens)
        self._refuse_in_step()
        for name, per_row in (("constraints", constraints), ("cancel", cancel)):
            if per_row is not None and len(per_row) != len(prompts):
                raise ValueError(f"{name} must be one per prompt ({len(prompts)}), got {len(per_row)}")
        hint = shared_prefix_len(prompts) if self.share_prefix else 0
        reqs = [self._request(p, max_new_tokens, temperature, greedy, top_p, stop, None, None, top_logprobs,
                              step_logprobs, None if constraints is None else constraints[i],
                              None if cancel is None else cancel[i], prefix_hint=hint)
                for i, p in enumerate(prompts)]
        call = Call(reqs, on_step, self.pad_token_id, step_logprobs) if on_step is not None else None
        for r in reqs:
            r.call = call
        self._enqueue(reqs)
        self._drive(lambda: all(r.future.done() for r in reqs))
        return [r.future.result() for r in reqs]

    def submit(self, prompt: list[int], max_new_tokens: int, temperature: float = 1.0, greedy: bool = False,
               top_p: float = 1.0, stop: list[str] | tuple[str, ...] | None = None,
               on_tokens: Callable[..., None] | None = None, seed: int | None = None, top_logprobs: int = 0,
               step_logprobs: bool = False, constraint=None, cancel: threading.Event | None = None) -> Future:
        """Queue one continuation; returns a future of its :class:`Generation`.

        ``on_tokens(ids)`` is called from the worker thread with the ids sampled so far
        (with ``step_logprobs``: ``on_tokens(ids, logprobs, top)``, ``top`` the
        ``top_logprobs`` alternatives per id or None). The row samples from its own
        generator, seeded with ``seed`` (or with a draw from torch's global generator in
        the calling thread), so what it samples does not depend on which rows share its
        batch. ``constraint`` (a :class:`selfrl.chat.constrain.Constraint`) masks its logits;
        setting ``cancel`` stops it before the next step (its slot is freed, the result
        has ``cancelled=True``). Blocks only while a swap is waiting or running. With
        ``driver="caller"`` the row is sampled only while some thread waits: use
        :meth:`wait` or the future's ``result()`` (both drive the engine).

        Raises:
            ValueError: bad arguments.
            selfrl.chat.constrain.ConstraintError: a grammar that does not compile.
            RuntimeError: the engine is closed.
        """
        check_generate_args([prompt], max_new_tokens, temperature, greedy, top_p, self._ref.num_embeddings)
        self._check_window([prompt], max_new_tokens)
        req = self._request(prompt, max_new_tokens, temperature, greedy, top_p, stop, on_tokens, seed, top_logprobs,
                            step_logprobs, constraint, cancel)
        self._enqueue([req])
        return req.future

    @property
    def context(self) -> int:
        """Tokens a request may hold, prompt and completion together: the model's context
        (:func:`~selfrl.engines.base.model_context`), or with a sliding window the window plus one
        (the last id is never fed back), which the engine's masks do not apply beyond. A server
        refuses longer requests with a 400 (:func:`~selfrl.engines.base.engine_context`)."""
        context = model_context(self.model, self.tokenizer)
        return context if self.sliding_window is None else min(context, self.sliding_window + 1)

    def _check_window(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """Refuse a request that could outgrow the model's sliding window (the engine's masks have none)."""
        if self.sliding_window is not None and max(len(p) for p in prompts) + max_new_tokens > self.context:
            raise ValueError(f"prompt ({max(len(p) for p in prompts)} tokens) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds the model's sliding window ({self.sliding_window} tokens) plus one, which the "
                             "slot engine does not apply; use the reference engine (--engine reference)")

    def _request(self, prompt, max_new_tokens, temperature, greedy, top_p, stop, on_tokens, seed, top_logprobs,
                 step_logprobs, constraint, cancel, prefix_hint: int = 0) -> Request:
        if not 0 <= top_logprobs <= self.vocab_size:
            raise ValueError(f"top_logprobs must be in [0, {self.vocab_size}], got {top_logprobs}")
        grammar = None if constraint is None else RowGrammar(constraint, self.tokenizer, self.vocab_size,
                                                            self.eos_token_ids)
        return Request(list(prompt), max_new_tokens, temperature, greedy, top_p, tuple(stop or ()), on_tokens,
                       future=(DrivenFuture(self._drive) if self.driver == "caller"
                               else WorkerFuture(self._refuse_in_step)),
                       prefix_hint=prefix_hint, generator=row_generator(seed), top_logprobs=top_logprobs,
                       step_logprobs=step_logprobs, grammar=grammar, cancel=cancel,
                       constrained=None if grammar is None else [], top=[] if top_logprobs else None)

    def swap(self, adapter: AdapterSource, version: int) -> float:
        """Wait for the requests in flight, then load ``adapter`` as ``version`` in place
        (see :meth:`selfrl.engines.reference.Engine.swap`); returns the seconds the copy took.

        Raises:
            ValueError: the adapter does not fit the model (nothing changes).
        """
        # with driver "caller", the requests in flight need a thread to finish them: this one steps
        # while the swap waits (and new requests wait behind it)
        self._refuse_in_step()
        self.lock.acquire_exclusive(self._progress if self.driver == "caller" else None)
        try:
            seconds = self._ref.swap(adapter, version)
            self._prefixes.clear()
            self._continuations.clear()
            return seconds
        finally:
            self.lock.__exit__(None, None, None)

    def forget_kept(self) -> int:
        """Forget the stored prefixes and the finished rows' keys and values (the next requests prefill
        in full): for a caller whose weights change before it samples again, which would find them stale.
        Returns the bytes the finished rows' entries held."""
        with self._cond:
            freed = self._continuations.nbytes
            self._prefixes.clear()
            self._continuations.clear()
        return freed

    def health(self) -> EngineHealth:
        """Ok while the engine is open (and its worker thread, if it has one, runs); the detail
        gives rows, queue and cache size."""
        ok = not self._closed and (self._worker is None or self._worker.is_alive())
        state = "busy" if self._rows or self._queue else "idle"  # the reference engine's words first
        detail = (self._error or "closed") if not ok else (
            f"{state}: {len(self._rows)} active rows, {len(self._queue)} queued, "
            f"cache {self.cache.nbytes / 2**20:.0f} MiB")
        return EngineHealth(ok, self.version, self.name, detail)

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the worker (queued requests fail with RuntimeError) and free the cache. Waits at
        most ``timeout_s`` for the step in progress (the worker's, or a caller's thread's)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._worker is not None:
            if self._worker.ident != threading.get_ident():  # (from a callback: the worker ends after this step)
                self._worker.join(timeout=timeout_s)
        elif self._stepping == threading.get_ident():  # from a callback inside a step
            self._fail_all(RuntimeError("the slot engine is closed"))
        elif self._driving.acquire(timeout=timeout_s):  # after the step in progress, if any
            try:
                self._fail_all(RuntimeError("the slot engine is closed"))
            finally:
                self._driving.release()
        self.cache = SlotCache(slots=1, capacity=1)
        self.merged = None  # its merged weights go with it (later forwards, if any, run the model)

    def lora_parameters(self) -> dict[str, torch.Tensor]:
        return self._ref.lora_parameters()
