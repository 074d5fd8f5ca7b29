"""The real vLLM as a backend of the engine contract: a factory in the shape of
``tests/engine_backends.py``'s, and the client that sends a model's output bias as ``logit_bias``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from selfrl.engines.vllm import VLLMEngine


class LogitBiasVLLM(VLLMEngine):
    """The vLLM client, sending ``logit_bias`` with every sampling request (not with the probe)."""

    def __init__(self, *args, logit_bias: dict[str, float] | None = None, **kwargs):
        self.logit_bias = logit_bias
        super().__init__(*args, **kwargs)

    def _call(self, path: str, body=None, timeout_s: float | None = None):
        if path == "/v1/completions" and self.logit_bias and body.get("prompt_logprobs") is None:
            body = {**body, "logit_bias": self.logit_bias}
        return super()._call(path, body, timeout_s)


def base_state(model) -> dict[str, torch.Tensor]:
    """The frozen weights of a (LoRA-wrapped) tiny model under the names of its saved folder,
    without the output bias."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {k.replace(".base_layer", ""): v for k, v in base.state_dict().items()
            if "lora_" not in k and k != "lm_head.bias"}


def real_vllm_backend(url: str, base_dir: Path, scratch: Path):
    """A ``tests/engine_backends.py`` factory: the vLLM server at ``url`` (serving ``base_dir``)
    with the model's LoRA loaded as ``version``, its output bias sent as ``logit_bias``.

    Fails the test when the model's frozen weights are not the served base's."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    served = load_file(base_dir / "model.safetensors")

    def make(model, tokenizer, version: int = 0):
        mine = base_state(model)
        if set(mine) != set(served) or any(not torch.equal(mine[k], served[k]) for k in served):
            pytest.fail(f"the test model's frozen weights are not those vLLM serves ({base_dir})")
        bias = model.get_base_model().lm_head.bias
        logit_bias = None if bias is None else {str(i): float(b) for i, b in enumerate(bias.tolist()) if b != 0.0}
        engine = LogitBiasVLLM(url, tokenizer, version=version, adapter_config=model.peft_config["default"],
                               adapter_dir=scratch / f"adapters-{len(list(scratch.iterdir()))}", timeout_s=120,
                               logit_bias=logit_bias)
        engine.swap(get_peft_model_state_dict(model), version)
        return engine

    return make
