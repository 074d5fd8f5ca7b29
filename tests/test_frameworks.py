"""Agent frameworks, unchanged but for the base URL, against the real server on loopback.

The model is the tiny random Llama (EOS-biased, so free text ends quickly). Where a
framework asks for a tool call (``tool_choice`` required or named) or structured output
(``response_format``), constrained decoding makes even this model produce a valid call
or schema-valid JSON, so nothing is scripted. Each test runs the framework's standard
flow to the end and checks the store holds its turns. Schemas use integers, booleans
and enums: a random model rarely closes a free string within a small token budget.
"""

import json

import pytest
from openai import OpenAI

from selfrl.serve import records
from serving import API_KEY, http, running_server, tiny_serve_config

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"type": "string", "enum": ["A", "B"]}},
           "required": ["ok", "grade"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    cfg = tiny_serve_config(tmp_path_factory.mktemp("frameworks"))
    cfg.max_tokens_default = 200  # frameworks send no max_tokens; a call with random integers needs room
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service


@pytest.fixture
def client(server):
    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def served(service, response_id: str) -> dict:
    with service.store.lock:
        row = records.find_response(service.store, response_id)
    assert row is not None, f"{response_id} was not recorded"
    return row


def turns(service) -> int:
    with service.store.lock:
        return len(service.store.trajectories())


# ------------------------------------------------------------------ openai: chat completions


def test_openai_chat_required_and_named_tool_choice_give_calls(server, client):
    url, service = server
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "2+3?"}],
                                       tools=[ADD], tool_choice="required")
    call = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "add"
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    other = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"]}}}
    r2 = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "2+3?"}],
                                        tools=[other, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    assert [c.function.name for c in r2.choices[0].message.tool_calls] == ["add"]
    row = served(service, r.id)
    with service.store.lock:
        traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
    assert traj.num_completion_tokens == 0  # every token was constrained: recorded, kept out of the loss
    assert len(traj.token_ids) > traj.prompt_len


def test_openai_chat_response_format_json_schema_and_json_object(server, client):
    r = client.chat.completions.create(
        model="selfrl", messages=[{"role": "user", "content": "grade it"}],
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}})
    v = json.loads(r.choices[0].message.content)
    assert isinstance(v["ok"], bool) and v["grade"] in ("A", "B") and set(v) == {"ok", "grade"}
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "json"}],
                                       response_format={"type": "json_object"}, max_tokens=200)
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}],
                                       response_format={"type": "text"}, max_tokens=4)
    assert r.choices[0].message.content is not None


# ------------------------------------------------------------------ openai: Responses


def test_openai_responses_tool_loop_previous_response_id_stream_and_feedback(server, client):
    url, service = server
    tool = {"type": "function", "name": "add", "description": "Add two integers.",
            "parameters": ADD["function"]["parameters"], "strict": True}
    r1 = client.responses.create(model="selfrl", instructions="Use the tool.", input="What is 2+3?",
                                 tools=[tool], tool_choice="required")
    call = next(i for i in r1.output if i.type == "function_call")
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"} and r1.status == "completed"
    r2 = client.responses.create(model="selfrl", previous_response_id=r1.id, tools=[tool], max_output_tokens=8,
                                 input=[{"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert r2.usage.input_tokens > r1.usage.input_tokens and r2.output_text is not None
    row1, row2 = served(service, r1.id), served(service, r2.id)
    assert row2["parent_id"] == row1["trajectory_id"]  # the tool result continued the recorded turn
    assert r1.id.startswith("resp_")
    status, fb = http("POST", url + "/v1/feedback", {"response_id": r2.id, "rating": 1.0}, key=API_KEY)
    assert status == 200 and fb["turns_updated"] == 2  # the turn and the call before it
    events = list(client.responses.create(model="selfrl", input="hello", stream=True, max_output_tokens=6))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and [e.sequence_number for e in events] == list(range(len(events)))
    served(service, final.id)
    with pytest.raises(Exception, match="previous_response_not_found|no response"):
        client.responses.create(model="selfrl", previous_response_id="resp_nope", input="hi")


def test_openai_responses_structured_output(server, client):
    r = client.responses.create(model="selfrl", input="grade it", text={"format": {
        "type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}})
    v = json.loads(r.output_text)
    assert set(v) == {"ok", "grade"} and v["grade"] in ("A", "B")
