"""The easy code tier: generated one-line functions, split by content hash, verified in the sandbox."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

from selfrl.envs import get_env, load_run_config
from selfrl.envs.code import MAX_SHOTS, CodeEnv
from selfrl.envs.code_tasks import N_TASKS, N_TESTS, easy_tasks

ROOT = Path(__file__).resolve().parent.parent
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
EASY = CodeEnv(tier="easy")


def _expected(test: str):
    """The expected value of ``assert candidate(...) == VALUE``."""
    return ast.literal_eval(test.split(" == ", 1)[1])


def test_the_family_is_hundreds_of_distinct_tasks_the_same_on_every_build():
    tasks = easy_tasks()
    assert len(tasks) == N_TASKS == 600 and len({t.prompt for t in tasks}) == 600
    shapes = {t.task_id.split("/")[1] for t in tasks}
    assert {"filter-map-sum", "filter-count", "map-max", "edit1-count", "edit2-text"} <= shapes
    assert len(shapes) == 13
    easy_tasks.cache_clear()
    again = easy_tasks()
    assert again is not tasks and again == tasks  # rebuilt from scratch: equal, inputs included
    task = next(t for t in tasks if t.task_id == "CodeEasy/filter-map-list/list_squared_odds")
    assert task.prompt.startswith('def list_squared_odds(xs: list) -> list:\n    """Take the numbers of xs that '
                                  'are odd, square each, and return them as a list, in order.\n    >>> ')
    for test in task.tests:  # the expected values are the odd numbers squared
        xs = ast.literal_eval(test[len("assert candidate("):test.index(") == ")])
        assert _expected(test) == [x * x for x in xs if x % 2]


def test_hidden_tests_tell_a_constant_answer_from_the_right_one():
    for t in easy_tasks():
        values = [repr(_expected(x)) for x in t.tests]
        assert len(set(t.tests)) == N_TESTS, t.task_id
        assert values[0] != values[1], t.task_id  # the docstring's two examples differ, so no constant passes


def test_split_is_disjoint_deterministic_and_keeps_the_k_shot_examples_out():
    train, val = EASY.split(400, 64, 0, 1)
    assert len(train) == 400 and len(val) == 64
    assert not {t.id for t in train} & {t.id for t in val}
    assert [t.id for t in CodeEnv(tier="easy").split(400, 64, 7, 9)[1]] == [t.id for t in val]  # seeds do not move it
    assert [t.id for t in CodeEnv(tier="easy", shots=3).split(400, 64, 0, 1)[1]] == [t.id for t in val]
    shots = {t.id for t in EASY._reserved}
    assert len(shots) == MAX_SHOTS and not shots & ({t.id for t in train} | {t.id for t in val})
    assert len({t.metadata["problem_id"].split("/")[1] for t in EASY._reserved}) == MAX_SHOTS  # three shapes
    with pytest.raises(ValueError, match="exceed the 597 there are in the easy tier"):
        EASY.split(534, 64, 0, 1)
    a, b = EASY.sample(20, 5), CodeEnv(tier="easy").sample(20, 5)
    assert [t.id for t in a] == [t.id for t in b] != [t.id for t in EASY.sample(20, 6)]
    assert not {t.id for t in EASY.sample(500, 1)} & shots


def test_k_shot_prompt_is_k_solved_problems_and_humaneval_refuses_shots():
    demo = CodeEnv(tier="easy", shots=2).make_env(EASY._reserved[0]).demonstration
    assert [m["role"] for m in demo] == ["user", "assistant"] * 2
    first = EASY._reserved[0]
    assert demo[0]["content"] == first.question
    assert demo[1]["content"].startswith(f"```python\ndef {first.metadata['entry_point']}(")
    assert CodeEnv(tier="easy").make_env(first).demonstration[1]["content"].startswith("<tool_call>")
    with pytest.raises(ValueError, match="humaneval code tier has no k-shot"):
        CodeEnv(shots=1)
    with pytest.raises(ValueError, match="valid: humaneval, easy"):
        CodeEnv(tier="medium")
    with pytest.raises(ValueError, match="shots must be an integer in 0-3"):
        CodeEnv(tier="easy", shots=4)


@needs_bwrap
def test_verifier_passes_the_reference_and_fails_wrong_code_in_the_sandbox():
    by_shape = {}
    for t in EASY._ordered():
        by_shape.setdefault(t.metadata["problem_id"].split("/")[1], t)
    assert len(by_shape) == 13
    for shape, task in by_shape.items():
        entry = task.metadata["entry_point"]
        assert EASY.score(task, task.answer) == 1.0, shape  # the reference body, completed onto the prompt
        first = _expected(task.metadata["tests"][0])
        constant = f"```python\ndef {entry}(*args):\n    return {first!r}\n```"
        assert EASY.score(task, constant) == 0.0, shape  # right on the first example only
    task = next(t for t in EASY._ordered() if t.metadata["entry_point"] == "sum_times_3_over_5")
    assert EASY.score(task, "def sum_times_3_over_5(xs):\n    return 3 * sum(x for x in xs if x > 5)\n") == 1.0
    assert EASY.score(task, "def sum_times_3_over_5(xs):\n    return 3 * sum(x for x in xs if x >= 5)\n") == 0.0
    assert EASY.score(task, "def sum_times_3_over_5(xs):\n    while True: pass\n") == 0.0


def test_config_code_easy_loads_and_builds_the_easy_tier():
    cfg = load_run_config(ROOT / "configs" / "code_easy.toml")
    assert cfg.task.source == "code" and cfg.task.options == {"tier": "easy"}
    env = get_env(cfg.task.source, **cfg.task.options)
    train, val = env.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    assert (len(train), len(val)) == (400, 64) and val[0].metadata["problem_id"].startswith("CodeEasy/")
    assert cfg.rollout.tools == ["run_python"] and cfg.preset == "code"


def test_config_code_easy_warm_is_code_easy_from_the_3_shot_prompt_with_a_warm_start():
    # the same held-out and training problems as code_easy.toml (the split does not depend on shots),
    # the three shown problems in neither
    plain, warm = (load_run_config(ROOT / "configs" / f"{n}.toml") for n in ("code_easy", "code_easy_warm"))
    assert warm.task.options == {"tier": "easy", "shots": 3} and warm.warm_start.enabled
    assert (warm.train, warm.rollout, warm.gate) == (plain.train, plain.rollout, plain.gate)
    splits = [get_env(c.task.source, **c.task.options).split(c.task.num_train, c.gate.val_size, c.task.train_seed,
                                                             c.task.val_seed) for c in (plain, warm)]
    assert [[t.id for t in part] for part in splits[0]] == [[t.id for t in part] for part in splits[1]]
    shown = get_env(warm.task.source, **warm.task.options).demonstration
    assert len([m for m in shown if m["role"] == "user"]) == 3
    assert not any(t.question in m["content"] for t in splits[1][0] + splits[1][1] for m in shown if m["role"] == "user")
