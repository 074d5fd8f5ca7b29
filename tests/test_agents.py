"""Many agents, one learner: per-agent advantage balance and the per-agent gate."""

import pytest

from selfrl.run.agents import balance_agents, judge_agents


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


def test_candidate_that_helps_a_and_hurts_b_is_not_promoted():
    champion = {"A": {"a1": False, "a2": False, "a3": True, "a4": False},
                "B": {"b1": True, "b2": True, "b3": True, "b4": False}}
    candidate = {"A": {"a1": True, "a2": True, "a3": True, "a4": False},  # 0.25 -> 0.75
                 "B": {"b1": True, "b2": False, "b3": False, "b4": False}}  # 0.75 -> 0.25
    verdict = judge_agents(champion, candidate, {"A": 0.1, "B": 0.1})
    assert not verdict.promoted
    assert verdict.success == {"A": (0.25, 0.75), "B": (0.75, 0.25)}
    [conflict] = verdict.conflicts
    assert conflict.agent == "B" and conflict.drop == pytest.approx(0.5) and conflict.lost_tasks == ["b2", "b3"]
    assert "agent B" in verdict.report() and "b2, b3" in verdict.report() and "agent A" not in verdict.report()
    # within B's tolerance the same candidate is promoted
    assert judge_agents(champion, candidate, {"A": 0.1, "B": 0.5}).promoted
    # a drop of exactly the tolerance passes (candidate >= best - tolerance, as selfrl.record.versions.passes_gate)
    assert judge_agents({"A": {"x": True, "y": True}}, {"A": {"x": True, "y": False}}, {"A": 0.5}).promoted


def test_judge_refuses_mismatched_agents_or_tasks():
    with pytest.raises(ValueError, match="agents differ"):
        judge_agents({"A": {"x": True}}, {"B": {"x": True}}, {"A": 0.0})
    with pytest.raises(ValueError, match="different"):
        judge_agents({"A": {"x": True}}, {"A": {"y": True}}, {"A": 0.0})
    with pytest.raises(ValueError, match="tolerance"):
        judge_agents({"A": {"x": True}}, {"A": {"x": True}}, {"A": -0.1})
