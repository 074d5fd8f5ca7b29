"""The serving core behind the HTTP layer: requests -> engine jobs -> OpenAI responses,
every choice recorded as a trajectory, feedback attached, adapter versions swapped.

The HTTP layer (``selfrl.serve.app``) only parses, authenticates and formats; all
decisions are below it, in plain methods that raise :class:`selfrl.serve.errors.ApiError`
for bad input. :class:`Service` composes the parts along those seams and is the one object
the HTTP layer talks to:

- :class:`selfrl.serve.turns.Turns`: a request validated and rendered to a prompt, cut
  into engine jobs, and the response built and recorded;
- :class:`selfrl.serve.served_version.ServedVersion`: which adapter version the engine
  serves (restore, publish a promotion, pin, unpin, roll back, a request's own version);
- :class:`selfrl.serve.batcher.Batcher`: the jobs of concurrent requests, batched;
- the engine: in process (``engine``), or a vLLM server (``[sampler]``, :mod:`selfrl.serve.remote`);
- the background learner (:mod:`selfrl.serve.background`) or, on a replica, the follower
  of the owner's versions (:mod:`selfrl.serve.replica`);
- the feedback of a response (:meth:`Service.feedback`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from selfrl.chat.template import control_tokens, template_supports_tools
from selfrl.config.serve import ServeConfig
from selfrl.engines import make_engine
from selfrl.engines.base import engine_context, model_context
from selfrl.record import served as records
from selfrl.record.runlock import RunDirLock
from selfrl.record.store import Store
from selfrl.record.versions import EventKind, Ledger
from selfrl.run.setup import check_names
from selfrl.serve.batcher import Batcher
from selfrl.serve.corrections import offered_problem, row_tools, says_answer, setting_refuses
from selfrl.serve.errors import ApiError
from selfrl.serve.feedback import explicit_value
from selfrl.serve.health import StorageWatch
from selfrl.serve.late_feedback import FeedbackAges
from selfrl.serve.feedback_request import FeedbackRequest
from selfrl.serve.protocol import ChatCompletionRequest
from selfrl.serve.served_version import ServedVersion
from selfrl.serve.turns import Prepared, Turns

__all__ = ["ApiError", "Prepared", "Service", "start_learning"]  # ApiError, Prepared: where they were


class Service:
    """Serving state: engine, batcher, store, versions and (optionally) the learner.

    Args:
        model: the serving policy (a ``peft.PeftModel``); with ``sampler.url``, the local copy whose
            weights follow the version vLLM serves (the swap check's reference).
        tokenizer: its tokenizer.
        cfg: :class:`ServeConfig`.
        learner_model: a separate copy of the policy for the background learner, or
            None to serve and record without learning.
        clock: seconds (``time.time``), used for ages and budgets in time (the feedback age, the
            collapse budget's window and cool-down): tests and the user simulator pass a fake
            clock to play days without waiting. Stored row times stay real.

    Raises:
        selfrl.config.ConfigError: a value out of range, or a name no registry knows; a replica whose
            ``[learner]`` age rule is not its owner's (:func:`selfrl.serve.replica.check_owner_age_rule`).
        ValueError: the stored versions do not fit the model.
        selfrl.record.runlock.RunDirLocked: another process serves (or runs) this run directory.
        ConnectionError: ``sampler.url`` cannot be reached.
        selfrl.safety.swap_check.SwapCheckError: the start version failed its swap check on vLLM.
    """

    def __init__(self, model, tokenizer, cfg: ServeConfig, learner_model=None,
                 clock: Callable[[], float] = time.time):
        self.cfg = cfg.validate()
        self.clock = clock
        check_names(cfg, cfg.learner.reward_weights)  # the built-in environments' names included
        if cfg.families:  # their environments, before anything is started (selfrl.serve.families)
            from selfrl.serve.families import check_family_sources

            check_family_sources(cfg)
        prunes_turns = bool(cfg.retention.trajectories_max_age_s) and not cfg.replica  # a replica's owner prunes
        if prunes_turns:
            from selfrl.serve.retention import check_turn_retention

            check_turn_retention(cfg, learner_model is not None)
        self.tok = tokenizer
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # one owner per run directory; replicas (selfrl.serve.replica) share its store and follow its versions
        self.run_lock = None if cfg.replica else RunDirLock(self.run_dir, "selfrl serve")
        if cfg.replica and not (self.run_dir / "selfrl.db").exists():
            from selfrl.serve.replica import no_owner

            raise no_owner(self.run_dir)
        if cfg.replica:  # it answers feedback by the owner's age rule
            from selfrl.serve.replica import check_owner_age_rule

            with Store(self.run_dir / "selfrl.db", readonly=True) as owner:
                check_owner_age_rule(cfg.learner, owner.runs(), self.run_dir)
        self.storage = StorageWatch(self.run_dir)  # storage faults met while serving (selfrl.serve.health)
        self.store = Store(self.run_dir / "selfrl.db", shared=True)
        records.init(self.store)
        self.run_id = self.store.start_run({"serve": cfg.to_dict()})
        self.ledger = Ledger(self.store, self.run_id, self.run_dir)
        if cfg.sampler.url is not None:  # samples from vLLM; every version proved there (selfrl.serve.remote)
            from selfrl.serve.remote import connect_sampler

            self.engine = connect_sampler(cfg, model, tokenizer, self.ledger)
        else:
            self.engine = make_engine(cfg.engine, model, tokenizer, idle_cache_bytes=cfg.idle_kv_cache_mb * 2**20,
                                      continuation_bytes=cfg.kv_continuation_mb * 2**20)
        self.context = engine_context(self.engine) or model_context(model, tokenizer)  # (a slot engine: a window)
        self.native_tools = template_supports_tools(tokenizer)
        self.control = tuple(control_tokens(tokenizer))  # their text is never content (split_completion)
        self.versions = ServedVersion(self.engine, self.ledger, self.run_dir, replica=cfg.replica)
        self.versions.restore_replica() if cfg.replica else self.versions.restore()
        self.batcher = Batcher(self.engine, self.versions.run_on_version, cfg.max_batch, cfg.batch_window_s)
        self.turns = Turns(cfg, tokenizer, self.engine, self.batcher, self.store, self.run_id, self.versions,
                           self.context, self.native_tools, self.storage, self.control, clock)
        self.learner = self.follower = self.turn_retention = None
        if prunes_turns:  # old served turns exported, then pruned, after each update (selfrl.serve.retention)
            from selfrl.serve.retention import TurnRetention

            self.turn_retention = TurnRetention(self.store, cfg.retention, self.run_dir,
                                                tuple(f.name for f in cfg.families), self.ledger.event, clock)
        self.ages = FeedbackAges.from_config(cfg.learner, self.ledger, clock)
        if cfg.replica:  # no learner: the owner's trains on this replica's turns too
            from selfrl.serve.replica import Follower

            self.follower = Follower(self.ledger, self.versions, cfg.follow_s)
            self.follower.start()
        elif learner_model is not None and cfg.learner.enabled:
            from selfrl.serve.background import BackgroundLearner

            self.learner = BackgroundLearner(cfg, learner_model, tokenizer, self.store, self.ledger, self.publish,
                                             self.storage, clock=clock, prune=self.retain)
            self.versions.on_rollback = self.learner.reset_to

    # -- versions (selfrl.serve.served_version) ------------------------------------------

    @property
    def pinned(self) -> int | None:
        """The pinned version, or None (:attr:`ServedVersion.pinned`)."""
        return self.versions.pinned

    def state_of(self, version: int):
        """:meth:`ServedVersion.state_of`: a stored version's LoRA tensors, or ApiError 404/409."""
        return self.versions.state_of(version)

    def version_ids(self) -> list[dict[str, Any]]:
        """:meth:`ServedVersion.version_ids`: the servable versions, for ``/v1/models``."""
        return self.versions.version_ids()

    def publish(self, version: int, state, reason: str) -> float | None:
        """:meth:`ServedVersion.publish`: serve a promoted version unless one is pinned (the learner's callback)."""
        return self.versions.publish(version, state, reason)

    def prune_versions(self) -> list[int]:
        """Retention (``[retention]``, :mod:`selfrl.record.retention`): the folders of versions outside
        the newest ``keep_newest`` that are not base, promoted (the newest ``keep_promoted`` of
        them, when set), the champion, pinned, served, or a version that sampled turns not yet
        trained on which the age rule may still train on (:meth:`FeedbackAges.needed`: at most
        ``learner.max_feedback_age_versions`` weight changes back; a late judgement is weighed by
        its log-probs) are moved to ``adapters/.pruned``
        (deleted with ``retention.delete``), each marked in the ledger with a ``prune`` event;
        returns the versions pruned ([] with ``keep_newest = 0``)."""
        rc = self.cfg.retention
        if not rc.keep_newest:
            return []
        from selfrl.record.retention import VersionRow, prune_versions, versions_to_remove

        with self.ledger.lock:  # an admin's rollback or pin comes before or after, never inside
            rows = [VersionRow(v.version, v.status.value, v.path) for v in self.ledger.all()
                    if not v.metrics.get("pruned")]
            keep = {self.ledger.champion.version} | ({self.pinned} if self.pinned is not None else set())
            needed = FeedbackAges.from_config(self.cfg.learner, self.ledger).needed() & {r.version for r in rows}
            keep |= records.versions_with_untrained_turns(self.store, needed)  # a late judgement is weighed by them
            remove = versions_to_remove(rows, rc.keep_newest, keep, self.engine.version, rc.keep_promoted)
            where = "deleted" if rc.delete else "moved to adapters/.pruned"
            prune_versions(self.run_dir, rows, remove, lambda v: self.ledger.mark_pruned(v, where), rc.delete)
        return remove

    def retain(self) -> None:
        """Retention after every update (the learner's callback, in its thread): old served turns
        exported, then pruned (:class:`selfrl.serve.retention.TurnRetention`; it never raises), then
        version folders (:meth:`prune_versions`)."""
        if self.turn_retention is not None:
            self.turn_retention.run_pass()
        self.prune_versions()

    def pin(self, version: int) -> dict[str, Any]:
        """:meth:`ServedVersion.pin`, then the :meth:`status`."""
        self.versions.pin(version)
        return self.status()

    def unpin(self) -> dict[str, Any]:
        """:meth:`ServedVersion.unpin`, then the :meth:`status`."""
        self.versions.unpin()
        return self.status()

    def rollback(self, version: int) -> dict[str, Any]:
        """:meth:`ServedVersion.rollback` (the learner restarts from ``version``), then the :meth:`status`."""
        self.versions.rollback(version)
        return self.status()

    def event(self, kind: EventKind, message: str, data: dict | None = None) -> None:
        self.ledger.event(kind, message, data)

    def status(self) -> dict[str, Any]:
        """``GET /admin/status``: the served and pinned version, every version, the queue, the turns'
        counts, the last swaps, the learner's or the follower's state, and the turns retention pruned."""
        versions = [{"version": v.version, "status": v.status.value, "parent": v.parent,
                     "val_success": v.val_success} for v in self.ledger.all()]
        counts = records.counts(self.store)
        return {
            "served_version": self.engine.version, "pinned": self.pinned, "versions": versions,
            "queue": self.batcher.pending, "batches": self.batcher.batches, "rows": self.batcher.rows,
            "turns": counts, "swap_ms": [round(s * 1000, 2) for s in self.versions.swap_seconds],
            "learner": None if self.learner is None else self.learner.status(),
            "replica": None if self.follower is None else {"swaps": self.follower.swaps, "error": self.follower.error},
            "retention": None if self.turn_retention is None else self.turn_retention.status(),
            "sampler": None if self.cfg.sampler.url is None else {
                "url": self.cfg.sampler.url, "kind": self.cfg.sampler.kind, "name": self.engine.remote.model_name,
                "swap_check_failed": None if self.engine.failed is None else self.engine.failed.to_dict()},
        }

    # -- requests (selfrl.serve.turns) ---------------------------------------------------

    def prepare(self, req: ChatCompletionRequest, client: str = "") -> Prepared:
        """:meth:`Turns.prepare`: a validated request and its prompt, or ApiError."""
        return self.turns.prepare(req, client)

    def jobs(self, p: Prepared, on_tokens=None):
        """:meth:`Turns.jobs`: one batcher job per choice."""
        return self.turns.jobs(p, on_tokens)

    def finish(self, p: Prepared, gens, seconds: float) -> dict[str, Any]:
        """:meth:`Turns.finish`: the OpenAI response, each choice recorded."""
        return self.turns.finish(p, gens, seconds)

    async def complete(self, req: ChatCompletionRequest, client: str = "", response_id: str | None = None,
                       is_disconnected=None) -> dict[str, Any]:
        """A non-streaming chat completion for ``client`` (recorded under ``response_id``
        when given: the Responses API's ``resp_`` ids).

        Args:
            is_disconnected: the HTTP request's ``is_disconnected``; a client that leaves
                before the end has its turn cut off (``selfrl.serve.disconnect``).

        Raises:
            ApiError: as :meth:`prepare`; 499 when the client disconnected (nobody reads it);
                500 when the generation failed (its other choices are cancelled), 400
                ``invalid_schema`` when the request's grammar failed during generation.
        """
        from selfrl.serve.disconnect import await_jobs, generation_failed

        p = await asyncio.to_thread(self.prepare, req, client)  # tokenizing a long prompt must not block the loop
        if response_id is not None:
            p.response_id = response_id
        t0 = time.perf_counter()
        jobs = self.jobs(p)
        try:
            for j in jobs:
                self.batcher.submit(j)
        except RuntimeError as e:  # the batcher has stopped (the reason is in the message)
            raise generation_failed(jobs, e) from e
        gens = await await_jobs(self, p, jobs, t0, is_disconnected)
        if gens is None:
            raise ApiError(499, "the client disconnected", code="client_disconnected")
        return await asyncio.to_thread(self.finish, p, gens, time.perf_counter() - t0)

    def age_rule(self, version: int, created_at: float) -> tuple[str, str, dict]:
        """The outcome of feedback on a turn of ``version`` stored at ``created_at``, its reason and the
        decision (:meth:`FeedbackAges.at_feedback`): the age rule of the learner that trains it (this
        server's, or a replica's owner's), else only recorded."""
        outcome, reason, decision = self.ages.at_feedback(version, created_at, note=True)
        if self.learner is None and not self.cfg.replica and outcome != "too_old":
            return "queued", ("queued: this server does not learn (learner.enabled = false, or no learner model); "
                              "a learning server on this run directory trains it within the age cutoffs"), decision
        return outcome, reason, decision

    def feedback(self, f: FeedbackRequest) -> dict[str, Any]:
        """Attach a user's feedback to a response (and its conversation's earlier turns).

        The answer says what became of it (:mod:`selfrl.serve.late_feedback`): ``outcome`` is
        ``used`` (the next update trains on it at full weight), ``queued`` (the learner has
        moved since the turn: the next update weighs it) or ``too_old`` (only recorded: past
        an age cutoff, already trained, cut off, or a server that does not learn), with a
        ``reason``; ``turns_updated`` / ``turns_too_late`` count the turns of the conversation
        it reached. A message that judges nothing (a comment alone:
        :func:`selfrl.serve.feedback.explicit_value`) is stored and changes no turn: ``reward``
        None, ``outcome`` ``comment_only``, whose reason gives the value the turn keeps.

        Raises:
            ApiError: 404 when the response (or that choice) was never served or recorded.
        """
        value = explicit_value(f.rating, f.is_corrected)
        calls = [{"name": c.name, "arguments": json.loads(c.arguments or "{}")}
                 for c in f.correction_tool_calls] if f.correction_tool_calls else None  # []: no calls
        try:
            applied = records.apply_feedback(self.store, f.response_id, f.choice, "explicit", value, f.rating,
                                             f.is_corrected, f.correction, f.comment, now=self.clock(), age=self.age_rule,
                                             correction_calls=calls)
        except KeyError:
            raise ApiError(404, f"no recorded response {f.response_id!r} with choice {f.choice}",
                           "response_id", "response_not_found") from None
        out = {"object": "feedback", "response_id": f.response_id, "choice": f.choice, "reward": value,
               "outcome": applied.outcome, "reason": applied.reason,
               "turns_updated": applied.updated, "turns_too_late": applied.too_late}
        if f.correction is not None or f.correction_tool_calls is not None:
            offered = row_tools(records.find_response(self.store, f.response_id, f.choice))
            out["correction"] = self.correction_use(applied.outcome, says_answer(f.correction, f.correction_tool_calls),
                                                    f.correction_tool_calls, offered_problem(calls, offered))
        if applied.too_late:
            note = (f"came too late for {applied.too_late} turn(s): already trained on or skipped (a turn waits "
                    f"learner.feedback_wait_s = {self.cfg.learner.feedback_wait_s:g} s for feedback); recorded, "
                    "but it changes no update")
            out["message"] = note
            self.event(EventKind.LATE_FEEDBACK, f"feedback on {f.response_id}: {note}",
                       {"response_id": f.response_id, "updated": applied.updated, "too_late": applied.too_late})
        return out

    def correction_use(self, outcome: str, problem: str | None = None, calls: list | None = None,
                       unoffered: str | None = None) -> str:
        """What becomes of a correction (:mod:`selfrl.serve.corrections`) of a turn whose feedback
        ``outcome`` this is; ``problem``: why it cannot be an answer at all
        (:func:`selfrl.serve.corrections.says_answer`), or None; ``calls``: its
        ``correction_tool_calls``; ``unoffered``: why its calls cannot be its turn's
        (:func:`selfrl.serve.corrections.offered_problem`), or None. A replica answers by its owner's
        setting (it refuses to start with another one: :func:`selfrl.serve.replica.check_owner_age_rule`)."""
        if problem is not None:
            return f"recorded only: {problem}"
        if (why := setting_refuses(self.cfg.learner.learn_from_corrections, calls)) is not None:
            return f"recorded only: {why}"
        if unoffered is not None:
            return f"recorded only: {unoffered}"
        if outcome == "too_old":
            return "recorded only: its turn is not trained on (see reason)"
        if self.learner is None and not self.cfg.replica:
            return ("queued: this server does not learn; a learning server on this run directory with "
                    f"learner.learn_from_corrections = {self.cfg.learner.learn_from_corrections!r} trains it as a "
                    "demonstration with its turn, unless it cannot be the turn's answer (its update says why)")
        return "trains as a demonstration with its turn, unless it cannot be the turn's answer (the update says why)"

    def close(self) -> None:
        if self.learner is not None:
            self.learner.stop()
        if self.follower is not None:
            self.follower.stop()
        self.batcher.close()
        if callable(close_engine := getattr(self.engine, "close", None)):
            close_engine()  # a continuous engine's worker thread
        self.store.close()
        if self.run_lock is not None:
            self.run_lock.release()


def start_learning(service: Service) -> None:
    """Start the background learner thread, if there is one."""
    if service.learner is not None and not service.learner.is_alive():
        service.learner.start()
