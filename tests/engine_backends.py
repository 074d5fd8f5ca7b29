"""The sampling backends that ``tests/test_engine_conformance.py`` runs its contract on.

Each entry is ``factory(model, tokenizer, version) -> SamplingEngine``: a backend
that serves ``model``'s weights (with its LoRA adapter) as ``version``. The
conformance tests hand the factory its own copy of the model and check the
backend against a second copy, so a backend may share the weights (in process) or
load them elsewhere (a server in another process, on another device). A backend
that needs hardware this machine lacks is listed with a skip reason in
``UNAVAILABLE`` instead of being left out silently.

Also here: the chat prompts the engine tests sample from and the naive log-prob
recomputation they check sampled log-probs against (``tests/test_engine.py`` too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from selfrl.chat.template import prompt_ids
from selfrl.engines import ENGINES
from selfrl.engines.base import SamplingEngine

BackendFactory = Callable[..., SamplingEngine]
QUESTIONS = ["Hi", "What is 17+25? Use the calculator.", "Add 1, 2, 3, 4, 5, 6, 7, 8, 9 and 10, then say the total."]


def chat_prompts(tok) -> list[list[int]]:
    """Chat-template prompts of different lengths (each holds EOS = pad ids inside), sharing a > 16-token prefix."""
    return [prompt_ids(tok, [{"role": "user", "content": q}]) for q in QUESTIONS]


def assert_same_samples(a, b, atol: float = 1e-10) -> None:
    """Two lists of generations sampled the same ids, with logprobs within ``atol`` (fp64 runs: two
    ways of computing the same passes, where rounding cannot flip a draw)."""
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol, rtol=0)


def naive_logps(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    """(n,) log-probs of ``completion`` after ``prompt`` from full-vocabulary logits of one unpadded row."""
    ids = torch.tensor([prompt + completion])  # (1, T)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature  # (T, V)
    pred = logits[len(prompt) - 1:-1]  # (n, V): position t predicts token t+1
    return torch.log_softmax(pred, dim=-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)  # (n,)


def _in_process(name: str) -> BackendFactory:
    def make(model, tokenizer, version: int = 0) -> SamplingEngine:
        return ENGINES[name](model, tokenizer, version=version)

    return make


# every in-process backend registered in selfrl.engines is tested; other backends add themselves here
BACKENDS: dict[str, BackendFactory] = {name: _in_process(name) for name in ENGINES}



def _slots_caller(model, tokenizer, version: int = 0) -> SamplingEngine:
    """The slot engine with no worker thread: the waiting threads run its steps (``selfrl run``'s)."""
    return ENGINES["slots"](model, tokenizer, version=version, driver="caller")


BACKENDS["slots-caller"] = _slots_caller

# name -> why it cannot run here (reported as a skip)
UNAVAILABLE: dict[str, str] = {}


# ------------------------------------------------------------------ remote backends on loopback

_SERVERS: list = []  # every server started here, stopped at exit


def start_loopback(app) -> str:
    """Run ``app`` under uvicorn on a free 127.0.0.1 port in a daemon thread; returns its base URL."""
    import atexit

    from serving import start_uvicorn

    url, server, thread = start_uvicorn(app)
    if not _SERVERS:
        atexit.register(stop_loopback_servers)
    _SERVERS.append((server, thread))
    return url


def stop_loopback_servers() -> None:
    while _SERVERS:
        server, thread = _SERVERS.pop()
        server.should_exit = True
        thread.join(timeout=30)


def _http_sampler(model, tokenizer, version: int = 0) -> SamplingEngine:
    """``selfrl sampler`` (the reference engine behind HTTP) on loopback, used through RemoteEngine."""
    from selfrl.engines.reference import Engine
    from selfrl.engines.remote import RemoteEngine
    from selfrl.serve.sampler_app import create_sampler_app

    url = start_loopback(create_sampler_app(Engine(model, tokenizer, version=version)))
    return RemoteEngine(url, tokenizer, timeout_s=120)


BACKENDS["http"] = _http_sampler


def _fake_vllm(model, tokenizer, version: int = 0) -> SamplingEngine:
    """The vLLM client against tests/fake_vllm.py on loopback (the real vLLM: tests/real_vllm/)."""
    from selfrl.engines.reference import Engine
    from selfrl.engines.vllm import VLLMEngine
    from tests.fake_vllm import create_fake_vllm

    url = start_loopback(create_fake_vllm(Engine(model, tokenizer)))
    return VLLMEngine(url, tokenizer, version=version, adapter_config=model.peft_config["default"], timeout_s=120)


BACKENDS["vllm-client-on-fake-vllm"] = _fake_vllm
UNAVAILABLE["vllm"] = ("a real vLLM runs in its own venv and takes minutes to start: tests/real_vllm/ runs this "
                       "contract on it (make test-vllm)")


def _slots_unmerged(model, tokenizer, version: int = 0) -> SamplingEngine:
    """The slot engine on the peft model's own forward pass (``merge_lora=False``)."""
    from selfrl.engines.slots import SlotEngine

    return SlotEngine(model, tokenizer, version=version, merge_lora=False)


BACKENDS["slots-unmerged"] = _slots_unmerged
