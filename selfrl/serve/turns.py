"""A chat request's way through ``selfrl serve``: validated and rendered to a prompt, cut
into engine jobs, and the finished generations turned into OpenAI's response, each choice
recorded as a trajectory (the served rows: :mod:`selfrl.record.served`).

:meth:`Turns.prepare` refuses what the server cannot honour with an :class:`ApiError` (an
unknown model or version, settings selfrl does not support, a prompt beyond the context, a
schema that does not compile) and links a conversation's next request to the turn it
continues, reading an implicit correction there (``selfrl.serve.feedback``);
:meth:`Turns.jobs` makes one batcher job per choice; :meth:`Turns.finish` builds the
response and records the turns. The service (``selfrl.serve.service``) awaits the jobs in
between, whole or streamed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from selfrl.chat.template import PromptTooLong, decode_turn, prompt_ids, template_wraps_tool_responses
from selfrl.core.trajectory import Trajectory
from selfrl.engines.base import Generation, context_overflow
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.serve.batcher import Batcher, Job
from selfrl.config.serve import ServeConfig
from selfrl.serve.errors import ApiError
from selfrl.serve.feedback import conversation_key, correction_reason, default_group_key
from selfrl.serve.health import StorageWatch
from selfrl.serve.limits import parse_version_suffix
from selfrl.serve.logprobs import bytes_text, char_offsets, char_to_byte_spans, content_entries, token_bytes
from selfrl.serve.completion import split_completion
from selfrl.serve.protocol import ChatCompletionRequest, client_tools, to_chat
from selfrl.serve.served_version import ServedVersion


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
    constraint: Any = None  # a selfrl.chat.constrain.Constraint when tool_choice/response_format constrain decoding
    family: str | None = None  # the request's metadata.family ([[families]]), recorded on its turns
    response_id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


class Turns:
    """Requests to prompts, jobs and recorded responses, for one server.

    Args:
        cfg: the server's :class:`selfrl.config.ServeConfig`.
        tokenizer: the policy's tokenizer (its chat template renders the prompts).
        engine: the sampling engine (its constraints support, vocabulary and EOS ids).
        batcher: where the jobs go (asked which request settings it supports).
        store: the run's store (the served turns, their feedback).
        run_id: this server's run in the store.
        versions: the served version (a request may name a stored one).
        context: the tokens a prompt and its completion may take together.
        native_tools: the chat template renders tools itself (else they go into the system prompt).
        control: the template's control-token text (``<|im_end|>``), never content (``split_completion``).
        storage: the run directory's storage faults (:class:`selfrl.serve.health.StorageWatch`): a
            request that records is refused while the directory cannot be written.
    """

    def __init__(self, cfg: ServeConfig, tokenizer, engine, batcher: Batcher, store: Store, run_id: int,
                 versions: ServedVersion, context: int, native_tools: bool, storage: StorageWatch,
                 control: tuple[str, ...] = (), clock=time.time):
        self.cfg, self.tok, self.engine, self.batcher, self.clock = cfg, tokenizer, engine, batcher, clock
        self.store, self.run_id, self.versions = store, run_id, versions
        self.context, self.native_tools, self.storage, self.control = context, native_tools, storage, control

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

    def prepare(self, req: ChatCompletionRequest, client: str = "") -> Prepared:
        """Validate a request from ``client`` and build its prompt; applies implicit corrections
        (to ``client``'s own turns only, see ``selfrl.serve.feedback``).

        Raises:
            ApiError: 400 for settings selfrl cannot honour, non-text content or a prompt
                beyond the model's context; 404 for an unknown adapter version.
            selfrl.record.storage_errors.StorageFaultError: the request records (``record``, the
                default) while the run directory cannot be written (``self.storage``).
        """
        problem = req.unsupported()
        if problem:
            raise ApiError(400, problem, problem.split()[0])
        if req.record:  # refused before any generation: its turn could not be stored
            self.storage.check()
        refusal = getattr(self.engine, "refusal", None)  # a remote sampler's own limits (selfrl.serve.remote)
        if refusal is not None and (why := refusal(req)) is not None:
            raise ApiError(400, why[0], why[1], "unsupported_by_backend")
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
        family = self.family_of(req)
        if version is not None:
            self.versions.check_servable(version)
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
            raise ApiError(400, message.replace(f"{e.tokens} tokens", f"at least {e.tokens} token" + "s" * (e.tokens != 1), 1), param,
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
                        constraint=constraint, family=family)

    def family_of(self, req: ChatCompletionRequest) -> str | None:
        """The family ``metadata.family`` names (recorded on the turn: once trained on, the family
        is gated, :mod:`selfrl.safety.families`), or None.

        Raises:
            ApiError: 400 when ``[[families]]`` is configured and the name is not one of them (the
                message lists them); a server without families records any name.
        """
        family = (req.metadata or {}).get("family")
        names = [f.name for f in self.cfg.families]
        if family is not None and names and family not in names:
            raise ApiError(400, f"metadata.family {family[:64]!r} is not a family of this server; valid: "
                           f"{', '.join(names)} ([[families]] of its config)", "metadata.family", "unknown_family")
        return family

    def constraint_for(self, req: ChatCompletionRequest):
        """The grammar ``req``'s decoding must follow (``selfrl.serve.structured``), or None.

        Raises:
            ApiError: 400 ``invalid_schema`` naming the schema's field when the grammar does not
                compile or fails on its first steps (``selfrl.serve.structured.checked_constraint``);
                501 when the engine cannot constrain decoding (never ignored).
        """
        from selfrl.chat.constrain import check_constraint
        from selfrl.serve.structured import SchemaError, checked_constraint, request_constraint

        tools = [(t.function.name, t.function.parameters) for t in req.tools or []]
        constraint = request_constraint(tools, req.tool_choice, req.response_format)
        if constraint is None:
            return None
        param = "response_format" if constraint.kind == "json" else "tool_choice"
        if not getattr(self.engine, "supports_constraints", False):
            # a remote sampler refuses it as a request it cannot take (400); an in-process engine without it is ours (501)
            raise ApiError(400 if hasattr(self.engine, "refusal") else 501, f"the {getattr(self.engine, 'name', type(self.engine).__name__)} engine cannot "
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
        offered = [{"name": t.name, "parameters": t.parameters} for t in tools if not isinstance(p.req.tool_choice, dict)
                   or t.name == p.req.tool_choice["function"]["name"]]  # a named tool_choice: that tool alone
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
            # as OpenAI: content is null only beside tool calls; an empty answer without any is ""
            message = {"role": "assistant", "content": content if calls else (content or "")}
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
                turns.append(self._turn(p, i, g, message, records_, content, not (finished or stopped), seconds,
                                        offered))
        if turns:
            records.add_turns(self.store, self.run_id, turns, now=self.clock())  # a turn's age runs on the clock
        return {
            "id": p.response_id, "object": "chat.completion", "created": p.created,
            "model": self.cfg.served_model_name + (f"@v{version}" if p.version is not None else ""),
            "system_fingerprint": f"selfrl-v{version}", "adapter_version": version,
            "choices": choices,
            "usage": {"prompt_tokens": len(p.prompt), "completion_tokens": completion_tokens,
                      "total_tokens": len(p.prompt) + completion_tokens},
        }

    def _turn(self, p: Prepared, i: int, g: Generation, message: dict, calls, content, truncated,
              seconds, offered: list[dict[str, Any]]) -> records.ServedTurn:
        P = len(p.prompt)
        # a turn sampled under a grammar records it: the learner replays its masks (selfrl.chat.constrain)
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
        return records.ServedTurn(traj, p.response_id, i, conversation, p.group_key, key, p.client, p.family,
                                  offered)
