"""Truncated importance sampling and the sampler/learner mismatch KL, by hand."""

import math

import pytest
import torch

from selfrl.rl.off_policy import mismatch_kl, tis_weights

D = torch.float64
OLD = torch.tensor([[-1.0, -1.0, -1.0, -1.0, -2.0]], dtype=D)  # the learner's log-probs before the update
SAMPLER = torch.tensor([[-1.0, -2.0, -0.5, -5.0, -math.inf]], dtype=D)  # old - sampler = 0, 1, -0.5, 4, inf


def test_weight_is_exactly_one_for_the_same_numerics():
    lp = torch.randn(3, 7, dtype=torch.float32)
    w = tis_weights(lp, lp.clone(), 2.0)
    assert torch.equal(w, torch.ones_like(lp))
    assert torch.equal(mismatch_kl(lp, lp.clone()), torch.zeros_like(lp))


def test_truncated_weights_by_hand():
    # min(e^(old - sampler), 2): e^0 = 1; e^1 = 2.718 -> 2; e^-0.5 = 0.606531; e^4 -> 2; e^inf -> e^20 -> 2
    w = tis_weights(OLD, SAMPLER, 2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, math.exp(-0.5), 2.0, 2.0]], dtype=D), atol=1e-12, rtol=0)
    # a larger cap lets e^1 through
    assert tis_weights(OLD, SAMPLER, 3.0)[0, 1].item() == pytest.approx(math.e, abs=1e-12)
    assert not tis_weights(OLD.requires_grad_(False), SAMPLER, 2.0).requires_grad


def test_mismatch_kl_by_hand():
    # k3 with log r = old - sampler: r - 1 - log r
    expected = [0.0, math.e - 2, math.exp(-0.5) - 1 + 0.5, math.exp(4) - 5, math.exp(20) - 21]
    # = 0, 0.718282, 0.106531, 49.598150, 4.85e8 (an impossible token is bounded, not inf)
    torch.testing.assert_close(mismatch_kl(OLD, SAMPLER), torch.tensor([expected], dtype=D), atol=1e-6, rtol=1e-12)
    assert expected[2] == pytest.approx(0.1065306597, abs=1e-9)


def test_nan_stays_nan_and_bad_arguments_raise():
    nan = torch.tensor([[math.nan]])
    assert torch.isnan(tis_weights(torch.zeros(1, 1), nan, 2.0)).all()
    with pytest.raises(ValueError, match="cap must be > 0"):
        tis_weights(OLD, SAMPLER, 0.0)
    with pytest.raises(ValueError, match="shapes differ"):
        tis_weights(OLD, SAMPLER[:, :2], 2.0)
