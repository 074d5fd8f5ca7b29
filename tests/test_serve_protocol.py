"""OpenAI messages <-> the model's chat, completion parsing, and the server's records."""

import json
import re
import sqlite3

import pytest
from pydantic import ValidationError

from selfrl.record import served as records
from selfrl.serve.protocol import ChatCompletionRequest, parse_completion, to_chat, client_tools
from selfrl.record.store import Store
from selfrl.core.trajectory import Trajectory
from serving import CALC


def req(**kw):
    return ChatCompletionRequest(model="m", **kw)


def test_tool_turns_become_the_text_the_model_was_taught():
    r = req(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "17+"}, {"type": "text", "text": "25?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "17+25"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ], tools=[CALC])
    chat = to_chat(r, native_tools=False)
    assert chat[0]["role"] == "system" and chat[0]["content"].startswith("Be brief.\n\nTools:\n- calculator(expression: string)")
    assert chat[1] == {"role": "user", "content": "17+25?"}
    assert chat[2] == {"role": "assistant",
                       "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>'}
    assert chat[3] == {"role": "tool", "content": "<tool_response>\n42\n</tool_response>"}
    assert to_chat(r, native_tools=True)[0] == {"role": "system", "content": "Be brief."}  # the template shows tools
    none = req(messages=[{"role": "user", "content": "x"}], tools=[CALC], tool_choice="none")
    assert to_chat(none, native_tools=False) == [{"role": "user", "content": "x"}]


def test_images_are_refused_not_dropped():
    r = req(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(ValueError, match="only text"):
        to_chat(r, native_tools=False)


def test_parse_completion_returns_openai_tool_calls():
    tools = client_tools([ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                                "tools": [CALC]}).tools[0]])
    content, calls, recs = parse_completion(
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>', tools)
    assert content == "Let me compute." and len(calls) == 1
    assert calls[0]["type"] == "function" and json.loads(calls[0]["function"]["arguments"]) == {"expression": "1+1"}
    assert recs[0].ok
    # wrong argument type: still returned (the client runs the tool), recorded as failed
    _, calls, recs = parse_completion('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>', tools)
    assert len(calls) == 1 and not recs[0].ok and "expression" in recs[0].error
    # unknown tool or broken JSON: not a call; the text between the tags stays visible to the
    # agent, the internal markup does not
    text = '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'
    content, calls, recs = parse_completion(text, tools)
    assert calls == [] and content == '{"name": "weather", "arguments": {}}' and not recs[0].ok
    content, calls, recs = parse_completion("<tool_call>{oops</tool_call>", tools)
    assert calls == [] and content == "{oops" and recs[0].error
    assert parse_completion("<tool_call>{}</tool_call>", []) == ("{}", [], [])  # no tools offered
    # a call cut off before </tool_call> (max_tokens) while tools are offered: neither a call nor content
    content, calls, recs = parse_completion('Sure. <tool_call>\n{"name": "calcu', tools)
    assert (content, calls) == ("Sure.", []) and recs[0].error == "unclosed <tool_call>"
    assert parse_completion('<tool_call>{"name": "calcu', tools)[:2] == (None, [])
    # with no tools offered (tool_choice "none") it stays text, as every block does
    assert parse_completion('<tool_call>{"name": "calcu', []) == ('{"name": "calcu', [], [])
    # a tag cut off at the end is markup as well, with tools or without
    assert parse_completion("The sum is <tool_", tools)[0] == "The sum is"
    assert parse_completion('<tool_call>{"a": 1}</tool_c', [])[0] == '{"a": 1}'
    assert parse_completion("<", tools)[:2] == (None, [])


@pytest.mark.parametrize("bad", [
    {"temperature": 3}, {"temperature": 1e-300}, {"temperature": 5e-5}, {"n": 0}, {"top_p": 0}, {"stop": ["a", "b", "c", "d", "e"]}, {"tool_choice": "always"},
    {"unknown_field": 1}, {"messages": []},
])
def test_request_validation(bad):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **bad}
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate(body)


def test_temperature_zero_is_greedy_and_the_smallest_sampling_one_is_allowed():
    for t in (0, 1e-4, 2):
        body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": t}
        assert ChatCompletionRequest.model_validate(body).temperature == t
    with pytest.raises(ValidationError, match="temperature must be 0 \\(greedy\\) or at least 0.0001"):
        ChatCompletionRequest.model_validate({**body, "temperature": 1e-300})


def turn(store, run_id, tid, response_id, parent=None, key="k"):
    t = Trajectory(task_id="g", group_id="g", adapter_version=0, id=tid, parent_id=parent,
                   token_ids=[1, 2], completion_mask=[0, 1], logprobs=[0.0, -0.5])
    records.add_turn(store, run_id, t, response_id, 0, "conv", "g", key)


def test_feedback_precedence_and_chain(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    turn(store, run, "t1", "r1")
    turn(store, run, "t2", "r2", parent="t1")
    assert records.chain(store, "t2") == ["t2", "t1"]
    assert records.apply_feedback(store, "r1", 0, "implicit", -1.0).updated == 1
    assert records.apply_feedback(store, "r2", 0, "explicit", 1.0).updated == 2  # inherited beats implicit on t1
    assert records.find_response(store, "r1")["feedback_source"] == "inherited"
    assert records.apply_feedback(store, "r2", 0, "implicit", -1.0).updated == 0  # implicit never beats explicit
    assert records.find_response(store, "r2")["feedback"] == 1.0
    with pytest.raises(KeyError):
        records.apply_feedback(store, "nope", 0, "explicit", 1.0)
    assert records.counts(store)["feedback_messages"] == 3  # every message is kept; the refused one wrote nothing
    ready = records.ready(store, wait_s=3600, limit=10)
    assert [t.id for t, _ in ready] == ["t1", "t2"]


def test_a_failed_turn_write_leaves_nothing(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    turn(store, run, "t1", "r1")
    with pytest.raises(sqlite3.IntegrityError):
        turn(store, run, "t2", "r1")  # the same response id and choice again: the served row fails
    assert store.count_trajectories() == 1  # ... and the trajectory written before it in the transaction is gone


CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}


@pytest.mark.parametrize("messages, reason", [
    ([{"role": "user", "content": None}], "messages[0]: content of a 'user' message must not be null"),
    ([{"role": "system"}, {"role": "user", "content": "x"}], "content of a 'system' message must not be null"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}],
     "messages[1]: an assistant message needs content or tool_calls"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_9", "content": "5"}],
     "messages[1]: the tool message answers tool_call_id 'call_9', which is no tool call of an earlier"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_2", "content": "5"}], "answers tool_call_id 'call_2'"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]},
      {"role": "tool", "content": "5"}], "messages[2]: the tool message has no tool_call_id"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "5"}, {"role": "assistant", "tool_calls": [CALL]}],
     "answers tool_call_id 'call_1'"),  # the call must come before its answer
    ([{"role": "user", "content": []}], "messages[0]: content of a 'user' message must not be an empty array"),
])
def test_messages_that_openai_refuses_are_refused_with_the_reason(messages, reason):
    with pytest.raises(ValidationError, match=re.escape(reason)):
        req(messages=messages)


def test_a_tool_name_offered_twice_is_refused():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with pytest.raises(ValidationError, match="tools\\[1\\]: a tool named 'add' is offered twice"):
        req(messages=[{"role": "user", "content": "x"}], tools=[tool, tool])
    dotted = {"type": "function", "function": {"name": "math.add", "parameters": {"type": "object"}}}
    assert [t.function.name for t in req(messages=[{"role": "user", "content": "x"}], tools=[tool, dotted]).tools] == [
        "add", "math.add"]  # names outside OpenAI's pattern (BFCL's dotted ones) are served, as vLLM does


def test_what_openai_accepts_is_accepted():
    # an assistant message with tool_calls and null (or missing) content; a refusal alone; a
    # tool answer to an earlier call; list content
    accepted = req(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}]},
                             {"role": "assistant", "content": None, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                             {"role": "assistant", "refusal": "no"}, {"role": "user", "content": ""}])
    assert [m.role for m in accepted.messages] == ["user", "assistant", "tool", "assistant", "user"]


def test_a_response_message_sent_back_by_an_openai_client_is_read_as_sent():
    # the pattern `messages.append(resp.choices[0].message.model_dump())`: the client's model
    # adds annotations, audio, function_call and refusal as null; the chat is the same without them
    from openai.types.chat import ChatCompletionMessage

    served = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]}
    dumped = ChatCompletionMessage.model_validate(served).model_dump()
    assert {"annotations", "audio", "function_call", "refusal"} <= set(dumped)
    head, tail = [{"role": "user", "content": "2+3?"}], [{"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    plain, sent_back = (req(messages=[*head, m, *tail], tools=[CALC]) for m in (served, dumped))
    assert to_chat(sent_back, native_tools=False) == to_chat(plain, native_tools=False)
    assert req(messages=[*head, {"role": "assistant", "content": "5", "annotations": []}]).messages[1].text() == "5"


@pytest.mark.parametrize("field, value, reason", [
    ("annotations", [{"type": "url_citation"}], "annotations are output citations"),
    ("audio", {"id": "audio_1"}, "audio is not supported"),
    ("function_call", {"name": "calculator", "arguments": "{}"}, "send it in tool_calls"),
])
def test_a_response_message_field_that_holds_something_is_refused_with_its_reason(field, value, reason):
    with pytest.raises(ValidationError, match=reason):
        req(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", field: value}])


def test_a_correction_call_in_openai_tool_call_shape_is_taken_as_its_function():
    from openai.types.chat import ChatCompletionMessageFunctionToolCall

    from selfrl.serve.feedback_request import FeedbackRequest

    call = ChatCompletionMessageFunctionToolCall.model_validate(
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}).model_dump()
    both = FeedbackRequest(response_id="chatcmpl-1", correction_tool_calls=[call, {"name": "mul", "arguments": "{}"}])
    assert [(c.name, c.arguments) for c in both.correction_tool_calls] == [("add", '{"a": 2}'), ("mul", "{}")]
    with pytest.raises(ValidationError, match="name"):  # another shape stays refused, naming the field
        FeedbackRequest(response_id="chatcmpl-1", correction_tool_calls=[{"id": "c", "type": "custom", "function": {}}])


@pytest.mark.parametrize("args, why", [
    ('{"a": Infinity}', "Infinity is not a JSON number"), ('{"a": NaN}', "NaN is not a JSON number"),
    ('{"a": -Infinity}', "-Infinity is not a JSON number"), ('{"a": 1e400}', "beyond a double's range"),
    ('{"a": [' * 5000 + "]" * 5000 + "}", "not JSON")])
def test_call_arguments_a_client_sends_back_hold_only_finite_json(args, why):
    from selfrl.serve.feedback_request import FeedbackRequest

    history = {"model": "m", "messages": [
        {"role": "user", "content": "add"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]}
    for build in (lambda: ChatCompletionRequest(**history),
                  lambda: FeedbackRequest(response_id="chatcmpl-1",
                                          correction_tool_calls=[{"name": "add", "arguments": args}])):
        with pytest.raises(ValidationError, match=re.escape(why)):
            build()
    ok = FeedbackRequest(response_id="chatcmpl-1", correction_tool_calls=[{"name": "add", "arguments": '{"a": 1e300}'}])
    assert ok.correction_tool_calls[0].arguments == '{"a": 1e300}'


@pytest.mark.parametrize("schema, where", [
    ({"type": "object", "properties": {"a": {"type": "number", "maximum": float("nan")}}}, "parameters.properties.a.maximum"),
    ({"type": "object", "properties": {"a": {"enum": [1, float("-inf")]}}}, "parameters.properties.a.enum[1]"),
    ({"type": "object", "properties": {}, "x-default": float("inf")}, "parameters.x-default"),
    ({"type": "object", "properties": {"a": {"default": 10 ** 400}}}, "parameters.properties.a.default")])
def test_a_tool_schema_with_a_non_finite_number_is_refused_naming_where(schema, where):
    # it would reach the prompt (tools_prompt = "json" writes NaN) and the stored trajectory
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]}
    with pytest.raises(ValidationError, match=re.escape(f"{where} is not a finite number (NaN and infinities are not JSON)")):
        ChatCompletionRequest(**body)
    body["tools"][0]["function"]["parameters"] = {"type": "object", "properties": {"a": {"maximum": 1e308}}}
    assert ChatCompletionRequest(**body).tools[0].function.parameters["properties"]["a"]["maximum"] == 1e308


@pytest.mark.parametrize("args, where", [
    ('{"a": {"b.c": [1, NaN]}}', 'arguments.a["b.c"][1]'), ('{"x": Infinity}', "arguments.x"),
    ('{"list": [[1e400]]}', "arguments.list[0][0]")])
def test_a_non_finite_number_in_call_arguments_is_refused_naming_where(args, where):
    # before: "... NaN is not a JSON number" and no path, where a tool schema's message names one
    from selfrl.serve.feedback_request import FeedbackRequest

    with pytest.raises(ValidationError, match=re.escape(f"is not a JSON number, at {where}") + "|" +
                       re.escape(f"beyond a double's range, at {where}")):
        FeedbackRequest(response_id="chatcmpl-1", correction_tool_calls=[{"name": "add", "arguments": args}])


def test_a_response_format_schema_with_a_non_finite_number_is_refused_naming_where():
    # before: "the schema cannot be compiled: expected value at line 1 column 55"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"properties": {"a.b": {"minimum": float("nan")}}}}}}
    with pytest.raises(ValidationError, match=re.escape(
            'response_format.json_schema.schema.properties["a.b"].minimum is not a finite number')):
        ChatCompletionRequest(**body)


@pytest.mark.parametrize("field, value, where", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "x": float("nan")}},
     "response_format.json_schema.x"),
    ("response_format", {"type": "json_object", "x": float("inf")}, "response_format.x"),
    ("stream_options", {"a": float("inf")}, "stream_options.a"),
])
def test_a_non_finite_number_anywhere_in_a_free_form_field_is_refused_naming_where(field, value, where):
    # before: accepted outside response_format.json_schema.schema
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ValidationError, match=re.escape(f"{where} is not a finite number")):
        ChatCompletionRequest(**body)
    tool = {"type": "function", "function": {"name": "k", "parameters": {"type": "object"}}}
    with pytest.raises(ValidationError, match=re.escape("tool_choice.function.x is not a finite number")):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool],
                              tool_choice={"type": "function", "function": {"name": "k", "x": float("nan")}})


@pytest.mark.parametrize("kind, named", [("str", "'str'"), (["string", "int"], "'int'"), ("Integer", "'Integer'")])
def test_a_tool_schema_type_json_schema_does_not_have_is_refused_at_the_request(kind, named):
    # before: accepted, and every later call or correction of the tool failed on "unsupported type(s)"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "k", "parameters": {"properties": {"a": {"type": kind}}}}}]}
    with pytest.raises(ValidationError, match=re.escape(f'"type" of argument \'a\' names {named}, not a JSON Schema '
                                                        "type: use one of string, number, integer, boolean, object")):
        ChatCompletionRequest(**body)
    body["tools"][0]["function"]["parameters"]["properties"]["a"]["type"] = ["string", "null"]
    assert ChatCompletionRequest(**body).tools[0].function.name == "k"


def test_a_json_answer_with_a_non_finite_number_is_not_the_json_a_grammar_asked_for():
    from selfrl.serve.corrections import _shape_problem

    assert _shape_problem("json", '{"a": 1.5}', []) is None
    assert _shape_problem("json", '{"a": NaN}', []) == "not the JSON the turn's response_format asked for"
    assert _shape_problem("json", "[" * 5000 + "]" * 5000, []) == "not the JSON the turn's response_format asked for"


@pytest.mark.parametrize("rating", [5, -2, "1.5"])
def test_a_rating_out_of_range_says_the_range_in_one_line(rating):
    from selfrl.serve.errors import validation_message
    from selfrl.serve.feedback_request import FeedbackRequest

    with pytest.raises(ValidationError) as err:
        FeedbackRequest(response_id="chatcmpl-1", rating=rating)
    message, param = validation_message(err.value.errors(), skip=0)
    assert param == "rating"
    assert message == (f"rating must be in [-1, 1] (-1 thumbs down, +1 thumbs up; scale other ratings into it), "
                       f"got {rating!r} (at rating)")
