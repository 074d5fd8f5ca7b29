"""Many agents, one learner: per-agent advantage balance (the per-agent gate is the no-forgetting
rule, tests/test_families.py)."""

import pytest

from selfrl.run.agents import balance_agents


def test_balance_gives_each_agent_the_same_share():
    # agent a: 2 samples, std 1; agent b: 4 samples, std sqrt(2); N = 6, K = 2
    out = balance_agents([1.0, -1.0, 2.0, -2.0, 0.0, 0.0, None], ["a", "a", "b", "b", "b", "b", "b"])
    assert out[:2] == [pytest.approx(1.5), pytest.approx(-1.5)]  # 6 / (2 * 2) / 1
    assert out[2:4] == [pytest.approx(2 * 0.75 / 2 ** 0.5), pytest.approx(-2 * 0.75 / 2 ** 0.5)]  # 6 / (2 * 4) / sqrt 2
    assert out[4:] == [0.0, 0.0, None]
    mass = {g: sum(abs(a) for a, h in zip(out, "aabbbb") if h == g) for g in "ab"}
    assert mass["a"] == pytest.approx(3.0) and mass["b"] == pytest.approx(4 * 0.75 / 2 ** 0.5)
    # no signal in an agent: its zeros stay zeros, the other agent is still balanced
    assert balance_agents([0.0, 0.0, 1.0, -1.0], ["a", "a", "b", "b"]) == [0.0, 0.0, 1.0, -1.0]
    with pytest.raises(ValueError, match="2 advantages but 1 agents"):
        balance_agents([1.0, 2.0], ["a"])


def test_balance_is_finite_for_huge_advantages():
    # Dr. GRPO advantages are in reward units; the per-agent std of [1e200, -1e200] overflowed
    out = balance_agents([1e200, -1e200, 1.0, -1.0], ["a", "a", "b", "b"])
    assert out == [pytest.approx(1.0), pytest.approx(-1.0), pytest.approx(1.0), pytest.approx(-1.0)]
    out = balance_agents([1.7e308, -1.7e308, 1e-300, -1e-300], ["a", "a", "b", "b"])
    assert out == [pytest.approx(1.0), pytest.approx(-1.0), pytest.approx(1.0), pytest.approx(-1.0)]
