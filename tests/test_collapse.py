"""Collapse rules on hand-made histories: each fires where it must and stays silent where it must not."""

import math

import pytest

from selfrl.safety.collapse import (
    CollapseConfig,
    UpdateRecord,
    cheap_alarms,
    degenerate_reasons,
    degenerate_share,
    entropy_estimate,
    heldout_alarms,
    repeated_ngram_share,
    safer_setting,
    validation_alarm,
)
from selfrl.core.trajectory import Trajectory

CFG = CollapseConfig()  # baseline_window 2, max_kl 0.5, entropy ratios 0.25 / 3, degenerate_rise 0.35


def rec(step, entropy=1.0, degenerate=0.1, kl=0.01, reward=0.2, version=0):
    return UpdateRecord(step=step, version=version, reward=reward, entropy=entropy, degenerate=degenerate, kl=kl)


def healthy(n=6):
    """A run that learns normally: entropy eases from 1.0 to 0.6, KL grows slowly, degenerate share flat."""
    return [rec(i, entropy=1.0 - 0.08 * i, degenerate=0.1 + 0.02 * (i % 2), kl=0.01 * i, reward=0.2 + 0.05 * i,
                version=i) for i in range(n)]


def test_a_healthy_run_fires_nothing():
    hist = healthy()
    for i in range(1, len(hist) + 1):
        assert cheap_alarms(hist[:i], CFG) == []


def test_kl_blow_up_fires_with_value_and_threshold():
    alarms = cheap_alarms(healthy() + [rec(6, kl=2.5)], CFG)
    assert [(a.rule, a.value, a.threshold) for a in alarms] == [("kl", 2.5, 0.5)]
    # not finite is a blow-up too; an unmeasured KL (beta = 0) is not
    assert [a.rule for a in cheap_alarms([rec(0, kl=math.inf)], CFG)] == ["kl"]
    assert cheap_alarms([rec(0, kl=None)], CFG) == []


def test_low_entropy_with_rising_reward_is_learning_not_collapse():
    # make demo: entropy 0.36 -> 0.075 nats/token while the reward went 0.04 -> 1.0
    hist = [rec(0, entropy=0.37, reward=0.04), rec(1, entropy=0.35, reward=0.40), rec(2, entropy=0.075, reward=1.0)]
    assert cheap_alarms(hist, CFG) == []
    hist[-1] = rec(2, entropy=0.075, reward=0.25)  # confident but no better than the baseline (0.22): collapse
    assert [a.rule for a in cheap_alarms(hist, CFG)] == ["entropy_collapse"]


def test_entropy_collapse_fires_against_the_baseline_window():
    hist = [rec(0, entropy=1.2), rec(1, entropy=0.8), rec(2, entropy=0.24)]  # baseline 1.0, limit 0.25
    alarms = cheap_alarms(hist, CFG)
    assert [(a.rule, a.value) for a in alarms] == [("entropy_collapse", 0.24)]
    assert alarms[0].threshold == pytest.approx(0.25)
    hist[-1] = rec(2, entropy=0.26)  # just above the limit: silent
    assert cheap_alarms(hist, CFG) == []


def test_entropy_blow_up_fires_and_nan_entropy_does_not():
    base = [rec(0, entropy=1.0), rec(1, entropy=1.0)]
    assert [a.rule for a in cheap_alarms(base + [rec(2, entropy=3.5)], CFG)] == ["entropy_blowup"]
    assert cheap_alarms(base + [rec(2, entropy=math.nan)], CFG) == []  # no completion tokens: nothing measured


def test_a_near_zero_baseline_needs_an_absolute_rise_for_a_blowup():
    # grammar-constrained turns (the soak's web family): baseline 0.019 nats/token, ordinary updates at 0.103 and
    # 0.163 (5-8 times it) are not weights turned to noise; the limit is the baseline + entropy_max_rise (0.5)
    base = [rec(0, entropy=0.019), rec(1, entropy=0.019)]
    assert cheap_alarms(base + [rec(2, entropy=0.163)], CFG) == []
    assert cheap_alarms(base + [rec(2, entropy=0.518)], CFG) == []
    alarms = cheap_alarms(base + [rec(2, entropy=0.52)], CFG)
    assert [(a.rule, round(a.threshold, 3)) for a in alarms] == [("entropy_blowup", 0.519)]
    tight = CollapseConfig(entropy_max_rise=0.0)  # the ratio alone, as before
    assert [a.rule for a in cheap_alarms(base + [rec(2, entropy=0.163)], tight)] == ["entropy_blowup"]


def test_a_near_zero_baseline_needs_an_absolute_drop_for_a_collapse():
    # the soak's web family (grammar-constrained): baseline 0.129 nats/token, ordinary updates anywhere in 0.01-0.20
    base = [rec(0, entropy=0.06), rec(1, entropy=0.198)]
    assert cheap_alarms(base + [rec(2, entropy=0.012)], CFG) == []  # before: entropy_collapse, rolled back
    tight = CollapseConfig(entropy_min_drop=0.0)  # the ratio alone, as before
    assert [a.rule for a in cheap_alarms(base + [rec(2, entropy=0.012)], tight)] == ["entropy_collapse"]
    # a family that explored (function calling, 0.5 nats/token) and stops: below 0.125 = 0.25 x 0.5, 0.375 down
    fc = [rec(0, entropy=0.5), rec(1, entropy=0.5)]
    alarms = cheap_alarms(fc + [rec(2, entropy=0.12)], CFG)
    assert [(a.rule, a.threshold) for a in alarms] == [("entropy_collapse", 0.125)]
    low = [rec(0, entropy=0.3), rec(1, entropy=0.3)]  # limits 0.075 (ratio) and 0.05 (drop): the lower holds
    assert cheap_alarms(low + [rec(2, entropy=0.06)], CFG) == []
    assert [round(a.threshold, 3) for a in cheap_alarms(low + [rec(2, entropy=0.04)], CFG)] == [0.05]


def test_rules_are_silent_inside_the_baseline_window():
    # a strange start is the baseline, not a collapse
    assert cheap_alarms([rec(0, entropy=0.01, degenerate=0.9)], CFG) == []
    assert cheap_alarms([rec(0, entropy=0.01, degenerate=0.9), rec(1, entropy=5.0, degenerate=0.0)], CFG) == []


def test_degenerate_share_rise_fires_but_a_high_baseline_alone_does_not():
    base = [rec(0, degenerate=0.5), rec(1, degenerate=0.6)]  # baseline 0.55, limit 0.9
    assert cheap_alarms(base + [rec(2, degenerate=0.85)], CFG) == []
    alarms = cheap_alarms(base + [rec(2, degenerate=1.0)], CFG)
    assert [(a.rule, a.value) for a in alarms] == [("degenerate", 1.0)]
    assert alarms[0].threshold == pytest.approx(0.9)


def test_several_rules_fire_together_and_disabled_fires_none():
    hist = healthy() + [rec(6, entropy=0.05, degenerate=0.9, kl=3.0)]
    assert {a.rule for a in cheap_alarms(hist, CFG)} == {"kl", "entropy_collapse", "degenerate"}
    assert cheap_alarms(hist, CollapseConfig(enabled=False)) == []


def test_heldout_rules():
    # a fall well beyond the gate tolerance
    alarms = heldout_alarms(0.30, 0.45, [], [], 0.02, CFG)
    assert [(a.rule, a.value) for a in alarms] == [("heldout_drop", 0.30)]
    assert alarms[0].threshold == pytest.approx(0.35)
    # reward up 0.15 while held-out fell by 0.05 (> tolerance, < heldout_drop): only the divergence rule
    alarms = heldout_alarms(0.40, 0.45, [0.50, 0.60], [0.40], 0.02, CFG)
    assert [(a.rule, round(a.value, 6)) for a in alarms] == [("reward_vs_heldout", 0.15)]


def test_heldout_rules_stay_silent_for_honest_changes():
    assert heldout_alarms(0.44, 0.45, [0.9], [0.1], 0.02, CFG) == []  # held-out within tolerance: reward may rise
    assert heldout_alarms(0.40, 0.45, [0.42], [0.40], 0.02, CFG) == []  # held-out fell but reward did not rise
    assert heldout_alarms(0.60, 0.45, [0.9], [0.1], 0.02, CFG) == []  # both rose: learning


def test_validation_degenerate_alarm():
    assert validation_alarm(0.9, 0.2, CFG).rule == "degenerate"
    assert validation_alarm(0.5, 0.2, CFG) is None
    assert validation_alarm(0.9, math.nan, CFG) is None  # no base measurement (older run): silent


def traj(completion, final_answer="<answer>4</answer>", truncated=False, logprobs=None):
    ids = [7, 8] + completion
    mask = [0, 0] + [1] * len(completion)
    lps = [0.0, 0.0] + (logprobs or [-0.5] * len(completion))
    return Trajectory("t", "g", 0, token_ids=ids, completion_mask=mask, logprobs=lps,
                      final_answer=final_answer, truncated=truncated)


def test_degenerate_reasons_and_share():
    cfg = CollapseConfig(repeat_ngram=2, repeat_share=0.5)
    ok = traj([1, 2, 3, 4, 5, 6])
    loop = traj([1, 2, 1, 2, 1, 2, 1, 2])  # 7 bigrams, 2 distinct: 5/7 repeated
    assert repeated_ngram_share([1, 2, 1, 2, 1, 2, 1, 2], 2) == pytest.approx(5 / 7)
    assert degenerate_reasons(ok, cfg) == []
    assert degenerate_reasons(loop, cfg) == ["loop"]
    assert degenerate_reasons(traj([1, 2], final_answer="  "), cfg) == ["empty"]
    assert degenerate_reasons(traj([1, 2, 3], truncated=True, final_answer=None), cfg) == ["truncated", "empty"]
    assert degenerate_share([ok, loop, ok, traj([1], truncated=True)], cfg) == 0.5
    # a turn whose output is a tool call is not empty (each calculator turn of served traffic was);
    # a rollout that got the tool's result and never answered still is
    from selfrl.core.trajectory import ToolCallRecord

    call = ToolCallRecord("calculator", {"expression": "1+1"}, "<tool_call>...</tool_call>", True, "2")
    on_call = traj([1, 2], final_answer=None)
    on_call.tool_calls, on_call.messages = [call], [{"role": "user", "content": "1+1?"},
                                                    {"role": "assistant", "content": "<tool_call>...</tool_call>"}]
    assert degenerate_reasons(on_call, cfg) == []
    unanswered = traj([1, 2], final_answer=None)
    unanswered.tool_calls, unanswered.messages = [call], on_call.messages + [{"role": "tool", "content": "2"}]
    assert degenerate_reasons(unanswered, cfg) == ["empty"]
    no_call = traj([1, 2], final_answer=None)
    no_call.messages = on_call.messages[:1] + [{"role": "assistant", "content": ""}]
    assert degenerate_reasons(no_call, cfg) == ["empty"]
    assert math.isnan(degenerate_share([], cfg))


def test_entropy_estimate_weights_tokens_not_trajectories():
    a = traj([1, 2], logprobs=[-1.0, -1.0])
    b = traj([3, 4, 5, 6], logprobs=[-4.0, -4.0, -4.0, -4.0])
    assert entropy_estimate([a, b]) == pytest.approx((2 * 1.0 + 4 * 4.0) / 6)  # not (1 + 4) / 2
    assert math.isnan(entropy_estimate([traj([])]))


def test_safer_setting_compounds():
    cfg = CollapseConfig(lr_factor=0.5, beta_factor=2.0, beta_min=0.01)
    lr, beta = 1e-4, 0.0
    for _ in range(3):
        lr, beta = safer_setting(lr, beta, cfg)
    assert lr == pytest.approx(1.25e-5) and beta == pytest.approx(0.04)


def test_history_rebuilt_from_stored_metrics_skips_unfinished_iterations():
    from selfrl.safety.collapse import history_from_metrics

    def rows(step, **m):
        return [{"step": step, "name": k.replace("__", "/"), "value": v} for k, v in m.items()]

    stored = (rows(0, reward__mean=0.2, sampled_version=0.0, train__entropy=1.0, train__degenerate=0.1, kl=0.0,
                   candidate_kl=0.01)
              + rows(1, reward__mean=0.3, sampled_version=1.0, train__entropy=0.9, train__degenerate=0.2, kl=None)
              + rows(2, **{"val/success": 0.5}))  # a step with no finished iteration
    hist = history_from_metrics(stored)
    assert [(r.step, r.version, r.reward, r.candidate_kl) for r in hist] == [(0, 0, 0.2, 0.01), (1, 1, 0.3, None)]
    # a KL stored as NULL was not finite when logged, and still counts as a blow-up
    assert math.isnan(hist[1].kl) and [a.rule for a in cheap_alarms(hist, CFG)] == ["kl"]
