"""The OpenAI chat-completions wire format: request models, and the conversion
between OpenAI messages and the chat the model sees.

What an OpenAI client sends is validated here (pydantic) and turned into plain
chat messages for the model's template:

* ``tools`` become a tools section in the system prompt (Hermes style, see
  ``selfrl.chat.toolcall``) unless the chat template renders tools itself;
* an assistant message's ``tool_calls`` become ``<tool_call>{...}</tool_call>``
  text, the form the model was prompted to write;
* a ``role: "tool"`` message becomes a ``<tool_response>`` tool turn.

The other way, :mod:`selfrl.serve.completion` turns the sampled text into OpenAI's
``content`` and ``tool_calls`` (id, type, function name, arguments as a JSON string); its
names are re-exported here.

Not supported (each is a 400 naming the field, not a silent no-op):
``frequency_penalty``/``presence_penalty``/``logit_bias`` other than neutral
values (they would make the recorded logprobs differ from the sampling
distribution), images and audio in message content. ``seed`` is accepted and
ignored: requests are batched, so a per-request seed cannot be honoured.
``tool_choice="required"``, a named function and ``response_format`` (``json_object``,
``json_schema``) constrain decoding with a grammar (``selfrl.serve.structured``).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from selfrl.engines.base import MIN_TEMPERATURE
from selfrl.serve.errors import _json_type, array_of_objects, error_body, error_param, finite, finite_fields, finite_json, non_finite_path, refuse  # noqa: F401
from selfrl.serve.limits import MAX_DEPTH, check_text, too_deep
from selfrl.chat.toolcall import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    STRICT_JSON,
    NotFiniteError,
    render_tools_prompt,
)
from selfrl.core.tools import JSON_TYPE_NAMES, Tool, ToolError
from selfrl.core.wording import shown
from selfrl.serve.completion import Completion, new_call_id, parse_completion, split_completion  # noqa: F401


def _valid_text(data: Any) -> Any:
    check_text(data)
    return data


def check_depth(data: Any) -> Any:
    """Refuse a body nested deeper than ``MAX_DEPTH``, naming the field it is in."""
    path = too_deep(data, MAX_DEPTH)
    if path is not None:
        head = path[:4] if path[0] == "tools" else path[:3] if path[0] == "response_format" else path[:1]
        raise refuse(f"this value nests objects and arrays more than {MAX_DEPTH} deep (the limit of a request)",
                     error_param(head))
    return data


STRICT = ConfigDict(extra="forbid", strict=True)
"""The config of every request model: unknown fields refused, and no type coercion: a boolean
field takes only ``true``/``false`` (not ``"yes"`` or ``1``), an integer field only a JSON integer
(not ``"0"`` or ``1.0``), a number field a JSON number (an integer is one), a string field a
string; anything else is a 400 naming the field and the type it takes
(:func:`selfrl.serve.errors.validation_message`)."""


class _Strict(BaseModel):
    """A request body part: unknown fields refused, no type coercion (:data:`STRICT`), every
    string valid Unicode."""

    model_config = STRICT
    _text = model_validator(mode="before")(_valid_text)


def _where_in(arguments: str) -> str:
    """``", at arguments<path>"``: where in the JSON text ``arguments`` (which Python's json reads
    with its NaN and infinities) the first number JSON cannot carry is, or "" when not found.

    >>> _where_in('{"a": {"b.c": [1, NaN]}}'), _where_in("not json")
    (', at arguments.a["b.c"][1]', '')
    """
    try:
        where = non_finite_path(json.loads(arguments))
    except (ValueError, RecursionError):
        return ""
    return "" if where in (None, ".") else f", at arguments{where}"


class FunctionCall(_Strict):
    name: str
    arguments: str = "{}"

    @field_validator("arguments")
    @classmethod
    def _arguments(cls, v: str) -> str:
        """A JSON object as a string (what a call returned by the server holds); empty means ``{}``.
        Its numbers are finite, as in a call the server returns (:data:`STRICT_JSON`): ``NaN``,
        ``Infinity`` and ``1e400`` are refused, so a client's history or correction never carries
        a value no strict JSON reader takes."""
        if not v:
            return v
        try:
            args = STRICT_JSON.decode(v)
        except NotFiniteError as e:
            raise refuse(f"arguments must be a JSON object with finite numbers: {e}{_where_in(v)}") from None
        except (ValueError, RecursionError) as e:
            raise refuse(f"arguments must be a JSON object encoded as a string; this is not JSON ({e})") from None
        if not isinstance(args, dict):
            raise refuse(f"arguments must be a JSON object encoded as a string, got {_json_type(args)}")
        return v


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


RESPONSE_ONLY = {
    "annotations": "annotations are output citations, not part of a request message: send the message "
                   "without them (null or [] is accepted)",
    "audio": "audio is not supported (selfrl serves text models): send audio: null or leave it out",
    "function_call": "function_call is OpenAI's deprecated form of a call: send it in tool_calls "
                     '([{"id": ..., "type": "function", "function": {"name": ..., "arguments": ...}}])',
}
"""Fields an OpenAI client's response message carries that a request message cannot use, and why."""


class Message(_Strict):
    """One OpenAI chat message (roles system, developer, user, assistant, tool)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # what we returned; accepted back, not shown to the model again
    # Fields of an OpenAI client's response message (``message.model_dump()`` sends them back as
    # null): accepted when empty, refused with the reason (:data:`RESPONSE_ONLY`) when they hold something.
    annotations: Any = None
    audio: Any = None
    function_call: Any = None

    @field_validator(*RESPONSE_ONLY)
    @classmethod
    def _response_only(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise refuse(RESPONSE_ONLY[info.field_name])
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        """A string, null, or a list of typed parts, each text part with its ``text`` string;
        anything else is refused naming the part and saying what is wrong with it. (A part of
        another type, an image say, is well formed: :func:`to_chat` refuses it as unsupported.)"""
        if v is None or isinstance(v, str):
            return v
        array_of_objects(v, "content must be a string, an array of content parts or null",
                         'a content part must be an object such as {"type": "text", "text": "..."}')
        for k, part in enumerate(v):
            if "type" not in part:
                raise refuse('a content part needs a "type" (only "text" parts are supported)', f"[{k}].type")
            if part["type"] != "text":
                continue
            if "text" not in part:
                raise refuse('a "text" content part needs a "text" string; this one has no "text" key',
                             f"[{k}].text")
            if not isinstance(part["text"], str):
                raise refuse(f'"text" must be a string, got {_json_type(part["text"])}', f"[{k}].text")
        return v

    def text(self, where: str = "messages[?]") -> str:
        """The content as text; list content must be ``{"type": "text"}`` parts.

        Raises:
            ContentError: a non-text part (image, audio, file), at ``<where>.content[k]``.
        """
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for k, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ContentError(f"only text content parts are supported, got type {part.get('type')!r} "
                                   "(selfrl serves text models)", f"{where}.content[{k}].type")
            parts.append(part["text"])
        return "".join(parts)


class ContentError(ValueError):
    """Message content selfrl cannot show the model; ``param`` names the part."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_messages(messages: list[Message]) -> None:
    """The conversation rules OpenAI applies: a system, developer, user or tool message has
    content (not null); an assistant message has content, ``tool_calls`` or a refusal; a
    tool message's ``tool_call_id`` answers a call of an earlier assistant message.

    Raises:
        pydantic_core.PydanticCustomError: the first message that breaks one (:func:`refuse`,
            at ``[i].content`` or ``[i].tool_call_id``), its index and role in the message.
    """
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            if m.content is None and not m.tool_calls and m.refusal is None:
                raise refuse(f"messages[{i}]: an assistant message needs content or tool_calls (both are null)",
                             f"[{i}].content")
            calls.update(c.id for c in m.tool_calls or [])
        elif m.content is None:
            raise refuse(f"messages[{i}]: content of a {m.role!r} message must not be null", f"[{i}].content")
        elif m.content == []:
            raise refuse(f"messages[{i}]: content of a {m.role!r} message must not be an empty array (send at least "
                         'one part, {"type": "text", "text": ...}, or a string)', f"[{i}].content")
        if m.role == "tool" and m.tool_call_id not in calls:
            said = "has no tool_call_id" if m.tool_call_id is None else f"answers tool_call_id {m.tool_call_id!r}"
            raise refuse(f"messages[{i}]: the tool message {said}, which is no tool call of an earlier "
                         "assistant message", f"[{i}].tool_call_id")


def check_parameters_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Refuse a tool's ``parameters`` that the prompt and the argument checks cannot read:
    ``properties`` must map names to objects, a property's ``type`` must be one of JSON
    Schema's type names or a list of them (``"str"`` is refused here, not at every later call
    or correction), ``enum`` a list, ``required`` a list of strings.

    Raises:
        ValueError: the first problem found.
    """
    finite_json("parameters", schema)
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
        raise ValueError('"properties" must be an object mapping each argument name to a schema object')
    for name, prop in props.items():
        kind = prop.get("type")
        if kind is not None and not (isinstance(kind, str) or (isinstance(kind, list) and kind
                                                               and all(isinstance(k, str) for k in kind))):
            raise ValueError(f'"type" of argument {name!r} must be a string or a list of strings')
        unknown = [k for k in ([kind] if isinstance(kind, str) else kind or []) if k not in JSON_TYPE_NAMES]
        if unknown:
            raise ValueError(f'"type" of argument {shown(name)} names {", ".join(map(shown, unknown))}, not a JSON '
                             f'Schema type: use one of {", ".join(JSON_TYPE_NAMES)} (a call\'s arguments are checked '
                             "against it)")
        if "enum" in prop and not isinstance(prop["enum"], list):
            raise ValueError(f'"enum" of argument {name!r} must be a list')
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError('"required" must be a list of argument names')
    return schema


class FunctionDef(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None

    _schema = field_validator("parameters")(check_parameters_schema)


class ToolDef(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` body. Unknown fields are rejected (400), as OpenAI does, and so
is a value of the wrong JSON type (:data:`STRICT`).

    selfrl extensions (pass them with the openai client's ``extra_body``):
    ``task_key`` groups requests for the learner (default: the conversation's first
    user message), ``record=False`` keeps a request out of the store and of training
    (for evaluation traffic).
    """

    model_config = STRICT
    _text = model_validator(mode="before")(_valid_text)
    _depth = model_validator(mode="before")(check_depth)

    model: str
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-2**63, le=2**63 - 1)  # accepted and ignored, but bounded (int64)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # selfrl extensions
    task_key: str | None = Field(default=None, max_length=200)
    record: bool = True

    _finite = finite_fields("temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "seed",
                            "top_logprobs", "frequency_penalty", "presence_penalty")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v):
        if v is not None and 0 < v < MIN_TEMPERATURE:  # 0 is greedy decoding
            raise refuse(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE}, got {v!r}", "")
        return v

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias(cls, v):
        for k, bias in (v.items() if isinstance(v, dict) else ()):
            try:
                finite("a logit_bias value", bias)
            except PydanticCustomError:
                raise refuse(f"logit_bias[{k!r}] must be a finite number, got {bias!r}", f".{k}") from None
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        fn = v.get("function") if isinstance(v, dict) else None
        if isinstance(v, dict) and v.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return finite_json("tool_choice", v)
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v):
        return finite_json("stream_options", v) if v is not None else v

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v):
        if v is None or v.get("type") in ("text", "json_object"):
            return v if v is None else finite_json("response_format", v)
        if v.get("type") != "json_schema":
            raise refuse('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                         f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}; got type '
                         f"{v.get('type')!r}", ".type")
        spec = v.get("json_schema")
        if not isinstance(spec, dict):
            raise refuse('a json_schema response_format needs "json_schema": {"name": ..., "schema": {...}}, '
                         f"got {_json_type(spec)}", ".json_schema")
        if not isinstance(spec.get("schema", {}), dict):
            raise refuse(f"the schema must be a JSON schema object, got {_json_type(spec['schema'])}",
                         ".json_schema.schema")
        return finite_json("response_format", v)  # its types are checked by the grammar compiler (always run)

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[Message]) -> list[Message]:
        check_messages(v)
        return v

    @field_validator("tools")
    @classmethod
    def _tool_names(cls, v: list[ToolDef] | None) -> list[ToolDef] | None:
        """Each tool has a name of its own: a call names one tool, whose schema checks its arguments."""
        seen: set[str] = set()
        for i, t in enumerate(v or []):
            if t.function.name in seen:
                raise refuse(f"tools[{i}]: a tool named {t.function.name!r} is offered twice; give each tool a name "
                             "of its own", f"[{i}].function.name")
            seen.add(t.function.name)
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return v

    def unsupported(self) -> str | None:
        """The first setting selfrl cannot honour exactly, as an error message, or None."""
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                return f"{name} is not supported (it would change the sampling distribution the logprobs record)"
        if self.logit_bias:
            return "logit_bias is not supported (it would change the sampling distribution the logprobs record)"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs needs logprobs: true"
        return None

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class VersionRequest(_Strict):
    """Admin body naming an adapter version."""

    version: int = Field(ge=0, le=999_999_999)  # bounded like a model name's @v<N>


# ------------------------------------------------------------------ conversion


def client_tools(tools: list[ToolDef] | None) -> list[Tool]:
    """The request's tools as :class:`Tool` objects (for the prompt and argument checks);
    they run on the client, so their ``fn`` raises if ever called."""

    def client_side(**_: Any) -> str:
        raise ToolError("this tool runs on the client")

    return [Tool(t.function.name, t.function.description, t.function.parameters, client_side) for t in tools or []]


def _call_text(call: ToolCall) -> str:
    args = json.loads(call.function.arguments or "{}")  # a JSON object: FunctionCall checked it
    return TOOL_CALL_OPEN + json.dumps({"name": call.function.name, "arguments": args}) + TOOL_CALL_CLOSE


def to_chat(req: ChatCompletionRequest, native_tools: bool, tools_prompt: str = "compact",
            wrap_tool_responses: bool = True) -> list[dict[str, str]]:
    """The request's messages as the chat the model's template renders.

    Args:
        native_tools: the chat template renders ``tools`` itself (then no tools
            section is added to the system prompt).
        tools_prompt: ``compact`` or ``json`` (see ``render_tools_prompt``).
        wrap_tool_responses: put a tool message inside ``<tool_response>`` tags (False
            when the template adds them itself, see ``selfrl.chat.template``).

    Raises:
        ContentError: non-text content parts (a ValueError naming the part in ``param``).
    """
    msgs: list[dict[str, str]] = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if role == "assistant":
            text = m.text(f"messages[{i}]") + "".join(_call_text(c) for c in m.tool_calls or [])
            msgs.append({"role": "assistant", "content": text})
        elif role == "tool":
            text = m.text(f"messages[{i}]")
            msgs.append({"role": "tool", "content": f"{TOOL_RESPONSE_OPEN}\n{text}\n{TOOL_RESPONSE_CLOSE}"
                         if wrap_tool_responses else text})
        else:
            msgs.append({"role": role, "content": m.text(f"messages[{i}]")})
    use_tools = bool(req.tools) and req.tool_choice != "none"
    section = ""
    if use_tools and not native_tools:
        section = render_tools_prompt(client_tools(req.tools), tools_prompt)
    if use_tools and req.tool_choice not in (None, "auto"):
        name = req.tool_choice["function"]["name"] if isinstance(req.tool_choice, dict) else None
        section += f"\nYou must call the tool {name} now." if name else "\nYou must call a tool now."
    if section:
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": msgs[0]["content"] + "\n\n" + section.strip()}
        else:
            msgs.insert(0, {"role": "system", "content": section.strip()})
    return msgs
