"""The arithmetic environment: reasoning-gym tasks answered with a calculator tool.

Task source: any reasoning-gym procedural dataset (``rg:<dataset>``); the
registered ``arithmetic`` is ``chain_sum`` with 2-3 terms of 1-2 digits, which
``make demo`` learns. Tools: the stateless ``calculator`` (``selfrl.core.tools``).
Verifier: the dataset's own ``score_answer`` on the ``<answer>`` of the final
text (binary in the ``verified`` preset: partial credit pays wrong answers).
Worked example: ``selfrl.rollout.agent.DEMONSTRATION`` (one calculator call).
Split: ``selfrl.core.tasks.split_tasks`` (by question content, since generators
repeat questions across seeds).

``chain_sum`` and ``basic_arithmetic`` stay registered as names of their own
(aliases of this environment): their tasks keep the source names, and so the
task ids, of runs made before environments existed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, ClassVar

import reasoning_gym
import reasoning_gym.factory

from selfrl.envs.base import Env
from selfrl.envs.registry import RG_PREFIX, register_env, register_prefix
from selfrl.core.tasks import Task

__all__ = ["BASIC_ARITHMETIC_SMALL", "CHAIN_SUM_SMALL", "ReasoningGymEnv", "ReasoningGymSource"]


def _reasoning_gym_names() -> list[str]:
    return sorted(reasoning_gym.factory.DATASETS)


class ReasoningGymEnv(Env):
    """Tasks from a reasoning-gym procedural dataset, scored by the dataset's own ``score_answer``,
    solved with the calculator tool.

    ``Task.metadata`` holds ``entry`` (the reasoning-gym item, after a JSON
    round trip so that it scores the same whether it comes from memory or from
    the store) and ``dataset``, ``seed``, ``index`` to regenerate it. Datasets
    whose items do not score the same after a JSON round trip (arc_agi, rearc:
    boards are tuples) are refused at ``sample`` time rather than mis-scored.
    """

    def __init__(self, dataset: str, config: dict[str, Any] | None = None, name: str | None = None):
        """Build a source for reasoning-gym ``dataset`` with config fields ``config``.

        Args:
            dataset: a reasoning-gym dataset name, e.g. ``"chain_sum"``.
            config: fields of that dataset's config dataclass, without ``seed`` and ``size``.
            name: the source name written into each ``Task.source`` (default: ``dataset``).

        Raises:
            ValueError: unknown dataset (the message lists the valid ones), unknown
                config field (lists the valid fields), or a config the dataset rejects.
        """
        valid = _reasoning_gym_names()
        if dataset not in valid:
            raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; valid names: {', '.join(valid)}")
        config = dict(config or {})
        _, config_cls = reasoning_gym.factory.DATASETS[dataset]
        fields = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
        unknown = sorted(set(config) - set(fields))
        if unknown:
            raise ValueError(f"unknown config field(s) {unknown} for {dataset!r}; valid fields: {', '.join(fields)}")
        self.dataset = dataset
        self.config = config
        self.name = name or dataset
        # One instance for scoring: score_answer may read the config, never the seed.
        self._scorer = self._create(seed=0, size=1)

    def _create(self, seed: int, size: int) -> Any:
        try:
            return reasoning_gym.create_dataset(self.dataset, seed=seed, size=size, **self.config)
        except AssertionError as err:  # reasoning-gym validates configs with assert
            raise ValueError(f"invalid config {self.config} for {self.dataset!r}: {err}") from err

    def sample(self, n: int, seed: int) -> list[Task]:
        """Return items ``0..n-1`` of the dataset seeded with ``seed``, as tasks."""
        if n <= 0:
            return []
        data = self._create(seed=seed, size=n)
        tasks = []
        for index in range(n):
            item = data[index]
            entry = json.loads(json.dumps(item))
            if data.score_answer(item["answer"], item) != data.score_answer(entry["answer"], entry):
                raise ValueError(
                    f"reasoning-gym dataset {self.dataset!r} scores differently after a JSON round trip "
                    "of its items, so its tasks cannot be stored; it is not supported"
                )
            metadata = {"entry": entry, "dataset": self.dataset, "seed": seed, "index": index}
            tasks.append(Task.make(self.name, item["question"], str(item["answer"]), metadata))
        return tasks

    def score(self, task: Task, answer: str | None) -> float:
        """Score ``answer`` with reasoning-gym's ``score_answer(answer, entry)``.

        Raises:
            ValueError: the task is from another source, or reasoning-gym returned
                a score outside [0, 1].
        """
        if task.source != self.name:
            raise ValueError(f"task {task.id} is from source {task.source!r}, not {self.name!r}")
        if answer is None:
            return 0.0
        value = float(self._scorer.score_answer(answer, task.metadata["entry"]))
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{self.dataset!r} score_answer returned {value} for task {task.id}, outside [0, 1]")
        return value

    def __repr__(self) -> str:
        return f"ReasoningGymEnv(dataset={self.dataset!r}, config={self.config!r}, name={self.name!r})"

    description: ClassVar[str] = "reasoning-gym arithmetic (chain_sum, 2-3 terms) with a calculator tool; rg:<dataset> for any other"
    preset: ClassVar[str] = "verified"
    config_defaults: ClassVar[dict[str, Any]] = {}  # the RunConfig defaults are this environment's


ReasoningGymSource = ReasoningGymEnv  # the name before environments existed

# Small configs: 2-3 terms of 1-2 digit numbers.
CHAIN_SUM_SMALL: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
# Keeps reasoning-gym's default allow_parentheses=True: its parenthesis-free generator
# evaluates left to right, ignoring operator precedence, so its answers can be wrong.
BASIC_ARITHMETIC_SMALL: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}



def _factory(dataset: str, defaults: dict[str, Any]):
    def factory(**overrides: Any) -> Env:
        return ReasoningGymEnv(dataset, {**defaults, **overrides})

    factory.description = ReasoningGymEnv.description  # type: ignore[attr-defined]
    factory.config_defaults = {}  # type: ignore[attr-defined]
    return factory


def _dataset(dataset: str):
    def rg(**options: Any) -> Env:
        return ReasoningGymEnv(dataset, options)

    return rg


register_prefix(RG_PREFIX, _dataset)  # rg:<dataset>: any reasoning-gym dataset, its own defaults
register_env("arithmetic", _factory("chain_sum", CHAIN_SUM_SMALL))
register_env("chain_sum", _factory("chain_sum", CHAIN_SUM_SMALL), alias_of="arithmetic")
register_env("basic_arithmetic", _factory("basic_arithmetic", BASIC_ARITHMETIC_SMALL), alias_of="arithmetic")
