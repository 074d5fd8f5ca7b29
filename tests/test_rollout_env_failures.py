"""A failing environment fails only its own trajectory (issue: "bad input gets a clear error
and loses nothing").

A scripted agent pokes a stateful tool once, then answers. One trajectory of three has an
environment whose hook raises: the reset (``make_env``), ``is_completed()``,
``turn_tools()``, ``state()`` or ``close()``. That trajectory is recorded with the error (and
is left out of the update), the other two complete as if nothing happened, and every
environment made is closed exactly once. On the code before this change each of these hooks
raised out of ``rollout`` and failed the whole batch (and with it the iteration). A tool that
raises was already an error message to the model; it is pinned here too.
"""

from __future__ import annotations

import sys
import types
from concurrent.futures import Future

import pytest

from selfrl.config import RolloutConfig
from selfrl.engines.reference import Engine
from selfrl.engines.base import Generation
from selfrl.envs import Env
from selfrl.rollout.agent import rollout, scripted_rollout
from selfrl.core.tasks import Task
from selfrl.core.tools import Tool

CALL = '<tool_call>{"name": "poke", "arguments": {}}</tool_call>'
ANSWER = "<answer>done</answer>"
TASKS = [Task.make("flaky", f"Poke, then say done ({k}).", "done") for k in range(3)]
BAD = TASKS[1].id  # the trajectory whose environment fails
HOOKS = ["make_env", "is_completed", "turn_tools", "state", "close"]


class FlakyState:
    """A per-trajectory environment whose hook ``fail`` raises (None: none does)."""

    demonstration = None

    def __init__(self, fail: str | None):
        self.fail, self.poked, self.closes, self.turn_tools_calls = fail, False, 0, 0
        self.tools = [Tool("poke", "Poke the environment.", {"type": "object", "properties": {}}, self._poke)]

    def _raise_if(self, hook: str) -> None:
        if self.fail == hook:
            raise RuntimeError(f"{hook} broke")

    def _poke(self) -> str:
        self._raise_if("tool")
        self.poked = True
        return "POKED"

    def is_completed(self) -> bool:
        self._raise_if("is_completed")
        return False

    def turn_tools(self):
        self.turn_tools_calls += 1
        if self.turn_tools_calls > 1:  # fine when the rollout starts, broken before the second turn
            self._raise_if("turn_tools")
        return None

    def state(self) -> dict:
        self._raise_if("state")
        return {"poked": self.poked}

    def close(self) -> None:
        self.closes += 1
        self._raise_if("close")


def factory(fail: str | None, made: list[FlakyState]):
    def make_env(task: Task) -> FlakyState:
        if fail == "make_env" and task.id == BAD:
            raise RuntimeError("make_env broke")
        made.append(FlakyState(fail if task.id == BAD else None))
        return made[-1]
    return make_env


class ScriptedAgent(Engine):
    """Pokes until the tool said "POKED", then answers (one ``generate`` call per turn)."""

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False, stop=None, constraints=None, **_):
        return [self.turn(p) for p in prompts]

    def turn(self, prompt: list[int]) -> Generation:
        text = ANSWER if "POKED" in self.tokenizer.decode(prompt) else CALL
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Generation(ids, [-0.5] * len(ids), True, self.version)


class PipelinedAgent(ScriptedAgent):
    """The same agent behind ``submit``: ``rollout`` takes its pipelined path."""

    def submit(self, prompt, max_new_tokens, temperature=1.0, greedy=False, stop=None, seed=None, **_):
        f = Future()
        f.set_result(self.turn(prompt))
        return f


def cfg_for(hook: str) -> RolloutConfig:
    # turn_tools() is asked only when a grammar offers the tools (rollout.constrain)
    return RolloutConfig(max_turns=3, max_new_tokens=64, demonstration=False,
                         constrain="tool_call" if hook == "turn_tools" else "none")


EXPECTED = {  # hook -> (the failed trajectory's error, its turns)
    "make_env": ("environment reset (make_env) failed: RuntimeError: make_env broke", 0),
    "is_completed": ("environment is_completed() after turn 1 failed: RuntimeError: is_completed broke", 1),
    "turn_tools": ("environment turn_tools() failed: RuntimeError: turn_tools broke", 1),
    "state": ("environment state() failed: RuntimeError: state broke", 2),
    "close": ("environment close() failed: RuntimeError: close broke", 2),
}


def assert_batch_failures(trajs, made: list[FlakyState], hook: str) -> None:
    error, turns = EXPECTED[hook]
    assert [t.task_id for t in trajs] == [t.id for t in TASKS]
    bad = trajs[1]
    assert bad.error == error and bad.num_turns == turns
    for t in (trajs[0], trajs[2]):  # the rest of the batch is untouched by it
        assert t.error is None and t.num_turns == 2 and t.env_state == {"poked": True}
        assert [c.ok for c in t.tool_calls] == [True] and t.final_answer.strip() == ANSWER
    assert len(made) == (2 if hook == "make_env" else 3)
    assert [env.closes for env in made] == [1] * len(made)  # every environment made, closed once


@pytest.mark.parametrize("hook", HOOKS)
@pytest.mark.parametrize("engine_cls", [ScriptedAgent, PipelinedAgent], ids=["batched", "pipelined"])
def test_a_failing_environment_hook_fails_only_its_trajectory(tiny_tokenizer, tiny_model, engine_cls, hook):
    made: list[FlakyState] = []
    trajs = rollout(engine_cls(tiny_model, tiny_tokenizer), TASKS, ["a", "b", "c"], [], cfg_for(hook),
                    env_factory=factory(hook, made))
    assert_batch_failures(trajs, made, hook)
    for t in trajs:
        t.check()  # token-level fields stay aligned, failed or not


@pytest.mark.parametrize("hook", ["make_env", "is_completed", "state", "close"])
def test_scripted_rollout_records_the_same_failures(hook):
    made: list[FlakyState] = []

    def policy(task, messages):
        return ANSWER if any(m["role"] == "tool" and "POKED" in m["content"] for m in messages) else CALL

    trajs = scripted_rollout(policy, TASKS, [], cfg_for(hook), env_factory=factory(hook, made))
    assert_batch_failures(trajs, made, hook)


def test_a_tool_that_raises_is_an_error_message_to_the_model(tiny_tokenizer, tiny_model):
    made: list[FlakyState] = []
    trajs = rollout(ScriptedAgent(tiny_model, tiny_tokenizer), TASKS, ["a", "b", "c"], [], cfg_for("tool"),
                    env_factory=factory("tool", made))
    bad = trajs[1]
    assert bad.error is None and bad.num_turns == 3  # it keeps trying: never told POKED, its last call unrun
    assert [(c.ok, c.error) for c in bad.tool_calls] == [(False, "'poke' failed: RuntimeError: tool broke")] * 2
    tool_messages = [m["content"] for m in bad.messages if m["role"] == "tool"]
    assert tool_messages == ["<tool_response>\nerror: 'poke' failed: RuntimeError: tool broke\n</tool_response>"] * 2
    assert [t.error for t in trajs] == [None] * 3 and [env.closes for env in made] == [1, 1, 1]


# -- the verifier ------------------------------------------------------------------------------------


class _Flaky(Env):
    """Three tasks; the verifier raises on the middle one."""

    name = "flaky"
    description = "a verifier that raises on one task"

    def sample(self, n, seed):
        return TASKS[:n]

    def score(self, task, answer):
        if task.id == BAD:
            raise RuntimeError("the verifier broke")
        return float(answer == task.answer)


def test_a_verifier_that_raises_fails_only_its_trajectory_in_scoring_and_in_validation(tiny_tokenizer, tiny_model):
    from selfrl.safety.gate import validate
    from selfrl.envs.rewards import score_batch

    source = _Flaky()
    cfg = RolloutConfig(max_turns=1, max_new_tokens=64, demonstration=False)
    engine = ScriptedAgent(tiny_model, tiny_tokenizer)
    engine.turn = lambda prompt: Generation(*(lambda ids: (ids, [-0.5] * len(ids), True, 0))(
        tiny_tokenizer("<answer>done</answer>", add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]))
    trajs = rollout(engine, TASKS, [t.id for t in TASKS], [], cfg)
    score_batch(trajs, {t.id: t for t in TASKS}, source, {"verifier": 1.0})
    assert [t.reward for t in trajs] == [1.0, None, 1.0]  # recorded, left out, never a 0
    assert trajs[1].error == "reward 'verifier (for correct)' failed: RuntimeError: the verifier broke"
    res = validate(engine, TASKS, source, [], cfg)  # on the old code this raised out of the validation
    assert [c for _, c, _ in res.results] == [True, False, True] and res.success == pytest.approx(2 / 3)
    assert res.errors == {BAD: "verifier failed: RuntimeError: the verifier broke"}


# -- a whole run -------------------------------------------------------------------------------------


class _ResetFails(Env):
    """Two train and two held-out tasks; the reset of the "bad" ones raises."""

    name = "reset_fails"
    description = "make_env raises for some tasks"
    config_defaults = {"rollout.tools": [], "rollout.max_turns": 2}

    def sample(self, n, seed):
        return [Task.make(self.name, q, "x") for q in ("good one", "bad one", "good two", "bad two")][:n]

    def split(self, n_train, n_val, train_seed, val_seed):
        tasks = self.sample(4, 0)
        return tasks[:2], tasks[2:]

    def score(self, task, answer):
        return 0.0

    def make_env(self, task):
        if task.question.startswith("bad"):
            raise RuntimeError("cannot reset this task")
        return FlakyState(None)


def test_a_run_goes_on_when_an_environment_reset_fails(model_dir, short_reward, tmp_path, monkeypatch):
    from selfrl.config import RunConfig
    from selfrl.run.main import run
    from selfrl.record.store import Store

    mod = types.ModuleType("selfrl_test_flaky_envs")
    mod.ResetFails = _ResetFails
    monkeypatch.setitem(sys.modules, "selfrl_test_flaky_envs", mod)
    cfg = RunConfig(run_dir=str(tmp_path / "r"), iterations=1, num_prompts=2, num_generations=2,
                    reward_weights={"short": 1.0})
    cfg.model.name, cfg.model.device, cfg.engine = str(model_dir), "cpu", "reference"
    cfg.lora.r = 4
    cfg.task.source = "selfrl_test_flaky_envs:ResetFails"
    cfg.task.num_train, cfg.gate.val_size = 2, 2
    cfg.rollout.max_new_tokens, cfg.rollout.max_turns, cfg.rollout.tools = 6, 2, []
    result = run(cfg.validate())  # on the old code: RuntimeError out of the first validation
    with Store(result.run_dir / "selfrl.db") as store:
        trajs = store.trajectories()
    by_task = {}
    for t in trajs:
        by_task.setdefault(t.task_id, []).append(t)
    bad = next(k for k, ts in by_task.items() if all(t.error for t in ts))
    good = [t for k, ts in by_task.items() if k != bad for t in ts]
    assert len(trajs) == 4 and len(by_task[bad]) == 2 and len(good) == 2
    assert all(t.error == "environment reset (make_env) failed: RuntimeError: cannot reset this task"
               and t.reward is None for t in by_task[bad])
    assert all(t.error is None and t.reward is not None for t in good)
