"""docs/guides/write-an-environment.md: the smallest environment on the page is under 50 lines, and it
runs: registered by name, scored, used by a scripted agent and by a one-iteration run on a tiny model.
The guide's complete example, examples/guess_env.py, runs too: its game, verifier, reward, detector and a
one-iteration run."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
from conftest import save_tiny_phi

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "guides" / "write-an-environment.md"


def _custom_env_block() -> str:
    section = DOC.read_text().split("## The smallest environment", 1)[1]
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


# ------------------------------------------------------------------ the guide's complete example


@pytest.fixture(scope="module")
def guess_env():
    """``examples/guess_env.py`` imported by its dotted path, as the guide's command does."""
    import sys

    from selfrl.safety.detectors import TRAJECTORY_DETECTORS
    from selfrl.envs import get_env, registry
    from selfrl.envs.rewards import PRESET_DOCS, PRESETS, REWARD_FUNCS

    sys.path.insert(0, str(ROOT))
    try:
        env = get_env("examples.guess_env:GuessEnv")
        yield env, sys.modules["examples.guess_env"]
    finally:
        sys.path.remove(str(ROOT))
        for table, key in ((registry._REGISTRY, "guess"), (TRAJECTORY_DETECTORS, "guess_spray"),
                           (REWARD_FUNCS, "guess_economy"), (PRESETS, "guess"), (PRESET_DOCS, "guess")):
            table.pop(key, None)
        sys.modules.pop("examples.guess_env", None)


def _play(module, guesses_for):
    """A scripted player: one ``guess`` call a turn, its numbers from ``guesses_for(secret, answers)``."""
    def policy(task, messages):
        answers = [m["content"].split("\n")[1] for m in messages if m["role"] == "tool"][5:]  # after the demo
        n = guesses_for(int(task.answer), answers)
        return "".join(f'<tool_call>{{"name": "guess", "arguments": {{"n": {k}}}}}</tool_call>' for k in n)
    return policy


def test_the_guide_example_is_found_split_and_registered(guess_env):
    from selfrl.safety.detectors import available_detectors
    from selfrl.envs import describe_envs
    from selfrl.envs.rewards import get_preset

    env, module = guess_env
    assert isinstance(env, module.GuessEnv) and "guess" in dict(describe_envs())
    train, val = env.split(64, 16, 1, 2)
    assert len(val) == len({t.id for t in val}) == 16 and not {t.id for t in train} & {t.id for t in val}
    assert all(t.answer == str(module.secret_of(t.metadata["game"])) for t in val)
    assert get_preset("guess") == {"verifier": 1.0, "guess_economy": 0.5} and "guess_spray" in available_detectors()


def test_binary_search_is_paid_and_spraying_is_clamped(guess_env):
    from selfrl.config import DetectorConfig
    from selfrl.safety.detectors import apply_detectors
    from selfrl.envs.rewards import get_preset, score_group
    from selfrl.rollout.agent import RolloutConfig, scripted_rollout

    env, module = guess_env
    task = env.sample(1, 7)[0]
    cfg = RolloutConfig(max_turns=6, tools=[])

    def search(secret, answers):  # binary search over [1, 32], from the answers so far
        lo, hi = 1, 32
        for a, n in zip(answers, search.made):
            lo, hi = (n + 1, hi) if a == "higher" else (lo, n - 1) if a == "lower" else (n, n)
        search.made.append((lo + hi) // 2)
        return [search.made[-1]]
    search.made = []
    [honest] = scripted_rollout(_play(module, search), [task], [], cfg, env_factory=env.make_env)
    [spray] = scripted_rollout(_play(module, lambda s, a: range(1, 33)), [task], [], cfg, env_factory=env.make_env)
    for traj in (honest, spray):
        score_group([traj], task, env, get_preset("guess"))
    apply_detectors([honest, spray], DetectorConfig(names=["guess_spray"]))
    n = len(honest.env_state["guesses"])
    assert honest.correct and n <= 6 and honest.flags == {}
    assert honest.reward == pytest.approx(1.0 + 0.5 * (1 - (n - 1) / module.MAX_GUESSES))
    # every number in one turn: the verifier pays it, the detector clamps it
    assert spray.correct and len(spray.env_state["guesses"]) == 32
    assert "guess_spray" in spray.flags and spray.reward <= 0.0 and spray.rewards["verifier"] == 1.0


def test_a_bad_guess_is_a_failed_call_not_a_crash(guess_env):
    from selfrl.rollout.agent import RolloutConfig, scripted_rollout

    env, module = guess_env
    task = env.sample(1, 3)[0]
    [traj] = scripted_rollout(_play(module, lambda s, a: [99]), [task], [], RolloutConfig(max_turns=2, tools=[]),
                              env_factory=env.make_env)
    assert traj.tool_calls[0].ok is False and traj.env_state == {"secret": int(task.answer), "guesses": []}


def test_selfrl_run_env_guess_runs_on_a_tiny_model(guess_env, tmp_path, tiny_tokenizer):
    from selfrl.envs import load_run_config
    from selfrl.run.main import run
    from selfrl.record.store import Store

    model = save_tiny_phi(tmp_path / "model", tiny_tokenizer)
    cfg = load_run_config(None, {"task.source": "examples.guess_env:GuessEnv", "model.name": str(model),
                                 "run_dir": str(tmp_path / "r"), "iterations": 1, "num_prompts": 2,
                                 "num_generations": 2, "lora.r": 4, "gate.val_size": 4, "rollout.max_turns": 2})
    assert cfg.preset == "guess" and cfg.detectors.names == ["guess_spray"] and cfg.rollout.constrain == "tool_call"
    run(cfg)
    with Store(tmp_path / "r" / "selfrl.db") as store:
        trajs = store.trajectories()
    assert len(trajs) == 4 and all(t.env_state is not None and "guess_economy" in t.rewards for t in trajs)
    assert all(c.name == "guess" for t in trajs for c in t.tool_calls)  # the grammar allows nothing else
