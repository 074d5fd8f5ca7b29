"""Batch statistics of a set of rollouts."""

import math

import pytest

from selfrl.run.metrics import rollout_metrics
from selfrl.core.trajectory import Trajectory


def traj(mask, reward=None, error=None):
    n = len(mask)
    return Trajectory("t", "g", 0, token_ids=list(range(n)), completion_mask=mask, logprobs=[0.0] * n,
                      reward=reward, error=error)


def test_rollouts_without_trainable_tokens_are_counted():
    # 1 of 4 has every token masked: it is left out of grouping and the loss, and the share says so
    trajs = [traj([0, 1, 1], 1.0), traj([0, 0, 0], 0.0), traj([0, 1], 0.0), traj([0, 1, 1, 1], None, error="boom")]
    m = rollout_metrics(trajs)
    assert m["train/no_trainable_tokens"] == 0.25
    assert m["train/completion_tokens"] == (2 + 0 + 1 + 3) / 4
    assert m["reward/mean"] == 1.0 / 3 and m["train/failed_rollouts"] == 0.25
    assert math.isnan(m["train/tool_success"])  # no tool called: not a rate of 0


def test_mean_reward_is_finite_for_huge_finite_rewards():
    m = rollout_metrics([traj([0, 1], 1.7e308), traj([0, 1], 1.7e308), traj([0, 1], -1e308)])
    assert m["reward/mean"] == pytest.approx(1.7e308 / 3 * 2 - 1e308 / 3, rel=1e-12)


def test_tool_use_counts_a_call_written_on_the_last_turn():
    """With max_turns = 1 a call is parsed and scored but never dispatched: it is still tool use
    (the iteration line said 0.00 on every BFCL iteration where every turn was a call)."""
    written = Trajectory("a", "g", 0, messages=[{"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'}])
    prose = Trajectory("b", "g", 0, messages=[{"role": "assistant", "content": "no call"}])
    assert rollout_metrics([written, prose])["train/tool_use"] == 0.5
    assert written.wrote_a_call and not prose.wrote_a_call
