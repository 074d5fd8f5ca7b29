"""The sampled text of a turn as OpenAI returns it: ``content``, ``reasoning_content`` and
``tool_calls`` (:func:`split_completion`), the one rule for every response, streamed or not.

The other way, a request's messages to the chat the model sees, is :mod:`selfrl.serve.protocol`
(which re-exports these names). Tool calls are Hermes-style ``<tool_call>{...}</tool_call>``
blocks (:mod:`selfrl.chat.toolcall`); a call that parsed and names an offered tool becomes an
OpenAI tool call with a fresh id, everything else stays text, and markup never reaches the content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from selfrl.chat.toolcall import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, markup_spans, scan_blocks, split_reasoning, strip_markup,
                                 tool_error_result)
from selfrl.core.tools import Tool, ToolError, validate_arguments
from selfrl.core.trajectory import ToolCallRecord

__all__ = ["Completion", "new_call_id", "parse_completion", "split_completion"]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class Completion:
    """Sampled text split into what OpenAI returns.

    Attributes:
        content: the answer text, or None when empty.
        reasoning: the reasoning blocks' text (``reasoning_content``), or None.
        tool_calls: OpenAI tool-call dicts (id, type, function name, arguments as JSON).
        records: a :class:`ToolCallRecord` per attempted call (for the trajectory).
        spans: character spans ``[start, end)`` of the sampled text that make up
            ``content``, in order: ``content == "".join(text[s:e] for s, e in spans)``
            (used to give logprobs only for the tokens of the content).
    """

    content: str | None
    reasoning: str | None
    tool_calls: list[dict[str, Any]]
    records: list[ToolCallRecord]
    spans: list[tuple[int, int]]


def _complement(length: int, removed: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out, pos = [], 0
    for start, end in sorted(removed):
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    if pos < length:
        out.append((pos, length))
    return out


def _strip_spans(text: str, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` without the whitespace at the start of the first and the end of the last."""
    spans = list(spans)
    while spans:
        s, e = spans[0]
        s += len(text[s:e]) - len(text[s:e].lstrip())
        if s < e:
            spans[0] = (s, e)
            break
        spans.pop(0)
    while spans:
        s, e = spans[-1]
        e -= len(text[s:e]) - len(text[s:e].rstrip())
        if s < e:
            spans[-1] = (s, e)
            break
        spans.pop()
    return spans


def split_completion(text: str, tools: list[Tool], control: tuple[str, ...] = ()) -> Completion:
    """Split sampled text into OpenAI ``content``, ``reasoning_content`` and ``tool_calls``.

    The rule (one for every request, streamed or not):

    * reasoning blocks (``<think>...</think>``, see ``selfrl.chat.toolcall``) go to
      ``reasoning``, never to ``content``; a call drafted inside one is not a call;
    * a ``<tool_call>`` block that parsed and names one of ``tools`` is returned in
      ``tool_calls`` (its arguments are checked against the tool's schema; a mismatch
      is recorded as a failed call but still returned, since the client runs the tool
      and reports the error back). A ``</tool_call>`` inside one of its JSON strings
      does not end the block (``selfrl.chat.toolcall.scan_blocks``);
    * a block cut off before its ``</tool_call>`` (the ``max_tokens`` limit, or an end
      token inside it) while tools are offered is dropped whole: the partial call is
      neither a call nor content (recorded as a failed call). With
      ``tool_choice: "required"`` or a named function and a tiny ``max_tokens`` the
      answer is then empty content, no ``tool_calls``, ``finish_reason: "length"``;
    * any other block (malformed, an unknown tool, or no tools offered, which is the
      case under ``tool_choice: "none"``) is not a call: it is returned as plain text,
      the text between its tags, in place;
    * markup never reaches ``content`` or ``reasoning``: every tag of the call format
      (``selfrl.chat.toolcall.MARKUP_TAGS``: ``<tool_call>``, ``<tool_response>``,
      ``<think>``, ``<tools>`` and their closing tags), each of ``control`` (the
      template's control-token text, ``<|im_end|>``, written out as plain text) and a
      tag cut off at the very end (``<tool_``, ``</tool_respo``, ``<|im_``) are removed,
      the text between them stays;
    * ``content`` is what remains, without leading or trailing whitespace (None when nothing
      does; the response's message has ``""`` then, unless it has tool calls:
      :meth:`selfrl.serve.turns.Turns.finish`).
    """
    by_name = {t.name: t for t in tools}
    thinks, blocks = scan_blocks(text)
    removed = list(thinks)
    out: list[dict[str, Any]] = []
    records: list[ToolCallRecord] = []
    for start, end, c in blocks:
        if c.error is None and c.name in by_name:
            err = None
            try:
                validate_arguments(by_name[c.name], c.arguments)
            except (ToolError, ValueError) as e:
                err = str(e)
            records.append(ToolCallRecord(c.name, c.arguments, c.raw, err is None, "", err))
            out.append({"id": new_call_id(), "type": "function",
                        "function": {"name": c.name, "arguments": json.dumps(c.arguments)}})
            removed.append((start, end))
            continue
        closed = (end - len(TOOL_CALL_CLOSE) >= start + len(TOOL_CALL_OPEN)
                  and text.startswith(TOOL_CALL_CLOSE, end - len(TOOL_CALL_CLOSE)))
        if tools:
            why = c.error or f"unknown tool {c.name!r}; valid tools: {', '.join(sorted(by_name))}"
            records.append(ToolCallRecord(c.name, c.arguments, c.raw, False, tool_error_result(why), why))
            if not closed:  # a call cut off (by max_tokens, or an end token): not a call, and not text either
                removed.append((start, end))
                continue
        removed.append((start, start + len(TOOL_CALL_OPEN)))  # the tags go, the text between them stays
        if closed:
            removed.append((end - len(TOOL_CALL_CLOSE), end))
    stray = [span for s, e in _complement(len(text), removed) for span in markup_spans(text, s, e, control)]
    spans = _strip_spans(text, _complement(len(text), removed + stray))
    content = "".join(text[s:e] for s, e in spans)
    reasoning = strip_markup(split_reasoning(text)[0], control).strip()
    return Completion(content or None, reasoning or None, out, records, spans)


def parse_completion(text: str, tools: list[Tool]) -> tuple[str | None, list[dict[str, Any]], list[ToolCallRecord]]:
    """``(content, tool_calls, records)`` of :func:`split_completion`."""
    c = split_completion(text, tools)
    return c.content, c.tool_calls, c.records
