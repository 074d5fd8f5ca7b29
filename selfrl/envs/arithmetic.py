"""The arithmetic environment: reasoning-gym tasks answered with a calculator tool.

Task source: any reasoning-gym procedural dataset (``rg:<dataset>``); the
registered ``arithmetic`` is ``chain_sum`` with 2-3 terms of 1-2 digits, which
``make demo`` learns. Tools: the stateless ``calculator`` (``selfrl.core.tools``).
Verifier: the dataset's own ``score_answer`` on the ``<answer>`` of the final
text (binary in the ``verified`` preset: partial credit pays wrong answers).
Worked example: ``selfrl.rollout.agent.DEMONSTRATION`` (one calculator call); with
``options.shots = k`` (k > 0), k of the dataset's own tasks solved instead (a calculator
call on the item's ``expression`` where it has one, else the answer alone), never one of
the held-out tasks (:meth:`ReasoningGymEnv.demonstration`). It is shown when
``rollout.demonstration`` is true and the run has tools, as the default example is.
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
from selfrl.core.tools import evaluate_expression

# Worked examples (``shots``) are drawn from this seed of the dataset, skipping held-out tasks.
SHOTS_SEED = 1_000_003

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

    def __init__(self, dataset: str, config: dict[str, Any] | None = None, name: str | None = None,
                 shots: int = 0):
        """Build a source for reasoning-gym ``dataset`` with config fields ``config``.

        Args:
            dataset: a reasoning-gym dataset name, e.g. ``"chain_sum"``.
            config: fields of that dataset's config dataclass, without ``seed`` and ``size``.
            name: the source name written into each ``Task.source`` (default: ``dataset``).
            shots: worked examples shown before each task: 0 is the one fixed calculator
                example (``selfrl.rollout.agent.DEMONSTRATION``), k > 0 is k tasks of the
                dataset solved (the k-shot prompt baseline, ``scripts/prompt_baseline.py``).

        Raises:
            ValueError: unknown dataset (the message lists the valid ones), unknown
                config field (lists the valid fields), a config the dataset rejects, or
                ``shots`` not an integer >= 0.
        """
        if isinstance(shots, bool) or not isinstance(shots, int) or shots < 0:
            raise ValueError(f"shots must be an integer >= 0, got {shots!r}")
        self.shots = shots
        self.held_out: set[str] = set()  # ids of the last split's held-out tasks: never a worked example
        self._examples: list[dict[str, str]] | None = None
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

    def split(self, n_train: int, n_val: int, train_seed: int, val_seed: int) -> tuple[list[Task], list[Task]]:
        """:meth:`Env.split`; the held-out ids are kept so that no worked example is one of them."""
        train, val = super().split(n_train, n_val, train_seed, val_seed)
        self.held_out, self._examples = {t.id for t in val}, None
        return train, val

    def demonstration(self) -> list[dict[str, str]] | None:
        """The ``shots`` worked examples as chat messages (None for ``shots = 0``: the default
        example): the first ``shots`` tasks of seed :data:`SHOTS_SEED` whose id is not held out
        by the last :meth:`split`, each its question, a calculator call on its ``expression``
        (when the item has one) with the calculator's result, and ``<answer>ANSWER</answer>``.

        Raises:
            ValueError: fewer than ``shots`` distinct tasks outside the held-out set.
        """
        if not self.shots:
            return None
        if self._examples is None:
            pool = [t for t in self.sample(self.shots + len(self.held_out), SHOTS_SEED) if t.id not in self.held_out]
            picked = list({t.id: t for t in pool}.values())[:self.shots]
            if len(picked) < self.shots:
                raise ValueError(f"{self.name}: only {len(picked)} distinct tasks outside the held-out set for "
                                 f"{self.shots} shots; ask for fewer")
            self._examples = [m for t in picked for m in _worked(t)]
        return self._examples

    def make_env(self, task: Task) -> "_Shown | None":
        """None (stateless calculator) unless ``shots``: a state that only shows the worked examples."""
        return _Shown(self.demonstration()) if self.shots else None

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


class _Shown:
    """The per-trajectory state of a k-shot arithmetic task: no tools of its own, its worked
    examples, never completed early (the episode ends as it does without an environment)."""

    def __init__(self, demonstration: list[dict[str, str]]):
        self.tools: list = []
        self.demonstration = demonstration

    def is_completed(self) -> bool:
        return False

    def state(self) -> dict[str, Any]:
        return {}


def _worked(task: Task) -> list[dict[str, str]]:
    """One solved task as chat messages, in the shape of ``selfrl.rollout.agent.DEMONSTRATION``."""
    expression = (task.metadata["entry"].get("metadata") or {}).get("expression")
    out = [{"role": "user", "content": task.question}]
    if isinstance(expression, str):
        call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
        out += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                {"role": "tool", "content": f"<tool_response>\n{evaluate_expression(expression)}\n</tool_response>"}]
    return out + [{"role": "assistant", "content": f"<answer>{task.answer}</answer>"}]

# Small configs: 2-3 terms of 1-2 digit numbers.
CHAIN_SUM_SMALL: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
# Keeps reasoning-gym's default allow_parentheses=True: its parenthesis-free generator
# evaluates left to right, ignoring operator precedence, so its answers can be wrong.
BASIC_ARITHMETIC_SMALL: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}



def _factory(dataset: str, defaults: dict[str, Any]):
    def factory(shots: int = 0, **overrides: Any) -> Env:
        return ReasoningGymEnv(dataset, {**defaults, **overrides}, shots=shots)

    factory.description = ReasoningGymEnv.description  # type: ignore[attr-defined]
    factory.config_defaults = {}  # type: ignore[attr-defined]
    return factory


def _dataset(dataset: str):
    def rg(shots: int = 0, **options: Any) -> Env:
        return ReasoningGymEnv(dataset, options, shots=shots)

    return rg


register_prefix(RG_PREFIX, _dataset)  # rg:<dataset>: any reasoning-gym dataset, its own defaults
register_env("arithmetic", _factory("chain_sum", CHAIN_SUM_SMALL))
register_env("chain_sum", _factory("chain_sum", CHAIN_SUM_SMALL), alias_of="arithmetic")
register_env("basic_arithmetic", _factory("basic_arithmetic", BASIC_ARITHMETIC_SMALL), alias_of="arithmetic")
