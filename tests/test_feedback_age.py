"""The age rule for delayed feedback (selfrl.rl.feedback_age), hand-computed on 3 tokens."""

import math

import pytest

from selfrl.rl.feedback_age import AgePolicy, Outcome, decide_at, lineage_distance, sequence_weight, versions_behind

BEHAVIOUR = [-1.0, -2.0, -0.5]  # the sampler's log-probs of a 3-token completion
POLICY = AgePolicy(max_versions=2, max_age_s=3600.0, tis_cap=2.0)


def decide(turn_version, chain, *args, **kwargs):
    """:func:`decide_at` for a turn of ``turn_version`` when the learner's weights went through
    ``chain`` (each version trained from the one before; the last is current)."""
    parents = {v: (chain[i - 1] if i else None) for i, v in enumerate(chain)}
    return decide_at(turn_version, lineage_distance(turn_version, chain[-1], parents), chain[-1], *args, **kwargs)


def test_unmoved_policy_weight_is_exactly_one_without_logprobs():
    d = decide(7, [5, 6, 7], turn_time=0.0, now=10.0, policy=POLICY)
    assert (d.outcome, d.weight, d.versions_behind, d.age_s) == (Outcome.USED, 1.0, 0, 10.0)
    # equal log-probs: exp(0) is 1.0 exactly, no rounding
    assert sequence_weight(BEHAVIOUR, BEHAVIOUR, [1, 1, 1], 2.0) == 1.0


def test_moved_policy_weight_hand_computed():
    # log-ratios 0, +1, -0.5 -> sum 0.5 -> exp(0.5) = 1.6487212707, below the cap 2.0
    d = decide(6, [5, 6, 7], 0.0, 60.0, POLICY, [-1.0, -1.0, -1.0], BEHAVIOUR, [1, 1, 1])
    assert d.outcome == Outcome.USED and d.versions_behind == 1
    assert d.weight == pytest.approx(1.6487212707, abs=1e-9)
    assert "weight 1.65" in d.reason and "changed 1 time since" in d.reason


def test_weight_capped():
    # log-ratios +0.5, +1, 0 -> sum 1.5 -> exp(1.5) = 4.48 -> cap 2.0
    d = decide(6, [5, 6, 7], 0.0, 60.0, POLICY, [-0.5, -1.0, -0.5], BEHAVIOUR, [1, 1, 1])
    assert d.weight == 2.0 and "(capped)" in d.reason


def test_masked_tokens_do_not_count():
    # the first token is prompt (mask 0): only +1 and -0.5 count -> exp(0.5); with it, +3 more -> capped
    w = sequence_weight([2.0, -1.0, -1.0], BEHAVIOUR, [0, 1, 1], 2.0)
    assert w == pytest.approx(math.exp(0.5))
    assert sequence_weight([2.0, -1.0, -1.0], BEHAVIOUR, [1, 1, 1], 2.0) == 2.0


def test_weight_below_one_when_current_policy_likes_it_less():
    # log-ratios -1, 0, -1 -> exp(-2) = 0.1353352832
    assert sequence_weight([-2.0, -2.0, -1.5], BEHAVIOUR, [1, 1, 1], 2.0) == pytest.approx(0.1353352832)


def test_queued_when_moved_and_current_logprobs_unknown():
    d = decide(6, [5, 6, 7], 0.0, 60.0, POLICY)
    assert (d.outcome, d.weight) == (Outcome.QUEUED, None)
    assert d.reason == ("queued: the policy changed 1 time since version 6; "
                        "waits for the learner to weigh it under version 7")


def test_too_old_in_versions_counts_weight_changes_not_numbers():
    # 3 was rejected and the champion 2 came back: version 2 is 0 changes behind, version 3 is 1
    assert versions_behind(2, [1, 2, 3, 2]) == 0
    assert versions_behind(3, [1, 2, 3, 2]) == 1
    d = decide(5, [5, 6, 7, 8], 0.0, 1.0, POLICY)  # 3 changes > max_versions 2
    assert d.outcome == Outcome.TOO_OLD and d.weight is None and d.versions_behind == 3
    assert "only recorded: the policy changed 3 times since version 5, more than max_versions = 2" == d.reason
    assert decide(6, [5, 6, 7, 8], 0.0, 1.0, POLICY).outcome == Outcome.QUEUED  # exactly 2: still in


def test_too_old_in_time_even_at_the_current_version():
    d = decide(7, [7], 0.0, 3600.5, POLICY)  # a day-late judgement with no update since
    assert d.outcome == Outcome.TOO_OLD and "3600 s old" in d.reason and "max_age_s = 3600" in d.reason
    assert decide(7, [7], 0.0, 3600.0, POLICY).outcome == Outcome.USED  # the boundary is kept


def test_foreign_version_too_old():
    d = decide(99, [1, 2], 0.0, 1.0, POLICY)
    assert d.outcome == Outcome.TOO_OLD and d.versions_behind == math.inf and "never loaded" in d.reason


def test_errors():
    with pytest.raises(ValueError, match="before its turn"):
        decide(1, [1], 10.0, 5.0, POLICY)
    with pytest.raises(ValueError, match="no version"):
        versions_behind(1, [])  # the staleness of rollouts: a learner that held no version
    with pytest.raises(ValueError, match="NaN"):
        sequence_weight([math.nan, 0.0, 0.0], BEHAVIOUR, [1, 1, 1], 2.0)
    with pytest.raises(ValueError, match="lengths differ"):
        sequence_weight([0.0], BEHAVIOUR, [1, 1, 1], 2.0)
    with pytest.raises(ValueError, match="behaviour"):
        decide(6, [6, 7], 0.0, 1.0, POLICY, current_logps=[0.0, 0.0, 0.0])
    for bad in (dict(max_versions=-1), dict(max_age_s=0), dict(tis_cap=0)):
        with pytest.raises(ValueError):
            AgePolicy(**bad)


def test_minus_inf_behaviour_gets_the_cap_not_nan():
    assert sequence_weight([-1.0, -1.0, -1.0], [-math.inf, -2.0, -0.5], [1, 1, 1], 2.0) == 2.0
