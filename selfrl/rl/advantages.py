"""Group-relative advantages (GRPO).

Source: Shao et al. 2024, "DeepSeekMath", eq. (3) outcome supervision:
``A_i = (r_i - mean(r_group)) / std(r_group)``.

How this departs from the paper, and why:

* A group with one sample, or whose rewards are all equal (std below ``eps``),
  gets advantage 0 for every member and is reported as "no signal". The paper's
  formula would divide by zero there (NaN) or, with the usual ``+ 1e-4``, blow a
  tiny float difference up into a huge advantage.
* ``scale_rewards="none"`` gives ``r_i - mean`` only (Dr. GRPO, Liu et al. 2025),
  which does not up-weight nearly-solved or nearly-failed groups.
* The std is the population std (ddof=0) of the group (TRL and verl use the
  unbiased one), so that a two-sample group {0, 1} gives exactly {-1, +1}.
* Trajectories whose reward is None (failed rollout, excluded) take no part in
  their group's statistics and get advantage None.
* So do trajectories with no trainable token (``num_completion_tokens`` 0: every
  token masked, e.g. a turn that produced nothing). Counting them would move the
  group's mean and std by a sample that the loss can never push on: rewards
  [1.0, 0.0] with the second sample empty would give [+1, -1], and the whole push
  would land on the real sample with no partner to balance it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages for a batch of trajectories.

    Attributes:
        advantages: one per trajectory, same order as the input; None where the
            reward was None.
        num_groups: groups with at least one scored trajectory.
        num_groups_no_signal: groups whose advantages are all 0 (one sample or
            constant reward).
    """

    advantages: list[float | None]
    num_groups: int
    num_groups_no_signal: int

    @property
    def frac_no_signal(self) -> float:
        """Share of groups that carry no learning signal (TRL's ``frac_reward_zero_std``)."""
        return self.num_groups_no_signal / self.num_groups if self.num_groups else 1.0


def group_advantages(
    rewards: Sequence[float | None],
    group_ids: Sequence[str],
    scale_rewards: str = "group",
    eps: float = 1e-6,
    num_completion_tokens: Sequence[int] | None = None,
) -> AdvantageResult:
    """Compute GRPO advantages for trajectories grouped by ``group_ids``.

    Args:
        rewards: (N,) scalar reward per trajectory, or None to exclude it.
        group_ids: (N,) group key per trajectory (same task, same iteration).
            Groups may have uneven sizes.
        scale_rewards: ``"group"`` divides by the group std (GRPO), ``"none"``
            only centres (Dr. GRPO).
        eps: std below this counts as a constant group; > 0.
        num_completion_tokens: (N,) trainable tokens per trajectory
            (``Trajectory.num_completion_tokens``); a trajectory with 0 is left out like a
            None reward. None: every trajectory counts.

    Returns:
        :class:`AdvantageResult` with (N,) advantages.

    Raises:
        ValueError: lengths differ, unknown ``scale_rewards``, ``eps`` not > 0, a negative
            token count, or a reward is not finite.

    >>> group_advantages([1.0, 0.0, 0.5, 0.5], ["a", "a", "b", "b"]).advantages
    [1.0, -1.0, 0.0, 0.0]
    >>> group_advantages([1.0, 0.0], ["a", "a"], num_completion_tokens=[3, 0]).advantages
    [0.0, None]
    """
    if len(rewards) != len(group_ids):
        raise ValueError(f"rewards ({len(rewards)}) and group_ids ({len(group_ids)}) differ in length")
    if num_completion_tokens is not None and len(num_completion_tokens) != len(rewards):
        raise ValueError(f"num_completion_tokens ({len(num_completion_tokens)}) and rewards ({len(rewards)}) "
                         "differ in length")
    if num_completion_tokens is not None and any(n < 0 for n in num_completion_tokens):
        raise ValueError("num_completion_tokens must be >= 0")
    if scale_rewards not in ("group", "none"):
        raise ValueError(f"scale_rewards must be 'group' or 'none', got {scale_rewards!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it guards the division by the group std), got {eps}")
    members: dict[str, list[int]] = defaultdict(list)
    for i, (r, g) in enumerate(zip(rewards, group_ids)):
        if r is None:
            continue
        if not math.isfinite(r):
            raise ValueError(f"reward {i} is not finite: {r}")
        if num_completion_tokens is not None and num_completion_tokens[i] == 0:
            continue
        members[g].append(i)

    advantages: list[float | None] = [None] * len(rewards)
    no_signal = 0
    for idx in members.values():
        values = [float(rewards[i]) for i in idx]  # type: ignore[arg-type]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        if len(values) < 2 or std < eps:
            no_signal += 1
            for i in idx:
                advantages[i] = 0.0
            continue
        for i, v in zip(idx, values):
            advantages[i] = (v - mean) / std if scale_rewards == "group" else v - mean
    return AdvantageResult(advantages, len(members), no_signal)
