"""The serving core behind the HTTP layer: requests -> engine jobs -> OpenAI responses,
every choice recorded as a trajectory, feedback attached, adapter versions swapped.

The HTTP layer (``selfrl.serve.app``) only parses, authenticates and formats; all
decisions are here, in plain methods that raise :class:`ApiError` for bad input.

Versions: ``engine.version`` is the version being served. A promoted candidate is
swapped in by :meth:`Service.publish` (in place, under the engine lock, so between two
batches) unless a version is pinned. A request may name a version as
``<served_model_name>@v<N>``; it then runs on that version (swapped in for its batch
and back out after).
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrl import adapters
from selfrl.adapters import lora_state
from selfrl.atomic import write_atomic
from selfrl.chat import (
    PromptTooLong,
    control_tokens,
    decode_turn,
    prompt_ids,
    template_supports_tools,
    template_wraps_tool_responses,
)
from selfrl.engine import Generation
from selfrl.engines import make_engine
from selfrl.engines.base import context_overflow, engine_context, model_context
from selfrl.runlock import RunDirLock
from selfrl.serve import records
from selfrl.serve.batcher import Batcher, Job
from selfrl.serve.config import ServeConfig
from selfrl.serve.health import StorageWatch
from selfrl.serve.feedback import (
    conversation_key,
    correction_reason,
    default_group_key,
    explicit_value,
)
from selfrl.serve.limits import parse_version_suffix
from selfrl.serve.logprobs import bytes_text, char_offsets, char_to_byte_spans, content_entries, token_bytes
from selfrl.serve.protocol import (
    ChatCompletionRequest,
    FeedbackRequest,
    client_tools,
    split_completion,
    to_chat,
)
from selfrl.store import Store
from selfrl.trajectory import Trajectory
from selfrl.versions import EventKind, Ledger


def finish_reason(ended: bool, called: bool) -> str:
    """OpenAI's ``finish_reason`` of a choice: ``"length"`` when the token limit cut the turn
    (even after complete calls, which are still returned: a client must not take a cut turn
    for a finished call), else ``"tool_calls"`` when it made calls, else
    ``"stop"`` (an EOS or a stop string).

    >>> finish_reason(False, True), finish_reason(True, True), finish_reason(True, False)
    ('length', 'tool_calls', 'stop')
    """
    if not ended:
        return "length"
    return "tool_calls" if called else "stop"


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_


@dataclass
class Prepared:
    """A validated request, ready for the engine."""

    req: ChatCompletionRequest
    messages: list[dict[str, Any]]  # the request's messages as OpenAI dicts
    chat: list[dict[str, str]]  # what the template renders
    prompt: list[int]
    limit: int
    version: int | None
    parent: dict[str, Any] | None
    group_key: str
    client: str = ""  # the client identity (selfrl.serve.feedback.client_identity)
    constraint: Any = None  # a selfrl.constrain.Constraint when tool_choice/response_format constrain decoding
    response_id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


class Service:
    """Serving state: engine, batcher, store, versions and (optionally) the learner.

    Args:
        model: the serving policy (a ``peft.PeftModel``).
        tokenizer: its tokenizer.
        cfg: :class:`ServeConfig`.
        learner_model: a separate copy of the policy for the background learner, or
            None to serve and record without learning.

    Raises:
        ValueError: the stored versions do not fit the model.
        selfrl.runlock.RunDirLocked: another process serves (or runs) this run directory.
    """

    def __init__(self, model, tokenizer, cfg: ServeConfig, learner_model=None):
        self.cfg = cfg.validate()
        self.tok = tokenizer
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # one owner per run directory; replicas (selfrl.serve.replica) share its store and follow its versions
        self.run_lock = None if cfg.replica else RunDirLock(self.run_dir, "selfrl serve")
        if cfg.replica and not (self.run_dir / "selfrl.db").exists():
            from selfrl.serve.replica import NoOwner

            raise NoOwner(f"{self.run_dir} has no servable version to follow: start its owner (selfrl serve "
                          "without --replica) on it first")
        self.storage = StorageWatch(self.run_dir)  # storage faults met while serving (selfrl.serve.health)
        self.store = Store(self.run_dir / "selfrl.db", shared=True)
        records.init(self.store)
        self.run_id = self.store.start_run({"serve": cfg.to_dict()})
        self.ledger = Ledger(self.store, self.run_id, self.run_dir)
        self.engine = make_engine(cfg.engine, model, tokenizer)
        self.context = engine_context(self.engine) or model_context(model, tokenizer)  # (a slot engine: a window)
        self.native_tools = template_supports_tools(tokenizer)
        self.control = tuple(control_tokens(tokenizer))  # their text is never content (split_completion)
        self.pinned: int | None = None
        self.admin = threading.Lock()  # pin, unpin, rollback and publish: one at a time, each whole
        self.swap_seconds: list[float] = []
        self._states: dict[int, Any] = {}
        self._restore_replica() if cfg.replica else self._restore()
        self.batcher = Batcher(self.engine, self.run_on_version, cfg.max_batch, cfg.batch_window_s)
        self.learner = self.follower = None
        if cfg.replica:  # no learner: the owner's trains on this replica's turns too
            from selfrl.serve.replica import Follower

            self.follower = Follower(self, cfg.follow_s)
            self.follower.start()
        elif learner_model is not None and cfg.learner.enabled:
            from selfrl.serve.background import BackgroundLearner

            self.learner = BackgroundLearner(cfg, learner_model, tokenizer, self.store, self.ledger, self.publish,
                                             self.storage)

    # -- versions ----------------------------------------------------------------------

    def _restore(self) -> None:
        """Record (or repair) the base version, move aside what a killed save left, and serve
        the latest complete promoted version (the champion) or the pinned one, as ``run`` does."""
        self.ledger.recover_strays()
        self.ledger.ensure_base(self.engine.model)
        best = self.ledger.latest_servable()
        if best.version != 0:
            self.engine.swap(self.state_of(best.version), best.version)
        self.ledger.set_champion(best.version, lora_state(self.engine.model))
        pin = self.run_dir / "pinned.json"
        if pin.exists():  # a pin outlives a restart
            version = json.loads(pin.read_text())["version"]
            try:
                self.check_servable(version, "version")
                self.engine.swap(self.state_of(version), version)
                self.pinned = version
            except ApiError as e:
                if version in self.ledger.missing:  # its folder may come back: the pin is kept, not served now
                    self.event(EventKind.PIN, f"restart: the pinned version {version} is not served: "
                               f"{self.ledger.missing[version]}; serving version {best.version}, pin kept")
                    return
                self.event(EventKind.UNPIN, f"restart: the pinned version cannot be served ({e.message}); unpinned")
                pin.unlink()

    def _restore_replica(self) -> None:
        """A replica serves the owner's newest servable version; it never writes a version.

        Raises:
            selfrl.serve.replica.NoOwner: the owner has not recorded a base version yet.
        """
        from selfrl.serve.replica import NoOwner, newest_servable

        best = newest_servable(self.ledger) if self.ledger.get(0) is not None else None
        if best is None:
            raise NoOwner(f"{self.run_dir} has no servable version to follow: start its owner (selfrl serve "
                          "without --replica) on it first")
        if best.version != 0:
            self.engine.swap(self.state_of(best.version), best.version)

    def owner_only(self, action: str) -> None:
        """Raise ApiError 409 on a replica: pins and rollbacks belong to the run directory's owner."""
        if self.cfg.replica:
            raise ApiError(409, f"this server is a replica of the run directory {self.run_dir}; {action} on the "
                           "server that owns it (it holds the learner and the versions)", code="replica")

    def state_of(self, version: int):
        """The LoRA tensors of a stored version (cached).

        Raises:
            ApiError: 404 when the version does not exist or was never saved; 409 when its
                folder is not complete.
        """
        if version not in self._states:
            try:
                self._states[version] = self.ledger.load_state(version)
            except KeyError:
                raise ApiError(404, f"adapter version {version} does not exist", "model", "model_not_found") from None
            except (adapters.CorruptVersionError, FileNotFoundError) as e:
                raise ApiError(409, f"adapter version {version} cannot be served: {e}", "model",
                               "version_incomplete") from e
        return self._states[version]

    def check_servable(self, version: int, param: str = "model") -> None:
        """Raise ApiError unless ``version`` is the base or a promoted version with a complete folder."""
        rec = self.ledger.get(version)
        if rec is None:
            raise ApiError(404, f"adapter version {version} does not exist", param, "model_not_found")
        if not rec.servable:
            raise ApiError(409, f"adapter version {version} cannot be served: it is {rec.status.value}; only the "
                           "base and promoted versions are served", param, "version_not_servable")
        self.state_of(version)

    def check_model_name(self, model: str, version: int | None) -> None:
        """Refuse a model id this server does not list in ``/v1/models``: it serves
        ``served_model_name`` (the current version), ``<served_model_name>@v<N>`` (version N)
        and each of ``model_aliases`` (the current version), as OpenAI and vLLM refuse an
        unknown model rather than answer with another one.

        Raises:
            ApiError: 404 ``model_not_found``, naming the ids that are served.
        """
        name = self.cfg.served_model_name
        if model == name or (version is None and model in self.cfg.model_aliases) or (
                version is not None and model == f"{name}@v{version}"):
            return
        aliases = "".join(f", {a!r}" for a in self.cfg.model_aliases)
        raise ApiError(404, f"the model {model[:64]!r} does not exist: this server serves {name!r}{aliases} and "
                       f"'{name}@v<N>' for a stored version (GET /v1/models lists them; serve.model_aliases adds "
                       "names)", "model", "model_not_found")

    def version_ids(self) -> list[dict[str, Any]]:
        """The servable versions as dicts: version, status, created_at, metrics (a version whose
        folder is missing is not served, so not listed: :meth:`selfrl.versions.Ledger.servable`)."""
        return [{"version": v.version, "status": v.status.value, "created_at": v.created_at, "metrics": v.metrics}
                for v in self.ledger.servable()]

    def run_on_version(self, version: int, fn):
        """Run ``fn()`` with ``version`` swapped in, then swap the served version back."""
        state = self.state_of(version)
        with self.engine.lock:
            served, served_state = self.engine.version, lora_state(self.engine.model)
            self.engine.swap(state, version)
            try:
                return fn()
            finally:
                self.engine.swap(served_state, served)

    def publish(self, version: int, state, reason: str) -> float | None:
        """Serve ``version`` now, unless a version is pinned or an admin rolled it back
        meanwhile (it is no longer servable); returns the swap seconds."""
        with self.admin:
            self._states[version] = {k: v.clone() for k, v in state.items()}
            rec = self.ledger.get(version)
            if rec is None or not rec.servable:
                status = "unknown" if rec is None else rec.status.value
                self.event(EventKind.SWAP, f"version {version} {reason}; not served: it is {status} now",
                           {"version": version, "served": False})
                return None
            if self.pinned is not None:
                self.event(EventKind.SWAP, f"version {version} {reason}; not served: version {self.pinned} is pinned",
                           {"version": version, "served": False})
                return None
            seconds = self.engine.swap(state, version)
            self.swap_seconds.append(seconds)
            self.event(EventKind.SWAP, f"serving version {version} ({reason}); swap took {seconds * 1000:.1f} ms",
                       {"version": version, "swap_s": seconds})
            return seconds

    def pin(self, version: int) -> dict[str, Any]:
        """Serve ``version`` and keep it until :meth:`unpin`, across restarts (promotions are
        recorded, not served). Serialised with the other admin operations; the pin file is
        written before the swap, so a failure leaves the served version as it was."""
        self.owner_only("pin")
        with self.admin:
            self.check_servable(version, "version")
            state = self.state_of(version)
            write_atomic(self.run_dir / "pinned.json", json.dumps({"version": version}))
            self.engine.swap(state, version)
            self.pinned = version
            self.event(EventKind.PIN, f"version {version} pinned")
        return self.status()

    def unpin(self) -> dict[str, Any]:
        self.owner_only("unpin")
        with self.admin:
            best = self.ledger.latest_servable()
            state = self.state_of(best.version)
            (self.run_dir / "pinned.json").unlink(missing_ok=True)
            self.engine.swap(state, best.version)
            self.pinned = None
            self.event(EventKind.UNPIN, f"unpinned; serving the latest promoted version {best.version}")
        return self.status()

    def rollback(self, version: int) -> dict[str, Any]:
        """Serve ``version`` again, mark the promoted versions after it rolled back, and
        restart the learner from it. A version that was rolled back earlier is promoted again.
        The rollback sticks: a candidate the learner is training from a rolled-back parent is
        rejected at its gate (``Ledger.judge``), and the learner continues from ``version``."""
        self.owner_only("roll back")
        with self.admin:
            self.state_of(version)  # 404 / 409 before anything changes
            try:
                self.ledger.roll_back_to(version)
            except KeyError:
                raise ApiError(404, f"adapter version {version} does not exist", "version",
                               "model_not_found") from None
            except ValueError as e:
                raise ApiError(409, str(e), "version", "version_not_servable") from None
            (self.run_dir / "pinned.json").unlink(missing_ok=True)
            self.pinned = None
            champ = self.ledger.champion
            self.engine.swap(champ.state, version)
            if self.learner is not None:
                self.learner.reset_to(champ)  # applied by the learner before its next update
        return self.status()

    def event(self, kind: EventKind, message: str, data: dict | None = None) -> None:
        self.ledger.event(kind, message, data)

    def status(self) -> dict[str, Any]:
        versions = [{"version": v.version, "status": v.status.value, "parent": v.parent,
                     "val_success": v.val_success} for v in self.ledger.all()]
        counts = records.counts(self.store)
        return {
            "served_version": self.engine.version, "pinned": self.pinned, "versions": versions,
            "queue": self.batcher.pending, "batches": self.batcher.batches, "rows": self.batcher.rows,
            "turns": counts, "swap_ms": [round(s * 1000, 2) for s in self.swap_seconds[-10:]],
            "learner": None if self.learner is None else self.learner.status(),
            "replica": None if self.follower is None else {"swaps": self.follower.swaps, "error": self.follower.error},
        }

    # -- requests ----------------------------------------------------------------------

    def prepare(self, req: ChatCompletionRequest, client: str = "") -> Prepared:
        """Validate a request from ``client`` and build its prompt; applies implicit corrections
        (to ``client``'s own turns only, see ``selfrl.serve.feedback``).

        Raises:
            ApiError: 400 for settings selfrl cannot honour, non-text content or a prompt
                beyond the model's context; 404 for an unknown adapter version.
            selfrl.storage_errors.StorageFaultError: the request records (``record``, the
                default) while the run directory cannot be written (``self.storage``).
        """
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, problem.split()[0])
        if req.record:  # refused before any generation: its turn could not be stored
            self.storage.check()
        if req.logprobs and req.top_logprobs and not self.batcher.supports("top_logprobs"):
            raise ApiError(400, f"top_logprobs is not supported by the {self.cfg.engine!r} engine backend; "
                           "the reference engine supports it", "top_logprobs")
        if req.tool_choice not in (None, "none", "auto") and not req.tools:
            raise ApiError(400, "tool_choice needs tools", "tool_choice")
        if isinstance(req.tool_choice, dict):
            name = req.tool_choice["function"]["name"]
            if name not in {t.function.name for t in req.tools}:
                raise ApiError(400, f"tool_choice names {name!r}, which is not in tools", "tool_choice")
        try:
            version = parse_version_suffix(req.model)
        except ValueError as e:
            raise ApiError(404, f"model {req.model[:64]!r}...: {e}", "model", "model_not_found") from None
        self.check_model_name(req.model, version)
        if version is not None:
            self.check_servable(version)
        try:
            chat = to_chat(req, self.native_tools, self.cfg.tools_prompt, not template_wraps_tool_responses(self.tok))
        except ValueError as e:
            raise ApiError(400, str(e), getattr(e, "param", "messages")) from e
        tools = [t.model_dump() for t in req.tools] if (req.tools and self.native_tools) else None
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        fits = max(0, self.context - (req.token_limit or 1))  # the most prompt tokens that leave room to answer
        try:
            prompt = prompt_ids(self.tok, chat, tools=tools, max_tokens=fits)
        except PromptTooLong as e:  # refused from its size in bytes, before the tokenizer read it
            message, param = context_overflow(e.tokens, req.token_limit, self.context, "messages", field)
            raise ApiError(400, message.replace(f"{e.tokens} tokens", f"at least {e.tokens} tokens", 1), param,
                           "context_length_exceeded") from None
        except Exception as e:  # a template that rejects this message order, e.g.
            raise ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from e
        overflow = context_overflow(len(prompt), req.token_limit, self.context, "messages", field)
        if overflow is not None:
            raise ApiError(400, overflow[0], overflow[1], "context_length_exceeded")
        limit = req.token_limit or min(self.cfg.max_tokens_default, self.context - len(prompt))
        constraint = self.constraint_for(req)
        messages = [msg.model_dump(exclude_none=True) for msg in req.messages]
        parent = self._link(messages, client) if req.record else None
        group = req.task_key or (parent["group_key"] if parent else default_group_key(messages))
        return Prepared(req, messages, chat, prompt, limit, version, parent, group, client,
                        constraint=constraint)

    def constraint_for(self, req: ChatCompletionRequest):
        """The grammar ``req``'s decoding must follow (``selfrl.serve.structured``), or None.

        Raises:
            ApiError: 400 ``invalid_schema`` naming the schema's field when the grammar does not
                compile or fails on its first steps (``selfrl.serve.structured.checked_constraint``);
                501 when the engine cannot constrain decoding (never ignored).
        """
        from selfrl.constrain import check_constraint
        from selfrl.serve.structured import SchemaError, checked_constraint, request_constraint

        tools = [(t.function.name, t.function.parameters) for t in req.tools or []]
        constraint = request_constraint(tools, req.tool_choice, req.response_format)
        if constraint is None:
            return None
        param = "response_format" if constraint.kind == "json" else "tool_choice"
        if not getattr(self.engine, "supports_constraints", False):
            raise ApiError(501, f"the {getattr(self.engine, 'name', type(self.engine).__name__)} engine cannot "
                           f"constrain decoding, which this request's {param} needs; serve with the reference "
                           "engine", param, "constraints_unsupported")
        vocab = self.engine.model.get_output_embeddings().weight.shape[0]
        try:  # compiled and walked here, so a schema that cannot be decoded never reaches a batch or a stream
            return checked_constraint(tools, req.tool_choice, req.response_format,
                                      lambda c: check_constraint(c, self.tok, vocab, self.engine.eos_token_ids))
        except SchemaError as e:
            raise ApiError(400, str(e), e.param, "invalid_schema") from e

    def _link(self, messages: list[dict[str, Any]], client: str) -> dict[str, Any] | None:
        """The turn served to ``client`` this request continues (and an implicit correction of it), or None."""
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
        if last is None:
            return None
        parent = records.find_by_continuation(self.store, conversation_key(messages[:last + 1]), client)
        if parent is None:
            return None
        after = [m for m in messages[last + 1:] if m["role"] == "user"]
        before = [m for m in messages[:last] if m["role"] == "user"]
        if after:
            text = lambda m: m["content"] if isinstance(m.get("content"), str) else ""  # noqa: E731
            reason = correction_reason(text(after[-1]), text(before[-1]) if before else None)
            if reason:
                records.apply_feedback(self.store, parent["response_id"], parent["choice"], "implicit", -1.0,
                                       corrected=True, comment=f"implicit: the next user message {reason}")
        return parent

    def jobs(self, p: Prepared, on_tokens=None) -> list[Job]:
        req = p.req
        greedy = req.temperature == 0
        temperature = 1.0 if req.temperature is None else req.temperature
        top = (req.top_logprobs or 0) if req.logprobs else 0
        return [Job(p.prompt, p.limit, temperature, req.top_p or 1.0, greedy, p.version, tuple(req.stops),
                    None if on_tokens is None else (lambda ids, *step, i=i: on_tokens(i, ids, *step)), top,
                    bool(req.logprobs) and on_tokens is not None, constraint=p.constraint)
                for i in range(req.n)]

    def finish(self, p: Prepared, gens: list[Generation], seconds: float) -> dict[str, Any]:
        """Build the OpenAI response for finished generations and record its choices (in one
        transaction: ``records.add_turns``).

        Raises:
            sqlite3.Error: the store could not be written (nothing of the response is recorded).
        """
        tools = client_tools(p.req.tools) if p.req.tool_choice != "none" else []
        choices, completion_tokens, turns = [], 0, []
        version = gens[0].adapter_version
        for i, g in enumerate(gens):
            ids, finished = list(g.token_ids), g.finished
            pieces = token_bytes(self.tok, ids)
            text = bytes_text(pieces)  # the sampled bytes, special tokens left out, never cleaned up
            stopped = g.stopped  # the engine cut the row right after a stop string
            for s in p.req.stops:
                if s in text:
                    text = text[:text.index(s)]
            parts = split_completion(text, tools, self.control)
            content, calls, records_ = parts.content, parts.tool_calls, parts.records
            finish = finish_reason(finished or stopped, bool(calls))
            message = {"role": "assistant", "content": content}
            if parts.reasoning:
                message["reasoning_content"] = parts.reasoning
            if calls:
                message["tool_calls"] = calls
            choice = {"index": i, "message": message, "finish_reason": finish, "logprobs": None}
            if p.req.logprobs:
                top = None
                if g.top_logprobs is not None:
                    top = [[(token_bytes(self.tok, [t])[0], lp) for t, lp in alts] for alts in g.top_logprobs]
                spans = char_to_byte_spans(text, parts.spans, char_offsets(b"".join(pieces)))
                choice["logprobs"] = {"content": content_entries(pieces, g.logprobs, spans, top), "refusal": None}
            choices.append(choice)
            completion_tokens += len(ids)
            if p.req.record:
                turns.append(self._turn(p, i, g, message, records_, content, not (finished or stopped), seconds))
        if turns:
            records.add_turns(self.store, self.run_id, turns)
        return {
            "id": p.response_id, "object": "chat.completion", "created": p.created,
            "model": self.cfg.served_model_name + (f"@v{version}" if p.version is not None else ""),
            "system_fingerprint": f"selfrl-v{version}", "adapter_version": version,
            "choices": choices,
            "usage": {"prompt_tokens": len(p.prompt), "completion_tokens": completion_tokens,
                      "total_tokens": len(p.prompt) + completion_tokens},
        }

    def _turn(self, p: Prepared, i: int, g: Generation, message: dict, calls, content, truncated,
              seconds) -> records.ServedTurn:
        P = len(p.prompt)
        # a turn sampled under a grammar records it: the learner replays its masks (selfrl.constrain)
        trained = [1] * len(g.token_ids)
        constraints = [] if p.constraint is None or not g.token_ids else [
            {"start": P, "end": P + len(g.token_ids), "kind": p.constraint.kind, "grammar": p.constraint.grammar}]
        traj = Trajectory(
            task_id=p.group_key, group_id=p.group_key, adapter_version=g.adapter_version, prompt_len=P,
            token_ids=list(p.prompt) + list(g.token_ids), completion_mask=[0] * P + trained,
            logprobs=[0.0] * P + list(g.logprobs), messages=[*p.chat, {"role": "assistant", "content":
                                                                       decode_turn(self.tok, g.token_ids)}],
            tool_calls=calls, final_answer=None if message.get("tool_calls") else content, truncated=truncated,
            num_turns=1, timings={"generate": seconds}, parent_id=p.parent["trajectory_id"] if p.parent else None,
            constraints=constraints,
        )
        conversation = p.parent["conversation_id"] if p.parent else uuid.uuid4().hex
        key = conversation_key([*p.messages, message])
        return records.ServedTurn(traj, p.response_id, i, conversation, p.group_key, key, p.client)

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

    def feedback(self, f: FeedbackRequest) -> dict[str, Any]:
        """Attach a user's feedback to a response (and its conversation's earlier turns).

        Raises:
            ApiError: 404 when the response (or that choice) was never served or recorded.
        """
        value = explicit_value(f.rating, f.corrected)
        try:
            applied = records.apply_feedback(self.store, f.response_id, f.choice, "explicit", value, f.rating,
                                             f.corrected, f.correction, f.comment)
        except KeyError:
            raise ApiError(404, f"no recorded response {f.response_id!r} with choice {f.choice}",
                           "response_id", "response_not_found") from None
        out = {"object": "feedback", "response_id": f.response_id, "choice": f.choice, "reward": value,
               "turns_updated": applied.updated, "turns_too_late": applied.too_late}
        if applied.too_late:
            note = (f"came too late for {applied.too_late} turn(s): already trained on or skipped (a turn waits "
                    f"learner.feedback_wait_s = {self.cfg.learner.feedback_wait_s:g} s for feedback); recorded, "
                    "but it changes no update")
            out["message"] = note
            self.event(EventKind.LATE_FEEDBACK, f"feedback on {f.response_id}: {note}",
                       {"response_id": f.response_id, "updated": applied.updated, "too_late": applied.too_late})
        return out

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
