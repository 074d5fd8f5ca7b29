"""Which grammar a request's decoding follows: OpenAI's ``tool_choice`` and
``response_format`` turned into a :class:`selfrl.constrain.Constraint` (pure functions).

* ``tool_choice: "required"`` -> one call of any offered tool;
  ``{"type": "function", "function": {"name": N}}`` -> one call of N;
* ``response_format`` ``json_object`` / ``json_schema`` -> a JSON answer (with tools
  offered and ``tool_choice`` "auto", a tool call or that answer);
* ``tool_choice`` "none"/"auto" without a JSON format, and ``response_format: text`` ->
  no constraint.

A ``json_schema`` without ``schema`` means any JSON object. The schema is enforced
whether or not the request says ``strict`` (OpenAI only guarantees it with ``strict``).
"""

from __future__ import annotations

from typing import Any

from selfrl.constrain import Constraint, json_constraint, tool_call_constraint


def answer_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """The JSON schema a ``response_format`` asks for, or None for free text.

    >>> answer_schema({"type": "json_object"})
    {'type': 'object'}
    >>> answer_schema({"type": "text"}) is None
    True
    """
    if not response_format or response_format.get("type") == "text":
        return None
    if response_format["type"] == "json_object":
        return {"type": "object"}
    return response_format.get("json_schema", {}).get("schema") or {"type": "object"}


def request_constraint(tools: list[tuple[str, dict[str, Any]]], tool_choice: str | dict | None,
                       response_format: dict[str, Any] | None) -> Constraint | None:
    """The grammar for a request, or None when its decoding is free.

    Args:
        tools: ``(name, parameters schema)`` per offered tool.
        tool_choice: as validated by ``ChatCompletionRequest`` (None, "none", "auto",
            "required" or ``{"type": "function", "function": {"name": ...}}``).
        response_format: as validated by ``ChatCompletionRequest``.

    >>> request_constraint([], None, None) is None
    True
    >>> request_constraint([("add", {})], "required", None).kind
    'tool_call'
    >>> request_constraint([("add", {})], "auto", {"type": "json_object"}).kind
    'tool_call_or_json'
    >>> request_constraint([("add", {})], "none", {"type": "json_object"}).kind
    'json'
    """
    schema = answer_schema(response_format)
    if tools and tool_choice == "required":
        return tool_call_constraint(tools)
    if tools and isinstance(tool_choice, dict):
        return tool_call_constraint(tools, tool_choice["function"]["name"])
    if schema is None:
        return None
    if tools and tool_choice in (None, "auto"):
        return tool_call_constraint(tools, answer_schema=schema)
    return json_constraint(schema)
