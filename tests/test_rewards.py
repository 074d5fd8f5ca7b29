"""Tests for selfrl.envs.rewards: hand-made trajectories scored against a real chain_sum task."""

from __future__ import annotations

import pytest

from selfrl.envs.rewards import (
    PRESET_DOCS,
    PRESETS,
    REWARD_FUNCS,
    RewardContext,
    format_reward,
    get_preset,
    get_reward_func,
    normalize_answer,
    score_batch,
    score_group,
    self_consistency,
    tool_success,
    verifier,
)
from selfrl.core.tasks import Task, TaskSource
from selfrl.envs import get_env
from selfrl.core.trajectory import ToolCallRecord, Trajectory


@pytest.fixture(scope="module")
def source() -> TaskSource:
    return get_env("chain_sum")


@pytest.fixture(scope="module")
def task(source) -> Task:
    return source.sample(1, seed=1234)[0]


@pytest.fixture(scope="module")
def wrong(task) -> str:
    """A wrong answer that contains the right one (reasoning-gym gives it partial credit)."""
    return "1" + task.answer


def make(task: Task, final_answer: str | None, oks: tuple[bool, ...] = (), group: str = "g", **kw) -> Trajectory:
    calls = [ToolCallRecord(name="calculator", arguments={}, raw="", ok=ok, result="") for ok in oks]
    return Trajectory(task_id=task.id, group_id=group, adapter_version=0, final_answer=final_answer,
                      tool_calls=calls, **kw)


def ctx_of(task, source, group) -> RewardContext:
    return RewardContext(task=task, source=source, group=group)


# ---------------------------------------------------------------- verifier


def test_verifier_right_wrong_truncated(task, source, wrong):
    right = make(task, f"The sum is <answer>{task.answer}</answer>")
    bad = make(task, f"<answer>{wrong}</answer>")
    cut = make(task, None, truncated=True)
    ctx = ctx_of(task, source, [right, bad, cut])
    assert verifier(right, ctx) == 1.0
    assert 0.0 < source.score(task, wrong) < 1.0  # partial credit that the verifier must not pay
    assert verifier(bad, ctx) == 0.0
    assert verifier(cut, ctx) == 0.0


# ---------------------------------------------------------------- self-consistency


def test_normalize_answer():
    assert normalize_answer(" 3.0 ") == "3"
    assert normalize_answer("1,234") == "1234"
    assert normalize_answer("2.50") == "2.5"
    assert normalize_answer("-0") == "0"
    assert normalize_answer("abc") == "abc"
    assert normalize_answer("  ") is None
    assert normalize_answer(None) is None


def test_self_consistency_majority(task, source):
    group = [make(task, "<answer>7</answer>"), make(task, "<answer>7.0</answer>"),
             make(task, "<answer>1,000</answer>"), make(task, "no answer here"), make(task, None)]
    ctx = ctx_of(task, source, group)
    assert [self_consistency(t, ctx) for t in group] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_self_consistency_plurality_is_enough(task, source):
    group = [make(task, f"<answer>{a}</answer>") for a in ("5", "5", "6", "7", "8")]
    ctx = ctx_of(task, source, group)
    assert [self_consistency(t, ctx) for t in group] == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_self_consistency_tie_is_none(task, source):
    group = [make(task, f"<answer>{a}</answer>") for a in ("5", "5", "6", "6")]
    ctx = ctx_of(task, source, group)
    assert all(self_consistency(t, ctx) is None for t in group)
    all_different = [make(task, f"<answer>{a}</answer>") for a in ("1", "2", "3")]
    ctx = ctx_of(task, source, all_different)
    assert all(self_consistency(t, ctx) is None for t in all_different)


def test_self_consistency_too_few_answers(task, source):
    group = [make(task, "<answer>5</answer>"), make(task, None), make(task, "")]
    ctx = ctx_of(task, source, group)
    assert all(self_consistency(t, ctx) is None for t in group)
    alone = [make(task, "<answer>5</answer>")]
    assert self_consistency(alone[0], ctx_of(task, source, alone)) is None


# ---------------------------------------------------------------- tool success, format


def test_tool_success(task, source):
    ctx = ctx_of(task, source, [])
    assert tool_success(make(task, "x", oks=(True, False, True)), ctx) == pytest.approx(2 / 3)
    assert tool_success(make(task, "x"), ctx) is None


@pytest.mark.parametrize(
    "text, expected",
    [
        ("I added them. <answer>42</answer>", 1.0),
        ("<answer>4</answer> or <answer>42</answer>", 0.0),
        ("<answer><answer>42</answer></answer>", 0.0),
        ("<answer>  </answer>", 0.0),
        ("<answer></answer>", 0.0),
        ("</answer>42<answer>", 0.0),
        ("<answer>42", 0.0),
        ("42", 0.0),
        (None, 0.0),
    ],
)
def test_format(task, source, text, expected):
    assert format_reward(make(task, text), ctx_of(task, source, [])) == expected


# ---------------------------------------------------------------- registry and presets


def test_registry_and_presets():
    import selfrl.judge  # noqa: F401  registers "judge" (tests/test_judge.py imports it in the same process)

    shipped = {"verifier", "self_consistency", "tool_success", "format", "webshop_naive", "partial_credit",
               "agreement", "user_correction", "length_penalty", "web_naive", "user_feedback", "judge"}
    # other tests may register rewards of their own (the docs' worked example): those come from outside selfrl
    assert {n for n, f in REWARD_FUNCS.items() if f.__module__.startswith("selfrl")} == shipped
    assert get_reward_func("format") is format_reward
    with pytest.raises(ValueError, match="valid names: ") as e:
        get_reward_func("nope")
    named = str(e.value).split("valid names: ")[1].split(", ")
    assert [n for n in named if n in shipped] == sorted(shipped) and named == sorted(named)
    assert get_preset("verified") == {"verifier": 1.0, "tool_success": 0.2}
    assert all("verifier" not in w and "partial_credit" not in w
               for name, w in PRESETS.items() if name.endswith("label-free"))
    assert all("format" not in w for w in PRESETS.values())
    with pytest.raises(ValueError, match="valid names: ") as e:
        get_preset("nope")
    presets = ["code", "code-label-free", "function_calling", "function_calling-label-free", "function_calling-partial",
               "label-free", "swe", "verified", "web-naive", "webshop-naive"]
    named = str(e.value).split("valid names: ")[1].split(", ")
    assert [n for n in named if n in presets] == presets and named == sorted(named)
    assert set(PRESET_DOCS) == set(PRESETS) and all("Gamed by" in d for d in PRESET_DOCS.values())
    get_preset("verified")["verifier"] = 5.0  # a copy: the preset is unchanged
    assert PRESETS["verified"]["verifier"] == 1.0


# ---------------------------------------------------------------- scoring


def test_score_group_weighted_sum(task, source, wrong):
    right = make(task, f"<answer>{task.answer}</answer>", oks=(True, False))
    bad = make(task, f"<answer>{wrong}</answer>", oks=(True, True))
    no_tool = make(task, f"<answer>{task.answer}</answer>")
    score_group([right, bad, no_tool], task, source, get_preset("verified"))
    assert right.rewards == {"verifier": 1.0, "tool_success": 0.5}
    assert right.reward == pytest.approx(1.0 + 0.2 * 0.5)
    assert bad.reward == pytest.approx(0.0 + 0.2 * 1.0)
    assert no_tool.rewards == {"verifier": 1.0, "tool_success": None}
    assert no_tool.reward == pytest.approx(1.0)
    assert [right.correct, bad.correct, no_tool.correct] == [True, False, True]


def test_label_free_rewards_agreement_but_records_correctness(task, source, wrong):
    # The majority is wrong: label-free pays agreement, and `correct` still tells the truth.
    group = [make(task, f"<answer>{wrong}</answer>", group="lf") for _ in range(3)]
    group.append(make(task, f"<answer>{task.answer}</answer>", group="lf"))
    score_batch(group, {task.id: task}, source, get_preset("label-free"))
    assert all("verifier" not in t.rewards for t in group)
    assert [t.reward for t in group] == [1.0, 1.0, 1.0, 0.0]
    assert [t.correct for t in group] == [False, False, False, True]


def test_errored_trajectory_is_left_out(task, source):
    failed = make(task, "<answer>5</answer>", error="RuntimeError: engine died", reward=0.7)
    ok = [make(task, "<answer>6</answer>"), make(task, "<answer>7</answer>")]
    score_group([failed, *ok], task, source, get_preset("label-free"))
    assert failed.reward is None and failed.rewards == {} and failed.correct is None
    assert failed.error == "RuntimeError: engine died"
    # The failed one's "5" does not vote: 6 vs 7 is a tie, so no consensus.
    assert all(t.rewards["self_consistency"] is None and t.reward == 0.0 and isinstance(t.reward, float) for t in ok)


def test_raising_reward_function_records_error(task, source, monkeypatch):
    def boom(traj, ctx):
        if traj.final_answer == "<answer>1</answer>":
            raise RuntimeError("kaboom")
        return 0.5

    monkeypatch.setitem(REWARD_FUNCS, "boom", boom)
    bad = make(task, "<answer>1</answer>")
    good = make(task, "<answer>2</answer>")
    score_group([bad, good], task, source, {"verifier": 1.0, "boom": 1.0})
    assert bad.reward is None
    assert bad.error is not None and "boom" in bad.error and "kaboom" in bad.error
    assert good.error is None and good.reward == pytest.approx(0.5)


def test_non_finite_reward_is_an_error(task, source, monkeypatch):
    monkeypatch.setitem(REWARD_FUNCS, "nan", lambda traj, ctx: float("nan"))
    t = make(task, "<answer>1</answer>")
    score_group([t], task, source, {"nan": 1.0})
    assert t.reward is None and "non-finite" in t.error


def test_a_weighted_sum_that_overflows_is_recorded_as_a_failure_not_used(task, source, monkeypatch):
    # each value and weight is finite, their sum is not: 1e200 * 1e200 = inf
    monkeypatch.setitem(REWARD_FUNCS, "huge", lambda traj, ctx: 1e200)
    over = make(task, "<answer>1</answer>")
    score_group([over], task, source, {"huge": 1e200})
    assert over.reward is None and "weighted sum" in over.error and "inf" in over.error
    # +inf and -inf parts would sum to NaN: refused the same way
    monkeypatch.setitem(REWARD_FUNCS, "neg", lambda traj, ctx: -1e200)
    mixed = make(task, "<answer>1</answer>")
    score_group([mixed], task, source, {"huge": 1e200, "neg": 1e200})
    assert mixed.reward is None and "nan" in mixed.error
    # huge but finite sums are rewards like any other
    fine = make(task, "<answer>1</answer>")
    score_group([fine], task, source, {"huge": 1e100})
    assert fine.error is None and fine.reward == 1e300


def test_score_group_rejects_bad_input_before_writing(task, source):
    t = make(task, "<answer>1</answer>")
    with pytest.raises(ValueError, match="valid names"):
        score_group([t], task, source, {"verifer": 1.0})
    with pytest.raises(ValueError, match="finite"):
        score_group([t], task, source, {"verifier": float("inf")})
    other = Task.make("chain_sum", "1 + 1 =", "2")
    with pytest.raises(ValueError, match="other task"):
        score_group([t], other, source, {"verifier": 1.0})
    assert t.rewards == {} and t.reward is None and t.correct is None


def test_score_batch_groups_by_group_id(task, source):
    other = source.sample(1, seed=99)[0]
    assert other.id != task.id
    a = [make(task, f"<answer>{task.answer}</answer>", group="a"), make(task, "<answer>0</answer>", group="a")]
    b = [make(other, f"<answer>{other.answer}</answer>", group="b") for _ in range(2)]
    score_batch([a[0], b[0], a[1], b[1]], {task.id: task, other.id: other}, source, {"verifier": 1.0})
    assert [t.reward for t in a] == [1.0, 0.0]
    assert [t.reward for t in b] == [1.0, 1.0]
    with pytest.raises(ValueError, match="not in tasks_by_id"):
        score_batch(a, {}, source, {"verifier": 1.0})
    with pytest.raises(ValueError, match="mixes tasks"):
        score_batch([a[0], make(other, "1", group="a")], {task.id: task, other.id: other}, source, {"verifier": 1.0})
