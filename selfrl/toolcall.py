"""Tool calls in plain text, Hermes style, for chat templates without tool support.

The tools are described in the system prompt as JSON schemas inside
``<tools></tools>``; the model calls one by writing

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>

and the result comes back as the content of a ``tool`` message,
``<tool_response>\\n...\\n</tool_response>``.

Parsing never guesses: a block that is not exactly one JSON object with a
string ``name`` and object ``arguments`` becomes a failed call with a reason,
which is recorded on the trajectory and sent back to the model; the tool
function is not run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from selfrl.tools import Tool, ToolError, json_type_name, validate_arguments
from selfrl.trajectory import ToolCallRecord

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"

_PLACEHOLDERS: dict[str, Any] = {
    "string": "...",
    "number": 1,
    "integer": 1,
    "boolean": True,
    "object": {},
    "array": [],
}


def _example_arguments(tool: Tool) -> dict[str, Any]:
    if tool.example_arguments is not None:
        return tool.example_arguments
    props = tool.parameters.get("properties", {})
    example = {}
    for key in tool.parameters.get("required", []):
        kind = props.get(key, {}).get("type", "string")
        example[key] = _PLACEHOLDERS.get(kind if isinstance(kind, str) else kind[0], "...")
    return example


def render_tools_prompt(tools: list[Tool], style: str = "json") -> str:
    """The system-prompt section that describes ``tools`` and the call format.

    ``style="json"``: one JSON schema per line inside ``<tools></tools>``, the
    exact call format, a one-line example call (on the first tool) and where the
    result arrives (Hermes style). ``style="compact"``: one line per tool,
    ``name(arg: type, ...): description``, then the call format with the first
    tool's example. The compact form is the default of ``selfrl run``: on
    SmolLM2-135M the JSON schemas (about 150 more prompt tokens) stopped the base
    model from calling the tool at all (0 of 64 samples), while the compact form
    with one demonstration gave about a third. Returns "" when ``tools`` is empty.

    Raises:
        ValueError: unknown ``style``.
    """
    if not tools:
        return ""
    if style == "compact":
        return _render_compact(tools)
    if style != "json":
        raise ValueError(f"unknown tools prompt style {style!r}; valid: compact, json")
    schemas = "\n".join(json.dumps(t.openai_schema()) for t in tools)
    example = json.dumps({"name": tools[0].name, "arguments": _example_arguments(tools[0])})
    return (
        "# Tools\n"
        f"You can call these tools:\n<tools>\n{schemas}\n</tools>\n"
        "To call a tool, write:\n"
        f'{TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <JSON object>}}{TOOL_CALL_CLOSE}\n'
        f"Example: {TOOL_CALL_OPEN}{example}{TOOL_CALL_CLOSE}\n"
        f"The result comes back in a {TOOL_RESPONSE_OPEN}{TOOL_RESPONSE_CLOSE} message."
    )


def _render_compact(tools: list[Tool]) -> str:
    lines = []
    for t in tools:
        props = t.parameters.get("properties", {})
        args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in props.items())
        lines.append(f"- {t.name}({args}): {t.description}")
    example = json.dumps({"name": tools[0].name, "arguments": _example_arguments(tools[0])})
    return (
        "Tools:\n" + "\n".join(lines) + "\n"
        f"To use a tool, write {TOOL_CALL_OPEN}{example}{TOOL_CALL_CLOSE} "
        f"and wait for the {TOOL_RESPONSE_OPEN}."
    )


@dataclass
class ParsedCall:
    """One ``<tool_call>`` block as parsed from the model's text.

    Attributes:
        name: the tool name ("" when it could not be read).
        arguments: the arguments ({} when parsing failed).
        raw: the exact text between the tags (to the end of the text when unclosed).
        error: why the block is not a valid call, or None.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None


def _parse_block(raw: str) -> ParsedCall:
    body = raw.strip()
    if not body:
        return ParsedCall("", {}, raw, "empty <tool_call>")
    try:
        obj, end = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return ParsedCall("", {}, raw, f"invalid JSON in <tool_call>: {e.msg} at char {e.pos}")
    if body[end:].strip():
        return ParsedCall("", {}, raw, "expected one JSON object, found extra data")
    if not isinstance(obj, dict):
        return ParsedCall("", {}, raw, f"expected a JSON object, found {json_type_name(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        why = 'missing "name"' if name is None else '"name" must be a non-empty string'
        return ParsedCall("", {}, raw, why)
    if "arguments" not in obj:
        return ParsedCall(name, {}, raw, None)
    args = obj["arguments"]
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            return ParsedCall(name, {}, raw, f'"arguments" string is not valid JSON: {e.msg}')
    if not isinstance(args, dict):
        return ParsedCall(name, {}, raw, f'"arguments" must be a JSON object, found {json_type_name(args)}')
    return ParsedCall(name, args, raw, None)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """Split ``text`` into the text outside tool-call blocks and the calls, in order.

    Each ``<tool_call>...</tool_call>`` block must hold exactly one JSON object
    ``{"name": str, "arguments": object}``; ``arguments`` may be missing
    (taken as {}) or a JSON string holding an object. Whitespace around the
    object is ignored. Anything else yields a ``ParsedCall`` with ``error``
    set and empty arguments: an unclosed ``<tool_call>`` (its raw text runs to
    the end), invalid JSON, several objects glued together, a non-object,
    a missing or non-string name, or arguments of another type.

    Returns:
        (text with the blocks removed and stripped, calls in order of appearance).
    """
    pieces: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        if start < 0:
            pieces.append(text[pos:])
            break
        pieces.append(text[pos:start])
        body_start = start + len(TOOL_CALL_OPEN)
        end = text.find(TOOL_CALL_CLOSE, body_start)
        if end < 0:
            calls.append(ParsedCall("", {}, text[body_start:], f"unclosed {TOOL_CALL_OPEN}"))
            break
        calls.append(_parse_block(text[body_start:end]))
        pos = end + len(TOOL_CALL_CLOSE)
    return "".join(pieces).strip(), calls


def _failed(call: ParsedCall, why: str) -> ToolCallRecord:
    return ToolCallRecord(
        name=call.name, arguments=call.arguments, raw=call.raw, ok=False, result=f"error: {why}", error=why
    )


def execute_call(call: ParsedCall, tools: dict[str, Tool] | list[Tool]) -> ToolCallRecord:
    """Run one parsed call against ``tools`` and record what happened. Never raises.

    The tool function runs only when the call parsed, names one of ``tools``
    and its arguments pass ``validate_arguments``. Otherwise, or when the
    function raises (``ToolError`` or any other ``Exception``) or returns a
    non-string, the record has ``ok=False``, ``error`` set to the reason and
    ``result="error: <reason>"`` (the text sent back to the model). On success
    ``ok=True`` and ``result`` is the tool's output.
    """
    by_name = tools if isinstance(tools, dict) else {t.name: t for t in tools}
    if call.error is not None:
        return _failed(call, call.error)
    tool = by_name.get(call.name)
    if tool is None:
        valid = ", ".join(sorted(by_name)) or "(none)"
        return _failed(call, f"unknown tool {call.name!r}; valid tools: {valid}")
    try:
        validate_arguments(tool, call.arguments)
        output = tool.fn(**call.arguments)
    except ToolError as e:
        return _failed(call, str(e))
    except Exception as e:  # a tool bug must not end the rollout; it is recorded
        return _failed(call, f"{call.name!r} failed: {type(e).__name__}: {e}")
    if not isinstance(output, str):
        return _failed(call, f"{call.name!r} returned {type(output).__name__}, expected str")
    return ToolCallRecord(name=call.name, arguments=call.arguments, raw=call.raw, ok=True, result=output)


def format_tool_response(record: ToolCallRecord) -> str:
    """The content of the ``tool`` message for ``record``: ``<tool_response>\\n{result}\\n</tool_response>``."""
    return f"{TOOL_RESPONSE_OPEN}\n{record.result}\n{TOOL_RESPONSE_CLOSE}"
