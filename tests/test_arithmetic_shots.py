"""``options.shots`` of the arithmetic environment: k solved tasks of the dataset as the worked
example, none of them held out, shown in the prompt exactly as the default example is."""

import pytest

from selfrl.config import RolloutConfig
from selfrl.envs import get_env
from selfrl.rollout.agent import DEMONSTRATION, initial_messages
from selfrl.core.tools import resolve_tools


def test_zero_shots_is_the_default_example():
    env = get_env("arithmetic", shots=0)
    train, val = env.split(20, 10, 0, 1)
    assert env.make_env(val[0]) is None  # the calculator's DEMONSTRATION, as before


def test_k_shots_are_solved_tasks_never_held_out():
    env = get_env("arithmetic", shots=2)
    train, val = env.split(20, 128, 0, 1)
    state = env.make_env(val[0])
    demo = state.demonstration
    assert [m["role"] for m in demo] == ["user", "assistant", "tool", "assistant"] * 2
    users = [m["content"] for m in demo if m["role"] == "user"]
    assert len(set(users)) == 2 and not set(users) & {t.question for t in val}
    for q, call, result, answer in zip(*(iter(demo),) * 4):
        expr = q["content"].split(": ", 1)[1].removesuffix(" =")
        assert f'"expression": "{expr}"' in call["content"]
        value = result["content"].split("\n")[1]
        assert answer["content"] == f"<answer>{value}</answer>"  # the calculator agrees with the dataset
        assert int(value) == eval(expr)  # noqa: S307  (test: a reasoning-gym expression of small integers)
    assert state.tools == [] and state.is_completed() is False


def test_k_shots_replace_the_default_example_in_the_prompt(tiny_tokenizer):
    env = get_env("arithmetic", shots=3)
    _, val = env.split(20, 10, 0, 1)
    msgs = initial_messages(val[0], resolve_tools(["calculator"]), RolloutConfig(), tiny_tokenizer,
                            env.make_env(val[0]).demonstration)
    assert DEMONSTRATION[0] not in msgs
    assert [m["role"] for m in msgs].count("user") == 4 and msgs[-1]["content"] == val[0].question


@pytest.mark.parametrize("shots", [-1, 1.5, True])
def test_bad_shots_is_refused(shots):
    with pytest.raises(ValueError, match="shots must be an integer >= 0"):
        get_env("arithmetic", shots=shots)


def test_shots_work_for_any_reasoning_gym_dataset():
    env = get_env("rg:basic_arithmetic", shots=1)
    env.split(10, 5, 0, 1)
    assert env.make_env(None).demonstration[-1]["content"].startswith("<answer>")
