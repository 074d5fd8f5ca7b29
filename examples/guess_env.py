"""Guess the number: a whole selfrl environment in one module, the worked example of the guide
"Write an environment" (docs/guides/write-an-environment.md).

The agent must find a hidden number from 1 to 32 with a ``guess`` tool that answers "higher",
"lower" or "correct". Each trajectory plays its own game (per-trajectory state); success is read
from that state, never from what the model says. The module also registers a reward preset with
a reward function of its own, and a detector for the one way this verifier can be gamed
(spraying guesses), on by default for this environment.

    PYTHONPATH=. selfrl run --env examples.guess_env:GuessEnv --iterations 1 --run-dir runs/guess

Importing the module registers the environment as ``guess``, the reward ``guess_economy``, the
preset ``guess`` and the detector ``guess_spray``.
"""

from __future__ import annotations

import json
import random
from typing import Any

from selfrl.safety.detectors import Verdict, register_detector
from selfrl.envs import Env, register_env
from selfrl.envs.rewards import register_preset, register_reward_func
from selfrl.core.tasks import Task
from selfrl.core.tools import Tool, ToolError

LOW, HIGH = 1, 32
GAMES = 10_000  # distinct games: a task is one game, its hidden number fixed by the game's number
MAX_GUESSES = 8  # more guesses than this in one game is spraying, not searching (binary search needs 5)


def secret_of(game: int) -> int:
    """The hidden number of ``game`` (the same on every machine and in every process)."""
    return random.Random(game).randint(LOW, HIGH)


class GuessState:
    """One trajectory's game: the hidden number, the guesses so far, and the ``guess`` tool
    bound to them. The rollout dispatches this trajectory's calls to ``tools``, asks
    ``is_completed()`` after every turn and stores ``state()`` on the trajectory."""

    demonstration = None  # set below: one worked game, shown before the task

    def __init__(self, secret: int):
        self.secret = secret
        self.guesses: list[int] = []
        self.tools = [Tool(
            name="guess",  # what the model writes in its call
            description=f"guess the hidden number from {LOW} to {HIGH}; answers higher, lower or correct",
            parameters={"type": "object", "required": ["n"],  # JSON schema of the arguments
                        "properties": {"n": {"type": "integer", "minimum": LOW, "maximum": HIGH}}},
            fn=self.guess,  # called as fn(**arguments); returns the text the model sees
            example_arguments={"n": 16},  # shown in the prompt's example call
        )]

    def guess(self, n: int) -> str:
        if isinstance(n, bool) or not isinstance(n, int) or not LOW <= n <= HIGH:
            raise ToolError(f"n must be a whole number from {LOW} to {HIGH}")  # shown to the model as a failed call
        self.guesses.append(n)
        return "correct" if n == self.secret else ("higher" if n < self.secret else "lower")

    def is_completed(self) -> bool:
        return self.secret in self.guesses

    def state(self) -> dict[str, Any]:
        return {"secret": self.secret, "guesses": list(self.guesses)}


class GuessEnv(Env):
    """Find a hidden number with higher/lower answers; success is read from the game's state."""

    name = "guess"
    description = f"find a hidden number from {LOW} to {HIGH} with a guess tool (higher / lower / correct)"
    preset = "guess"
    config_defaults = {  # under the user's config file and flags: a value the user sets wins
        "rollout.tools": [],  # no shared tools: the game's own guess tool only
        "rollout.system_prompt": "You are playing a guessing game. Call the guess tool until it answers correct.",
        "rollout.max_turns": 6,
        "rollout.max_new_tokens": 32,
        "rollout.constrain": "tool_call",  # every turn is one well-formed guess (a grammar)
        "preset": "guess",
        "detectors.names": ["guess_spray"],
        "gate.val_size": 32,
        "task.num_train": 256,
    }

    def sample(self, n: int, seed: int) -> list[Task]:
        rng = random.Random(seed)
        return [self._task(rng.randrange(GAMES)) for _ in range(n)]

    def _task(self, game: int) -> Task:
        question = f"Game {game}: find the hidden number from {LOW} to {HIGH}."
        return Task.make(self.name, question, str(secret_of(game)), {"game": game})

    def make_env(self, task: Task) -> GuessState:
        return GuessState(int(task.answer))

    def trajectory_answer(self, traj) -> str | None:
        """The answer is the game's outcome, not the model's text: the hidden number when found."""
        state = traj.env_state or {}
        return str(state["secret"]) if state.get("secret") in state.get("guesses", []) else None

    def score(self, task: Task, answer: str | None) -> float:
        if task.source != self.name:
            raise ValueError(f"task {task.id} is a {task.source!r} task, not a {self.name!r} one")
        return 1.0 if answer == task.answer else 0.0


def guess_economy(traj, ctx) -> float | None:
    """1.0 for a game found at the first guess, down to 0.0 at ``MAX_GUESSES``; 0.0 when the number
    was not found; None (not applicable) when the trajectory has no game state.

    >>> from types import SimpleNamespace as T
    >>> guess_economy(T(env_state={"secret": 9, "guesses": [16, 8, 12, 10, 9]}), None)
    0.5
    """
    state = traj.env_state
    if not state:
        return None
    if state["secret"] not in state["guesses"]:
        return 0.0
    return max(0.0, 1.0 - (len(state["guesses"]) - 1) / MAX_GUESSES)


def guess_spray(traj, cfg) -> Verdict:
    """Flag a game with more than ``MAX_GUESSES`` guesses: calling every number finds any secret,
    and the verifier alone would pay it in full."""
    guesses = (traj.env_state or {}).get("guesses", [])
    if len(guesses) > MAX_GUESSES:
        return Verdict(True, f"{len(guesses)} guesses (more than {MAX_GUESSES}: spraying)")
    return Verdict(False)


def _demonstration() -> list[dict[str, str]]:
    """One game played well (binary search), with the tool's real answers."""
    game = GuessState(secret=21)
    messages = [{"role": "user", "content": f"Game 0: find the hidden number from {LOW} to {HIGH}."}]
    for n in (16, 24, 20, 22, 21):
        call = {"name": "guess", "arguments": {"n": n}}
        messages.append({"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"})
        messages.append({"role": "tool", "content": f"<tool_response>\n{game.guess(n)}\n</tool_response>"})
    return messages


GuessState.demonstration = _demonstration()
register_reward_func("guess_economy", guess_economy)
register_preset("guess", {"verifier": 1.0, "guess_economy": 0.5},
                "the number found (1), plus up to 0.5 for finding it in few guesses. "
                "Gamed by: spraying guesses still earns the verifier's 1 (the guess_spray detector clamps it)")
register_detector("guess_spray", guess_spray)
register_env("guess", GuessEnv)
