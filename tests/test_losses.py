import math

import pytest
import torch

from selfrl.rl.losses import (
    LOSS_TYPES,
    Normalizer,
    get_loss_aggregation,
    k3_kl,
    loss_dapo,
    loss_dr_grpo,
    loss_grpo,
    per_token_loss,
)

D = torch.float64  # exact enough that hand arithmetic matches to 1e-12

# Two sequences of three tokens. ratio = exp(logp - old) = [1.0, 1.5, 0.5] in both rows.
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]], dtype=D)
RATIO = torch.tensor([[1.0, 1.5, 0.5], [1.0, 1.5, 0.5]], dtype=D)
ADV = torch.tensor([1.0, -2.0], dtype=D)  # one positive, one negative advantage
MASK = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]], dtype=D)
# With epsilon = 0.2, clip(ratio) = [1.0, 1.2, 0.8].
# row 0, A = +1: ratio*A = [1, 1.5, 0.5], clip*A = [1, 1.2, 0.8]; min = [1, 1.2, 0.5]
#                -> loss = [-1, -1.2, -0.5]; the bound binds at ratio 1.5 (1.2 < 1.5)
# row 1, A = -2: ratio*A = [-2, -3, -1], clip*A = [-2, -2.4, -1.6]; min = [-2, -3, -1.6]
#                -> loss = [2, 3, 1.6]; the bound binds at ratio 0.5 (-1.6 < -1)
EXPECTED_LOSS = torch.tensor([[-1.0, -1.2, -0.5], [2.0, 3.0, 1.6]], dtype=D)
EXPECTED_CLIPPED = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=D)
# masked: row 0 sums to -1 - 1.2 - 0.5 = -2.7 over 3 tokens; row 1 to 3 + 1.6 = 4.6 over 2 tokens
NORM = Normalizer(num_tokens=5, num_sequences=2, max_completion_length=4)


def logps():
    return (OLD + RATIO.log()).clone().requires_grad_(True)


def test_per_token_loss_clips_for_positive_and_negative_advantages():
    lp = logps()
    loss, parts = per_token_loss(lp, OLD, ADV)
    torch.testing.assert_close(loss, EXPECTED_LOSS, atol=1e-12, rtol=0)
    torch.testing.assert_close(parts["ratio"], RATIO, atol=1e-12, rtol=0)
    torch.testing.assert_close(parts["clipped"], EXPECTED_CLIPPED.float(), atol=0, rtol=0)
    assert torch.equal(parts["kl"], torch.zeros_like(OLD))  # no reference, no KL
    # gradient d loss / d logp = -ratio * A where the unclipped term is the min, 0 where the clip binds:
    # row 0: [-1 * 1, 0, -0.5 * 1]; row 1: [-1 * -2, -1.5 * -2, 0]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.0, 0.0, -0.5], [2.0, 3.0, 0.0]], dtype=D), atol=1e-12, rtol=0)


def test_asymmetric_clip_uses_epsilon_high_above_one():
    # epsilon_high = 0.28: ratio 1.5 with A = +1 is clipped to 1.28, ratio 0.5 with A = -2 still to 0.8
    loss, _ = per_token_loss(logps(), OLD, ADV, epsilon_low=0.2, epsilon_high=0.28)
    torch.testing.assert_close(loss[0, 1], torch.tensor(-1.28, dtype=D), atol=1e-12, rtol=0)
    torch.testing.assert_close(loss[1, 2], torch.tensor(1.6, dtype=D), atol=1e-12, rtol=0)


@pytest.mark.parametrize(
    "name, fn, expected",
    [
        ("dapo", loss_dapo, (-2.7 + 4.6) / 5),  # all masked tokens of the batch / 5 tokens = 0.38
        ("grpo", loss_grpo, (-2.7 / 3 + 4.6 / 2) / 2),  # mean per sequence (-0.9, 2.3), then / 2 = 0.7
        ("dr_grpo", loss_dr_grpo, (-2.7 + 4.6) / (2 * 4)),  # / (sequences * max_completion_length) = 0.2375
    ],
    ids=["dapo", "grpo", "dr_grpo"],
)
def test_aggregations(name, fn, expected):
    assert get_loss_aggregation(name) is fn
    loss, _ = per_token_loss(logps(), OLD, ADV)
    assert fn(loss, MASK, NORM).item() == pytest.approx(expected, abs=1e-12)


def test_k3_kl_known_values():
    # delta = ref - logp; k3 = e^delta - delta - 1
    lp = torch.tensor([[-1.0, -1.0, -1.0]], dtype=D)
    ref = torch.tensor([[-0.5, -1.5, -1.0]], dtype=D)  # delta = +0.5, -0.5, 0
    expected = [math.exp(0.5) - 0.5 - 1, math.exp(-0.5) + 0.5 - 1, 0.0]  # 0.148721..., 0.106531..., 0
    torch.testing.assert_close(k3_kl(lp, ref), torch.tensor([expected], dtype=D), atol=1e-12, rtol=0)
    assert expected[0] == pytest.approx(0.1487212707, abs=1e-9)


def test_kl_term_is_added_with_beta():
    lp = logps()
    ref = lp.detach() + 0.5  # delta = 0.5 on every token
    k = math.exp(0.5) - 0.5 - 1
    loss, parts = per_token_loss(lp, OLD, ADV, ref_per_token_logps=ref, beta=0.1)
    torch.testing.assert_close(loss, EXPECTED_LOSS + 0.1 * k, atol=1e-12, rtol=0)
    torch.testing.assert_close(parts["kl"], torch.full_like(OLD, k), atol=1e-12, rtol=0)
    # beta = 0 with a reference: the KL is reported, not added
    loss0, parts0 = per_token_loss(logps(), OLD, ADV, ref_per_token_logps=ref, beta=0.0)
    torch.testing.assert_close(loss0, EXPECTED_LOSS, atol=1e-12, rtol=0)
    torch.testing.assert_close(parts0["kl"], torch.full_like(OLD, k), atol=1e-12, rtol=0)


def test_beta_without_reference_raises():
    with pytest.raises(ValueError, match="beta > 0 needs ref_per_token_logps"):
        per_token_loss(logps(), OLD, ADV, beta=0.01)


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_all_masked_sample_contributes_zero(name):
    # row 1 fully masked; its per-token losses (2, 3, 1.6) must not reach the result or the gradient
    mask = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=D)
    norm = Normalizer(num_tokens=3, num_sequences=2, max_completion_length=4)
    expected = {"dapo": -2.7 / 3, "grpo": (-2.7 / 3 + 0.0) / 2, "dr_grpo": -2.7 / 8}[name]
    lp = logps()
    loss, _ = per_token_loss(lp, OLD, ADV)
    out = get_loss_aggregation(name)(loss, mask, norm)
    assert out.item() == pytest.approx(expected, abs=1e-12)
    out.backward()
    assert torch.equal(lp.grad[1], torch.zeros(3, dtype=D))


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_micro_batches_sum_to_the_full_batch(name):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g, dtype=D) * 3  # (4, 5)
    lp_full = (old + (torch.rand(4, 5, generator=g, dtype=D) - 0.5)).requires_grad_(True)  # ratios in e^[-0.5, 0.5]
    adv = torch.tensor([1.5, -0.7, 0.3, -1.1], dtype=D)
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=D)
    norm = Normalizer(num_tokens=int(mask.sum()), num_sequences=4, max_completion_length=6)  # one Normalizer for all
    agg = get_loss_aggregation(name)

    full = agg(per_token_loss(lp_full, old, adv)[0], mask, norm)
    full.backward()

    lp_parts = lp_full.detach().clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part = agg(per_token_loss(lp_parts[rows], old[rows], adv[rows])[0], mask[rows], norm)
        part.backward()  # gradient accumulation
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(lp_parts.grad, lp_full.grad, atol=1e-12, rtol=0)
    assert full.item() != 0.0


def test_unknown_loss_type_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown loss_type 'bnpo'; valid: dapo, dr_grpo, grpo"):
        get_loss_aggregation("bnpo")


# ---------------------------------------------------------------- every exp in the loss is bounded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_kl_of_an_extreme_token_is_finite_and_capped(dtype):
    # issue 17 case 3: policy logprob -100 against the reference's 0 gave exp(100) = inf in float32.
    # d = ref - logp is clamped to [-20, 20] and k3 to at most 10 (verl's and OpenRLHF's bounds).
    lp = torch.tensor([[-100.0, 0.0, -1.0, -2.0, -3.0]], dtype=dtype, requires_grad=True)
    ref = torch.tensor([[0.0, -100.0, -3.0, 1.0, -1.0]], dtype=dtype)  # d = 100, -100, -2, 3, 2
    kl = k3_kl(lp, ref)
    # d = 100 -> 20 -> e^20 - 21, capped at 10; d = -100 -> -20 -> 19.0, capped; d = -2: e^-2 + 1 = 1.135335;
    # d = 3: e^3 - 4 = 16.09, capped; d = 2: e^2 - 3 = 4.389056, below the cap
    expected = [10.0, 10.0, math.exp(-2) + 1, 10.0, math.exp(2) - 3]
    torch.testing.assert_close(kl, torch.tensor([expected], dtype=dtype), atol=1e-6, rtol=0)
    # the loss with beta 0.04 on that token alone: ratio 1, A = 0, so loss = 0.04 * 10 = 0.4
    loss, parts = per_token_loss(lp[:, :1], lp[:, :1].detach(), torch.tensor([0.0], dtype=dtype), ref[:, :1], 0.04)
    assert loss.item() == pytest.approx(0.4, abs=1e-6) and torch.isfinite(parts["kl"]).all()
    # where a bound is active the token's KL gradient is 0; elsewhere it is 1 - e^d
    kl.sum().backward()
    grad = [[0.0, 0.0, 1 - math.exp(-2), 0.0, 1 - math.exp(2)]]
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=dtype), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_policy_ratio_of_an_extreme_token_is_finite(dtype):
    # logp - old = 1000 overflowed exp() in both dtypes; clamped to 20 it is e^20 = 4.85e8. With A = -1
    # the unclipped term is the min: loss = e^20, finite, and the gradient through the clamp is 0.
    lp = torch.tensor([[0.0, -1000.0]], dtype=dtype, requires_grad=True)
    old = torch.tensor([[-1000.0, 0.0]], dtype=dtype)
    loss, parts = per_token_loss(lp, old, torch.tensor([-1.0], dtype=dtype))
    assert torch.isfinite(loss).all()
    assert loss[0, 0].item() == pytest.approx(math.exp(20), rel=1e-6)
    assert parts["ratio"][0, 1].item() == pytest.approx(math.exp(-20), rel=1e-6)  # ratio e^-20 clipped to 0.8
    assert loss[0, 1].item() == pytest.approx(0.8, abs=1e-6)
    loss.sum().backward()
    assert torch.equal(lp.grad, torch.zeros_like(lp))


def test_nan_still_propagates_through_the_clamps():
    # the learner's not-finite guard must still see a corrupt log-prob
    nan = torch.tensor([[math.nan]])
    assert torch.isnan(k3_kl(nan, torch.zeros(1, 1))).all()
    loss, _ = per_token_loss(torch.zeros(1, 1), nan, torch.tensor([1.0]))
    assert torch.isnan(loss).all()


def test_is_weights_multiply_the_policy_gradient_term_only():
    # rows as above (loss [-1, -1.2, -0.5] and [2, 3, 1.6]); weights scale it and its gradient, not the KL
    w = torch.tensor([[2.0, 0.5, 1.0], [0.0, 1.0, 2.0]], dtype=D)
    ref = OLD + RATIO.log() - 1.0  # d = -1 on every token: k3 = e^-1 + 1 - 1 = 0.367879
    lp = logps()
    loss, parts = per_token_loss(lp, OLD, ADV, ref, beta=0.1, is_weights=w)
    k3 = math.exp(-1)
    torch.testing.assert_close(loss, EXPECTED_LOSS * w + 0.1 * k3, atol=1e-12, rtol=0)
    loss.sum().backward()
    pg_grad = torch.tensor([[-1.0, 0.0, -0.5], [2.0, 3.0, 0.0]], dtype=D)  # from the unweighted test
    torch.testing.assert_close(lp.grad, pg_grad * w + 0.1 * (1 - math.exp(-1)), atol=1e-12, rtol=0)


# ---------------------------------------------------------------- sequences without tokens


def test_normalizer_counts_only_sequences_with_tokens():
    masks = [torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]])]
    assert Normalizer.of(masks, 4) == Normalizer(num_tokens=3, num_sequences=2, max_completion_length=4)
    with pytest.raises(ValueError, match="max_completion_length"):
        Normalizer(1, 1, 0)
    with pytest.raises(ValueError, match="negative"):
        Normalizer(-1, 1, 4)


@pytest.mark.parametrize("name", ["dapo", "grpo", "dr_grpo"])
def test_a_sequence_without_tokens_changes_no_aggregation(name):
    # the batch above plus a third row whose mask is all 0 (its loss values are junk: 7.0):
    # grpo and dr_grpo must still divide by 2 sequences, not 3
    fn = get_loss_aggregation(name)
    loss, _ = per_token_loss(logps(), OLD, ADV)
    padded_loss = torch.cat([loss, torch.full((1, 3), 7.0, dtype=D)])
    padded_mask = torch.cat([MASK, torch.zeros(1, 3, dtype=D)])
    norm = Normalizer.of([padded_mask], 4)
    expected = {"dapo": (-2.7 + 4.6) / 5, "grpo": (-0.9 + 2.3) / 2, "dr_grpo": (-2.7 + 4.6) / 8}[name]
    assert fn(padded_loss, padded_mask, norm).item() == pytest.approx(expected, abs=1e-12)


def test_k3_kl_keeps_its_digits_for_a_policy_close_to_the_reference():
    # d = 1e-3 in float32: k3 = e^d - d - 1 = d^2/2 + d^3/6 + ... = 5.0015e-7. exp(d) - d - 1 in float32
    # rounds e^d to 7 digits near 1 and gives 4.768e-7 (5 % off); expm1(d) - d is within 1e-4 relative
    lp = torch.tensor([[-1.0]], dtype=torch.float32)
    ref = lp + 1e-3
    d = float(ref - lp)  # the float32 difference, as k3_kl sees it
    exact = math.expm1(d) - d
    assert k3_kl(lp, ref).item() == pytest.approx(exact, rel=1e-3)
