"""The no-forgetting rule (selfrl.safety.families) on hand-made results: one rule for run's
[[agents]] and serve's [[families]]."""

import pytest

from selfrl.safety.families import best_per_family, judge_families

CHAMPION = {"A": {"a1": False, "a2": False, "a3": True, "a4": False},  # 0.25
            "B": {"b1": True, "b2": True, "b3": True, "b4": False}}  # 0.75
CANDIDATE = {"A": {"a1": True, "a2": True, "a3": True, "a4": False},  # 0.25 -> 0.75
             "B": {"b1": True, "b2": False, "b3": False, "b4": False}}  # 0.75 -> 0.25


def test_a_drop_beyond_tolerance_in_one_family_of_two_rejects_and_names_it():
    verdict = judge_families(CHAMPION, CANDIDATE, {"A": 0.1, "B": 0.1}, reference_version={"A": 0, "B": 2})
    assert not verdict.passed
    assert verdict.success == {"A": (0.25, 0.75), "B": (0.75, 0.25)}
    [drop] = verdict.dropped
    assert drop.family == "B" and drop.drop == pytest.approx(0.5) and drop.lost_tasks == ["b2", "b3"]
    assert drop.tasks == 4 and drop.reference_version == 2
    # Wilson 95% of 3/4 and 1/4: center (p + z^2/2n) / (1 + z^2/n), z = 1.96
    assert drop.reference_interval == pytest.approx((0.300636, 0.954414), abs=1e-6)
    assert drop.candidate_interval == pytest.approx((0.045586, 0.699364), abs=1e-6)
    # per-task differences 0, -1, -1, 0: mean -0.5, s^2 = 1/3, half 1.96 * sqrt(1/3 / 4) = 0.565803
    assert drop.paired_difference == -0.5
    assert drop.paired_interval == pytest.approx((-1.0, -0.5 + 0.565803), abs=1e-6)
    msg = verdict.message()
    assert msg.startswith("family B: held-out 0.250 < 0.750 of version 2 - 0.1 (down 0.500); lost tasks b2, b3;")
    assert "paired difference -0.500 (95% CI -1.000 to +0.066) on 4 tasks" in msg and "family A" not in msg
    data = drop.to_dict()
    assert data["family"] == "B" and data["lost_tasks"] == ["b2", "b3"] and data["paired_interval"][0] == -1.0
    assert "agent B: held-out" in verdict.message("agent")


def test_within_tolerance_passes_and_exactly_the_tolerance_passes():
    assert judge_families(CHAMPION, CANDIDATE, {"A": 0.1, "B": 0.5}).passed
    # candidate >= best - tolerance, as selfrl.record.versions.passes_gate
    assert judge_families({"A": {"x": True, "y": True}}, {"A": {"x": True, "y": False}}, {"A": 0.5}).passed
    assert not judge_families({"A": {"x": True, "y": True}}, {"A": {"x": True, "y": False}}, {"A": 0.49}).passed


def test_a_family_never_learned_is_not_gated():
    verdict = judge_families(CHAMPION, CANDIDATE, {"A": 0.1, "B": 0.1}, gated=["A"])
    assert verdict.passed and verdict.not_gated == ["B"] and list(verdict.compared) == ["A"]
    assert "not gated (never learned): B" in verdict.report()
    # nothing learned yet: nothing gated, whatever the results
    assert judge_families(CHAMPION, CANDIDATE, {}, gated=[]).passed


def test_the_rule_refuses_mismatched_families_tasks_or_tolerances():
    with pytest.raises(ValueError, match="no held-out results or tolerance for B"):
        judge_families({"A": {"x": True}}, {"B": {"x": True}}, {"A": 0.0, "B": 0.0})
    with pytest.raises(ValueError, match="different"):
        judge_families({"A": {"x": True}}, {"A": {"y": True}}, {"A": 0.0})
    with pytest.raises(ValueError, match="tolerance"):
        judge_families({"A": {"x": True}}, {"A": {"x": True}}, {"A": -0.1})
    with pytest.raises(ValueError, match="tolerance for A"):
        judge_families({"A": {"x": True}}, {"A": {"x": True}}, {})


def test_the_reference_is_the_best_version_per_family_on_the_candidates_tasks():
    refs = {0: {"A": {"x": False, "y": False}, "B": {"u": True, "v": True}},
            2: {"A": {"x": True, "y": False}, "B": {"u": True, "v": False}},
            5: {"A": {"x": False, "y": True}, "B": {"u": True, "v": False}},  # ties A with 2: the newer wins
            7: {"A": {"x": True}}}  # not evaluated on all of A's tasks: never a reference
    cand = {"A": {"x": False, "y": False}, "B": {"u": True, "v": False}}
    results, versions = best_per_family(refs, cand)
    assert versions == {"A": 5, "B": 0}
    assert results == {"A": {"x": False, "y": True}, "B": {"u": True, "v": True}}
    # a family no version covers is left out
    assert best_per_family({0: {"A": {"x": True}}}, {"C": {"z": True}}) == ({}, {})
    # the champion (version 5, A 0.5) would let a candidate at 0.0 through with tolerance 0.5; the
    # best per family (version 2, A 1.0) does not: no forgetting by a tolerance at a time
    refs = {2: {"A": {"x": True, "y": True}}, 5: {"A": {"x": True, "y": False}}}
    cand = {"A": {"x": False, "y": False}}
    assert judge_families({"A": refs[5]["A"]}, cand, {"A": 0.5}).passed
    results, versions = best_per_family(refs, cand)
    [drop] = judge_families(results, cand, {"A": 0.5}, reference_version=versions).dropped
    assert (drop.reference_version, drop.drop, drop.lost_tasks) == (2, 1.0, ["x", "y"])
