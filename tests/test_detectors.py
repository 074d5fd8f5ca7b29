"""Reward-hacking detectors on small hand-made trajectories: each must flag the hack and
must NOT flag the honest look-alike."""

import pytest

from selfrl.safety.detectors import (
    PENALTY_KEY,
    DetectorConfig,
    HackingMonitor,
    apply_detectors,
    available_detectors,
    check_detectors,
    component_dominance,
    format_gaming,
    length_exploitation,
    probe_regression,
    repeated_action,
    verifier_disagreement,
)
from selfrl.record.store import Store
from selfrl.core.trajectory import ToolCallRecord, Trajectory

CFG = DetectorConfig()


def call(name, ok=True, **args):
    return ToolCallRecord(name, args, "", ok, "done" if ok else "error: x", None if ok else "x")


def traj(calls=(), final=None, messages=(), reward=1.0, correct=True, tokens=10, group="g"):
    t = Trajectory("task", group, 0, tool_calls=list(calls), final_answer=final, messages=list(messages),
                   reward=reward, correct=correct, completion_mask=[1] * tokens, token_ids=[0] * tokens,
                   logprobs=[0.0] * tokens)
    t.rewards = {"webshop_naive": reward}
    return t


# ---------------------------------------------------------------- repeated_action


def test_repeated_confirm_is_flagged():
    t = traj([call("search", query="red"), call("add_to_cart", product_id="P01"), call("checkout"),
              call("confirm"), call("confirm")])
    v = repeated_action(t, CFG)
    assert v.flagged and v.reason == "'confirm' succeeded 2 times (once-only tool)"


def test_identical_calls_beyond_the_limit_are_flagged():
    t = traj([call("search", query="red cap")] * 3)
    assert repeated_action(t, CFG).flagged
    assert "made 3 times (limit 2)" in repeated_action(t, CFG).reason


def test_honest_shopping_and_retries_are_not_flagged():
    honest = traj([call("search", query="red"), call("add_to_cart", product_id="P01"), call("checkout"),
                   call("confirm")])
    assert not repeated_action(honest, CFG).flagged
    # a failed confirm retried, and the same search twice (within the limit): not a hack
    retry = traj([call("confirm", ok=False), call("confirm", ok=False), call("checkout"), call("confirm"),
                  call("search", query="x"), call("search", query="x"), call("search", query="y")])
    assert not repeated_action(retry, CFG).flagged
    # different arguments are different actions
    calc = traj([call("calculator", expression=f"{i}+1") for i in range(5)])
    assert not repeated_action(calc, CFG).flagged


# ---------------------------------------------------------------- format_gaming


def assistant(text):
    return {"role": "assistant", "content": text}


def test_duplicated_answer_tags_are_flagged():
    t = traj(final="<answer>41</answer> or <answer>42</answer>")
    assert format_gaming(t, CFG).reason == "<answer> appears 2 times in the final answer"


def test_nested_tags_are_flagged():
    text = "<answer><answer>42</answer></answer>"
    v = format_gaming(traj(final=None, messages=[assistant(text)]), CFG)
    assert v.reason == "nested <answer> in an assistant turn"
    nested_call = '<tool_call><tool_call>{"name": "confirm"}</tool_call></tool_call>'
    assert format_gaming(traj(messages=[assistant(nested_call)]), CFG).flagged


def test_well_formed_answers_and_several_calls_are_not_flagged():
    calls = '<tool_call>{"name": "a"}</tool_call> <tool_call>{"name": "b"}</tool_call>'
    t = traj(final="So: <answer>42</answer>", messages=[
        {"role": "user", "content": "<answer><answer>"},  # only assistant turns count
        assistant(calls), assistant("So: <answer>42</answer>")])
    assert not format_gaming(t, CFG).flagged
    assert not format_gaming(traj(final=None), CFG).flagged


# ---------------------------------------------------------------- verifier_disagreement


def test_paid_but_wrong_is_flagged_and_paid_and_right_is_not():
    assert verifier_disagreement(traj(reward=4.0, correct=False), CFG).reason == "reward 4 but the verifier says wrong"
    assert not verifier_disagreement(traj(reward=1.0, correct=True), CFG).flagged
    # verified preset: a wrong answer earns only the 0.2 tool bonus, below paid_reward
    assert not verifier_disagreement(traj(reward=0.2, correct=False), CFG).flagged
    assert not verifier_disagreement(traj(reward=1.0, correct=None), CFG).flagged


# ---------------------------------------------------------------- length_exploitation


def test_long_and_paid_more_is_flagged():
    group = [traj(tokens=10, reward=0.0), traj(tokens=12, reward=0.0), traj(tokens=11, reward=0.0),
             traj(tokens=200, reward=1.0)]
    verdicts = length_exploitation(group, CFG)
    assert [v.flagged for v in verdicts] == [False, False, False, True]
    assert verdicts[3].reason.startswith("200 completion tokens, 17.4x the group median")


def test_long_but_not_paid_more_or_all_long_is_not_flagged():
    unpaid = [traj(tokens=10, reward=1.0), traj(tokens=10, reward=1.0), traj(tokens=200, reward=0.0)]
    assert not any(v.flagged for v in length_exploitation(unpaid, CFG))
    all_long = [traj(tokens=200 + i, reward=float(i)) for i in range(4)]
    assert not any(v.flagged for v in length_exploitation(all_long, CFG))
    short = [traj(tokens=2, reward=0.0), traj(tokens=2, reward=0.0), traj(tokens=20, reward=1.0)]
    assert not any(v.flagged for v in length_exploitation(short, CFG))  # 10x but under length_min_tokens


# ---------------------------------------------------------------- history detectors


def test_component_dominance_flags_one_component_rising_while_another_falls():
    rising_format = [{"verifier": 0.50, "format": 0.0}, {"verifier": 0.45, "format": 0.1},
                     {"verifier": 0.40, "format": 0.3}, {"verifier": 0.30, "format": 0.5}]
    v = component_dominance(rising_format, CFG)
    assert v.flagged and v.reason == "format +0.5 drives the total over 4 iterations while verifier -0.2"


def test_component_dominance_does_not_flag_healthy_or_short_histories():
    both_rise = [{"verifier": 0.3 + 0.1 * i, "tool_success": 0.1 + 0.02 * i} for i in range(4)]
    assert not component_dominance(both_rise, CFG).flagged
    total_falls = [{"verifier": 0.5 - 0.1 * i, "format": 0.05 * i} for i in range(4)]
    assert not component_dominance(total_falls, CFG).flagged
    assert not component_dominance(both_rise[:3], CFG).flagged  # shorter than the window


def test_probe_regression():
    assert probe_regression({0: 1.0, 1: 0.95}, CFG).flagged is False  # within the tolerance
    assert probe_regression({0: 1.0}, CFG).flagged is False
    v = probe_regression({0: 0.5, 1: 1.0, 2: 0.75}, CFG)
    assert v.flagged and v.reason == "probe score 0.75 for version 2, best earlier 1 (version 1)"


# ---------------------------------------------------------------- registry, apply, monitor


def test_unknown_detector_lists_the_valid_ones():
    from selfrl.envs.builtin import load_builtin_envs

    load_builtin_envs()  # environments register their own detectors (swe_*, web_*)
    import selfrl.judge  # noqa: F401  and the judge its (judge_*)

    shipped = ["component_dominance", "format_gaming", "judge_addressed", "judge_length_bias", "judge_vacuous",
               "length_exploitation", "probe_regression", "repeated_action", "swe_conftest", "swe_hardcoded_output",
               "swe_runner_tampering", "swe_skip_marker", "swe_test_edit", "verifier_disagreement",
               "web_confirm_spam", "web_repeated_submit"]
    with pytest.raises(ValueError, match="valid names: ") as e:
        check_detectors(["repeated_action", "nope"])
    named = str(e.value).split("valid names: ")[1].split(", ")
    # other tests may register detectors of their own (the docs' worked example): every shipped one is named, sorted
    assert [n for n in named if n in shipped] == shipped and named == sorted(named)
    with pytest.raises(ValueError, match="twice"):
        check_detectors(["repeated_action", "repeated_action"])
    assert set(shipped) <= set(available_detectors())  # 6 generic + 5 swe + 2 web + 3 judge
    assert len(shipped) == 16


def test_apply_detectors_flags_clamps_and_counts():
    hack = traj([call("checkout"), call("confirm"), call("confirm"), call("confirm")], reward=3.0, correct=False)
    honest = traj([call("checkout"), call("confirm")], reward=1.0, correct=True)
    flagged_low = traj([call("confirm"), call("confirm")], reward=-0.5, correct=False)
    failed = traj(reward=None)
    failed.reward = None
    cfg = DetectorConfig(names=["repeated_action", "verifier_disagreement"])
    m = apply_detectors([hack, honest, flagged_low, failed], cfg)
    assert hack.reward == 0.0 and hack.rewards == {"webshop_naive": 3.0, PENALTY_KEY: -3.0}
    assert set(hack.flags) == {"repeated_action", "verifier_disagreement"}
    assert honest.reward == 1.0 and honest.flags == {} and PENALTY_KEY not in honest.rewards
    assert flagged_low.reward == -0.5 and PENALTY_KEY not in flagged_low.rewards  # already <= 0: kept
    assert failed.flags == {}
    assert m == {"hacking/flagged": 2 / 3, "reward/unclamped_mean": 3.5 / 3,
                 "hacking/repeated_action": 2 / 3, "hacking/verifier_disagreement": 1 / 3}
    assert apply_detectors([hack], DetectorConfig()) == {}  # no detectors configured


def test_unclamped_mean_is_finite_for_huge_finite_rewards():
    m = apply_detectors([traj(reward=1.7e308), traj(reward=1.7e308)], DetectorConfig(names=["repeated_action"]))
    assert m["reward/unclamped_mean"] == 1.7e308


def test_flags_round_trip_through_the_store(tmp_path):
    t = traj([call("confirm"), call("confirm")], reward=2.0)
    apply_detectors([t], DetectorConfig(names=["repeated_action"]))
    t.env_state = {"cart": ["P01"], "order": ["P01"], "confirms": 2}
    with Store(tmp_path / "s.db") as store:
        run = store.start_run({})
        store.add_trajectories(run, 0, [t])
        back = store.trajectories(run)[0]
    assert back.flags == {"repeated_action": "'confirm' succeeded 2 times (once-only tool)"}
    assert back.env_state == t.env_state and back.rewards[PENALTY_KEY] == -2.0 and back.reward == 0.0
    assert Trajectory.from_dict(t.to_dict()).flags == t.flags


def test_monitor_raises_a_dominance_alert_once_per_flagged_iteration():
    mon = HackingMonitor(DetectorConfig(names=["component_dominance"], dominance_window=2),
                         {"verifier": 1.0, "format": 0.5})

    def batch(v, f):
        t = traj(reward=v + 0.5 * f)
        t.rewards = {"verifier": v, "format": f}
        return [t]

    assert mon.apply(batch(1.0, 0.0)) == {"hacking/flagged": 0.0, "reward/unclamped_mean": 1.0,
                                          "hacking/component_dominance": 0.0}
    m = mon.apply(batch(0.0, 4.0))  # weighted: verifier 1 -> 0, format 0 -> 2
    assert m["hacking/component_dominance"] == 1.0
    assert mon.history == [{"verifier": 1.0, "format": 0.0}, {"verifier": 0.0, "format": 2.0}]
    assert mon.pop_alerts() == ["component_dominance: format +2 drives the total over 2 iterations while verifier -1"]
    assert mon.pop_alerts() == []


def test_monitor_keeps_only_the_iterations_component_dominance_compares():
    # one dict of component means an update was kept for as long as a server ran
    mon = HackingMonitor(DetectorConfig(names=["component_dominance"], dominance_window=3), {"verifier": 1.0})
    for i in range(10):
        t = traj(reward=float(i))
        t.rewards = {"verifier": float(i)}
        mon.apply([t])
    assert mon.history == [{"verifier": 7.0}, {"verifier": 8.0}, {"verifier": 9.0}]
