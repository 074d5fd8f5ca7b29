"""How a sampled turn becomes what a client sees (the real ``openai`` client against the real
server, tiny model, the engine 'sampling' a scripted text one id per step): the finish
reason of a turn the token limit cut, markup kept out of every content and delta, and a
closing tag inside a call's JSON string, streamed and not, in chat completions and the
Responses API."""

import json

import pytest
import torch

from selfrl.engines.reference import Generation, stop_cut
from selfrl.record import served as records
from selfrl.chat.toolcall import MARKUP_TAGS
from serving import CALC, patch_generate

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>'
AFTER = " The result will come back from the calculator, and then I will explain it."
WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                   "required": ["path", "content"]}}}
ASK = [{"role": "user", "content": "What is 17+25?"}]


def sampling(service, text: str):
    """An ``Engine.generate`` stand-in that 'samples' ``text`` + EOS as the engine would: one id
    per step (``on_step`` sees each prefix, so a tag arrives split over several chunks), cut at
    ``max_new_tokens`` (then not finished) or right after a stop string (``stopped``). The text
    is tokenized as text: ``<|im_end|>`` written in it is the characters, not the control token."""
    tok = service.tok
    ids = tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tok.eos_token_id]

    def generate(prompts, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, on_step=None, stop=None,
                 **_):
        row, stopped = ids[:max_new_tokens], False
        k = stop_cut(tok, row, stop) if stop else None
        if k is not None:
            row, stopped = row[:k], True
        if on_step is not None:
            for k in range(1, len(row)):
                on_step(torch.tensor([row[:k]] * len(prompts)))  # (B, k)
        finished = stopped or (bool(row) and row[-1] == tok.eos_token_id)
        return [Generation(list(row), [-1.0] * len(row), finished, service.engine.version, stopped=stopped)
                for _ in prompts]

    return generate, ids


def stream(client, **kw):
    """``(content, tool_calls, finish_reason)`` of a streamed chat completion, from its deltas."""
    content, calls, finish = "", [], None
    for c in client.chat.completions.create(stream=True, **kw):
        for ch in c.choices:
            content += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    return content, calls, finish


def trajectory(service, response_id):
    with service.store.lock:
        row = records.find_response(service.store, response_id, 0)
        return next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])


# ------------------------------------------------------------------ a turn cut by the token limit


def test_a_turn_cut_after_a_complete_call_finishes_with_length_and_keeps_the_call(server, client, monkeypatch):
    _, service = server
    generate, ids = sampling(service, CALL + AFTER)
    patch_generate(monkeypatch, service, generate)
    limit = len(service.tok(CALL, add_special_tokens=False)["input_ids"]) + 4  # the call, then a few ids of text
    r = client.chat.completions.create(model="selfrl", messages=ASK, tools=[CALC], max_tokens=limit)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and r.usage.completion_tokens == limit
    assert [json.loads(c.function.arguments) for c in ch.message.tool_calls] == [{"expression": "17+25"}]
    assert ch.message.content and AFTER.strip().startswith(ch.message.content)
    assert trajectory(service, r.id).truncated
    content, calls, finish = stream(client, model="selfrl", messages=ASK, tools=[CALC], max_tokens=limit)
    assert finish == "length" and content == ch.message.content
    assert [json.loads(c.function.arguments) for c in calls] == [{"expression": "17+25"}]
    # the whole turn (EOS within the limit) did make a call
    whole = client.chat.completions.create(model="selfrl", messages=ASK, tools=[CALC], max_tokens=len(ids))
    assert whole.choices[0].finish_reason == "tool_calls"


def test_a_stop_string_after_a_call_ends_the_turn_with_tool_calls(server, client, monkeypatch):
    _, service = server
    patch_generate(monkeypatch, service, sampling(service, CALL + AFTER)[0])
    r = client.chat.completions.create(model="selfrl", messages=ASK, tools=[CALC], stop=["come back"], max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    assert r.choices[0].message.content == "The result will"


def test_a_response_cut_after_a_complete_call_is_incomplete(server, client, monkeypatch):
    _, service = server
    patch_generate(monkeypatch, service, sampling(service, CALL + AFTER)[0])
    limit = len(service.tok(CALL, add_special_tokens=False)["input_ids"]) + 4
    tool = {"type": "function", "name": "calculator", "parameters": CALC["function"]["parameters"]}
    r = client.responses.create(model="selfrl", input="What is 17+25?", tools=[tool], max_output_tokens=limit)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [(i.type, i.status) for i in r.output] == [("message", "incomplete"), ("function_call", "completed")]
    events = list(client.responses.create(model="selfrl", input="What is 17+25?", tools=[tool],
                                          max_output_tokens=limit, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"


# ------------------------------------------------------------------ markup never reaches content


HISTORY = [ASK[0], {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "17+25"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "42"}]


@pytest.mark.parametrize("text, content, reasoning", [
    # a history with calls and tool replies, under tool_choice "none": the model writes the format out
    (CALL + "\n<tool_response>\n42\n</tool_response>\nThe answer is 42.",
     '{"name": "calculator", "arguments": {"expression": "17+25"}}\n\n42\n\nThe answer is 42.', None),
    ("It is 42.<|im_end|>\n<|im_start|>user\nthanks<|im_end|>", "It is 42.\nuser\nthanks", None),
    ("<think>17+25 is 42</think>The answer is 42 <tool_resp", "The answer is 42", "17+25 is 42"),
    ("<think>a <tool_call> drafted</think>42 </tool_call></think> <tools>x</tools>", "42  x", "a  drafted"),
    ("The answer is 42<|im_", "The answer is 42", None),
])
def test_no_template_markup_reaches_content_streamed_or_not(server, client, monkeypatch, text, content, reasoning):
    _, service = server
    patch_generate(monkeypatch, service, sampling(service, text)[0])
    kw = dict(model="selfrl", messages=HISTORY, tools=[CALC], tool_choice="none", max_tokens=120)
    r = client.chat.completions.create(logprobs=True, **kw)
    msg = r.choices[0].message
    assert (msg.content, msg.model_extra.get("reasoning_content"), msg.tool_calls) == (content, reasoning, None)
    assert b"".join(bytes(e.bytes) for e in r.choices[0].logprobs.content) == content.encode()
    streamed, calls, finish = stream(client, **kw)
    assert (streamed, calls, finish) == (content, [], "stop")  # no delta ever held a tag's first characters
    for shown in (content, reasoning or ""):
        assert not any(tag in shown for tag in (*MARKUP_TAGS, *service.control))


# ------------------------------------------------------------------ a closing tag inside a JSON string


@pytest.mark.parametrize("body", ["x </tool_call> y", 'a "quoted" <tool_call> {not json} </tool_call>', "</think>"])
def test_a_string_argument_holding_the_closing_tag_is_one_call_with_the_whole_string(server, client, monkeypatch,
                                                                                    body):
    _, service = server
    args = {"path": "a.md", "content": body}
    text = "<tool_call>" + json.dumps({"name": "write_file", "arguments": args}) + "</tool_call>"
    patch_generate(monkeypatch, service, sampling(service, text)[0])
    kw = dict(model="selfrl", messages=[{"role": "user", "content": "Write a.md."}], tools=[WRITE], max_tokens=200)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ch.message.tool_calls] == [
        ("write_file", args)]
    streamed, calls, finish = stream(client, **kw)
    assert (streamed, finish) == ("", "tool_calls")
    assert [json.loads(c.function.arguments) for c in calls] == [args]
    assert [c.ok for c in trajectory(service, r.id).tool_calls] == [True]
