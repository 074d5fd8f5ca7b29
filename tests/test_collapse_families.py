"""Collapse rules in selfrl serve follow the traffic mix: each family of served turns is judged
against its own baseline, so a family that joins later with its own normal (function-calling
turns cut at max_tokens more often, grammar-constrained calls with another entropy per token)
is no collapse, while the same family drifting from its own normal still is."""

import math

import pytest

from selfrl.core.trajectory import Trajectory
from selfrl.safety.collapse import (
    NO_FAMILY,
    SMALL_FAMILIES,
    CollapseConfig,
    FamilyStats,
    UpdateRecord,
    cheap_alarms,
    family_metrics,
    family_stats,
    history_from_metrics,
    record_from_metrics,
)

CFG = CollapseConfig()  # baseline_window 2, family_min_turns 4, entropy ratios 0.25 / 3, degenerate_rise 0.35


def mixed(step, **families):
    """An update whose batch holds ``families`` (name -> (turns, entropy, degenerate), reward 0.5), with
    the run-wide values a turn-weighted mix of them (what the rules judged before families)."""
    stats = {f: FamilyStats(n, 0.5, e, d) for f, (n, e, d) in families.items()}
    total = sum(st.turns for st in stats.values())
    entropy = sum(st.turns * st.entropy for st in stats.values()) / total
    degenerate = sum(st.turns * st.degenerate for st in stats.values()) / total
    return UpdateRecord(step, step, 0.5, entropy, degenerate, kl=0.01, families=stats)


def arithmetic_then_function_calling(fc_degenerate, fc_entropy):
    """Two arithmetic-only updates (degenerate 0.04, entropy 0.3), then three with 12 function-calling
    turns each joining 4 arithmetic ones."""
    hist = [mixed(0, arithmetic=(16, 0.3, 0.04)), mixed(1, arithmetic=(16, 0.3, 0.04))]
    hist += [mixed(i, arithmetic=(4, 0.3, 0.04), function_calling=(12, fc_entropy, fc_degenerate)) for i in (2, 3, 4)]
    return hist


def test_a_family_that_joins_with_a_higher_degenerate_share_is_no_collapse():
    hist = arithmetic_then_function_calling(fc_degenerate=0.55, fc_entropy=0.3)
    # the run-wide share 0.42 is past the arithmetic baseline 0.04 + 0.35: the old rule fired on it
    assert hist[2].degenerate == pytest.approx(0.4225) and hist[2].degenerate > 0.04 + CFG.degenerate_rise
    for i in range(1, len(hist) + 1):
        assert cheap_alarms(hist[:i], CFG) == []
    # function calling now has its baseline (updates 2 and 3, 0.55): past 0.55 + 0.35 it fires, named
    hist.append(mixed(5, arithmetic=(4, 0.3, 0.04), function_calling=(12, 0.3, 0.95)))
    alarms = cheap_alarms(hist, CFG)
    assert [(a.rule, a.value) for a in alarms] == [("degenerate", 0.95)]
    assert alarms[0].threshold == pytest.approx(0.9)
    assert alarms[0].message == "degenerate rollouts 0.95 > baseline 0.55 + 0.35 (family function_calling)"


def test_an_old_family_rising_beyond_its_own_baseline_fires_while_the_newcomer_is_silent():
    hist = arithmetic_then_function_calling(fc_degenerate=0.55, fc_entropy=0.3)[:3]
    hist.append(mixed(3, arithmetic=(4, 0.3, 0.5), function_calling=(12, 0.3, 0.55)))
    alarms = cheap_alarms(hist, CFG)
    assert [(a.rule, a.value) for a in alarms] == [("degenerate", 0.5)]
    assert alarms[0].threshold == pytest.approx(0.39) and alarms[0].message.endswith("(family arithmetic)")


def test_a_family_that_joins_with_a_higher_entropy_is_no_blowup_and_its_own_collapse_fires():
    hist = arithmetic_then_function_calling(fc_degenerate=0.04, fc_entropy=1.2)
    # the run-wide entropy 0.975 nats/token is past 3 x the arithmetic baseline 0.3: the old rule fired on it
    assert hist[2].entropy == pytest.approx(0.975) and hist[2].entropy > CFG.entropy_max_ratio * 0.3
    for i in range(1, len(hist) + 1):
        assert cheap_alarms(hist[:i], CFG) == []
    # function calling's entropy falls below 0.25 x its own baseline 1.2 with a flat reward: collapse, named
    hist.append(mixed(5, arithmetic=(4, 0.3, 0.04), function_calling=(12, 0.2, 0.04)))
    alarms = cheap_alarms(hist, CFG)
    assert [(a.rule, a.value) for a in alarms] == [("entropy_collapse", 0.2)]
    assert alarms[0].threshold == pytest.approx(0.3)
    assert alarms[0].message == "entropy 0.200 nats/token < 0.300 (0.25 x baseline 1.200, at least -0.25) (family function_calling)"
    # and above 3 x 1.2: blow-up, named
    hist[-1] = mixed(5, arithmetic=(4, 0.3, 0.04), function_calling=(12, 3.7, 0.04))
    assert [(a.rule, a.message) for a in cheap_alarms(hist, CFG)] == [
        ("entropy_blowup", "entropy 3.700 nats/token > 3.600 (3 x baseline 1.200, at least +0.5) (family function_calling)")]


def test_a_family_with_too_few_turns_is_neither_judged_nor_part_of_its_baseline():
    hist = [mixed(0, arithmetic=(16, 0.3, 0.04)), mixed(1, arithmetic=(16, 0.3, 0.04))]
    # 3 web turns (< family_min_turns 4), all degenerate: not judged, and not a baseline for web
    hist += [mixed(i, arithmetic=(13, 0.3, 0.04), web=(3, 0.3, 1.0)) for i in (2, 3)]
    assert cheap_alarms(hist, CFG) == []
    hist += [mixed(i, arithmetic=(12, 0.3, 0.04), web=(4, 0.3, 0.0)) for i in (4, 5)]  # web's baseline: 0.0
    hist.append(mixed(6, arithmetic=(12, 0.3, 0.04), web=(4, 0.3, 0.5)))
    assert [(a.rule, a.message) for a in cheap_alarms(hist, CFG)] == [
        ("degenerate", "degenerate rollouts 0.50 > baseline 0.00 + 0.35 (family web)")]
    assert cheap_alarms(hist, CollapseConfig(family_min_turns=5)) == []  # web never had 5 turns: never judged


def test_turns_without_a_family_are_their_own_group():
    hist = [UpdateRecord(0, 0, 0.5, 0.3, 0.04), UpdateRecord(1, 1, 0.5, 0.3, 0.04)]  # no family at all
    hist.append(mixed(2, function_calling=(12, 0.3, 0.6), **{NO_FAMILY: (4, 0.3, 0.04)}))
    assert cheap_alarms(hist, CFG) == []  # function calling builds its baseline; the rest is as before
    hist.append(mixed(3, function_calling=(12, 0.3, 0.6), **{NO_FAMILY: (4, 0.3, 0.5)}))
    assert [a.message for a in cheap_alarms(hist, CFG)] == [
        "degenerate rollouts 0.50 > baseline 0.04 + 0.35 (turns without a family)"]


def test_without_families_the_rules_and_messages_are_the_run_wide_ones():
    hist = [UpdateRecord(0, 0, 0.2, 1.0, 0.5), UpdateRecord(1, 1, 0.2, 1.0, 0.6), UpdateRecord(2, 2, 0.2, 3.5, 1.0)]
    assert [(a.rule, a.message) for a in cheap_alarms(hist, CFG)] == [
        ("entropy_blowup", "entropy 3.500 nats/token > 3.000 (3 x baseline 1.000, at least +0.5)"),
        ("degenerate", "degenerate rollouts 1.00 > baseline 0.55 + 0.35")]


def traj(tid, truncated=False, answer="42", logprob=-1.0):
    return Trajectory(tid, "g", 0, prompt_len=1, token_ids=[1, 2, 3], completion_mask=[0, 1, 1],
                      logprobs=[0.0, logprob, logprob], final_answer=answer, truncated=truncated, reward=1.0)


def test_family_stats_splits_the_batch_and_none_without_families():
    trajs = [traj("a"), traj("b", truncated=True, logprob=-2.0), traj("c", logprob=-3.0), traj("d", answer="")]
    named = {t.id: f for t, f in zip(trajs, ["math", "tools", "tools", None])}
    out = family_stats(trajs, named, CollapseConfig(family_min_turns=1))
    assert out == {"math": FamilyStats(1, 1.0, 1.0, 0.0), "tools": FamilyStats(2, 1.0, 2.5, 0.5),
                   NO_FAMILY: FamilyStats(1, 1.0, 1.0, 1.0)}
    # below family_min_turns (4) each group is pooled: the whole batch is still judged, as one group
    assert family_stats(trajs, named, CFG) == {SMALL_FAMILIES: FamilyStats(4, 1.0, 1.75, 0.5)}
    assert family_stats(trajs, named, CollapseConfig(family_min_turns=2)) == {
        "tools": FamilyStats(2, 1.0, 2.5, 0.5), SMALL_FAMILIES: FamilyStats(2, 1.0, 1.0, 0.5)}
    assert family_stats(trajs, {trajs[0].id: None}, CFG) is None


def test_a_degenerate_batch_spread_over_many_small_families_still_fires():
    healthy = [traj(f"h{i}") for i in range(32)]
    broken = [traj(f"b{i}", answer="") for i in range(32)]
    def record(step, trajs):  # every turn of its own family, as a client naming a new family per turn could
        return UpdateRecord(step, step, 1.0, 1.0, 0.0, kl=0.01,
                            families=family_stats(trajs, {t.id: f"user{t.id}" for t in trajs}, CFG))
    hist = [record(0, healthy), record(1, healthy), record(2, broken)]
    assert list(hist[2].families) == [SMALL_FAMILIES] and hist[2].families[SMALL_FAMILIES].degenerate == 1.0
    assert [a.rule for a in cheap_alarms(hist, CFG)] == ["degenerate"]


def rows(step, metrics):
    return [{"step": step, "name": k, "value": v} for k, v in metrics.items()]


def test_family_metrics_round_trip_and_old_rows_still_load():
    base = {"reward/mean": 0.5, "sampled_version": 0.0, "train/entropy": 0.9, "train/degenerate": 0.1, "kl": 0.0}
    families = {"function_calling": FamilyStats(12, 0.25, 1.2, 0.5), "a/b": FamilyStats(4, 1.0, 0.3, 0.0)}
    stored = rows(0, base) + rows(1, base | family_metrics(families))
    # a row set with one family field missing (a partial write): that family is left out
    stored += rows(2, base | {k: v for k, v in family_metrics(families).items() if k != "family/a/b/entropy"})
    hist = history_from_metrics(stored)
    assert [r.families for r in hist] == [None, families, {"function_calling": families["function_calling"]}]
    assert record_from_metrics(0, base).families is None
    assert family_metrics(None) == {}
    assert family_metrics({"web": FamilyStats(4, 0.5, math.nan, 0.25)})["family/web/turns"] == 4.0


def test_family_min_turns_is_checked():
    from selfrl.config import ConfigError

    with pytest.raises(ConfigError, match="family_min_turns must be >= 1"):
        CollapseConfig(family_min_turns=0).check()
