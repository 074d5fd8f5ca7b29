"""The code environment: HumanEval tasks, hidden tests in the sandbox, run_python, CodeT agreement."""

from __future__ import annotations

import pytest

from selfrl.envs import get_env
from selfrl.envs.code import CodeEnv, extract_program, run_python
from selfrl.envs.rewards import get_preset, score_group
from selfrl.rollout.agent import RolloutConfig, scripted_rollout
from selfrl.core.tools import resolve_tools

ENV = CodeEnv()


def _task(problem_id: str):
    return next(t for t in ENV._ordered() if t.metadata["problem_id"] == problem_id)


def test_humaneval_is_loaded_and_scored_by_its_hidden_tests():
    assert len(ENV._ordered()) == 164
    task = _task("HumanEval/0")
    assert "def has_close_elements" in task.question and task.metadata["entry_point"] == "has_close_elements"
    assert ENV.score(task, task.answer) == 1.0  # the canonical body, completed onto the prompt
    whole = "from typing import List\n\ndef has_close_elements(numbers, threshold):\n" \
            "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n"
    assert ENV.score(task, whole) == 1.0  # a whole function works too
    assert ENV.score(task, "def has_close_elements(numbers, threshold):\n    return False\n") == 0.0
    assert ENV.score(task, None) == 0.0
    assert ENV.score(task, "def has_close_elements(n, t):\n    while True: pass\n") == 0.0  # killed at the timeout


def test_model_code_cannot_reach_the_network_or_write_the_host():
    from pathlib import Path

    target = Path(__file__).resolve().parent / "escaped-by-model-code.txt"  # the host's /tmp is not visible
    out = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert "exit code 1" in out and not target.exists()  # /work is invisible inside the sandbox
    assert "Network is unreachable" in run_python("import socket; socket.create_connection(('1.1.1.1', 80), 2)")
    assert run_python("print(6 * 7)") == "exit code 0\nstdout:\n42\n"


def test_extract_program_takes_the_last_fenced_block():
    text = "try\n```python\nx = 1\n```\nfinal:\n```python\ndef f():\n    return 2\n```"
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program("def g(): return 1") == "def g(): return 1"


def test_scripted_agent_uses_run_python_then_answers_and_is_rewarded():
    task = _task("HumanEval/2")  # truncate_number
    body = "def truncate_number(number: float) -> float:\n    return number % 1.0\n"
    calls = iter([
        '<tool_call>{"name": "run_python", "arguments": {"code": "print(3.5 % 1.0)"}}</tool_call>',
        f"```python\n{body}```",
    ])
    cfg = RolloutConfig(max_turns=3, tools=["run_python"])
    [traj] = scripted_rollout(lambda t, m: next(calls), [task], resolve_tools(["run_python"]), cfg, ENV.make_env)
    assert traj.tool_calls[0].ok and traj.tool_calls[0].result == "exit code 0\nstdout:\n0.5\n"
    score_group([traj], task, ENV, get_preset("code"))
    assert traj.correct and traj.reward == 1.0


def test_execution_agreement_pays_the_majority_behaviour_without_labels():
    task = _task("HumanEval/2")
    right = "```python\ndef truncate_number(number):\n    return number % 1.0\n```"
    wrong = "```python\ndef truncate_number(number):\n    return 0.0\n```"
    probe = '<tool_call>{"name": "run_python", "arguments": {"code": "print(truncate_number(2.25))"}}</tool_call>'
    answers = [right, right, wrong, "no code"]
    trajs = []
    for j, a in enumerate(answers):
        seq = iter([probe, a])
        trajs += scripted_rollout(lambda t, m, s=seq: next(s), [task], resolve_tools(["run_python"]),
                                  RolloutConfig(max_turns=2, tools=["run_python"]), ENV.make_env, group_ids=["g"])
    score_group(trajs, task, ENV, get_preset("code-label-free"))
    # inputs: the docstring's truncate_number(3.5) and the samples' truncate_number(2.25); a score is
    # the share of the 3 other samples with equal outputs on both; no program scores 0
    assert [t.rewards["agreement"] for t in trajs] == [1 / 3, 1 / 3, 0.0, 0.0]
    assert [t.correct for t in trajs] == [True, True, False, False]  # accounting only


def test_code_env_refuses_a_split_larger_than_humaneval_and_subsets_by_limit():
    with pytest.raises(ValueError, match="exceed"):
        ENV.split(120, 48, 0, 0)
    assert len(get_env("code", limit=20)._ordered()) == 20
