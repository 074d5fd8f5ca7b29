"""The Responses API translation (pure functions): what is accepted, what is refused."""

import pytest

from selfrl.serve.responses import (
    ResponseLog,
    ResponsesError,
    ResponsesRequest,
    input_messages,
    stream_events,
    to_chat_request,
    to_response,
)


def test_a_tool_turn_round_trips_into_chat_messages():
    req = ResponsesRequest(model="m", instructions="Be brief.", input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"}],
        tools=[{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}],
        tool_choice={"type": "function", "name": "add"}, max_output_tokens=7,
        text={"format": {"type": "json_schema", "name": "v", "schema": {"type": "object"}, "strict": True}})
    chat = to_chat_request(req, [])
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert chat.messages[2].content == "Let me add." and chat.messages[2].tool_calls[0].id == "c1"
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[3].content == "5"
    assert chat.tool_choice == {"type": "function", "function": {"name": "add"}} and chat.max_completion_tokens == 7
    assert chat.tools[0].function.strict is True
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "object"},
                                                                          "strict": True}}


def test_history_comes_first_and_instructions_only_once():
    log = ResponseLog(size=2)
    log.add("resp_1", [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}],
            {"role": "assistant", "content": "hello", "refusal": None})
    req = ResponsesRequest(model="m", instructions="S", input="again", previous_response_id="resp_1")
    chat = to_chat_request(req, log.history("resp_1"))
    assert [(m.role, m.content) for m in chat.messages] == [("system", "S"), ("user", "hi"),
                                                            ("assistant", "hello"), ("user", "again")]
    log.add("resp_2", [], {"role": "assistant", "content": "x"})
    log.add("resp_3", [], {"role": "assistant", "content": "y"})
    with pytest.raises(KeyError):  # the oldest is forgotten beyond the size
        log.history("resp_1")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input.0"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
])
def test_what_is_outside_the_subset_is_refused_by_name(body, param):
    with pytest.raises(ResponsesError) as e:
        to_chat_request(ResponsesRequest(model="m", **{"input": "hi", **body}), [])
    assert e.value.param == param


def test_response_and_events_from_a_chat_completion():
    chat = {"id": "x", "created": 5, "model": "selfrl", "adapter_version": 3, "system_fingerprint": "selfrl-v3",
            "choices": [{"index": 0, "finish_reason": "length", "logprobs": None, "message": {
                "role": "assistant", "content": "The sum", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}}
    req = ResponsesRequest(model="m", input="hi")
    r = to_response(chat, req, to_chat_request(req, []), "resp_9")
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in r["output"]] == ["message", "function_call"]
    assert r["output"][1]["call_id"] == "call_1" and r["usage"]["output_tokens"] == 4 and r["adapter_version"] == 3
    events = stream_events(r)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "The sum"
    assert [e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done"] == ['{"a":1}']
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
