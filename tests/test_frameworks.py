"""Agent frameworks, unchanged but for the base URL, against the real server on loopback.

The model is the tiny random Llama (EOS-biased, so free text ends quickly). Where a
framework asks for a tool call (``tool_choice`` required or named) or structured output
(``response_format``), constrained decoding makes even this model produce a valid call
or schema-valid JSON, so nothing is scripted. Each test runs the framework's standard
flow to the end and checks the store holds its turns. Schemas use bounded integers,
booleans and enums: a grammar allows any number of digits or string characters, and a
random model rarely stops either within a small token budget.
"""

import json
from typing import Annotated

import pytest
from pydantic import Field

from selfrl.record import served as records
from serving import API_KEY, SERVE_ENGINES, http, running_server, serve_config

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"], "additionalProperties": False}}}
VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}, "grade": {"type": "string", "enum": ["A", "B"]}},
           "required": ["ok", "grade"], "additionalProperties": False}


@pytest.fixture(scope="module", params=SERVE_ENGINES)
def server(request, tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    # smolagents' system prompt alone is ~2,300 tokens of the tiny byte-level vocabulary;
    # rotary positions need no table, so the tiny Llama takes a longer context as it is
    model.config.max_position_embeddings = 8192
    cfg = serve_config(tmp_path_factory.mktemp("frameworks"), request.param)
    cfg.max_tokens_default = 200  # frameworks send no max_tokens; a call with random integers needs room
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service


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
                                        tools=[other, ADD],
                                        tool_choice={"type": "function", "function": {"name": "add"}})
    assert [c.function.name for c in r2.choices[0].message.tool_calls] == ["add"]
    chunks = list(client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "2+3?"}],
                                                 tools=[ADD], tool_choice="required", stream=True))
    calls = [c for ch in chunks for d in [ch.choices[0].delta] if d.tool_calls for c in d.tool_calls]
    assert [c.function.name for c in calls] == ["add"] and set(json.loads(calls[0].function.arguments)) == {"a", "b"}
    assert not "".join(ch.choices[0].delta.content or "" for ch in chunks)  # no markup streamed as content
    row = served(service, r.id)
    with service.store.lock:
        traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
    # every token was constrained: the turn records its grammar, so the learner replays the masks and trains it
    assert traj.num_completion_tokens == len(traj.token_ids) - traj.prompt_len > 0
    (span,) = traj.constraints
    assert (span["start"], span["end"], span["kind"]) == (traj.prompt_len, len(traj.token_ids), "tool_call")


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
    assert r.choices[0].finish_reason in ("stop", "length")  # accepted (it was a 400), decoding free


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
    r = client.responses.create(model="selfrl", input="grade it", include=["message.output_text.logprobs"],
                                text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT,
                                                 "strict": True}})
    v = json.loads(r.output_text)
    assert set(v) == {"ok", "grade"} and v["grade"] in ("A", "B")
    lps = r.output[0].content[0].logprobs  # the masked distribution's, one entry per piece of the text
    assert all(lp.logprob <= 0 for lp in lps) and "".join(lp.token for lp in lps) == r.output_text


# ------------------------------------------------------------------ LangChain and LangGraph


def _chat_model(url, **kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=url + "/v1", api_key="unused", model="selfrl", max_retries=0, **kw)


Small = Annotated[int, Field(ge=0, le=99)]


def _lc_add():
    from langchain_core.tools import tool

    @tool
    def add(a: Small, b: Small) -> int:
        """Add two integers."""
        return a + b

    return add


def test_langchain_bind_tools_any_and_structured_output(server):
    from typing import Literal

    from pydantic import BaseModel

    url, service = server
    before = turns(service)
    msg = _chat_model(url).bind_tools([_lc_add()], tool_choice="any").invoke("What is 2+3?")
    assert [c["name"] for c in msg.tool_calls] == ["add"] and set(msg.tool_calls[0]["args"]) == {"a", "b"}

    class Verdict(BaseModel):
        ok: bool
        grade: Literal["A", "B"]

    v = _chat_model(url).with_structured_output(Verdict).invoke("Grade this answer.")
    assert isinstance(v, Verdict) and v.grade in ("A", "B")
    assert turns(service) == before + 2


def test_langgraph_react_agent_runs_the_tool_loop(server):
    import warnings

    from langchain_core.messages import HumanMessage, ToolMessage

    url, service = server
    before = turns(service)
    add = _lc_add()
    first = _chat_model(url).bind_tools([add], tool_choice="any")  # the first step must call the tool
    then = _chat_model(url, max_tokens=8).bind_tools([add])  # then the model answers freely (ends quickly)

    def pick(state, runtime=None):
        return first if isinstance(state["messages"][-1], HumanMessage) else then

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # create_react_agent is deprecated in favour of langchain.agents
        from langgraph.prebuilt import create_react_agent

        agent = create_react_agent(pick, [add])
    out = agent.invoke({"messages": [HumanMessage("What is 2+3?")]}, {"recursion_limit": 12})
    tool_msgs = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert tool_msgs and tool_msgs[0].name == "add" and tool_msgs[0].status == "success", out["messages"]
    assert turns(service) >= before + 2


# ------------------------------------------------------------------ smolagents


def test_smolagents_tool_calling_agent(server):
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    url, service = server
    with service.store.lock:
        before = {t.id for t in service.store.trajectories()}

    @tool
    def switch(on: bool) -> str:
        """Turn the light on or off.

        Args:
            on: True for on.
        """
        return "light on" if on else "light off"

    model = OpenAIServerModel(model_id="selfrl", api_base=url + "/v1", api_key="unused", max_tokens=300)
    agent = ToolCallingAgent(tools=[switch], model=model, max_steps=2, verbosity_level=0)
    agent.run("Turn the light on.")  # returns: a final answer, or the answer after max_steps
    with service.store.lock:
        new = [t for t in service.store.trajectories() if t.id not in before]
    steps = [s for s in agent.memory.steps if hasattr(s, "tool_calls")]  # one ActionStep per model call
    assert len(new) >= len(steps) >= 1
    # every step sent tool_choice "required": each step's turn is a call smolagents ran
    # without an error, unless the token limit cut it (a random model may ramble inside
    # final_answer's string argument) -- then the step says so; after max_steps smolagents
    # asks once more without tools, and that step carries AgentMaxStepsError
    for s in steps:
        assert s.tool_calls and s.error is None or "parsing" in str(s.error) or "max steps" in str(s.error), s.error
    assert any(s.tool_calls for s in steps) or all(t.truncated for t in new)


# ------------------------------------------------------------------ OpenAI Agents SDK


def test_agents_sdk_default_runner_with_function_tool_and_output_type(server):
    import asyncio
    from typing import Literal

    from agents import Agent, ModelSettings, Runner, function_tool, set_default_openai_client, set_tracing_disabled
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    url, service = server
    before = turns(service)
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0),
                              use_for_tracing=False)
    calls = []

    @function_tool
    def add(a: Small, b: Small) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    class Verdict(BaseModel):
        ok: bool
        grade: Literal["A", "B"]

    # the first turn must call the tool; the SDK resets tool_choice after a call, and
    # then the grammar allows a call or the Verdict JSON
    agent = Agent(name="grader", instructions="Add, then grade.", model="selfrl", tools=[add], output_type=Verdict,
                  model_settings=ModelSettings(tool_choice="required"))
    result = asyncio.run(Runner.run(agent, "What is 2+3?", max_turns=12))
    assert isinstance(result.final_output, Verdict) and calls
    ids = [r.response_id for r in result.raw_responses]
    assert all(i.startswith("resp_") for i in ids) and len(ids) >= 2
    for i in ids:
        served(service, i)
    assert turns(service) == before + len(ids)
