"""OpenAI logprobs from the real server (the real ``openai`` client, tiny model): raw token
bytes, entries only for the content's tokens, ``top_logprobs`` 0..20, streamed chunks;
and what a completion returns for reasoning blocks and odd tool-call keys."""

import json

import pytest
import torch
from openai import OpenAI

from selfrl.engines.reference import Generation
from selfrl.serve.logprobs import LOGPROB_FLOOR, content_entries, slice_entries, token_bytes
from serving import CALC, SERVE_ENGINES, http, patch_generate, running_server, serve_config

MSGS = [{"role": "user", "content": "Say hello in Chinese."}]


def full_logps(model, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """(n, V) log_softmax(logits / T) at each position of ``ids`` after ``prompt``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0].float()  # (P+n, V)
    return torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)  # (n, V)


def forced(service, text: str):
    """An ``Engine.generate`` that 'samples' ``text`` + EOS, with the real logprobs and
    top-k alternatives the engine would record."""
    tok, model = service.tok, service.engine.model
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate(prompts, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, on_step=None, stop=None,
                 top_logprobs=0, step_logprobs=False):
        out, steps = [], []
        for p in prompts:
            lps = full_logps(model, p, ids, 1.0 if greedy else temperature)  # (n, V)
            sampled = lps.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)  # (n,)
            v, ix = lps.topk(max(top_logprobs, 1), dim=-1)  # (n, k)
            top = [list(zip(a, b)) for a, b in zip(ix.tolist(), v.tolist())] if top_logprobs else None
            steps.append((sampled, ix, v))
            out.append(Generation(list(ids), sampled.tolist(), True, service.engine.version, top_logprobs=top))
        if on_step is not None:  # as the engine does: every id but the last, in two steps
            for k in (len(ids) // 2, len(ids) - 1):
                batch = torch.tensor([ids[:k]] * len(prompts))
                if not step_logprobs:
                    on_step(batch)
                    continue
                top = (torch.stack([s[1][:k] for s in steps]), torch.stack([s[2][:k] for s in steps])) \
                    if top_logprobs else None
                on_step(batch, torch.stack([s[0][:k] for s in steps]), top)
        return out

    return generate, ids


def joined(entries) -> bytes:
    return b"".join(bytes(e["bytes"]) for e in entries)


def test_logprob_entries_carry_raw_token_bytes_and_only_the_contents_tokens(server, client, monkeypatch):
    url, service = server
    gen, ids = forced(service, "你好")
    patch_generate(monkeypatch, service, gen)
    pieces = token_bytes(service.tok, ids)
    assert len(ids) - 1 > 2  # the tiny vocabulary splits the two characters into byte tokens
    r = client.chat.completions.create(model="selfrl", messages=MSGS, logprobs=True, max_tokens=20)
    ch = r.choices[0]
    assert ch.message.content == "你好"
    entries = ch.logprobs.content
    # one entry per content token, each its own raw bytes (never U+FFFD's 239, 191, 189), no <|im_end|>
    assert [bytes(e.bytes) for e in entries] == pieces[:-1]
    assert b"".join(bytes(e.bytes) for e in entries) == "你好".encode()
    assert all(e.bytes != [239, 191, 189] for e in entries)
    assert "<|im_end|>" not in [e.token for e in entries]
    lps = full_logps(service.engine.model, service.prepare(
        __import__("selfrl.serve.protocol", fromlist=["x"]).ChatCompletionRequest(model="selfrl", messages=MSGS)).prompt,
        ids, 1.0)
    expected = [lps[i, t].item() for i, t in enumerate(ids[:-1])]
    assert [e.logprob for e in entries] == pytest.approx(expected, abs=1e-5)
    assert all(e.top_logprobs == [] for e in entries)


def test_logprobs_leave_out_tool_calls_and_reasoning(server, client, monkeypatch):
    url, service = server
    text = ('<think>maybe <tool_call>{"name": "calculator", "arguments": {"expression": "17*25"}}</tool_call>'
            '? no.</think>Sure. <tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>')
    gen, _ = forced(service, text)
    patch_generate(monkeypatch, service, gen)
    r = client.chat.completions.create(model="selfrl", messages=MSGS, tools=[CALC], logprobs=True, top_logprobs=1,
                                       max_tokens=200)
    ch = r.choices[0]
    assert ch.message.content == "Sure."
    assert joined([e.model_dump() for e in ch.logprobs.content]) == b"Sure."
    assert all(len(e.top_logprobs) == 1 for e in ch.logprobs.content)


@pytest.mark.parametrize("k", [0, 2, 20])
def test_top_logprobs_gives_k_alternatives_in_full_and_streamed_responses(server, client, monkeypatch, k):
    url, service = server
    gen, ids = forced(service, "hi 你")
    patch_generate(monkeypatch, service, gen)
    kw = dict(model="selfrl", messages=MSGS, logprobs=True, top_logprobs=k, temperature=0.7)
    full = client.chat.completions.create(**kw).choices[0]
    entries = full.logprobs.content
    assert joined([e.model_dump() for e in entries]) == full.message.content.encode() == "hi 你".encode()
    for e in entries:
        assert len(e.top_logprobs) == k
        alts = [a.logprob for a in e.top_logprobs]
        assert alts == sorted(alts, reverse=True)
        if k:
            assert alts[0] >= e.logprob - 1e-6  # the most likely token is at least as likely as the sampled one
    chunks = list(client.chat.completions.create(stream=True, **kw))
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content_chunks, "no content was streamed"
    assert len(content_chunks) >= 2  # streamed as decoding goes, not all at the end
    streamed = []
    for c in content_chunks:  # each content chunk carries the entries of its own bytes
        lp = c.choices[0].logprobs
        assert lp is not None and joined([e.model_dump() for e in lp.content]) == c.choices[0].delta.content.encode()
        streamed += lp.content
    # together they are the full response's entries (a token cut by a chunk edge is split in two)
    assert joined([e.model_dump() for e in streamed]) == joined([e.model_dump() for e in entries])
    by_offset, off = {}, 0
    for e in entries:
        by_offset.update({off + j: [e.logprob] + [a.logprob for a in e.top_logprobs] for j in range(len(e.bytes))})
        off += len(e.bytes)
    off = 0
    for e in streamed:
        assert [e.logprob] + [a.logprob for a in e.top_logprobs] == pytest.approx(by_offset[off], abs=1e-6)
        off += len(e.bytes)


@pytest.mark.parametrize("body, param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
])
def test_top_logprobs_out_of_range_or_without_logprobs_is_a_400(server, body, param):
    url, _ = server
    status, out = http("POST", url + "/v1/chat/completions", {"model": "selfrl", "messages": MSGS, **body})
    assert status == 400 and out["error"]["param"] == param


def test_a_call_drafted_while_thinking_is_not_returned(server, client, monkeypatch):
    url, service = server
    text = ('<think>maybe <tool_call>{"name": "calculator", "arguments": {"expression": "17*25"}}</tool_call>'
            '? no.</think><tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>')
    gen, _ = forced(service, text)
    patch_generate(monkeypatch, service, gen)
    for stream in (False, True):
        if stream:
            chunks = list(client.chat.completions.create(model="selfrl", messages=MSGS, tools=[CALC], stream=True,
                                                         max_tokens=200))
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                                for c in chunks if c.choices)
        else:
            msg = client.chat.completions.create(model="selfrl", messages=MSGS, tools=[CALC],
                                                 max_tokens=200).choices[0].message
            calls, content, reasoning = msg.tool_calls, msg.content or "", msg.model_extra["reasoning_content"]
        assert [json.loads(c.function.arguments) for c in calls] == [{"expression": "17+25"}]
        assert content == "" and "17*25" in reasoning


@pytest.mark.parametrize("body, args", [
    ({"name": "calculator", "parameters": {"expression": "2+3"}}, {"expression": "2+3"}),  # Llama-3.1's key
    ({"name": "calculator", "args": {"expression": "2+3"}}, None),
    ({"name": "calculator", "arguments": {"expression": "2+3"}, "parameters": {"expression": "9"}}, None),
    ({"name": "calculator", "input": {"expression": "2+3"}}, None),
])
def test_a_call_reaches_the_client_only_with_the_arguments_the_model_wrote(server, client, monkeypatch, body, args):
    url, service = server
    gen, _ = forced(service, "<tool_call>" + json.dumps(body) + "</tool_call>")
    patch_generate(monkeypatch, service, gen)
    msg = client.chat.completions.create(model="selfrl", messages=MSGS, tools=[CALC],
                                                 max_tokens=200).choices[0].message
    if args is None:  # malformed: never a call with "{}"; its text stays visible, without the markup
        assert msg.tool_calls is None and msg.content == json.dumps(body)
    else:
        assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [args]


def test_invalid_utf8_keeps_its_raw_bytes_and_the_entries_after_it_stay_aligned():
    from selfrl.serve.logprobs import bytes_text, char_offsets, char_to_byte_spans

    pieces = [b"\xec", b"\xda", b"ok", b"\xe4\xbd", b"\xa0"]
    text = bytes_text(pieces)
    assert text == "\ufffd\ufffdok你"
    spans = char_to_byte_spans(text, [(2, 5)], char_offsets(b"".join(pieces)))
    entries = content_entries(pieces, [-1.0, -2.0, -3.0, -4.0, -5.0], spans)
    assert [(e["bytes"], e["logprob"]) for e in entries] == [(list(b"ok"), -3.0), ([0xE4, 0xBD], -4.0), ([0xA0], -5.0)]


def test_content_entries_and_slices_keep_the_byte_invariant():
    pieces = [b"\xe4\xbd", b"\xa0\xe5", b"\xa5\xbd", b"!"]
    entries = content_entries(pieces, [-1.0, -2.0, float("-inf"), -4.0], [(0, 6)])
    assert joined(entries) == "你好".encode() and entries[2]["logprob"] == LOGPROB_FLOOR
    assert entries[0]["token"] == "\\xe4\\xbd"
    parts = [slice_entries(entries, 0, 3), slice_entries(entries, 3, 6)]
    assert [joined(p) for p in parts] == ["你".encode(), "好".encode()]


def test_engine_top_logprobs_are_the_k_most_likely_ids_of_the_sampling_distribution(server):
    _, service = server
    engine = service.engine
    prompt = service.tok("What is 12 + 30?", add_special_tokens=False)["input_ids"]
    torch.manual_seed(0)
    g = engine.generate([prompt], 5, temperature=0.7, top_logprobs=3)[0]
    lps = full_logps(engine.model, prompt, g.token_ids, 0.7)  # (n, V)
    assert len(g.top_logprobs) == len(g.token_ids)
    for i, alts in enumerate(g.top_logprobs):
        v, ix = lps[i].topk(3)
        assert [a for a, _ in alts] == ix.tolist()
        assert [b for _, b in alts] == pytest.approx(v.tolist(), abs=1e-4)
    assert engine.generate([prompt], 3, temperature=0.7)[0].top_logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_under_tool_choice_none_is_plain_text_without_markup(server, client, monkeypatch, stream):
    url, service = server
    call = {"name": "calculator", "arguments": {"expression": "2+3"}}
    gen, _ = forced(service, "Sure: <tool_call>" + json.dumps(call) + "</tool_call>")
    patch_generate(monkeypatch, service, gen)
    kw = dict(model="selfrl", messages=MSGS, tools=[CALC], tool_choice="none", max_tokens=200)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        ch = client.chat.completions.create(**kw).choices[0]
        content, calls, finish = ch.message.content, ch.message.tool_calls or [], [ch.finish_reason]
    assert content == "Sure: " + json.dumps(call) and calls == [] and finish == ["stop"]


def test_engine_step_logprobs_are_the_values_it_records(server):
    _, service = server
    engine = service.engine
    prompt = service.tok("What is 12 + 30?", add_special_tokens=False)["input_ids"]
    seen = []
    torch.manual_seed(1)
    g = engine.generate([prompt, prompt[:-2]], 6, temperature=0.7, top_logprobs=2, step_logprobs=True,
                        on_step=lambda ids, lps, top: seen.append((ids.clone(), lps.clone(), top)))
    ids, lps, (top_ix, top_v) = seen[-1]
    for row, gen in enumerate(g):
        k = min(ids.shape[1], len(gen.token_ids))
        assert ids[row, :k].tolist() == gen.token_ids[:k]
        assert lps[row, :k].tolist() == pytest.approx(gen.logprobs[:k], abs=1e-6)
        assert [[a for a, _ in t] for t in gen.top_logprobs[:k]] == top_ix[row, :k].tolist()


def test_a_real_streamed_completion_carries_the_recorded_logprobs_chunk_by_chunk(server, client):
    url, service = server
    for attempt in range(8):  # a random tiny model: retry until it writes a few content tokens
        chunks = list(client.chat.completions.create(model="selfrl", messages=MSGS, stream=True, logprobs=True,
                                                     top_logprobs=1, max_tokens=10, temperature=1.5))
        content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
        if len(content_chunks) >= 2:
            break
    assert len(content_chunks) >= 2
    from selfrl.record import served as records

    with service.store.lock:
        row = records.find_response(service.store, chunks[0].id)
        traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
    recorded = [lp for lp, m in zip(traj.logprobs, traj.completion_mask) if m]
    for c in content_chunks:  # a random model may sample bytes that are not UTF-8: they show as U+FFFD
        lp = c.choices[0].logprobs
        raw = joined([e.model_dump() for e in lp.content])
        assert raw.decode("utf-8", errors="replace") == c.choices[0].delta.content
        for e in lp.content:
            assert any(abs(e.logprob - r) < 1e-5 for r in recorded)
            assert len(e.top_logprobs) == 1 and e.top_logprobs[0].logprob >= e.logprob - 1e-6


def test_the_slot_engine_serves_the_reference_engines_top_logprobs(tiny_tokenizer, tiny_model_factory, tmp_path):
    """The same weights behind both backends, greedy: the same content and, per token, the
    same logprob and top alternatives within 1e-5 (fp32), full and streamed."""
    import copy

    model = tiny_model_factory(lora=True, eos_bias=1.0)
    body = dict(model="selfrl", messages=MSGS, logprobs=True, top_logprobs=3, max_tokens=8, temperature=0)
    answers = {}
    for engine in SERVE_ENGINES:
        with running_server(copy.deepcopy(model), tiny_tokenizer, serve_config(tmp_path / engine, engine)) as (url, _):
            client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            full = client.chat.completions.create(**body).choices[0]
            chunks = list(client.chat.completions.create(stream=True, **body))
            streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content]
            answers[engine] = (full.message.content, full.logprobs.content, streamed)
    (text_a, full_a, stream_a), (text_b, full_b, stream_b) = answers["reference"], answers["slots"]
    assert text_a == text_b and full_a and len(full_a) == len(full_b) == len(stream_a) == len(stream_b)
    for a, b in [*zip(full_a, full_b), *zip(stream_a, stream_b), *zip(full_a, stream_b)]:
        assert a.bytes == b.bytes and abs(a.logprob - b.logprob) < 1e-5
        assert [t.bytes for t in a.top_logprobs] == [t.bytes for t in b.top_logprobs] and len(a.top_logprobs) == 3
        assert all(abs(x.logprob - y.logprob) < 1e-5 for x, y in zip(a.top_logprobs, b.top_logprobs))
