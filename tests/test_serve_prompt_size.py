"""A prompt that cannot fit the context is refused from its size, before the tokenizer reads
it (selfrl.chat.prompt_size): a body just under the 4 MB limit cost seconds of CPU and hundreds
of MB that the server kept, per request. Each request below is one way to send such a
prompt; the tokenizer is wrapped to count the characters it is handed."""

import json

import pytest

from serving import CALC, http, running_server, tiny_serve_config

BIG = ("hello world 12345 lorem ipsum " * 130_000)[:3_900_000]  # 3.9 MB of text: under the body limit


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    cfg = tiny_serve_config(tmp_path_factory.mktemp("serve"))
    assert cfg.max_request_bytes == 4_000_000
    with running_server(tiny_model_factory(lora=True, eos_bias=3.0), tiny_tokenizer, cfg) as (url, service):
        yield url, service


@pytest.fixture
def tokenized(server, monkeypatch):
    """The characters handed to the serving tokenizer during the test, one entry per call."""
    tok = server[1].tok
    seen: list[int] = []
    real = type(tok).__call__

    def counting(self, text=None, *args, **kwargs):
        if self is tok:
            seen.append(len(text) if isinstance(text, str) else sum(map(len, text)))
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tok), "__call__", counting)
    return seen


def tool(i: int) -> dict:
    return {"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing " * 3,
                                             "parameters": {"type": "object", "properties": {}}}}


HISTORY_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": "{}"}}]}
CHAT = {
    "one huge message": {"messages": [{"role": "user", "content": BIG}]},
    "a huge system message": {"messages": [{"role": "developer", "content": BIG}, {"role": "user", "content": "hi"}]},
    "a huge tool reply": {"messages": [{"role": "user", "content": "hi"}, HISTORY_CALL,
                                       {"role": "tool", "tool_call_id": "c1", "content": BIG}], "tools": [CALC]},
    "many messages": {"messages": [{"role": "user", "content": "hi"}] * 100_000},
    "many empty messages": {"messages": [{"role": "user", "content": ""}] * 100_000},
    "many tools": {"messages": [{"role": "user", "content": "hi"}], "tools": [tool(i) for i in range(20_000)]},
}


@pytest.mark.parametrize("case", sorted(CHAT))
def test_a_prompt_beyond_the_context_is_refused_without_tokenizing_it(server, tokenized, case):
    url, service = server
    body = {"model": "selfrl", **CHAT[case]}
    assert 1_000_000 < len(json.dumps(body)) < 4_000_000
    before = service.store.count_trajectories()
    status, out = http("POST", url + "/v1/chat/completions", body)
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["param"] == "messages" and "the prompt is at least" in out["error"]["message"]
    assert sum(tokenized) == 0 and service.store.count_trajectories() == before


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_input_beyond_the_context_is_refused_without_tokenizing_it(server, tokenized, stream):
    url, _ = server
    for given in (BIG, [{"role": "user", "content": BIG}], [{"role": "user", "content": "hi"}] * 100_000):
        status, out = http("POST", url + "/v1/responses", {"model": "selfrl", "input": given, "stream": stream})
        assert status == 400 and out["error"]["code"] == "context_length_exceeded"
        assert out["error"]["param"] == "input"
    assert sum(tokenized) == 0


def test_a_token_limit_the_prompt_leaves_no_room_for_is_refused_without_tokenizing(server, tokenized):
    url, _ = server
    status, out = http("POST", url + "/v1/chat/completions", {
        "model": "selfrl", "messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 8000})
    assert status == 400 and out["error"]["code"] == "context_length_exceeded"
    assert out["error"]["param"] == "max_tokens"
    assert out["error"]["message"].startswith("max_tokens 8000 + prompt at least ")
    assert sum(tokenized) == 0


def test_a_prompt_that_fits_is_still_tokenized_and_served(server, tokenized):
    url, _ = server
    status, out = http("POST", url + "/v1/chat/completions", {
        "model": "selfrl", "messages": [{"role": "user", "content": "hello " * 500}], "max_tokens": 2})
    assert status == 200 and out["usage"]["prompt_tokens"] > 500
    assert sum(tokenized) >= 3000
