"""The EXPERIMENTAL vLLM client (selfrl.engines.vllm) against the stand-in server
tests/fake_vllm.py on loopback: versioned adapter names never reused, what each request
asks for, and the swap check through it. A real vLLM has not been run (no GPU here)."""

import copy

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from selfrl.record import adapters
from selfrl.engines.reference import Engine
from selfrl.engines.vllm import VLLMEngine
from selfrl.safety.swap_check import SwapChecker, SwapCheckError, probe_ids
from tests.engine_backends import start_loopback
from tests.fake_vllm import create_fake_vllm


@pytest.fixture
def served(tiny_tokenizer, tiny_model_factory, tmp_path):
    """``(learner_model, client, fake_app)`` with version 0 served as the base model."""
    model = tiny_model_factory(lora=True)
    app = create_fake_vllm(Engine(copy.deepcopy(model), tiny_tokenizer))
    client = VLLMEngine(start_loopback(app), tiny_tokenizer, adapter_dir=tmp_path / "scratch", timeout_s=60)
    return model, client, app


def state(model, seed):
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) * 0.3 for k, v in get_peft_model_state_dict(model).items()}


def test_names_are_never_reused_and_old_ones_unloaded(served, tmp_path):
    model, client, app = served
    folders = {}
    for version in (0, 1, 2):  # three saved versions: the start, then two updates
        if version:
            set_peft_model_state_dict(model, state(model, version))
        folders[version] = adapters.save_version(model, tmp_path, version)
    for version in (1, 2, 0, 1):  # version 1 is served again after a rollback to 0
        client.swap(folders[version], version)
        assert client.version == version and client.health().version == version
    loads = [body["lora_name"] for kind, body in app.state.log if kind == "load"]
    unloads = [body["lora_name"] for kind, body in app.state.log if kind == "unload"]
    assert len(loads) == 4 and len(set(loads)) == 4  # a new name each time, never a reused one
    assert [n.split("-")[1] for n in loads] == ["v1", "v2", "v0", "v1"]
    assert unloads == loads[:2]  # the two newest stay loaded
    assert client.generate([[1, 2, 3]], 3, greedy=True)[0].adapter_version == 1


def test_requests_ask_for_token_ids_and_logprobs(served, tiny_tokenizer):
    model, client, app = served
    gens = client.generate([[5, 6, 7], [8, 9]], 6, temperature=0.9, stop=["x"])
    kind, body = [e for e in app.state.log if e[0] == "completions"][-1]
    assert body["prompt"] == [[5, 6, 7], [8, 9]] and body["return_token_ids"] is True and body["logprobs"] == 0
    assert body["stop_token_ids"] == [tiny_tokenizer.eos_token_id] and body["stop"] == ["x"]
    assert body["model"] == "base-model" and body["temperature"] == 0.9
    assert [len(g.token_ids) == len(g.logprobs) for g in gens] == [True, True]
    assert client.generate([[5, 6, 7]], 4, greedy=True) and app.state.log[-1][1]["temperature"] == 0.0


def test_a_state_dict_needs_the_adapter_config(served):
    model, client, _ = served
    with pytest.raises(ValueError, match="adapter_config"):
        client.swap(state(model, 1), 1)
    assert client.version == 0


def test_swap_check_through_vllm_catches_a_stale_adapter(served, tiny_tokenizer, tmp_path):
    model, client, app = served
    checker = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=10)
    assert checker.check(client, model, 0).ok
    set_peft_model_state_dict(model, state(model, 1))
    client.swap(adapters.save_version(model, tmp_path / "run", 1), 1)
    assert checker.check(client, model, 1).ok
    set_peft_model_state_dict(model, state(model, 2))
    folder = adapters.save_version(model, tmp_path / "run", 2)
    app.state.stale.add(f"{client.prefix}-v2-{client.client_id}-{client.loads + 1}")  # acknowledged, not applied
    client.swap(folder, 2)
    with pytest.raises(SwapCheckError, match="version 2"):
        checker.require(client, model, 2)
