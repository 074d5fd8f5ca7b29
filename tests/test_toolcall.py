import json
import math

import pytest

from selfrl.chat.toolcall import (
    json_number_ok,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedCall,
    execute_call,
    format_tool_response,
    parse_tool_calls,
    render_tools_prompt,
)
from selfrl.core.tools import CALCULATOR, Tool, ToolError
from selfrl.core.trajectory import ToolCallRecord


class Spy:
    """A tool function that records every call it receives."""

    def __init__(self, output="spied", exc=None):
        self.calls = []
        self.output = output
        self.exc = exc

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if self.exc is not None:
            raise self.exc
        return self.output


def spy_tool(name="spy", **spy_kwargs):
    spy = Spy(**spy_kwargs)
    tool = Tool(
        name=name,
        description="records calls",
        parameters={
            "type": "object",
            "properties": {"x": {"type": "integer"}},
            "required": [],
            "additionalProperties": False,
        },
        fn=spy,
    )
    return tool, spy


def call_block(obj) -> str:
    return f"{TOOL_CALL_OPEN}{obj if isinstance(obj, str) else json.dumps(obj)}{TOOL_CALL_CLOSE}"


# ------------------------------------------------------------------ prompt


def test_render_tools_prompt():
    prompt = render_tools_prompt([CALCULATOR])
    start, end = prompt.index("<tools>\n") + len("<tools>\n"), prompt.index("\n</tools>")
    assert json.loads(prompt[start:end]) == CALCULATOR.openai_schema()
    example = prompt.split("Example: ", 1)[1].split("\n", 1)[0]
    _, calls = parse_tool_calls(example)
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "2*(3+4)"}, None)]
    assert "<tool_response>" in prompt
    assert len(prompt) < 800
    assert render_tools_prompt([]) == ""


def test_render_tools_prompt_placeholder_example():
    tool = Tool("t", "d", {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}, str)
    assert 'Example: <tool_call>{"name": "t", "arguments": {"q": "..."}}</tool_call>' in render_tools_prompt([tool])


# ------------------------------------------------------------------ parsing


def test_parse_several_calls_in_order_and_remaining_text():
    text = (
        "Let me compute.\n"
        + call_block({"name": "calculator", "arguments": {"expression": "1+1"}})
        + "\nand\n"
        + f'{TOOL_CALL_OPEN}\n  {{"name": "spy", "arguments": {{"x": 2}}}}  \n{TOOL_CALL_CLOSE}'
        + "\n"
    )
    remaining, calls = parse_tool_calls(text)
    assert remaining == "Let me compute.\n\nand"
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+1"}, None),
        ("spy", {"x": 2}, None),
    ]
    assert calls[1].raw == '\n  {"name": "spy", "arguments": {"x": 2}}  \n'


def test_parse_no_calls():
    assert parse_tool_calls("  The answer is 42.\n") == ("The answer is 42.", [])


def test_parse_arguments_missing_or_as_json_string():
    _, calls = parse_tool_calls(call_block({"name": "spy"}) + call_block({"name": "spy", "arguments": '{"x": 1}'}))
    assert [(c.name, c.arguments, c.error) for c in calls] == [("spy", {}, None), ("spy", {"x": 1}, None)]


@pytest.mark.parametrize("body, why", [
    ('{"name": "add", "arguments": {"a": 1e434, "b": 0}}', "invalid JSON in <tool_call>: the number 1e434 is beyond a double's range"),
    ('{"name": "add", "arguments": {"a": Infinity}}', "invalid JSON in <tool_call>: Infinity is not a JSON number"),
    ('{"name": "add", "arguments": {"a": [-Infinity]}}', "invalid JSON in <tool_call>: -Infinity is not a JSON number"),
    ('{"name": "add", "arguments": {"a": NaN}}', "invalid JSON in <tool_call>: NaN is not a JSON number"),
    ('{"name": "add", "arguments": "{\\"a\\": -1e999}"}', '"arguments" string is not valid JSON: the number -1e999 is beyond a double\'s range'),
    # an integer literal too: a reader that holds numbers as doubles (JavaScript) takes it as an infinity
    ('{"name": "add", "arguments": {"a": -' + "9" * 400 + '}}', "invalid JSON in <tool_call>: the number -" + "9" * 19 + "... is beyond a double's range"),
    # 5,000 digits: past int()'s own limit of 4,300, still a number beyond a double, not "not JSON"
    ('{"name": "add", "arguments": {"a": 1' + "0" * 5000 + '}}', "invalid JSON in <tool_call>: the number 1" + "0" * 19 + "... is beyond a double's range"),
])
def test_a_call_whose_numbers_json_cannot_carry_is_no_call(body, why):
    # a grammar lets the model write 1e434; parsed, it is an infinity that json.dumps writes as
    # Infinity, which no strict JSON reader takes: such a call never reaches a client or a tool
    _, [call] = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error == why and call.arguments == {}
    _, [ok] = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1e2, "b": 11403917163434172561256176225}}</tool_call>')
    assert ok.error is None and json.loads(json.dumps(ok.arguments)) == {"a": 100.0, "b": 11403917163434172561256176225}


def test_parse_unclosed_call():
    text = 'ok ' + call_block({"name": "spy"}) + ' then <tool_call>{"name": "spy", "arguments": {}'
    remaining, calls = parse_tool_calls(text)
    assert remaining == "ok  then"
    assert calls[0].error is None
    assert calls[1] == ParsedCall("", {}, '{"name": "spy", "arguments": {}', "unclosed <tool_call>")


@pytest.mark.parametrize(
    "body, reason",
    [
        ('{"name": "spy", "arguments": {"x": 1}', "invalid JSON"),
        ("{'name': 'spy'}", "invalid JSON"),
        (
            '{"name":"spy","arguments":{"x":1}}{"name":"spy","arguments":{"x":2}}',
            "expected one JSON object, found extra data",
        ),
        ('{"name":"spy","arguments":{}} trailing', "expected one JSON object, found extra data"),
        ('[{"name": "spy"}]', "expected a JSON object, found array"),
        ('"spy"', "expected a JSON object, found string"),
        ('{"arguments": {"x": 1}}', 'missing "name"'),
        ('{"name": 3}', '"name" must be a non-empty string'),
        ('{"name": ""}', '"name" must be a non-empty string'),
        ('{"name": "spy", "arguments": [1]}', '"arguments" must be a JSON object, found array'),
        ('{"name": "spy", "arguments": null}', '"arguments" must be a JSON object, found null'),
        ('{"name": "spy", "arguments": "[1]"}', '"arguments" must be a JSON object, found array'),
        ('{"name": "spy", "arguments": "x=1"}', '"arguments" string is not valid JSON'),
        ("  \n ", "empty <tool_call>"),
    ],
)
def test_malformed_calls_fail_without_running_the_tool(body, reason):
    tool, spy = spy_tool()
    _, calls = parse_tool_calls("before" + call_block(body) + "after")
    assert len(calls) == 1
    assert reason in calls[0].error
    assert calls[0].arguments == {}
    assert calls[0].raw == body
    record = execute_call(calls[0], [tool])
    assert record.ok is False
    assert reason in record.error
    assert record.result == f"error: {record.error}"
    assert spy.calls == []


def test_unclosed_call_is_not_executed():
    tool, spy = spy_tool()
    _, calls = parse_tool_calls('<tool_call>{"name": "spy", "arguments": {"x": 1}}')
    record = execute_call(calls[0], {"spy": tool})
    assert (record.ok, record.error) == (False, "unclosed <tool_call>")
    assert spy.calls == []


# ------------------------------------------------------------------ execution


def test_execute_success():
    tool, spy = spy_tool(output="done")
    record = execute_call(ParsedCall("spy", {"x": 3}, '{"name": "spy"}', None), [tool])
    assert record == ToolCallRecord(name="spy", arguments={"x": 3}, raw='{"name": "spy"}', ok=True, result="done")
    assert spy.calls == [{"x": 3}]


def test_execute_calculator_end_to_end():
    text = call_block({"name": "calculator", "arguments": {"expression": "17+25"}})
    _, calls = parse_tool_calls(text)
    record = execute_call(calls[0], [CALCULATOR])
    assert (record.ok, record.result, record.error) == (True, "42", None)
    assert format_tool_response(record) == "<tool_response>\n42\n</tool_response>"


def test_execute_calculator_tool_error():
    record = execute_call(ParsedCall("calculator", {"expression": "1/0"}, "", None), [CALCULATOR])
    assert (record.ok, record.error, record.result) == (False, "division by zero", "error: division by zero")
    assert format_tool_response(record) == "<tool_response>\nerror: division by zero\n</tool_response>"


def test_execute_unknown_tool_lists_valid_ones():
    tool, spy = spy_tool()
    record = execute_call(ParsedCall("search", {}, "", None), [tool, CALCULATOR])
    assert record.ok is False
    assert record.error == "unknown tool 'search'; valid tools: calculator, spy"
    assert spy.calls == []


@pytest.mark.parametrize(
    "args, reason",
    [
        ({"x": "1"}, "must be integer, got string"),
        ({"x": True}, "must be integer, got boolean"),
        ({"y": 1}, "unknown argument"),
    ],
)
def test_execute_schema_mismatch_does_not_run_tool(args, reason):
    tool, spy = spy_tool()
    record = execute_call(ParsedCall("spy", args, "", None), [tool])
    assert record.ok is False and reason in record.error
    assert record.arguments == args
    assert spy.calls == []


@pytest.mark.parametrize(
    "exc, reason",
    [(ToolError("bad input"), "bad input"), (RuntimeError("boom"), "'spy' failed: RuntimeError: boom")],
)
def test_execute_tool_raising_is_recorded(exc, reason):
    tool, spy = spy_tool(exc=exc)
    record = execute_call(ParsedCall("spy", {"x": 1}, "", None), [tool])
    assert (record.ok, record.error, record.result) == (False, reason, f"error: {reason}")
    assert spy.calls == [{"x": 1}]


def test_execute_non_string_output_is_an_error():
    tool, _ = spy_tool(output=42)
    record = execute_call(ParsedCall("spy", {}, "", None), [tool])
    assert record.ok is False and "returned int, expected str" in record.error


DRAFT = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*25"}}</tool_call>'
REAL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>'


@pytest.mark.parametrize("text", [
    f"<think>maybe {DRAFT}? no.</think>{REAL}",
    f"maybe {DRAFT}? no.</think>{REAL}",  # the template opened the block in the prompt (Qwen3)
    f"<think>a</think> <think>maybe {DRAFT}</think>\n{REAL}",
])
def test_a_call_drafted_inside_a_reasoning_block_is_not_a_call(text):
    rest, calls = parse_tool_calls(text)
    assert [c.arguments for c in calls] == [{"expression": "17+25"}] and rest == ""


def test_an_unclosed_reasoning_block_holds_every_call_after_it():
    rest, calls = parse_tool_calls(f"Let me think. <think>{REAL}")
    assert calls == [] and rest == "Let me think."


def test_parameters_is_an_alias_of_arguments():
    tool, spy = spy_tool()
    _, (call,) = parse_tool_calls(call_block({"name": "spy", "parameters": {"x": 1}}))
    assert call.error is None and call.arguments == {"x": 1}
    assert execute_call(call, [tool]).ok and spy.calls == [{"x": 1}]


@pytest.mark.parametrize("body, why", [
    ({"name": "spy", "args": {"x": 1}}, "unexpected key"),
    ({"name": "spy", "input": {"x": 1}}, "unexpected key"),
    ({"name": "spy", "arguments": {"x": 1}, "id": "call_1"}, "unexpected key"),
    ({"name": "spy", "arguments": {"x": 1}, "parameters": {"x": 2}}, "both"),
    ({"name": "spy", "parameters": "[1]"}, "must be a JSON object"),
])
def test_any_other_key_makes_the_call_malformed_and_the_tool_never_runs(body, why):
    tool, spy = spy_tool()
    _, (call,) = parse_tool_calls(call_block(body))
    record = execute_call(call, [tool])
    assert why in call.error and not record.ok and spy.calls == []


# ------------------------------------------------------------------ tags inside JSON strings


WRITE = {"name": "write_file", "arguments": {"path": "a.md", "content": "x </tool_call> y"}}


@pytest.mark.parametrize("content", [
    "x </tool_call> y",
    'q \\" </tool_call> "still a string"',  # escaped quotes around the tag
    "an <tool_call> opening tag, then </tool_call>",
    "braces { } {{ ]] inside </tool_call> the string",
    "<think>not a thought</think> and a stray </think>",
    "</tool_call>",
])
def test_a_closing_tag_inside_a_json_string_does_not_end_the_call(content):
    body = {"name": "write_file", "arguments": {"path": "a.md", "content": content}}
    rest, calls = parse_tool_calls("Writing it. " + call_block(body) + " Done.")
    assert [(c.name, c.arguments, c.error) for c in calls] == [("write_file", body["arguments"], None)]
    assert rest == "Writing it.  Done."


def test_two_calls_in_one_turn_each_with_the_closing_tag_in_a_string():
    second = {"name": "write_file", "arguments": {"path": "b.md", "content": "<tool_call>{}</tool_call>"}}
    rest, calls = parse_tool_calls(call_block(WRITE) + "\n" + call_block(second))
    assert [c.arguments for c in calls] == [WRITE["arguments"], second["arguments"]] and rest == ""
    assert all(c.error is None for c in calls)


def test_a_tag_inside_a_call_string_opens_no_reasoning_block():
    for tag in ("<think>", "</think>"):
        body = {"name": "write_file", "arguments": {"path": "a.md", "content": f"{tag} x"}}
        rest, calls = parse_tool_calls(call_block(body) + " The file is written.")
        assert [c.arguments for c in calls] == [body["arguments"]] and rest == "The file is written."


def test_invalid_json_still_ends_at_its_closing_tag_and_keeps_the_text_after():
    # an unbalanced quote: the tag after it counts, so the text after the block is not swallowed
    rest, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"s": "a"b"}}</tool_call> The answer is 4.')
    assert rest == "The answer is 4." and len(calls) == 1 and "invalid JSON" in calls[0].error


def test_an_unclosed_call_ends_where_the_next_call_opens():
    rest, calls = parse_tool_calls('<tool_call>{"name": "spy", "arguments": {"x": ' + call_block({"name": "spy"}))
    assert [(c.name, c.error) for c in calls] == [("", "unclosed <tool_call>"), ("spy", None)] and rest == ""


def test_a_call_cut_inside_a_string_holding_the_closing_tag_is_unclosed():
    rest, calls = parse_tool_calls('<tool_call>{"name": "write_file", "arguments": {"content": "x </tool_call> y')
    # the text is invalid JSON either way; the first tag counts (no string of it ever ended)
    assert len(calls) == 1 and calls[0].error is not None and calls[0].name == ""


@pytest.mark.parametrize("text, rest", [
    ("42 <tool_response>\n42\n</tool_response>", "42 \n42"),
    ("a </tool_call> b <tools></tools>", "a  b"),
    ("<think>t</think>x </think>y", "x y"),  # a closing tag after the block is a stray tag
    ("The answer is 4 <tool_resp", "The answer is 4"),
    ("The answer is 4</tool_c", "The answer is 4"),
])
def test_no_markup_reaches_the_answer_text(text, rest):
    assert parse_tool_calls(text) == (rest, [])


def test_a_closing_think_tag_inside_a_drafted_calls_string_does_not_end_the_thought():
    draft = call_block({"name": "spy", "arguments": {"note": "</think> is a tag"}})
    rest, calls = parse_tool_calls(f"<think>maybe {draft}? no.</think>The answer is 4.")
    assert calls == [] and rest == "The answer is 4."


def test_json_number_ok_is_the_one_rule_of_the_decoder_and_the_server():
    from selfrl.serve.errors import non_finite_path

    big = 10 ** 309  # past a double's largest, about 1.8e308
    # an integer a reader rounds to the largest double is carried; the halfway point rounds to infinity
    cases = [(0, True), (-3.5, True), (1.7e308, True), (10 ** 308, True), (2 ** 1024 - 2 ** 970 - 1, True),
             (2 ** 1024 - 2 ** 970, False), (big, False), (-big, False),
             (float("nan"), False), (float("inf"), False), (-float("inf"), False)]
    assert [json_number_ok(x) for x, _ in cases] == [ok for _, ok in cases]
    for x, ok in cases:  # the server's check of decoded values agrees with the predicate
        assert non_finite_path({"a": [x]}) == (None if ok else ".a[0]")
    assert non_finite_path({"a": True}) is None  # a bool is not a number here
    # before: ".a.b[0]", which reads as key a, key b, item 0
    assert non_finite_path({"a.b[0]": math.nan}) == '["a.b[0]"]'
    assert non_finite_path({"x": {"has space": [1, math.inf]}}) == '.x["has space"][1]'
    assert non_finite_path({"x-default": {"é": math.nan}}) == ".x-default.é"  # nothing to mistake: as written
    assert non_finite_path({"": [math.nan]}) == '[""][0]'
    # before: a zero-width space read as the empty key ([""]), and a key ending in a backslash as an escaped dot
    assert non_finite_path({"\u200b": math.nan}) == '["\\u200b"]'
    assert non_finite_path({"a\\": {"b": math.nan}}) == '["a\\\\"].b'
    assert non_finite_path({"me\u0301te\u0301o": math.nan}) == '["me\\u0301te\\u0301o"]'  # not the key "météo"
    # a letter that draws nothing, and one NFC replaces (the Kelvin sign reads as K)
    assert non_finite_path({"\u115fa": math.nan}) == '["\\u115fa"]'
    assert non_finite_path({"\u212a.": math.nan}) == '["\\u212a."]' != non_finite_path({"K.": math.nan})
