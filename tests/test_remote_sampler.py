"""``selfrl sampler`` as a separate process: another selfrl process samples from it,
loads adapter versions into it by folder, and checks each swap numerically."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_phi
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from selfrl.record import adapters
from selfrl.config import RunConfig
from selfrl.engines.http import RemoteBackendError
from selfrl.engines.remote import RemoteEngine
from selfrl.model.load import build_policy
from selfrl.rl.logprobs import sequence_logprobs
from selfrl.safety.swap_check import SwapChecker, probe_ids

ROOT = Path(__file__).resolve().parents[1]
KEY = "sampler-test-key-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def sampler_process(tmp_path_factory, tiny_tokenizer):
    """``(url, cfg)``: ``selfrl sampler`` serving a tiny Phi in a subprocess, with an API key."""
    folder = save_tiny_phi(tmp_path_factory.mktemp("model"), tiny_tokenizer)
    key_file = tmp_path_factory.mktemp("key") / "key"
    key_file.write_text(KEY + "\n")
    port = free_port()
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "selfrl.cli", "sampler", "--model", str(folder), "--lora-r", "4", "--port", str(port),
         "--device", "cpu", "--api-key-file", str(key_file)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            RemoteEngine(url, tiny_tokenizer, api_key=KEY, timeout_s=5)
            break
        except RemoteBackendError:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "selfrl sampler did not come up"
            time.sleep(0.3)
    cfg = RunConfig()
    cfg.model.name, cfg.lora.r, cfg.model.device = str(folder), 4, "cpu"  # as the sampler (fp32 on both sides)
    yield url, cfg
    proc.terminate()
    proc.wait(timeout=30)


def test_another_process_samples_swaps_by_folder_and_checks(sampler_process, tiny_tokenizer, tmp_path):
    url, cfg = sampler_process
    remote = RemoteEngine(url, tiny_tokenizer, api_key=KEY, timeout_s=60)
    learner_model, _ = build_policy(cfg)  # same seed and LoRA shape: the sampler's version 0
    checker = SwapChecker(probe_ids(tiny_tokenizer), deadline_s=10.0)
    assert checker.check(remote, learner_model, 0).ok

    prompt = tiny_tokenizer.encode("What is 17+25?")
    torch.manual_seed(0)
    gens = remote.generate([prompt] * 3, max_new_tokens=8, temperature=0.8)
    assert len(gens) == 3 and all(g.adapter_version == 0 and 1 <= len(g.token_ids) <= 8 for g in gens)
    for g in gens:  # the sampler's logprobs are the learner's numbers for the same weights
        got = sequence_logprobs(learner_model, prompt + g.token_ids, temperature=0.8)[len(prompt) - 1:]
        assert got == pytest.approx(g.logprobs, abs=1e-4)

    torch.manual_seed(5)
    state = {k: torch.randn_like(v) * 0.3 for k, v in get_peft_model_state_dict(learner_model).items()}
    set_peft_model_state_dict(learner_model, state)
    folder = adapters.save_version(learner_model, tmp_path, 1)
    remote.swap(folder, 1)
    res = checker.check(remote, learner_model, 1)
    assert res.ok and res.mean_abs_diff < 1e-5 and res.diff_to_previous > 0.01
    assert remote.generate([prompt], 4, greedy=True)[0].adapter_version == 1
    assert remote.health().ok and remote.health().version == 1


def test_the_sampler_refuses_a_wrong_key_and_a_torn_folder(sampler_process, tiny_tokenizer, tmp_path):
    url, cfg = sampler_process
    with pytest.raises(ValueError, match="API key"):
        RemoteEngine(url, tiny_tokenizer, api_key="wrong-key-0123456789")
    remote = RemoteEngine(url, tiny_tokenizer, api_key=KEY)
    model, _ = build_policy(cfg)
    folder = adapters.save_version(model, tmp_path, 7)
    (folder / adapters.MARKER).unlink()  # a save that never finished
    before = remote.version
    with pytest.raises(ValueError, match="no completion marker"):
        remote.swap(folder, 7)
    assert remote.health().version == before


def test_the_sampler_answers_400_for_ids_outside_the_vocabulary_and_goes_on(sampler_process, tiny_tokenizer):
    from selfrl.engines import http

    url, _ = sampler_process
    remote = RemoteEngine(url, tiny_tokenizer, api_key=KEY, timeout_s=60)
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 1000000 at position 1; ids must be integers"):
        remote.generate([[1, 10**6]], 2)
    with pytest.raises(ValueError, match=r"token id -3 at position 0"):
        http.call(url, "/sampler/logprobs", {"token_ids": [-3, 1]}, timeout_s=60, api_key=KEY)
    assert len(remote.generate([[1, 2]], 2, greedy=True)[0].token_ids) >= 1  # still serves


def test_the_sampler_reports_its_context_and_a_rollout_ends_a_row_that_would_not_fit(sampler_process,
                                                                                      tiny_tokenizer):
    from selfrl.config import RolloutConfig
    from selfrl.engines.base import engine_context
    from selfrl.rollout.agent import rollout
    from selfrl.core.tasks import Task
    from selfrl.core.tools import CALCULATOR

    url, _ = sampler_process
    remote = RemoteEngine(url, tiny_tokenizer, api_key=KEY, timeout_s=60)
    assert remote.context == engine_context(remote) == 8192  # the tiny model's max_position_embeddings
    with pytest.raises(ValueError, match=r"max_new_tokens 8188 \+ prompt 5 tokens exceeds the context of 8192"):
        remote.generate([[1, 2, 3, 4, 5]], 8188)
    # the rollout never sends what the sampler would refuse: the long row fails alone, the other is sampled
    long = Task.make("test", "What is 2+2? " + "Think. " * 3000, "4")
    trajs = rollout(remote, [long, Task.make("test", "What is 1+1?", "2")], ["a", "b"], [CALCULATOR],
                    RolloutConfig(max_new_tokens=8, max_turns=1))
    assert trajs[0].error.startswith("the prompt is ") and trajs[0].error.endswith("context of 8192 tokens")
    assert trajs[1].error is None and trajs[1].num_turns == 1
