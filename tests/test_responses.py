"""The Responses API translation (pure functions): what is accepted, what is refused; the
stored log behind ``previous_response_id``."""

import json

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


def test_history_comes_first_and_instructions_only_once(tmp_path):
    from selfrl.record.store import Store

    log = ResponseLog(Store(tmp_path / "selfrl.db"), size=2)
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


@pytest.mark.parametrize("item", [{"role": "user", "content": None}, {"role": "user"},
                                  {"type": "message", "role": "assistant", "content": None}])
def test_a_message_item_without_content_is_refused_as_chat_completions_refuses_it(item):
    with pytest.raises(ResponsesError, match=r"input\.0: a (user|assistant) message needs content") as e:
        input_messages([item])
    assert e.value.param == "input.0.content"


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


@pytest.mark.parametrize("content, calls, kinds", [
    ("", [], ["message"]),  # an empty answer is an empty text item, as OpenAI gives it: output_text is ""
    (None, [{"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}], ["function_call"]),
    ("hi", [], ["message"]),
])
def test_every_answer_has_an_output_item_and_an_empty_one_reads_back(content, calls, kinds):
    message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
    chat = {"id": "x", "created": 5, "model": "selfrl", "adapter_version": 0, "system_fingerprint": "selfrl-v0",
            "choices": [{"index": 0, "finish_reason": "tool_calls" if calls else "stop", "logprobs": None,
                         "message": message}], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}
    req = ResponsesRequest(model="m", input="hi")
    r = to_response(chat, req, to_chat_request(req, []), "resp_1")
    assert [i["type"] for i in r["output"]] == kinds
    texts = [p["text"] for i in r["output"] if i["type"] == "message" for p in i["content"]]
    assert texts == ([content] if not calls else [])
    back = to_chat_request(ResponsesRequest(model="m", input=[{"role": "user", "content": "hi"}, *r["output"]]), [])
    assert [m.role for m in back.messages] == ["user", "assistant"]


def test_the_log_is_bounded_by_bytes_and_scoped_to_its_client(tmp_path):
    from selfrl.record.store import Store

    store = Store(tmp_path / "selfrl.db")
    one = {"role": "assistant", "content": "x" * 100}
    size = len(json.dumps([one]))  # 116 bytes of JSON per response
    log = ResponseLog(store, size=10, max_bytes=2 * size + 10)
    for i in range(3):
        log.add(f"resp_{i}", [], one, client="alice")
    with pytest.raises(KeyError):  # three do not fit in 2 x 116 + 10 bytes: the oldest went
        log.history("resp_0", "alice")
    assert log.history("resp_2", "alice") == [one] and log.history("resp_1", "alice") == [one]
    with pytest.raises(KeyError):  # another client's id is unknown to this one
        log.history("resp_2", "bob")
    big = {"role": "assistant", "content": "y" * 1000}
    log.add("resp_big", [], big, client="alice")  # larger than the budget alone: kept, the rest go
    assert log.history("resp_big", "alice") == [big]
    assert store.conn.execute("SELECT COUNT(*) FROM response_history").fetchone()[0] == 1
    store.close()
    again = ResponseLog(Store(tmp_path / "selfrl.db"), size=10)  # after a restart
    assert again.history("resp_big", "alice") == [big]


def test_previous_response_id_works_after_a_restart_for_its_own_client_only(tiny_tokenizer, tiny_model_factory,
                                                                             tmp_path):
    import openai
    from openai import OpenAI

    from serving import running_server, tiny_serve_config

    cfg = tiny_serve_config(tmp_path / "run")
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    with running_server(model, tiny_tokenizer, cfg) as (url, _):
        first = OpenAI(base_url=url + "/v1", api_key="alice-key", max_retries=0).responses.create(
            model="selfrl", instructions="Be brief.", input="What is 2+3?", max_output_tokens=5)
    with running_server(model, tiny_tokenizer, cfg) as (url, service):  # a new process would read the same store
        alice = OpenAI(base_url=url + "/v1", api_key="alice-key", max_retries=0)
        second = alice.responses.create(model="selfrl", previous_response_id=first.id, input="And 3+4?",
                                        max_output_tokens=5)
        with service.store.lock:
            from selfrl.record import served as records

            row = records.find_response(service.store, second.id)
            traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
        prompt = tiny_tokenizer.decode(traj.token_ids[:traj.prompt_len])
        assert "What is 2+3?" in prompt and "And 3+4?" in prompt and prompt.count("Be brief.") == 1
        assert first.output_text in prompt
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
        unstored = alice.responses.create(model="selfrl", input="hi", max_output_tokens=2, store=False)
        assert unstored.store is False
        bob = OpenAI(base_url=url + "/v1", api_key="bob-key", max_retries=0)
        # another client's id, an unknown id, a response made with store: false
        for client, rid in ((bob, first.id), (alice, "resp_nope"), (alice, unstored.id)):
            with pytest.raises(openai.NotFoundError) as e:
                client.responses.create(model="selfrl", previous_response_id=rid, input="hi")
            assert e.value.body["code"] == "previous_response_not_found"
            assert "across restarts" in e.value.body["message"]
