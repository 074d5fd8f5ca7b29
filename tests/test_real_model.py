"""The embedded SmolLM2-135M-Instruct, really sampled with tools (slow: run with -m slow).

Converts the embedded GGUF on first use (about 30 s, cached in ~/.cache/selfrl).
"""

import pytest
import torch

from selfrl.chat.template import prompt_ids
from selfrl.config import RunConfig
from selfrl.engines.reference import Engine
from selfrl.model.load import build_policy
from selfrl.rl.logprobs import per_token_logps
from selfrl.rollout.agent import RolloutConfig, initial_messages, rollout
from selfrl.envs import get_env
from selfrl.core.tools import CALCULATOR
from test_rollout import assert_invariants

pytestmark = pytest.mark.slow


def test_embedded_model_rollouts_are_well_formed():
    model, tok = build_policy(RunConfig())  # load_model() default + the default LoRA (B = 0)
    engine = Engine(model, tok)
    cfg = RolloutConfig(max_turns=3, max_new_tokens=48, temperature=0.7)
    source = get_env("chain_sum")
    tasks = [t for t in source.sample(2, seed=7) for _ in range(2)]
    torch.manual_seed(0)
    trajs = rollout(engine, tasks, [t.id for t in tasks], [CALCULATOR], cfg)

    assert len(trajs) == 4
    for task, traj in zip(tasks, trajs):
        assert_invariants(traj, tok.eos_token_id)
        assert traj.token_ids[:traj.prompt_len] == prompt_ids(tok, initial_messages(task, [CALCULATOR], cfg, tok))
        assert traj.adapter_version == 0 and 1 <= traj.num_turns <= cfg.max_turns
        assert len(traj.tool_calls) <= traj.num_turns - 1
        ids = torch.tensor([traj.token_ids])  # (1, T)
        mask = torch.tensor([traj.completion_mask])  # (1, T)
        with torch.no_grad():
            recomputed = per_token_logps(model, ids, torch.ones_like(ids), mask, cfg.temperature)[0]  # (T,)
        torch.testing.assert_close(recomputed, torch.tensor(traj.logprobs), atol=1e-3, rtol=0)
