"""The OpenAI Responses API (``POST /v1/responses``) as a translation to and from chat
completions: a Responses request becomes a :class:`ChatCompletionRequest`, is served
and recorded exactly like one, and the chat completion becomes a Responses object (or
its stream of events). Pure functions, plus a bounded log of past responses (kept in
the run's store) for ``previous_response_id``.

The subset is what the openai client and the OpenAI Agents SDK send by default:

* ``input``: a string, or items: messages (``{"role", "content"}``, with ``type``
  ``"message"`` or without; content a string or ``input_text``/``output_text`` parts),
  ``function_call`` and ``function_call_output``;
* ``instructions`` (a system message first), ``tools`` (``type: "function"``),
  ``tool_choice``, ``text.format`` (``text``, ``json_object``, ``json_schema``: a
  grammar enforces them, see ``selfrl.serve.structured``), ``max_output_tokens``,
  ``temperature``, ``top_p``, ``parallel_tool_calls``, ``metadata``, ``user``, ``store``;
* ``previous_response_id``: the conversation so far (that response's input and output)
  is put in front of ``input``; responses are remembered in the run's store (the last
  :data:`RESPONSE_LOG_SIZE`, at most :data:`RESPONSE_LOG_BYTES`; across restarts), each
  for the client that made it (not with ``store: false``): an unknown, forgotten, unstored
  or other client's id gets a 404;
* ``stream: true``: the events ``response.created``, ``response.in_progress``, per
  output item ``response.output_item.added``, the text or arguments as one
  ``...delta`` and ``...done``, ``response.output_item.done``, then
  ``response.completed``. The text arrives whole, after decoding (not token by token).

Refused with a 400 naming the field (never ignored): built-in tools (web search, file
search, computer use...), ``conversation``, ``prompt`` templates, ``reasoning`` effort,
``background``, image/file input parts, ``item_reference`` and ``reasoning`` items.
The response id (``resp_...``) is the one the store records, so ``POST /v1/feedback``
takes it as ``response_id``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from selfrl.serve.errors import array_of_objects
from selfrl.serve.protocol import STRICT, ChatCompletionRequest, check_depth, finite_fields

RESPONSE_LOG_SIZE = 10_000  # responses whose conversation previous_response_id can continue
RESPONSE_LOG_BYTES = 256 * 2**20  # and at most this much of their JSON, in the run's store


class ResponsesRequest(BaseModel):
    """``POST /v1/responses`` body. Unknown fields are rejected (400), and so is a value of the
    wrong JSON type (:data:`selfrl.serve.protocol.STRICT`)."""

    model_config = STRICT
    _depth = model_validator(mode="before")(check_depth)

    model: str
    input: str | list[dict[str, Any]] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    parallel_tool_calls: bool | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    # refused when set (kept as fields so the error names them)
    conversation: Any = None
    prompt: Any = None
    reasoning: Any = None
    background: bool | None = None
    # selfrl extensions, as in chat completions
    task_key: str | None = Field(default=None, max_length=200)
    record: bool = True

    _finite = finite_fields("temperature", "top_p", "max_output_tokens", "top_logprobs")

    @field_validator("input", mode="before")
    @classmethod
    def _input(cls, v):
        if isinstance(v, str):
            return v
        return array_of_objects(v, "input must be a string or an array of input items",
                                "an input item must be an object (a message, function_call or function_call_output)")


class ResponsesError(ValueError):
    """A Responses request selfrl cannot honour; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _text(content: Any, where: str) -> str:
    """A message's content as text (``input_text``/``output_text``/``text`` parts).

    Raises:
        ResponsesError: content of another type, or a part that is not a text part or has no
            ``text`` string; ``param`` is the item (``where``), the message names the part.
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ResponsesError(f"{where}: content must be a string or an array of content parts, got "
                             f"{type(content).__name__}", where)
    parts = []
    for k, part in enumerate(content):
        at = f"{where}: content[{k}]"
        if not isinstance(part, dict):
            raise ResponsesError(f"{at} must be an object, got {type(part).__name__}", where)
        if part.get("type") not in ("input_text", "output_text", "text"):
            raise ResponsesError(f"{at}: content parts of type {part.get('type')!r} are not supported; only "
                                 "input_text, output_text and text parts are accepted", where)
        if not isinstance(part.get("text"), str):
            said = "has no \"text\" key" if "text" not in part else f"has a {type(part['text']).__name__} \"text\""
            raise ResponsesError(f"{at}: a {part['type']} part needs a \"text\" string; this one {said}", where)
        parts.append(part["text"])
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat-completions messages.

    Consecutive ``function_call`` items join the assistant message before them (one
    assistant turn with its text and calls); a ``function_call_output`` becomes a
    ``tool`` message.

    Raises:
        ResponsesError: an item type outside the subset.

    >>> input_messages([{"role": "user", "content": "2+2?"},
    ...                 {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
    ...                 {"type": "function_call_output", "call_id": "c1", "output": "4"}])[1:]
    [{'role': 'assistant', 'content': None, 'tool_calls': [{'id': 'c1', 'type': 'function', \
'function': {'name': 'add', 'arguments': '{}'}}]}, {'role': 'tool', 'tool_call_id': 'c1', 'content': '4'}]
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{k}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesError(f"unknown message role {role!r}", where)
            if item.get("content") is None:  # as chat completions refuses it (protocol.check_messages)
                raise ResponsesError(f"{where}: a {role} message needs content (a string or an array of content "
                                     "parts), got null", f"{where}.content")
            out.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            _require(item, ("call_id", "name"), f"{kind} item", where)
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments") or "{}"}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _require(item, ("call_id",), f"{kind} item", where)
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, where)})
        else:
            raise ResponsesError(f"input items of type {kind!r} are not supported (supported: message, "
                                 "function_call, function_call_output)", where)
    return out


def _require(item: dict[str, Any], keys: tuple[str, ...], kind: str, where: str) -> None:
    """Raise ResponsesError unless ``item`` has a string at each of ``keys``."""
    for key in keys:
        if not isinstance(item.get(key), str):
            said = "has none" if key not in item else f"has a {type(item[key]).__name__}"
            raise ResponsesError(f"a {kind} needs a {key!r} string; this one {said}", where)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise ResponsesError(f"text.format must be an object such as {{\"type\": \"json_schema\", ...}}, got "
                             f"{type(fmt).__name__}", "text.format")
    if not fmt or fmt.get("type") in ("text", "json_object"):
        return fmt
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if k in fmt}}
    raise ResponsesError(f"text.format type {fmt.get('type')!r} is not supported", "text.format")


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for k, t in enumerate(tools):
        if t.get("type") != "function":
            raise ResponsesError(f"only function tools are supported, got {t.get('type')!r}", f"tools.{k}")
        _require(t, ("name",), "function tool", f"tools.{k}")
        fn = {"name": t["name"], "description": t.get("description") or "",
              "parameters": t.get("parameters") or {"type": "object", "properties": {}}}
        if t.get("strict") is not None:
            fn["strict"] = t["strict"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or "name" not in choice:
            raise ResponsesError("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat-completions request that serves ``req``, after ``history`` (the messages
    of ``previous_response_id``, or [] without one).

    Raises:
        ResponsesError: a field or item outside the subset.
        pydantic.ValidationError: the translated request is invalid (bad tool_choice, say).
    """
    for name in ("conversation", "prompt", "reasoning", "background"):
        if getattr(req, name):
            raise ResponsesError(f"{name} is not supported by selfrl's Responses API", name)
    if req.truncation not in (None, "disabled"):
        raise ResponsesError("only truncation 'disabled' is supported (a prompt beyond the context is a 400)",
                             "truncation")
    if req.include and any(i != "message.output_text.logprobs" for i in req.include):
        raise ResponsesError(f"include supports only message.output_text.logprobs, got {req.include}", "include")
    messages = list(history)
    if req.instructions and not history:
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages += input_messages(req.input)
    if not messages:
        raise ResponsesError("input is empty", "input")
    return ChatCompletionRequest(
        model=req.model, messages=messages, tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice),
        response_format=_response_format(req.text), max_completion_tokens=req.max_output_tokens,
        temperature=req.temperature, top_p=req.top_p, parallel_tool_calls=req.parallel_tool_calls,
        metadata=req.metadata, user=req.user, store=req.store, task_key=req.task_key, record=req.record,
        logprobs=bool(req.include),
    )


def responses_param(param: str | None) -> str | None:
    """A chat-completions field named as the Responses request's own (the request is served
    as a chat completion, whose checks name chat fields).

    >>> responses_param("tools[1].function.parameters"), responses_param("response_format.json_schema.schema")
    ('tools[1].parameters', 'text.format.schema')
    >>> responses_param("messages[3].content[0].text"), responses_param("max_completion_tokens")
    ('input', 'max_output_tokens')
    """
    if param is None:
        return None
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    if param.startswith("response_format"):
        return "text.format" + param.removeprefix("response_format").replace(".json_schema", "", 1)
    if param.startswith("messages"):
        return "input"  # with instructions and history, the chat index is not the input's
    return {"max_completion_tokens": "max_output_tokens"}.get(param, param)


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def output_items(message: dict[str, Any], logprobs: list[dict[str, Any]] | None = None,
                 cut: bool = False) -> list[dict[str, Any]]:
    """A chat completion's assistant message as Responses output items (text first, then
    calls); ``logprobs`` (the chat choice's ``logprobs.content``) go with the text. With
    ``cut`` (the token limit ended the turn) the text item's status is ``"incomplete"``;
    a call, complete by construction, stays ``"completed"``.

    >>> [i["type"] for i in output_items({"role": "assistant", "content": "hi", "tool_calls": [
    ...     {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})]
    ['message', 'function_call']
    """
    items: list[dict[str, Any]] = []
    if message.get("content") or not message.get("tool_calls"):  # an empty answer is an empty text item
        items.append({"type": "message", "id": "msg_" + uuid.uuid4().hex,
                      "status": "incomplete" if cut else "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": message.get("content") or "", "annotations": [],
                                   "logprobs": logprobs or []}]})
    for call in message.get("tool_calls") or []:
        items.append({"type": "function_call", "id": "fc_" + uuid.uuid4().hex[:24], "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def to_response(chat: dict[str, Any], req: ResponsesRequest, chat_req: ChatCompletionRequest,
                response_id: str) -> dict[str, Any]:
    """The Responses object for a finished chat completion (its first choice)."""
    choice = chat["choices"][0]
    incomplete = choice["finish_reason"] == "length"
    usage = chat["usage"]
    return {
        "id": response_id, "object": "response", "created_at": chat["created"],
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None, "model": chat["model"], "instructions": req.instructions,
        "output": output_items(choice["message"], (choice.get("logprobs") or {}).get("content"), incomplete),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "metadata": req.metadata or {},
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled", "store": req.store is not False,
        "usage": {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
        "adapter_version": chat["adapter_version"], "system_fingerprint": chat["system_fingerprint"],
    }


def stream_events(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses streaming events for a finished ``response``, numbered in order."""
    started = {**response, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    events: list[dict[str, Any]] = [{"type": "response.created", "response": started},
                                    {"type": "response.in_progress", "response": started}]
    for i, item in enumerate(response["output"]):
        events.append({"type": "response.output_item.added", "output_index": i,
                       "item": {**item, "status": "in_progress",
                                **({"content": []} if item["type"] == "message" else {"arguments": ""})}})
        if item["type"] == "message":
            part = item["content"][0]
            where = {"item_id": item["id"], "output_index": i, "content_index": 0}
            events += [
                {"type": "response.content_part.added", **where, "part": {**part, "text": ""}},
                {"type": "response.output_text.delta", **where, "delta": part["text"], "logprobs": []},
                {"type": "response.output_text.done", **where, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **where, "part": part},
            ]
        else:
            where = {"item_id": item["id"], "output_index": i}
            events += [{"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **where, "name": item["name"],
                        "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    done = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
    events.append({"type": done, "response": response})
    return [{**e, "sequence_number": n} for n, e in enumerate(events)]


def sse(events: list[dict[str, Any]]) -> str:
    """Events as server-sent events (``event:`` and ``data:`` lines)."""
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)


class ResponseLog:
    """The conversation behind each recent response id, for ``previous_response_id``: kept
    in the run's store (:func:`selfrl.record.response_history.remember_response`), so it outlives a
    restart; the last ``size`` responses, at most ``max_bytes`` of JSON in all, each one
    visible only to the client that made it.

    Args:
        store: the run's store (its tables are created when missing).
        size: responses remembered.
        max_bytes: JSON bytes remembered in all (the oldest go first; the newest always stays).
    """

    def __init__(self, store, size: int = RESPONSE_LOG_SIZE, max_bytes: int = RESPONSE_LOG_BYTES):
        from selfrl.record import served as records

        records.init(store)
        self.store, self.size, self.max_bytes = store, size, max_bytes

    def history(self, response_id: str | None, client: str = "") -> list[dict[str, Any]]:
        """The messages up to and including ``response_id``'s output.

        Raises:
            KeyError: the id is unknown to ``client`` (never served to it, or forgotten).
        """
        from selfrl.record.response_history import recall_response

        if response_id is None:
            return []
        found = recall_response(self.store, response_id, client)
        if found is None:
            raise KeyError(response_id)
        return found

    def add(self, response_id: str, messages: list[dict[str, Any]], message: dict[str, Any],
            client: str = "") -> None:
        from selfrl.record.response_history import remember_response

        remember_response(self.store, response_id, client,
                                  [*messages, {k: v for k, v in message.items() if k != "refusal"}],
                                  self.size, self.max_bytes)


async def create_response(service, log: ResponseLog, req: ResponsesRequest, client: str = "",
                          is_disconnected=None) -> dict[str, Any]:
    """Serve ``req`` for ``client`` through ``service`` as a chat completion recorded under a ``resp_`` id,
    remember its conversation in ``log``, and return the Responses object.

    Raises:
        selfrl.serve.errors.ApiError: 404 for an unknown ``previous_response_id``, 400 for
            a request outside the subset, and whatever a chat completion raises.
    """
    from pydantic import ValidationError

    from selfrl.serve.errors import ApiError

    try:
        history = log.history(req.previous_response_id, client)
    except KeyError:
        raise ApiError(404, f"no response {req.previous_response_id!r} is remembered for this client (the server "
                       f"keeps the last {log.size} responses in its run directory, across restarts)",
                       "previous_response_id", "previous_response_not_found") from None
    try:
        chat_req = to_chat_request(req, history)
    except ResponsesError as e:
        raise ApiError(400, str(e), e.param) from e
    except ValidationError as e:
        from selfrl.serve.errors import error_param

        first = e.errors()[0]
        where = responses_param(error_param(first.get("loc", ()), first.get("ctx")))
        raise ApiError(400, str(first.get("msg", "invalid request")).removeprefix("Value error, "), where) from e
    response_id = new_response_id()
    try:
        chat = await service.complete(chat_req, client, response_id=response_id, is_disconnected=is_disconnected)
    except ApiError as e:
        chat_param, e.param = e.param, responses_param(e.param)
        if chat_param and e.message.startswith(chat_param):  # "max_completion_tokens 10 + prompt ..."
            e.message = e.param + e.message[len(chat_param):]
        raise
    if req.store is not False:  # store: false, as OpenAI: the response cannot be continued
        log.add(response_id, [m.model_dump(exclude_none=True) for m in chat_req.messages],
                chat["choices"][0]["message"], client)
    return to_response(chat, req, chat_req, response_id)
