"""Which grammar a request's decoding follows: OpenAI's ``tool_choice`` and
``response_format`` turned into a :class:`selfrl.chat.constrain.Constraint` (pure functions).

* ``tool_choice: "required"`` -> one call of any offered tool;
  ``{"type": "function", "function": {"name": N}}`` -> one call of N;
* ``response_format`` ``json_object`` / ``json_schema`` -> a JSON answer (with tools
  offered and ``tool_choice`` "auto", a tool call or that answer);
* ``tool_choice`` "none"/"auto" without a JSON format, and ``response_format: text`` ->
  no constraint.

A ``json_schema`` without ``schema`` means any JSON object. The schema is enforced
whether or not the request says ``strict`` (OpenAI only guarantees it with ``strict``).

:func:`checked_constraint` compiles the grammar and takes its first steps before any
generation (``selfrl.chat.constrain.check_constraint``); a grammar that fails is refused with
the request field it came from (``tools[i].function.parameters``,
``response_format.json_schema.schema``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from selfrl.chat.constrain import Constraint, ConstraintError, check_integer_bounds, json_constraint, tool_call_constraint


class SchemaError(ValueError):
    """A request's grammar cannot be decoded; ``param`` is the field whose schema is at fault."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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


def checked_constraint(tools: list[tuple[str, dict[str, Any]]], tool_choice: str | dict | None,
                       response_format: dict[str, Any] | None,
                       check: Callable[[Constraint], None]) -> Constraint | None:
    """:func:`request_constraint`, refused before any generation when ``check`` (for the
    serving tokenizer: ``selfrl.chat.constrain.check_constraint``) finds it cannot be decoded.

    Each schema the grammar holds is checked on its own first (the tools it may call, in
    order, then the answer schema), so the error names the field at fault and a broken
    alternative is found even where the walk of the whole grammar would take another
    branch; then the whole grammar.

    Raises:
        SchemaError: naming ``tools[i].function.parameters`` or
            ``response_format.json_schema.schema`` (``tools`` or ``response_format`` when
            each schema passes alone and only their combination fails).
    """
    constraint = request_constraint(tools, tool_choice, response_format)
    if constraint is None:
        return None
    parts: list[tuple[str, str, dict[str, Any]]] = []  # (param, label, schema)
    if constraint.kind != "json":
        only = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
        parts += [(f"tools[{i}].function.parameters", f" (tool {name!r})", params or {"type": "object"})
                  for i, (name, params) in enumerate(tools) if only is None or name == only]
    schema = answer_schema(response_format)
    if schema is not None and constraint.kind != "tool_call":
        param = "response_format.json_schema.schema" if response_format.get("type") == "json_schema" \
            else "response_format"
        parts.append((param, "", schema))
    for param, label, part in parts:
        try:
            check_integer_bounds(part)
            check(json_constraint(part))
        except ConstraintError as e:
            raise SchemaError(f"{param}{label}: {str(e).replace('the json grammar', 'the schema', 1)}", param) from e
    try:
        check(constraint)
    except ConstraintError as e:
        param = "response_format" if constraint.kind == "json" else "tools"
        raise SchemaError(f"{param}: {e}", param) from e
    return constraint
