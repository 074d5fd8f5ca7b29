import math

import pytest

from selfrl.rl.advantages import ADVANTAGE_LIMIT, group_advantages, mean_std

S = math.sqrt(1.5)  # 1 / sqrt(2/3): the scaled advantage of a reward 1 away from the mean of {1, 2, 3}


def approx(values):
    return [None if v is None else pytest.approx(v, abs=1e-12) for v in values]


def test_two_groups_of_uneven_size_interleaved():
    # group a = {1, 0}:    mean 0.5, population std sqrt((0.25 + 0.25) / 2) = 0.5 -> (r - 0.5) / 0.5 = +1, -1
    # group b = {3, 1, 2}: mean 2,   population std sqrt((1 + 1 + 0) / 3) = sqrt(2/3)
    #                      -> +1 / sqrt(2/3), -1 / sqrt(2/3), 0
    rewards = [1.0, 3.0, 0.0, 1.0, 2.0]
    groups = ["a", "b", "a", "b", "b"]
    res = group_advantages(rewards, groups)
    assert res.advantages == approx([1.0, S, -1.0, -S, 0.0])
    assert res.num_groups == 2 and res.num_groups_no_signal == 0 and res.frac_no_signal == 0.0


def test_scale_none_only_centres():
    # Dr. GRPO: r - mean; group a mean 0.5, group b mean 2
    res = group_advantages([1.0, 3.0, 0.0, 1.0, 2.0], ["a", "b", "a", "b", "b"], scale_rewards="none")
    assert res.advantages == approx([0.5, 1.0, -0.5, -1.0, 0.0])


def test_constant_and_single_sample_groups_give_zero_and_count_as_no_signal():
    # c = {0.7, 0.7, 0.7}: std 0; d = {5.0}: one sample; e = {0, 2}: mean 1, std 1 -> -1, +1
    rewards = [0.7, 0.7, 5.0, 0.7, 0.0, 2.0]
    groups = ["c", "c", "d", "c", "e", "e"]
    res = group_advantages(rewards, groups)
    assert res.advantages == [0.0, 0.0, 0.0, 0.0, -1.0, 1.0]
    assert res.num_groups == 3 and res.num_groups_no_signal == 2
    assert res.frac_no_signal == pytest.approx(2 / 3)


def test_spread_below_eps_is_a_constant_group_not_a_huge_advantage():
    # {0, 1e-7}: std 5e-8 < eps = 1e-6. The paper's (r - mean) / (std + 1e-4) would give ~ +-5e-4,
    # dividing by the bare std +-1; both are noise, so the group gets 0.
    res = group_advantages([0.0, 1e-7], ["g", "g"])
    assert res.advantages == [0.0, 0.0] and res.num_groups_no_signal == 1
    # just above eps the group carries signal: {0, 1e-5} has std 5e-6 -> exactly -1, +1
    assert group_advantages([0.0, 1e-5], ["g", "g"]).advantages == approx([-1.0, 1.0])


def test_none_rewards_are_excluded_from_their_group():
    # group a keeps {2, 4}: mean 3, std 1 -> -1, +1; the None gets None and does not move the mean.
    # group b = {None, 1.0}: one scored sample left -> 0, no signal.
    # group c has no scored sample: not a group at all.
    rewards = [None, 2.0, 4.0, None, 1.0, None]
    groups = ["a", "a", "a", "b", "b", "c"]
    res = group_advantages(rewards, groups)
    assert res.advantages == [None, -1.0, 1.0, None, 0.0, None]
    assert res.num_groups == 2 and res.num_groups_no_signal == 1


def test_all_none_batch_has_no_groups():
    res = group_advantages([None, None], ["a", "a"])
    assert res.advantages == [None, None]
    assert res.num_groups == 0 and res.frac_no_signal == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_reward_raises(bad):
    with pytest.raises(ValueError, match="reward 1 is not finite"):
        group_advantages([1.0, bad, 0.0], ["a", "a", "a"])


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="differ in length"):
        group_advantages([1.0, 0.0], ["a"])
    with pytest.raises(ValueError, match="scale_rewards must be 'group' or 'none'"):
        group_advantages([1.0, 0.0], ["a", "a"], scale_rewards="batch")


def test_never_nan():
    # every kind of group at once, with large and tiny magnitudes
    rewards = [1e12, 1e12, 1e12 + 1e6, -3.0, 5.0, 5.0, 0.0, None, 1e-300, 0.0]
    groups = ["big", "big", "big", "one", "const", "const", "tiny", "tiny", "tiny", "tiny"]
    for scale in ("group", "none"):
        adv = group_advantages(rewards, groups, scale_rewards=scale).advantages
        assert all(a is None or math.isfinite(a) for a in adv)
        assert adv[7] is None and adv[3:6] == [0.0, 0.0, 0.0]
        assert adv[6] == adv[8] == adv[9] == 0.0  # {0, 1e-300, 0}: spread far below eps
    # big: {0, 0, 1e6} around 1e12 -> mean offset 1e6/3, std 1e6 * sqrt(2)/3 -> -1/sqrt(2), -1/sqrt(2), sqrt(2)
    big = group_advantages(rewards, groups).advantages[:3]
    assert big == [pytest.approx(-1 / math.sqrt(2), rel=1e-6)] * 2 + [pytest.approx(math.sqrt(2), rel=1e-6)]


def test_sample_without_trainable_tokens_is_left_out_of_its_group():
    # issue 17 case 1: rewards [1, 0], the second sample has every token masked. Counted, it would
    # make a {0, 1} group and push the real sample by +1 with no partner; left out, the real sample
    # is alone in its group (no signal) and the empty one gets no advantage at all.
    res = group_advantages([1.0, 0.0], ["g", "g"], num_completion_tokens=[5, 0])
    assert res.advantages == [0.0, None]
    assert (res.num_groups, res.num_groups_no_signal) == (1, 1)
    # three samples, the middle one empty: the statistics are those of {1.0, 0.5}:
    # mean 0.75, population std 0.25 -> (1 - 0.75) / 0.25 = +1, (0.5 - 0.75) / 0.25 = -1
    res = group_advantages([1.0, 0.0, 0.5], ["g", "g", "g"], num_completion_tokens=[4, 0, 3])
    assert res.advantages == approx([1.0, None, -1.0])
    # Dr. GRPO's centring only: 1 - 0.75, 0.5 - 0.75
    res = group_advantages([1.0, 0.0, 0.5], ["g"] * 3, "none", num_completion_tokens=[4, 0, 3])
    assert res.advantages == approx([0.25, None, -0.25])
    # a group whose every sample is empty is not a group
    res = group_advantages([1.0, 0.0, 1.0, 0.0], ["a", "a", "b", "b"], num_completion_tokens=[0, 0, 2, 2])
    assert res.advantages == [None, None, 1.0, -1.0] and res.num_groups == 1


def test_token_counts_are_checked():
    with pytest.raises(ValueError, match="differ in length"):
        group_advantages([1.0, 0.0], ["g", "g"], num_completion_tokens=[1])
    with pytest.raises(ValueError, match=">= 0"):
        group_advantages([1.0, 0.0], ["g", "g"], num_completion_tokens=[1, -1])
    # a non-finite reward is still an error, even on a sample without tokens
    with pytest.raises(ValueError, match="not finite"):
        group_advantages([math.nan, 0.0], ["g", "g"], num_completion_tokens=[0, 1])


@pytest.mark.parametrize("eps", [0.0, -1.0])
def test_eps_must_be_positive_it_guards_the_division_by_the_std(eps):
    # with eps = 0 a constant group (std exactly 0) reached the division: ZeroDivisionError
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages([1.0, 1.0], ["g", "g"], eps=eps)


# ---------------------------------------------------------------- huge and tiny finite rewards

MAX = 1.7976931348623157e308  # the largest float
EXTREME_GROUPS = [
    [1e200, 0.0],  # issue 37 case 4: OverflowError in (r - mean) ** 2
    [MAX, -MAX],
    [MAX, MAX, -MAX],
    [-MAX, 0.0, 5e-324, MAX],
    [1e308, 1e308, 1e308, 1e308, -1e308],
    [1e300, 1e300, 1e300],  # identical huge values: no signal
    [1e-300, 0.0, 2e-300],  # tiny spread: below eps, no signal
    [3e-5, -1e250, 7.0],
]


@pytest.mark.parametrize("scale", ["group", "none"])
@pytest.mark.parametrize("rewards", EXTREME_GROUPS, ids=range(len(EXTREME_GROUPS)))
def test_any_finite_rewards_give_finite_advantages(rewards, scale):
    res = group_advantages(rewards, ["g"] * len(rewards), scale_rewards=scale)
    assert all(math.isfinite(a) for a in res.advantages)
    assert abs(sum(res.advantages)) <= 1e-9 * max(1.0, max(abs(a) for a in res.advantages))  # centred
    if scale == "group" and res.num_groups_no_signal == 0:
        n = len(rewards)  # population z-scores: sum of squares = n, each |z| <= sqrt(n - 1)
        assert sum(a * a for a in res.advantages) == pytest.approx(n)
        assert all(abs(a) <= math.sqrt(n - 1) + 1e-12 for a in res.advantages)


def test_huge_rewards_give_the_advantages_of_their_scaled_copy():
    # (r - mean) / std does not change when every reward is multiplied by c > 0
    base = [0.25, 1.0, -0.5, 0.0, 3.0]
    want = group_advantages(base, ["g"] * 5).advantages
    for c in (1e-3, 1e200, 2.0 ** 1000, 1e307):  # (a spread below eps, as 1e-300 gives, is no signal)
        got = group_advantages([r * c for r in base], ["g"] * 5).advantages
        assert got == [pytest.approx(w, rel=1e-12) for w in want]
    assert group_advantages([1e200, 0.0], ["g", "g"]).advantages == [1.0, -1.0]


def naive(rewards, scale):
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    return [(r - mean) / std if scale == "group" else r - mean for r in rewards]


@pytest.mark.parametrize("scale", ["group", "none"])
def test_advantages_are_the_naive_formula_bit_for_bit_where_it_does_not_overflow(scale):
    import random

    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(2, 9)
        magnitude = 10.0 ** rng.randint(-3, 5)
        rewards = [rng.uniform(-1, 1) * magnitude for _ in range(n)]
        if rng.random() < 0.3:
            rewards = [round(r) for r in rewards]  # ties and integers
        res = group_advantages(rewards, ["g"] * n, scale_rewards=scale)
        if res.num_groups_no_signal:
            continue
        assert res.advantages == naive(rewards, scale) and res.scale == 1.0


def test_none_scaling_keeps_the_batch_within_the_limit_by_one_power_of_two():
    # Dr. GRPO's r - mean is in reward units: 1e200 would be inf in the float32 loss. The whole
    # batch is multiplied by one power of two, so every ratio between advantages is kept.
    rewards = [1e200, 0.0, 3e199, 1e199]
    res = group_advantages(rewards, ["a", "a", "b", "b"], scale_rewards="none")
    want = [5e199, -5e199, 1e199, -1e199]
    assert max(abs(a) for a in res.advantages) <= ADVANTAGE_LIMIT
    assert math.log2(res.scale) == int(math.log2(res.scale))  # a power of two
    assert [a / res.scale for a in res.advantages] == [pytest.approx(w, rel=1e-12) for w in want]
    # at or below the limit nothing is scaled
    small = group_advantages([ADVANTAGE_LIMIT, -ADVANTAGE_LIMIT], ["g", "g"], scale_rewards="none")
    assert small.advantages == [ADVANTAGE_LIMIT, -ADVANTAGE_LIMIT] and small.scale == 1.0


def test_mean_std_is_finite_for_any_finite_values():
    assert mean_std([1e200, 0.0]) == (5e199, 5e199)
    assert mean_std([MAX, MAX, MAX]) == (MAX, 0.0)
    assert mean_std([MAX, -MAX]) == (0.0, MAX)
    assert mean_std([1e-300, 3e-300]) == (pytest.approx(2e-300, rel=1e-12), pytest.approx(1e-300, rel=1e-12))
    with pytest.raises(ValueError, match="finite"):
        mean_std([1.0, math.inf])
    with pytest.raises(ValueError, match="at least one"):
        mean_std([])


def test_advantages_of_huge_rewards_keep_the_float32_loss_finite():
    # Dr. GRPO's r - mean of rewards 1e200 was inf in the batch, which holds advantages in float32
    # (selfrl.rl.batch.collate); within ADVANTAGE_LIMIT even the clamped ratio e^20 on every one of
    # 4 x 4096 tokens gives a finite loss and gradient
    import torch

    from selfrl.rl.losses import Normalizer, loss_dapo, per_token_loss

    res = group_advantages([1e200, -1e200, 0.0, 3e199], ["g"] * 4, scale_rewards="none")
    adv = torch.tensor(res.advantages, dtype=torch.float32)  # (B,)
    assert torch.isfinite(adv).all() and adv.abs().max() <= ADVANTAGE_LIMIT
    T = 4096
    lp = torch.zeros(4, T, requires_grad=True)
    old = torch.full((4, T), -1000.0)  # every token's log-ratio beyond the clamp: ratio e^20
    loss, _ = per_token_loss(lp, old, adv, beta=0.0)
    total = loss_dapo(loss, torch.ones(4, T), Normalizer(4 * T, 4, T))
    total.backward()
    assert torch.isfinite(total) and torch.isfinite(lp.grad).all()


def test_an_int_reward_beyond_the_float_range_is_refused_as_not_finite():
    # math.isfinite(10**400) raised OverflowError, not the ValueError that names the reward
    with pytest.raises(ValueError, match="reward 0 is not finite: 1000"):
        group_advantages([10**400, 0.0], ["g", "g"])
    assert group_advantages([10**300, 0], ["g", "g"]).advantages == [1.0, -1.0]  # ints in range are rewards
