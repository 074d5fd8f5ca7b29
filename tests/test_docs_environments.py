"""docs/environments.md: the custom environment on the page is under 50 lines, and it runs:
registered by name, scored, used by a scripted agent and by a one-iteration run on a tiny model."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
from conftest import save_tiny_phi

DOC = Path(__file__).resolve().parent.parent / "docs" / "environments.md"


def _custom_env_block() -> str:
    section = DOC.read_text().split("## A custom environment in under 50 lines", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture(scope="module")
def reverse_env():
    from selfrl.envs import registry
    from selfrl.core.tools import _REGISTRY as TOOLS

    code = _custom_env_block()
    module = types.ModuleType("docs_reverse_env")
    exec(compile(code, str(DOC), "exec"), module.__dict__)  # the page's code, as written
    yield module, code
    registry._REGISTRY.pop("reverse", None)
    TOOLS.pop("reverse", None)


def test_the_page_shows_a_whole_environment_in_under_50_lines(reverse_env):
    _, code = reverse_env
    assert len(code.strip().splitlines()) < 50


def test_the_custom_environment_is_found_split_and_solved(reverse_env):
    from selfrl.envs import describe_envs, get_env
    from selfrl.envs.rewards import get_preset, score_group
    from selfrl.rollout.agent import RolloutConfig, scripted_rollout
    from selfrl.core.tools import resolve_tools

    module, _ = reverse_env
    env = get_env("reverse")
    assert isinstance(env, module.ReverseEnv) and ("reverse", "reverse a word, with a reverse tool") in describe_envs()
    train, val = env.split(12, 4, 1, 2)
    assert len(val) == 4 and not {t.id for t in train} & {t.id for t in val}
    task = val[0]
    word = task.metadata["word"]
    script = iter([f'<tool_call>{{"name": "reverse", "arguments": {{"word": "{word}"}}}}</tool_call>',
                   f"<answer>{word[::-1]}</answer>"])
    cfg = RolloutConfig(max_turns=3, tools=["reverse"])
    [traj] = scripted_rollout(lambda t, m: next(script), [task], resolve_tools(["reverse"]), cfg)
    score_group([traj], task, env, get_preset("verified"))
    assert traj.tool_calls[0].result == word[::-1] and traj.correct and traj.reward == pytest.approx(1.2)


def test_selfrl_run_env_reverse_runs_on_a_tiny_model(reverse_env, tmp_path, tiny_tokenizer):
    from selfrl.envs import load_run_config
    from selfrl.run.main import run
    from selfrl.record.store import Store

    model = save_tiny_phi(tmp_path / "model", tiny_tokenizer)
    cfg = load_run_config(None, {"task.source": "reverse", "model.name": str(model), "run_dir": str(tmp_path / "r"),
                                 "iterations": 1, "num_prompts": 2, "num_generations": 2, "lora.r": 4,
                                 "rollout.max_new_tokens": 6, "rollout.max_turns": 1})
    assert cfg.rollout.tools == ["reverse"] and cfg.gate.val_size == 4  # the environment's defaults
    run(cfg)
    module = reverse_env[0]
    with Store(tmp_path / "r" / "selfrl.db") as store:
        trajs, val = store.trajectories(), store.task_ids("val")
    assert len(trajs) == 4 and len(val) == 4
    words = {module.ReverseEnv()._task(w).id for w in module.WORDS}
    assert {t.task_id for t in trajs} <= words and val <= words
