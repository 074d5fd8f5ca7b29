"""End to end: the real ``openai`` client against the real server on loopback (tiny model)."""

import json

import openai
import pytest
import torch
from openai import OpenAI

from selfrl.engines.reference import Generation
from selfrl.record import served as records
from serving import (API_KEY, CALC, add_version, http, patch_generate, recomputed_logps, running_server,
                     tiny_serve_config)


def stored(service, response_id, choice=0):
    with service.store.lock:
        row = records.find_response(service.store, response_id, choice)
        traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
    return row, traj


def scripted(service, text: str):
    """Make the engine 'sample' ``text`` (+ EOS), recording its real logprobs as the engine would."""
    tok, engine = service.tok, service.engine
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate(prompts, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, on_step=None, stop=None,
                 cancel=None):  # scripted: returns at once, nothing to cancel
        out = []
        for p in prompts:
            full = torch.tensor([p + ids])
            mask = torch.tensor([[0] * len(p) + [1] * len(ids)])
            with torch.no_grad():
                lp = recomputed_logps(engine.model, type("T", (), {"token_ids": p + ids, "completion_mask": mask[0].tolist()}),
                                      1.0 if greedy else temperature)
            assert full.shape[1] == len(p) + len(ids)
            out.append(Generation(list(ids), lp.tolist(), True, engine.version))
        return out

    return generate


def script(monkeypatch, service, text: str) -> None:
    """Make the serving engine answer ``text`` from now on (``generate``, and ``submit`` for a
    continuous engine)."""
    patch_generate(monkeypatch, service, scripted(service, text))


def test_plain_chat_records_exact_tokens_and_names_its_version(server, client):
    url, service = server
    raw = client.chat.completions.with_raw_response.create(
        model="selfrl", messages=[{"role": "user", "content": "What is 2+3?"}], max_tokens=8, temperature=0.7)
    resp = raw.parse()
    assert raw.headers["x-selfrl-adapter-version"] == "0"
    assert resp.system_fingerprint == "selfrl-v0" and resp.model_extra["adapter_version"] == 0
    assert resp.usage.completion_tokens >= 1
    row, traj = stored(service, resp.id)
    assert traj.adapter_version == 0 and row["status"] == "pending" and row["parent_id"] is None
    n = traj.num_completion_tokens
    assert n == resp.usage.completion_tokens
    assert service.tok.decode(traj.token_ids[-n:], skip_special_tokens=True).startswith(resp.choices[0].message.content or "")
    sampled = torch.tensor([lp for lp, m in zip(traj.logprobs, traj.completion_mask) if m])
    assert torch.allclose(sampled, recomputed_logps(service.engine.model, traj, 0.7), atol=1e-4)


def test_tool_calls_across_turns_in_openai_shape_and_linked(server, client, monkeypatch):
    url, service = server
    script(monkeypatch, service, '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>')
    msgs = [{"role": "user", "content": "What is 17+25?"}]
    first = client.chat.completions.create(model="selfrl", messages=msgs, tools=[CALC], max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "17+25"}
    row1, traj1 = stored(service, first.id)
    assert traj1.tool_calls[0].ok and traj1.tool_calls[0].name == "calculator"
    assert "calculator(expression: string)" in traj1.messages[0]["content"]  # the tools section of the prompt

    script(monkeypatch, service, "<answer>42</answer>")
    msgs += [choice.message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "42"}]
    second = client.chat.completions.create(model="selfrl", messages=msgs, tools=[CALC], max_tokens=40)
    assert second.choices[0].message.content == "<answer>42</answer>"
    assert second.choices[0].finish_reason == "stop"
    row2, traj2 = stored(service, second.id)
    assert traj2.parent_id == traj1.id and row2["conversation_id"] == row1["conversation_id"]
    # the earlier call is shown to the model as the text it wrote, and the result as a tool turn
    assert traj2.messages[-3]["content"].startswith("<tool_call>") and "<tool_response>\n42\n" in traj2.messages[-2]["content"]

    status, body = http("POST", url + "/v1/feedback", {"response_id": second.id, "rating": 1.0}, key=API_KEY)
    assert status == 200 and body["turns_updated"] == 2  # the answer and the tool-call turn before it
    assert stored(service, first.id)[0]["feedback"] == 1.0
    assert stored(service, first.id)[0]["feedback_source"] == "inherited"


def test_streaming_deltas_equal_the_full_response(server, client):
    url, service = server
    kwargs = dict(model="selfrl", messages=[{"role": "user", "content": "Count to five."}], max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert {c.model_extra["adapter_version"] for c in chunks} == {0}
    row, traj = stored(service, chunks[0].id)  # streamed requests are recorded too
    assert traj.num_completion_tokens == full.usage.completion_tokens


def test_streaming_with_tools_offered_equals_the_full_response(server, client):
    kwargs = dict(model="selfrl", messages=[{"role": "user", "content": "Add 2 and 3."}], tools=[CALC],
                  max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (full.choices[0].message.content or "")


def test_usage_counts_the_prompt_once_for_several_choices(server, client):
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=3, n=3)
    assert len(r.choices) == 3
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_oversized_bodies_and_inconsistent_tool_choice_are_refused(server):
    url, service = server
    from http.client import HTTPConnection
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("POST", "/v1/chat/completions")  # announce a huge body; the server answers before reading it
    conn.putheader("content-type", "application/json")
    conn.putheader("content-length", str(service.cfg.max_request_bytes + 1))
    conn.endheaders()
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and body["error"]["code"] == "request_too_large"
    msgs = [{"role": "user", "content": "x"}]
    status, body = http("POST", url + "/v1/chat/completions", {"model": "selfrl", "messages": msgs, "tool_choice": "required"})
    assert status == 400 and body["error"]["param"] == "tool_choice"
    status, body = http("POST", url + "/v1/chat/completions", {
        "model": "selfrl", "messages": msgs, "tools": [CALC], "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert status == 400 and "nope" in body["error"]["message"]


def test_feedback_needs_the_key_and_an_existing_response(server, client):
    url, service = server
    resp = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert http("POST", url + "/v1/feedback", {"response_id": resp.id, "rating": 1})[0] == 401
    assert http("POST", url + "/v1/feedback", {"response_id": resp.id, "rating": 1}, key="wrong-key-0123456789")[0] == 401
    status, body = http("POST", url + "/v1/feedback", {"response_id": "chatcmpl-nope", "rating": 1}, key=API_KEY)
    assert status == 404 and body["error"]["code"] == "response_not_found"
    status, body = http("POST", url + "/v1/feedback", {"response_id": resp.id, "rating": 3}, key=API_KEY)
    assert status == 400 and body["error"]["param"] == "rating"
    assert body["error"]["message"].startswith("rating must be in [-1, 1] (-1 thumbs down, +1 thumbs up")
    status, body = http("POST", url + "/v1/feedback",
                        {"response_id": resp.id, "corrected": True, "correction": "hello"}, key=API_KEY)
    assert status == 200 and body["reward"] == -1.0
    assert stored(service, resp.id)[0]["feedback"] == -1.0


def test_a_correcting_next_user_turn_counts_as_implicit_feedback(server, client):
    url, service = server
    msgs = [{"role": "user", "content": "What is 6*7?"}]
    first = client.chat.completions.create(model="selfrl", messages=msgs, max_tokens=6)
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "No, that's wrong. Try again."}]
    second = client.chat.completions.create(model="selfrl", messages=msgs, max_tokens=6)
    row1, _ = stored(service, first.id)
    assert row1["feedback"] == -1.0 and row1["feedback_source"] == "implicit"
    assert stored(service, second.id)[1].parent_id == row1["trajectory_id"]
    # explicit feedback beats the implicit guess
    assert http("POST", url + "/v1/feedback", {"response_id": first.id, "rating": 0.5}, key=API_KEY)[0] == 200
    assert stored(service, first.id)[0]["feedback"] == 0.5


def test_bad_requests_get_openai_errors_and_store_nothing(server, client):
    url, service = server
    before = service.store.count_trajectories()
    cases = [
        (dict(raw=b'{"model": "selfrl", "messages": ['), 400, None),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}), 400, "temperature"),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": "x"}], "bogus": 1}), 400, "bogus"),
        (dict(body={"model": "selfrl", "messages": []}), 400, "messages"),
        (dict(body={"model": "selfrl", "messages": [{"role": "wizard", "content": "x"}]}), 400, None),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": "x " * 9000}]}), 400, "messages"),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9000}), 400, "max_tokens"),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 1}), 400, "presence_penalty"),
        (dict(body={"model": "selfrl@v99", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
        (dict(body={"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}), 404, "model"),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": None}]}), 400, "messages"),
        (dict(body={"model": "selfrl", "messages": [{"role": "user", "content": "x"},
                                                    {"role": "tool", "tool_call_id": "c9", "content": "5"}]}),
         400, "messages"),
    ]
    for kwargs, code, param in cases:
        status, body = http("POST", url + "/v1/chat/completions", **kwargs)
        assert status == code, (kwargs, body)
        assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
        if param:
            assert param in (body["error"]["param"] or ""), body
        if kwargs.get("body", {}).get("messages", [{}])[-1:] in ([{"role": "user", "content": None}],
                                                                  [{"role": "tool", "tool_call_id": "c9", "content": "5"}]):
            assert "messages[" in body["error"]["message"], body  # the reason names the message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="selfrl@v99", messages=[{"role": "user", "content": "x"}])
    assert service.store.count_trajectories() == before


def test_models_pin_and_rollback(server, client):
    url, service = server
    from selfrl.record.adapters import lora_state

    state = {k: torch.randn_like(v) * 0.1 for k, v in lora_state(service.engine.model).items()}
    with service.store.lock:
        v = service.store.next_version()
    add_version(service, state, v, metrics={"val/success": 0.0})
    service.publish(v, state, "test")
    models = {m.id: m for m in client.models.list().data}
    assert f"selfrl@v{v}" in models and "selfrl@v0" in models
    # the alias is the version serving: created when that version was (as vLLM, a Unix time, never 0)
    created = {r["version"]: int(r["created_at"]) for r in service.version_ids()}
    assert models["selfrl"].created == models[f"selfrl@v{v}"].created == created[v] > 1_600_000_000
    assert client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "a"}], max_tokens=2).system_fingerprint == f"selfrl-v{v}"
    old = client.chat.completions.create(model="selfrl@v0", messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert old.model_extra["adapter_version"] == 0 and service.engine.version == v  # swapped back after
    assert http("POST", url + "/admin/pin", {"version": 0})[0] == 401
    status, body = http("POST", url + "/admin/pin", {"version": 0}, key=API_KEY)
    assert status == 200 and body["served_version"] == 0 and body["pinned"] == 0
    assert {m.id: m.created for m in client.models.list().data}["selfrl"] == created[0]
    assert http("POST", url + "/admin/pin", {"version": 77}, key=API_KEY)[0] == 404
    assert http("POST", url + "/admin/unpin", key=API_KEY)[1]["served_version"] == v
    status, body = http("POST", url + "/admin/rollback", {"version": 0}, key=API_KEY)
    assert status == 200 and body["served_version"] == 0
    assert {x["version"]: x["status"] for x in body["versions"]}[v] == "rolled_back"
    status, body = http("GET", url + "/admin/status", key=API_KEY)
    assert status == 200 and body["turns"]["pending"] >= 1


def test_no_key_configured_disables_feedback_and_admin(tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    with running_server(model, tiny_tokenizer, tiny_serve_config(tmp_path), api_key=None) as (url, _):
        status, body = http("GET", url + "/admin/status", key="anything-0123456789")
        assert status == 403 and body["error"]["code"] == "no_api_key_configured"


def test_an_unknown_model_is_a_404_and_the_listed_ids_are_served(tiny_tokenizer, tiny_model_factory, tmp_path):
    # as OpenAI and vLLM: a request for a model the server does not list is refused, never
    # answered by another model; model_aliases adds ids (listed in /v1/models too)
    cfg = tiny_serve_config(tmp_path / "run")
    cfg.model_aliases = ["gpt-4o"]
    with running_server(tiny_model_factory(lora=True, eos_bias=3.0), tiny_tokenizer, cfg) as (url, service):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ids = [m.id for m in client.models.list().data]
        assert ids == ["selfrl", "gpt-4o", "selfrl@v0"]
        for model in ids:
            r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}], max_tokens=2)
            assert r.model_extra["adapter_version"] == 0
        before = service.store.count_trajectories()
        for model in ("gpt-4", "selfrl-x", "gpt-4o@v0", "other@v0", "SELFRL"):
            with pytest.raises(openai.NotFoundError) as e:
                client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}], max_tokens=2)
            assert e.value.body["code"] == "model_not_found" and "GET /v1/models" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model="gpt-4", input="hi", max_output_tokens=2)
        assert service.store.count_trajectories() == before
        # client.models.retrieve: each listed id, and a 404 naming them for another
        assert [client.models.retrieve(m).model_extra["adapter_version"] for m in ids] == [0, 0, 0]
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve("gpt-4")
        assert e.value.body["code"] == "model_not_found" and "selfrl, gpt-4o, selfrl@v0" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError) as e:  # a stored response is not retrievable: the 404 says what is
            client.responses.retrieve("resp_1")
        assert "pass its id as previous_response_id" in e.value.body["message"]


@pytest.mark.parametrize("limit", [1, 3, 9])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "calculator"}}])
def test_a_forced_call_cut_off_by_max_tokens_returns_no_markup(server, client, choice, limit):
    # the grammar forces '<tool_call>\n{"name": "calc...' and the limit cuts it (inside the tag or
    # inside the call): neither a call nor content, finish_reason "length" (as OpenAI: a cut-off
    # answer is "length"), streamed or not
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    r = client.chat.completions.create(model="selfrl", messages=msgs, tools=[CALC], tool_choice=choice,
                                       max_tokens=limit)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == limit
    assert r.choices[0].message.content == "" and not r.choices[0].message.tool_calls  # as OpenAI: "" without calls
    chunks = list(client.chat.completions.create(model="selfrl", messages=msgs, tools=[CALC], tool_choice=choice,
                                                 max_tokens=limit, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "" and not any(d.tool_calls for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"
    _, traj = stored(server[1], r.id)
    sampled = server[1].tok.decode(traj.token_ids[traj.prompt_len:])
    assert sampled.startswith("<tool_call>"[:len(sampled)])  # what was cut: the forced call
    if "<tool_call>" in sampled:  # the block opened: recorded as a failed call
        assert [c.error for c in traj.tool_calls] == ["unclosed <tool_call>"]


@pytest.mark.parametrize("rating", [b"NaN", b"Infinity", b"-Infinity", b'"nan"'])
def test_a_non_finite_rating_is_named_as_such(server, client, rating):
    url, _ = server
    resp = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raw = b'{"response_id": "' + resp.id.encode() + b'", "rating": ' + rating + b"}"
    status, body = http("POST", url + "/v1/feedback", raw=raw, key=API_KEY)
    assert status == 400 and body["error"]["param"] == "rating"
    assert "rating must be a finite number" in body["error"]["message"]
    assert "less than or equal" not in body["error"]["message"]


@pytest.mark.parametrize("rating", [b"true", b"false"])
def test_a_boolean_rating_is_refused(server, client, rating):
    # pydantic took true as a reward of 1.0
    url, _ = server
    resp = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    raw = b'{"response_id": "' + resp.id.encode() + b'", "rating": ' + rating + b"}"
    status, body = http("POST", url + "/v1/feedback", raw=raw, key=API_KEY)
    assert status == 400 and body["error"]["param"] == "rating"
    assert body["error"]["message"] == f"rating must be a number in [-1, 1], got the boolean {rating.decode()} (at rating)"
