import pytest

from selfrl.core.tools import (
    CALCULATOR,
    MAX_EXPRESSION_CHARS,
    Tool,
    ToolError,
    UnknownToolError,
    available_tools,
    evaluate_expression,
    format_number,
    get_tool,
    register_tool,
    resolve_tools,
    validate_arguments,
)


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("17+25", "42"),
        ("2**10", "1024"),
        ("(3+4)*5", "35"),
        ("7/2", "3.5"),
        ("6/3", "2"),
        ("-3 - -4", "1"),
        ("  1 + 1\n", "2"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("2**-1", "0.5"),
        ("+4", "4"),
        ("1.5*2", "3"),
        ("0.1+0.2", "0.3"),
        ("1/3", "0.333333333333333"),
        ("10**15", "1000000000000000"),
    ],
)
def test_calculator_values(expression, expected):
    assert evaluate_expression(expression) == expected
    assert CALCULATOR.fn(expression=expression) == expected


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("__import__('os')", "function calls are not allowed"),
        ("a+1", "names are not allowed"),
        ("(1).real", "attributes are not allowed"),
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("1%0.0", "division by zero"),
        ("0**-1", "division by zero"),
        ("9**9**9", "exponent too large"),
        ("2**101", "exponent too large"),
        ('"x"*3', "only numbers are allowed"),
        ("True+1", "only numbers are allowed"),
        ("1j", "only numbers are allowed"),
        ("10**16", "number too large"),
        ("1e308*10", "number too large"),
        ("99999999**2*99999999", "number too large"),
        ("(-8)**0.5", "not a real number"),
        ("2^3", "use ** for powers"),
        ("1 < 2", "not allowed"),
        ("[1]", "not allowed"),
        ("1 +", "invalid expression"),
        ("", "expression is empty"),
        ("1+" * 100 + "1", "too long"),
    ],
)
def test_calculator_rejects(expression, reason):
    with pytest.raises(ToolError, match=reason.replace("*", r"\*")):
        evaluate_expression(expression)


def test_calculator_length_limit_is_inclusive():
    expr = "1+" * ((MAX_EXPRESSION_CHARS - 1) // 2) + "1"
    assert len(expr) <= MAX_EXPRESSION_CHARS
    assert evaluate_expression(expr) == str(expr.count("1"))


def test_calculator_deep_nesting_within_length_limit():
    assert evaluate_expression("(" * 99 + "1" + ")" * 99) == "1"
    assert evaluate_expression("-" * 199 + "1") == "-1"
    assert evaluate_expression("1**" * 66 + "2") == "1"


def test_format_number():
    assert format_number(2.0) == "2"
    assert format_number(-0.0) == "0"
    assert format_number(7) == "7"
    assert format_number(3.25) == "3.25"


def test_openai_schema():
    schema = CALCULATOR.openai_schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert schema["function"]["parameters"]["additionalProperties"] is False


def test_registry_lookup_and_errors():
    assert "calculator" in available_tools()
    assert get_tool("calculator") is CALCULATOR
    with pytest.raises(KeyError, match="available tools: .*calculator"):
        get_tool("nope")
    with pytest.raises(ValueError, match="unknown tool 'nope'"):
        get_tool("nope")
    assert str(UnknownToolError("plain")) == "plain"
    assert resolve_tools(["calculator"]) == [CALCULATOR]
    with pytest.raises(ValueError, match="twice"):
        resolve_tools(["calculator", "calculator"])


def test_register_refuses_silent_replacement():
    register_tool(CALCULATOR)  # same object again: no-op
    other = Tool("calculator", "other", {"type": "object"}, lambda: "x")
    with pytest.raises(ValueError, match="already registered"):
        register_tool(other)
    assert get_tool("calculator") is CALCULATOR


TYPED = Tool(
    name="typed",
    description="test tool",
    parameters={
        "type": "object",
        "properties": {
            "s": {"type": "string"},
            "n": {"type": "number"},
            "i": {"type": "integer"},
            "b": {"type": "boolean"},
            "o": {"type": "object"},
            "a": {"type": "array"},
            "maybe": {"type": ["string", "null"]},
            "mode": {"type": "string", "enum": ["fast", "slow"]},
        },
        "required": ["s"],
    },
    fn=lambda **kw: "ok",
)


def test_validate_accepts_good_arguments():
    # validate_arguments returns None on success and raises ToolError otherwise
    assert validate_arguments(TYPED, {"s": "x", "n": 1.5, "i": 3, "b": False, "o": {}, "a": [1], "maybe": None}) is None
    assert validate_arguments(TYPED, {"s": "x", "n": 2, "mode": "fast", "extra": 1}) is None  # additionalProperties not false
    assert validate_arguments(CALCULATOR, {"expression": "1+1"}) is None


@pytest.mark.parametrize(
    "args, reason",
    [
        ([1, 2], "must be a JSON object, got array"),
        ("1+1", "must be a JSON object, got string"),
        ({}, "missing required argument"),
        ({"s": 1}, "'s' of 'typed' must be string, got integer"),
        ({"s": "x", "n": "1"}, "must be number, got string"),
        ({"s": "x", "n": True}, "must be number, got boolean"),
        ({"s": "x", "i": True}, "must be integer, got boolean"),
        ({"s": "x", "i": 1.0}, "must be integer, got number"),
        ({"s": "x", "b": 1}, "must be boolean, got integer"),
        ({"s": "x", "o": []}, "must be object, got array"),
        ({"s": "x", "a": {}}, "must be array, got object"),
        ({"s": "x", "maybe": 3}, "must be string or null"),
        ({"s": "x", "mode": "medium"}, "must be one of"),
    ],
)
def test_validate_rejects(args, reason):
    with pytest.raises(ToolError, match=reason):
        validate_arguments(TYPED, args)


def test_validate_rejects_unknown_keys_for_calculator():
    with pytest.raises(ToolError, match="unknown argument.*expr.*expected: expression"):
        validate_arguments(CALCULATOR, {"expression": "1", "expr": "2"})
    with pytest.raises(ToolError, match="missing required argument.*expression"):
        validate_arguments(CALCULATOR, {"expr": "2"})
