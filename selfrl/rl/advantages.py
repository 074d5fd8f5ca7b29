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
* The mean and std are computed on the rewards divided by a power of two near the
  group's largest |r| (:func:`mean_std`), so that any finite rewards give finite
  advantages: the naive ``sum(r)`` or ``(r - mean)^2`` overflows at |r| ~ 1e154
  (``(1e200 - 0)^2``) and ``(r - mean) / std`` then raised ``OverflowError`` or gave NaN.
  Dividing by a power of two is exact, so wherever the naive formula does not
  overflow or underflow the advantages are the same floats.
* With ``scale_rewards="none"`` the advantage ``r - mean`` is in reward units and
  unbounded. When the batch's largest ``|r - mean|`` exceeds :data:`ADVANTAGE_LIMIT`
  (2^20), every advantage of the batch is multiplied by one power of two that brings
  it within the limit (``AdvantageResult.scale``). A positive factor on the whole
  batch leaves the update's direction unchanged (Adam normalises its size); without it
  rewards of 1e200 give advantages that the float32 loss turns into inf, and centred
  rewards above 1.8e308 are not even a float.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

ADVANTAGE_LIMIT = 2.0 ** 20  # largest |advantage| with scale_rewards="none"; above it the batch is scaled down


def _finite_float(value: float, message: str) -> float:
    """``float(value)``, or ValueError ``message value`` when it is not finite (an int beyond
    the float range, 10**400, included: ``float`` raised OverflowError)."""
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x):
        raise ValueError(f"{message} {value}"[:200])
    return x


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and population std (ddof=0) of finite ``values``, finite for any finite input.

    Both are computed on ``values / 2^k`` with ``2^k`` the power of two just above the
    largest ``|v|`` and multiplied back: division by a power of two is exact, so the
    result equals the naive ``sum(v) / n`` and ``sqrt(sum((v - mean)^2) / n)`` wherever
    those do not overflow, and stays finite where they do (``|mean| <= max|v|``,
    ``std <= max|v|``).

    Raises:
        ValueError: ``values`` is empty or holds a value that is not finite.

    >>> mean_std([1e200, 0.0])
    (5e+199, 5e+199)
    >>> mean_std([1.0, 2.0, 3.0, 4.0])
    (2.5, 1.118033988749895)
    """
    if not values:
        raise ValueError("mean_std needs at least one value")
    values = [_finite_float(v, "mean_std needs finite values, got") for v in values]
    top = max(abs(v) for v in values)
    if top == 0.0:
        return 0.0, 0.0
    k = math.frexp(top)[1]  # top = m * 2^k with 0.5 <= m < 1
    w = [math.ldexp(v, -k) for v in values]  # in (-1, 1)
    mean_w = sum(w) / len(w)
    std_w = math.sqrt(sum((x - mean_w) ** 2 for x in w) / len(w))
    return math.ldexp(mean_w, k), math.ldexp(std_w, k)


@dataclass(frozen=True)
class AdvantageResult:
    """Advantages for a batch of trajectories.

    Attributes:
        advantages: one per trajectory, same order as the input; None where the
            reward was None.
        num_groups: groups with at least one scored trajectory.
        num_groups_no_signal: groups whose advantages are all 0 (one sample or
            constant reward).
        scale: the power of two every advantage was multiplied by to keep it within
            :data:`ADVANTAGE_LIMIT` (only with ``scale_rewards="none"``); 1.0 otherwise.
    """

    advantages: list[float | None]
    num_groups: int
    num_groups_no_signal: int
    scale: float = 1.0

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
        _finite_float(r, f"reward {i} is not finite:")
        if num_completion_tokens is not None and num_completion_tokens[i] == 0:
            continue
        members[g].append(i)

    advantages: list[float | None] = [None] * len(rewards)
    no_signal = 0
    centred: dict[int, tuple[float, int]] = {}  # i -> (r_i - mean) as mantissa, exponent ("none")
    for idx in members.values():
        values = [float(rewards[i]) for i in idx]  # type: ignore[arg-type]
        mean, std = mean_std(values)
        if len(values) < 2 or std < eps:
            no_signal += 1
            for i in idx:
                advantages[i] = 0.0
            continue
        k = math.frexp(max(abs(v) for v in values))[1]
        for i, v in zip(idx, values):
            d = math.ldexp(v, -k) - math.ldexp(mean, -k)  # (r - mean) / 2^k, in (-2, 2): never overflows
            if scale_rewards == "group":
                advantages[i] = d / math.ldexp(std, -k)
            else:
                centred[i] = (d, k)
    scale = 1.0
    if centred:
        # the largest |r - mean| as (exponent, mantissa): comparable without forming it
        e, m = max((math.frexp(d)[1] + k, abs(math.frexp(d)[0])) for d, k in centred.values())
        shift = max(0, e - math.frexp(ADVANTAGE_LIMIT)[1])  # now |r - mean| * 2^-shift <= 2^21
        while math.ldexp(m, e - shift) > ADVANTAGE_LIMIT:
            shift += 1
        scale = math.ldexp(1.0, -shift)
        for i, (d, k) in centred.items():
            advantages[i] = math.ldexp(d, k - shift)
    return AdvantageResult(advantages, len(members), no_signal, scale)
