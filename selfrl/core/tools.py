"""Tools the agent can call, and the registry that finds them by name.

A tool is a plain function from keyword arguments to a string, plus the JSON
schema of those arguments. The schema is what the model sees (see
``selfrl.chat.toolcall.render_tools_prompt``) and what ``validate_arguments`` checks
before the function runs, so a tool function only ever sees arguments of the
declared types.

Tools are registered once, explicitly, by name (``register_tool``); an unknown
name gets an error that lists the valid ones.

The built-in ``calculator`` evaluates arithmetic by walking the ``ast`` of the
expression (never ``eval``), with bounds on length, exponents and magnitudes so
that a sampled expression cannot hang or exhaust the process.
"""

from __future__ import annotations

import ast
import math
import operator
from dataclasses import dataclass
from typing import Any, Callable


class ToolError(Exception):
    """A tool call that cannot be carried out; the message is shown to the model."""


class UnknownToolError(KeyError, ValueError):
    """No tool is registered under the requested name (message lists the valid ones)."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


@dataclass
class Tool:
    """A function the agent may call.

    Attributes:
        name: the name the model writes in its call.
        description: one line telling the model what the tool does.
        parameters: JSON schema (``{"type": "object", ...}``) of the keyword arguments.
        fn: called as ``fn(**arguments)``; returns the text sent back to the model
            and raises ``ToolError`` for a bad call.
        example_arguments: arguments used in the prompt's example call, or None
            to derive placeholders from the schema.
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., str]
    example_arguments: dict[str, Any] | None = None

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI tool form: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


# ---------------------------------------------------------------- registry

_REGISTRY: dict[str, Tool] = {}


def register_tool(tool: Tool, *, replace: bool = False) -> Tool:
    """Register ``tool`` under ``tool.name`` and return it.

    Registering the same object twice is a no-op.

    Raises:
        ValueError: another tool already holds the name and ``replace`` is False.
    """
    existing = _REGISTRY.get(tool.name)
    if existing is not None and existing is not tool and not replace:
        raise ValueError(f"a tool named {tool.name!r} is already registered (pass replace=True)")
    _REGISTRY[tool.name] = tool
    return tool


def available_tools() -> list[str]:
    """Names of all registered tools, sorted."""
    return sorted(_REGISTRY)


def get_tool(name: str) -> Tool:
    """The registered tool called ``name``.

    Raises:
        UnknownToolError: (a ``KeyError`` and a ``ValueError``) when no tool has
            that name; the message lists the valid names.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        valid = ", ".join(available_tools()) or "(none)"
        raise UnknownToolError(f"unknown tool {name!r}; available tools: {valid}") from None


def resolve_tools(names: list[str]) -> list[Tool]:
    """The registered tools for ``names``, in the same order.

    Raises:
        UnknownToolError: a name is not registered.
        ValueError: a name appears twice.
    """
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"tool {name!r} listed twice")
        seen.add(name)
    return [get_tool(name) for name in names]


# ------------------------------------------------------ argument checking

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "null": lambda v: v is None,
}
JSON_TYPE_NAMES = tuple(_JSON_TYPES)
"""The ``type`` names a tool's argument schema may use (JSON Schema's seven)."""


def json_type_name(value: Any) -> str:
    """The JSON-schema type name of a parsed JSON value ("integer", "array", "null", ...).

    >>> json_type_name(True), json_type_name(1.5), json_type_name([])
    ('boolean', 'number', 'array')
    """
    for name in ("boolean", "integer", "number", "string", "object", "array", "null"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


def validate_arguments(tool: Tool, args: Any) -> None:
    """Check ``args`` against ``tool.parameters``, a small subset of JSON schema.

    Checked: ``args`` is a dict; every ``required`` key is present; each
    property's ``type`` (a name or a list of names among string, number,
    integer, boolean, object, array, null; a bool is not a number or integer,
    and ``integer`` means a Python int) and ``enum``; unknown keys when
    ``additionalProperties`` is False. Nested schemas are not descended into.

    Raises:
        ToolError: the first mismatch found, in words the model can act on.
    """
    if not isinstance(args, dict):
        raise ToolError(f"arguments for {tool.name!r} must be a JSON object, got {json_type_name(args)}")
    schema = tool.parameters
    properties: dict[str, Any] = schema.get("properties", {})
    missing = [key for key in schema.get("required", []) if key not in args]
    if missing:
        raise ToolError(f"{tool.name!r} is missing required argument(s): {', '.join(missing)}")
    if schema.get("additionalProperties") is False:
        unknown = [key for key in args if key not in properties]
        if unknown:
            raise ToolError(
                f"{tool.name!r} got unknown argument(s): {', '.join(map(str, unknown))}; "
                f"expected: {', '.join(properties) or '(none)'}"
            )
    for key, value in args.items():
        prop = properties.get(key)
        if not isinstance(prop, dict):
            continue
        expected = prop.get("type")
        if expected is not None:
            names = [expected] if isinstance(expected, str) else list(expected)
            unsupported = [n for n in names if n not in _JSON_TYPES]
            if unsupported:
                raise ValueError(f"tool {tool.name!r} schema: unsupported type(s) {unsupported}")
            if not any(_JSON_TYPES[n](value) for n in names):
                raise ToolError(
                    f"argument {key!r} of {tool.name!r} must be {' or '.join(names)}, got {json_type_name(value)}"
                )
        if "enum" in prop and value not in prop["enum"]:
            raise ToolError(f"argument {key!r} of {tool.name!r} must be one of {prop['enum']}, got {value!r}")


# ------------------------------------------------------------- calculator

MAX_EXPRESSION_CHARS = 200
"""Longest expression the calculator accepts."""
MAX_EXPONENT = 100
"""Largest absolute exponent allowed in ``**``."""
MAX_MAGNITUDE = 1e15
"""Largest absolute value of any literal, intermediate or result."""

_BINARY_OPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def _bounded(value: int | float) -> int | float:
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is too large")
    if abs(value) > MAX_MAGNITUDE:
        raise ToolError(f"number too large (limit is {MAX_MAGNITUDE:.0e} in absolute value)")
    return value


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ToolError(f"only numbers are allowed, found {node.value!r}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _bounded(_UNARY_OPS[type(node.op)](_eval_node(node.operand)))
    if isinstance(node, ast.BinOp):
        op = _BINARY_OPS.get(type(node.op))
        if op is None:
            hint = "; use ** for powers" if isinstance(node.op, ast.BitXor) else ""
            raise ToolError(f"operator {type(node.op).__name__} is not allowed{hint}")
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ToolError("division by zero")
        if isinstance(node.op, ast.Pow):
            if abs(right) > MAX_EXPONENT:
                raise ToolError(f"exponent too large (limit is {MAX_EXPONENT} in absolute value)")
            if left == 0 and right < 0:
                raise ToolError("division by zero")
        try:
            return _bounded(op(left, right))
        except OverflowError:
            raise ToolError("result is too large") from None
    if isinstance(node, ast.Name):
        raise ToolError(f"names are not allowed (found {node.id!r}); write numbers only")
    if isinstance(node, ast.Call):
        raise ToolError("function calls are not allowed")
    if isinstance(node, ast.Attribute):
        raise ToolError("attributes are not allowed")
    raise ToolError(f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses")


def format_number(value: int | float) -> str:
    """Format a calculator result: integral values without ".0", others to 15 significant digits.

    >>> format_number(2.0), format_number(3.5), format_number(0.1 + 0.2)
    ('2', '3.5', '0.3')
    """
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        return format(value, ".15g")
    return str(value)


def evaluate_expression(expression: str) -> str:
    """Evaluate an arithmetic expression safely and return the result as text.

    Allowed: int and float literals, ``+ - * / // % **``, unary ``+ -`` and
    parentheses. Integral results print without ".0" (``"6/3"`` -> ``"2"``).

    Raises:
        ToolError: not a string, empty, longer than ``MAX_EXPRESSION_CHARS``,
            a syntax error, anything other than numbers and those operators
            (names, calls, attributes, strings), division by zero, an exponent
            above ``MAX_EXPONENT``, or a number above ``MAX_MAGNITUDE``.
    """
    if not isinstance(expression, str):
        raise ToolError("expression must be a string")
    expression = expression.strip()
    if not expression:
        raise ToolError("expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is too long ({len(expression)} chars, limit {MAX_EXPRESSION_CHARS})")
    try:
        tree = ast.parse(expression, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        msg = e.msg if isinstance(e, SyntaxError) else type(e).__name__
        raise ToolError(f"invalid expression: {msg}") from None
    try:
        return format_number(_eval_node(tree.body))
    except RecursionError:
        raise ToolError("expression is nested too deeply") from None


CALCULATOR = register_tool(
    Tool(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (3+4)*5"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=evaluate_expression,
        example_arguments={"expression": "2*(3+4)"},
    )
)
"""The built-in calculator tool, registered as ``"calculator"``."""
