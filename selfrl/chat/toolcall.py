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

**Tags inside strings.** A block ends at the first ``</tool_call>`` outside the JSON
strings of its body (for a JSON value, the first one after it), so a string argument
may hold ``</tool_call>``, ``<tool_call>``, ``<think>`` or braces:
``{"content": "x </tool_call> y"}`` is one call with that whole string
(:func:`scan_blocks`).

**Markup.** The tags of this format (:data:`MARKUP_TAGS`) are never answer text:
what is left of a turn after its blocks are taken out loses any stray tag
(``</tool_call>`` without a block, ``<tool_response>`` tags a model wrote itself)
and a tag cut off at its end (:func:`markup_spans`).

**Argument keys.** ``arguments`` is the key; ``parameters`` is accepted as its
alias, because Llama-3.1's own tool format writes ``{"name": ..., "parameters":
{...}}``. Any other key besides ``name`` (``args``, ``input``, ``function``...), or
both ``arguments`` and ``parameters``, makes the call malformed: a call never reaches
a tool or a client with arguments other than the ones the model wrote.

**Reasoning blocks.** Qwen3, SmolLM3 and DeepSeek-R1 style models think inside
``<think>...</think>`` (:data:`THINK_OPEN`, :data:`THINK_CLOSE`). Nothing inside a
reasoning block is a call: a ``<tool_call>`` drafted while thinking is part of the
thought, never run, never returned to a client. An unclosed ``<think>`` runs to the
end of the text (the whole rest is reasoning); a ``</think>`` without an opening tag
closes a block that began at the start of the text (Qwen3's template opens the
block in the prompt, so the sampled text starts inside it). The rollout and the
server both go through :func:`scan_blocks`, so the rule is the same in both.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from selfrl.core.tools import Tool, ToolError, json_type_name, validate_arguments
from selfrl.core.trajectory import ToolCallRecord

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOLS_OPEN = "<tools>"
TOOLS_CLOSE = "</tools>"
# every tag of the call format and the templates that use it (Qwen2.5, Qwen3, SmolLM3): never text for a client
MARKUP_TAGS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE, THINK_OPEN, THINK_CLOSE,
               TOOLS_OPEN, TOOLS_CLOSE)
_BLOCK_TAGS = (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, THINK_OPEN, THINK_CLOSE)
ARGUMENT_KEYS = ("arguments", "parameters")  # "parameters": Llama-3.1's own tool format

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


class NotFiniteError(ValueError):
    """A number JSON cannot carry: ``NaN``, ``Infinity`` (no JSON at all), or a literal beyond a
    double's range (``1e400``), which every JSON reader takes as an infinity."""


def _no_constant(name: str) -> float:
    raise NotFiniteError(f"{name} is not a JSON number")


def json_number_ok(value: Any) -> bool:
    """Whether JSON can carry the number ``value`` (an int or float, not a bool) as itself: False
    for ``NaN``, an infinity, and an integer that rounds past the largest double (about 1.8e308),
    which a reader holding numbers as doubles takes as an infinity. The one rule of the strict
    decoder (:data:`STRICT_JSON`) and of the server's check of values already decoded
    (``selfrl.serve.errors.non_finite_path``)."""
    if isinstance(value, float):
        return math.isfinite(value)
    try:
        float(value)  # rounds to the nearest double, as a reader does; too large for any double raises
    except OverflowError:
        return False
    return True


def _beyond(literal: str) -> NotFiniteError:
    return NotFiniteError(f"the number {literal[:20]}{'...' if len(literal) > 20 else ''} is beyond a double's range")


def _finite(literal: str) -> float:
    value = float(literal)
    if not json_number_ok(value):
        raise _beyond(literal)
    return value


def _finite_int(literal: str) -> int:
    if len(literal.lstrip("-")) > 400:  # past any double (10**309 has 310 digits); int() refuses 4,300+ digits
        raise _beyond(literal)
    value = int(literal)
    if not json_number_ok(value):
        raise _beyond(literal)
    return value


STRICT_JSON = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite, parse_int=_finite_int)
"""The decoder of a call's JSON: standard JSON, every number finite (:class:`NotFiniteError`
otherwise), so a parsed call's arguments always encode back to JSON any client can read."""


def _json_error(e: Exception, at: bool = False) -> str:
    """Why :data:`STRICT_JSON` refused a text: the decoder's message (``at``: with its position),
    a :class:`NotFiniteError`'s, or the error's type (a recursion too deep, say)."""
    if isinstance(e, json.JSONDecodeError):
        return f"{e.msg} at char {e.pos}" if at else e.msg
    return str(e) if isinstance(e, NotFiniteError) else type(e).__name__


def _parse_block(raw: str) -> ParsedCall:
    body = raw.strip()
    if not body:
        return ParsedCall("", {}, raw, "empty <tool_call>")
    try:
        obj, end = STRICT_JSON.raw_decode(body)
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        return ParsedCall("", {}, raw, f"invalid JSON in <tool_call>: {_json_error(e, at=True)}")
    if body[end:].strip():
        return ParsedCall("", {}, raw, "expected one JSON object, found extra data")
    if not isinstance(obj, dict):
        return ParsedCall("", {}, raw, f"expected a JSON object, found {json_type_name(obj)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        why = 'missing "name"' if name is None else '"name" must be a non-empty string'
        return ParsedCall("", {}, raw, why)
    extra = [k for k in obj if k != "name" and k not in ARGUMENT_KEYS]
    if extra:
        return ParsedCall(name, {}, raw, f'unexpected key(s) {", ".join(map(repr, extra))} in <tool_call>; '
                          'write {"name": ..., "arguments": {...}}')
    given = [k for k in ARGUMENT_KEYS if k in obj]
    if len(given) > 1:
        return ParsedCall(name, {}, raw, 'both "arguments" and "parameters" given; write only "arguments"')
    if not given:
        return ParsedCall(name, {}, raw, None)
    key = given[0]
    args = obj[key]
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string
        try:
            args = STRICT_JSON.decode(args)
        except (json.JSONDecodeError, RecursionError, ValueError) as e:
            return ParsedCall(name, {}, raw, f'"{key}" string is not valid JSON: {_json_error(e)}')
    if not isinstance(args, dict):
        return ParsedCall(name, {}, raw, f'"{key}" must be a JSON object, found {json_type_name(args)}')
    return ParsedCall(name, args, raw, None)


def reasoning_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the reasoning blocks in ``text``, tags included.

    See the module docstring for the rule; a ``<think>`` or ``</think>`` inside a call
    block's JSON string is part of the call, not a tag (:func:`scan_blocks`).

    >>> reasoning_spans("<think>a</think>b")
    [(0, 16)]
    >>> reasoning_spans("a</think>b"), reasoning_spans("x<think>y")
    ([(0, 9)], [(1, 9)])
    """
    return scan_blocks(text)[0]


def split_reasoning(text: str) -> tuple[str, str]:
    """``(reasoning, rest)``: the text of the reasoning blocks (tags removed, joined by
    newlines, stripped) and the text outside them.

    >>> split_reasoning("<think>2+2 is 4</think>It is 4.")
    ('2+2 is 4', 'It is 4.')
    """
    thoughts, pieces, pos = [], [], 0
    for start, end in reasoning_spans(text):
        pieces.append(text[pos:start])
        inner = text[start:end]
        inner = inner[len(THINK_OPEN):] if inner.startswith(THINK_OPEN) else inner
        inner = inner[:-len(THINK_CLOSE)] if inner.endswith(THINK_CLOSE) else inner
        thoughts.append(inner.strip())
        pos = end
    pieces.append(text[pos:])
    return "\n".join(t for t in thoughts if t), "".join(pieces)


# the tags that end a call block's body; a JSON string is skipped whole (an unterminated one leaves its
# tags counting: the body is invalid JSON anyway)
_BODY_TAGS = re.compile("|".join(map(re.escape, _BLOCK_TAGS)))
_QUOTE_OR_TAG = re.compile('"|' + _BODY_TAGS.pattern)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*+"', re.S)  # possessive: an unterminated string fails in one pass
_NEXT_BLOCK = re.compile("|".join(map(re.escape, (TOOL_CALL_OPEN, THINK_OPEN, THINK_CLOSE))))


class _Bodies:
    """Where the call blocks of one text end (:meth:`end`), each read in one pass.

    A tag inside a JSON string does not end a block: its body is read with JSON's string
    syntax (a ``"`` to the next ``"`` not escaped by a backslash), and the first tag outside
    a string counts. For a body that is one JSON value this is the first tag after the value,
    as ``json.JSONDecoder.raw_decode`` would find it (``raw_decode`` itself reports each
    error's line, a count over all the text before it, for every block). A string left
    unterminated leaves its tags counting; and since whether a quote closes a string depends
    only on the backslashes just before it, no later quote can close one either: the rest of
    the text is read as plain text, so that each character is read a bounded number of times.
    The tags are ``</tool_call>`` and the ones that cut an unclosed block off: ``<tool_call>``,
    ``<think>``, ``</think>``.
    """

    def __init__(self, text: str):
        self.text, self.plain = text, len(text) + 1  # from ``plain`` on, no string can end

    def end(self, body_start: int) -> tuple[int, bool]:
        """``(i, closed)`` for the block whose body starts at ``body_start``: ``i`` the index of
        its ``</tool_call>`` (closed) or of the tag that cuts it off, else ``len(text)``."""
        text, pos = self.text, body_start
        while pos < self.plain:
            found = _QUOTE_OR_TAG.search(text, pos)
            if found is None or found.group() != '"':
                return self._ending(found)
            string = _STRING.match(text, found.start())
            if string is None:  # unterminated (no tag lies between pos and this quote)
                self.plain = found.start()
                break
            pos = string.end()
        return self._ending(_BODY_TAGS.search(text, pos))

    def _ending(self, tag: re.Match | None) -> tuple[int, bool]:
        return (len(self.text), False) if tag is None else (tag.start(), tag.group() == TOOL_CALL_CLOSE)

    def think_end(self, start: int) -> int:
        """The end of the reasoning block whose text starts at ``start``: after its ``</think>``,
        else ``len(text)``. A call drafted inside it is skipped whole, so a ``</think>`` in one
        of the draft's JSON strings does not end the thought."""
        text, pos, close = self.text, start, None
        while True:
            if close is None or 0 <= close < pos:  # the first </think> from pos on (-1: none), kept until passed
                close = text.find(THINK_CLOSE, pos)
            draft = text.find(TOOL_CALL_OPEN, pos, None if close < 0 else close)
            if draft < 0:
                return len(text) if close < 0 else close + len(THINK_CLOSE)
            body_end, closed = self.end(draft + len(TOOL_CALL_OPEN))
            if not closed:  # an unclosed draft: the first </think> after its opening ends the thought
                close = text.find(THINK_CLOSE, draft)
                return len(text) if close < 0 else close + len(THINK_CLOSE)
            pos = body_end + len(TOOL_CALL_CLOSE)


def scan_blocks(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, ParsedCall]]]:
    """The reasoning blocks and the tool-call blocks of ``text``, read left to right:
    ``(reasoning spans, calls)``, each span ``[start, end)`` with its tags.

    Each call is ``(start, end, call)``. A call block ends at its ``</tool_call>``, found
    by :class:`_Bodies` (a closing tag inside a JSON string is text); an unclosed block
    runs to the next ``<tool_call>``, ``<think>``, ``</think>`` or the end of the text, and
    is a failed call. A reasoning block is never a call (see the module docstring), and a
    tag inside a call's JSON string opens or closes no reasoning block.
    """
    thinks: list[tuple[int, int]] = []
    calls: list[tuple[int, int, ParsedCall]] = []
    bodies = _Bodies(text)
    pos, thought = 0, False  # thought: a reasoning block was seen (a later </think> is a stray tag)
    while (m := _NEXT_BLOCK.search(text, pos)) is not None:
        if m.group() == THINK_CLOSE:
            if not thought:  # opened by the prompt: all before it is reasoning, calls included
                thinks, calls = [(0, m.end())], []
            thought, pos = True, m.end()
        elif m.group() == THINK_OPEN:
            pos = bodies.think_end(m.end())
            thinks.append((m.start(), pos))
            thought = True
        else:
            body_end, closed = bodies.end(m.end())
            raw = text[m.end():body_end]
            pos = body_end + len(TOOL_CALL_CLOSE) if closed else body_end
            calls.append((m.start(), pos, _parse_block(raw) if closed else
                          ParsedCall("", {}, raw, f"unclosed {TOOL_CALL_OPEN}")))
    return thinks, calls


def call_spans(text: str) -> list[tuple[int, int, ParsedCall]]:
    """Each tool-call block outside reasoning blocks: ``(start, end, call)`` with
    ``[start, end)`` the block's characters in ``text``, tags included (see
    :func:`scan_blocks`)."""
    return scan_blocks(text)[1]


def markup_spans(text: str, start: int = 0, end: int | None = None, extra: tuple[str, ...] = ()
                 ) -> list[tuple[int, int]]:
    """Spans ``[s, e)`` of markup in ``text[start:end]``: each tag of :data:`MARKUP_TAGS` and
    of ``extra`` (a template's control-token text, ``<|im_end|>``...), and, when ``end`` is
    the end of the text, the start of one cut off there (``<tool_resp``, ``<|im_``).

    >>> markup_spans("a<tool_response>b</tool_response>c<tool_")
    [(1, 16), (17, 33), (34, 40)]
    """
    end = len(text) if end is None else end
    pattern, prefixes, longest = _markup(tuple(extra))
    spans = [(m.start(), m.end()) for m in pattern.finditer(text, start, end)]
    if end == len(text):
        last = spans[-1][1] if spans else start
        # the longest end of the text that begins a tag (the earliest start that does)
        cut = next((p for p in range(max(last, len(text) - longest + 1), len(text)) if text[p:] in prefixes), None)
        if cut is not None:
            spans.append((cut, len(text)))
    return spans


@lru_cache(maxsize=16)
def _markup(extra: tuple[str, ...]) -> tuple[re.Pattern, frozenset[str], int]:
    """The pattern of every tag, the set of their proper prefixes, and the longest tag's length."""
    tags = sorted({*MARKUP_TAGS, *(t for t in extra if t)}, key=len, reverse=True)
    prefixes = frozenset(t[:k] for t in tags for k in range(1, len(t)))
    return re.compile("|".join(map(re.escape, tags))), prefixes, len(tags[0])


def strip_markup(text: str, extra: tuple[str, ...] = ()) -> str:
    """``text`` without the markup of :func:`markup_spans`.

    >>> strip_markup("42</tool_response><|im_end|>", ("<|im_end|>",))
    '42'
    """
    out, pos = [], 0
    for s, e in markup_spans(text, extra=extra):
        out.append(text[pos:s])
        pos = e
    out.append(text[pos:])
    return "".join(out)


def parse_tool_calls(text: str) -> tuple[str, list[ParsedCall]]:
    """Split ``text`` into the answer text and the calls, in order.

    Each ``<tool_call>...</tool_call>`` block outside a reasoning block must hold
    exactly one JSON object ``{"name": str, "arguments": object}`` (``parameters``
    is an alias of ``arguments``); ``arguments`` may be missing (taken as {}) or a
    JSON string holding an object. Whitespace around the object is ignored, and a
    ``</tool_call>`` inside one of its strings is text (:func:`scan_blocks`).
    Anything else yields a ``ParsedCall`` with ``error`` set and empty arguments:
    an unclosed ``<tool_call>`` (its raw text runs to the end, or to the next block),
    invalid JSON, several objects glued together, a non-object, a missing or
    non-string name, arguments of another type, or any other key. Blocks inside
    ``<think>`` are part of the reasoning and are not calls (see the module docstring).

    Returns:
        (the text with the reasoning blocks, the call blocks and any other markup
        (:func:`markup_spans`: a stray ``</tool_call>``, ``<tool_response>`` tags, a tag
        cut off at the end) removed, stripped; calls in order of appearance).
    """
    thinks, calls = scan_blocks(text)
    pieces, pos = [], 0
    for start, end in sorted([*thinks, *((s, e) for s, e, _ in calls)]) + [(len(text), len(text))]:
        for s, e in markup_spans(text, pos, start) if start > pos else []:
            pieces.append(text[pos:s])
            pos = e
        pieces.append(text[pos:start])
        pos = max(pos, end)
    return "".join(pieces).strip(), [c for _, _, c in calls]


TOOL_ERROR_PREFIX = "error: "  # how a failed call's result begins: the tool message the model reads


def tool_error_result(why: str) -> str:
    """The result of a call that failed for ``why``, as the model reads it in the tool message.

    >>> tool_error_result("unknown tool 'x'")
    "error: unknown tool 'x'"
    """
    return f"{TOOL_ERROR_PREFIX}{why}"


def is_tool_error(result: str) -> bool:
    """Whether a tool message's text (its ``<tool_response>`` tags and blank space around it
    stripped) is a failed call's result (:func:`tool_error_result`), not the tool's answer.

    >>> is_tool_error("error: arguments are not JSON"), is_tool_error("<tool_response>\\n47\\n</tool_response>")
    (True, False)
    """
    text = result.strip()
    if text.startswith(TOOL_RESPONSE_OPEN) and text.endswith(TOOL_RESPONSE_CLOSE):
        text = text[len(TOOL_RESPONSE_OPEN):-len(TOOL_RESPONSE_CLOSE)].strip()
    return text.startswith(TOOL_ERROR_PREFIX)


def _failed(call: ParsedCall, why: str) -> ToolCallRecord:
    return ToolCallRecord(
        name=call.name, arguments=call.arguments, raw=call.raw, ok=False, result=tool_error_result(why), error=why
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


def format_tool_response(record: ToolCallRecord, wrap: bool = True) -> str:
    """The content of the ``tool`` message for ``record``: ``<tool_response>\\n{result}\\n</tool_response>``,
    or the bare result when ``wrap`` is False (a template that adds those tags itself)."""
    return f"{TOOL_RESPONSE_OPEN}\n{record.result}\n{TOOL_RESPONSE_CLOSE}" if wrap else record.result
