"""Task sources: where questions come from and how an answer is checked.

A ``TaskSource`` samples ``Task`` records deterministically from a seed and
scores a final answer against one of them (the verifier). Sources are found by
registered name (``chain_sum``, ``basic_arithmetic``) or as ``rg:<dataset>`` for
any reasoning-gym dataset; an unknown name gets an error listing the valid ones.

``split_tasks`` builds a train/validation split with no validation question in
training. Procedural generators reuse questions across seeds (reasoning-gym
seeds item ``i`` of seed ``s`` with ``s + i``, and small configs have few
distinct questions), so the split removes leaks by question content, not seed.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import reasoning_gym
import reasoning_gym.factory

__all__ = [
    "ReasoningGymSource",
    "Task",
    "TaskSource",
    "assert_disjoint",
    "available_task_sources",
    "extract_answer",
    "get_task_source",
    "register_task_source",
    "split_tasks",
    "task_id",
]


def task_id(source: str, question: str) -> str:
    """Stable content hash of ``(source, question)``: 16 hex characters.

    >>> task_id("chain_sum", "1 + 1 =") == task_id("chain_sum", "1 + 1 =")
    True
    """
    digest = hashlib.sha256(f"{source}\x00{question}".encode("utf-8")).hexdigest()
    return digest[:16]


@dataclass(frozen=True)
class Task:
    """One question with its reference answer.

    Attributes:
        id: ``task_id(source, question)``; equal questions have equal ids whatever the seed.
        source: name of the ``TaskSource`` that made the task and can score it.
        question: the question text shown to the policy.
        answer: the reference answer, as text.
        metadata: JSON-serializable data the source needs to score (and to reproduce) the task.
    """

    id: str
    source: str
    question: str
    answer: str
    metadata: dict[str, Any] = field(default_factory=dict, hash=False)

    @classmethod
    def make(cls, source: str, question: str, answer: str, metadata: dict[str, Any] | None = None) -> Task:
        """Build a task, computing its id from ``(source, question)``."""
        return cls(task_id(source, question), source, question, answer, dict(metadata or {}))


# A number: optional minus (not right after a word character, so "5-3" gives 3),
# digits with optional thousands commas, optional decimal part.
_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_OPEN = "<answer>"
_ANSWER_CLOSE = "</answer>"


def extract_answer(text: str) -> str | None:
    """Pull the final answer out of a model's final text.

    The content (stripped) of the last ``<answer>...</answer>`` tag if there is
    one; a last ``<answer>`` left unclosed (generation stopped on ``</answer>``)
    counts too, up to the end of the text. Otherwise the last number in the text
    (int or decimal, optional minus sign, thousands commas removed). None when
    there is neither, or when the last tag is empty.

    >>> extract_answer("<answer>4</answer> then <answer> 42 </answer>")
    '42'
    >>> extract_answer("so it is 1,234.")
    '1234'
    >>> extract_answer("no number") is None
    True
    """
    start = text.rfind(_ANSWER_OPEN)
    if start >= 0:
        body = text[start + len(_ANSWER_OPEN) :]
        end = body.find(_ANSWER_CLOSE)
        content = (body if end < 0 else body[:end]).strip()
        return content or None
    numbers = _NUMBER_RE.findall(text)
    if not numbers:
        return None
    return numbers[-1].replace(",", "")


class TaskSource(abc.ABC):
    """A generator of tasks plus their verifier.

    Subclasses set ``name`` and implement ``sample`` and ``score``.
    ``sample(n, seed)`` must be deterministic in ``(n, seed)``.
    """

    name: str

    @abc.abstractmethod
    def sample(self, n: int, seed: int) -> list[Task]:
        """Return ``n`` tasks generated from ``seed`` (same arguments, same tasks)."""

    @abc.abstractmethod
    def score(self, task: Task, answer: str | None) -> float:
        """Score an extracted answer for ``task``: a float in [0, 1]; None (no answer) scores 0."""

    def correct(self, task: Task, answer: str | None) -> bool:
        """True when ``answer`` earns full credit (``score >= 1.0``)."""
        return self.score(task, answer) >= 1.0

    def extract_answer(self, text: str) -> str | None:
        """Pull the final answer out of the model's final text; see ``selfrl.tasks.extract_answer``."""
        return extract_answer(text)

    def trajectory_answer(self, traj) -> str | None:
        """The answer a ``Trajectory`` gave, for ``score``: by default
        ``extract_answer(final_answer)``; an environment's source reads ``traj.env_state``."""
        return self.extract_answer(traj.final_answer or "")

    def make_env(self, task: Task):
        """A fresh per-trajectory ``selfrl.envs.Environment`` for ``task``, or None (stateless tools only)."""
        return None

    def probe_tasks(self) -> list[Task]:
        """Adversarial tasks whose right behaviour is known (``selfrl.detectors.probe_regression``); none by default."""
        return []


def _reasoning_gym_names() -> list[str]:
    return sorted(reasoning_gym.factory.DATASETS)


class ReasoningGymSource(TaskSource):
    """Tasks from a reasoning-gym procedural dataset, scored by the dataset's own ``score_answer``.

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
        return f"ReasoningGymSource(dataset={self.dataset!r}, config={self.config!r}, name={self.name!r})"


# ---------------------------------------------------------------- registry

TaskSourceFactory = Callable[..., TaskSource]
_REGISTRY: dict[str, TaskSourceFactory] = {}
_RG_PREFIX = "rg:"


def register_task_source(name: str, factory: TaskSourceFactory) -> None:
    """Register ``factory(**overrides) -> TaskSource`` under ``name``.

    Raises:
        ValueError: ``name`` is already registered or uses the reserved ``rg:`` prefix.
    """
    if name.startswith(_RG_PREFIX):
        raise ValueError(f"names starting with {_RG_PREFIX!r} are reserved for reasoning-gym datasets: {name!r}")
    if name in _REGISTRY:
        raise ValueError(f"task source {name!r} is already registered")
    _REGISTRY[name] = factory


def available_task_sources() -> list[str]:
    """Registered task source names, sorted (``rg:<dataset>`` also works for any reasoning-gym dataset)."""
    return sorted(_REGISTRY)


def get_task_source(name: str, **overrides: Any) -> TaskSource:
    """Build the task source registered as ``name``, or ``rg:<dataset>`` for any reasoning-gym dataset.

    ``overrides`` go to the factory; for reasoning-gym sources they are config
    fields merged over the defaults.

    Raises:
        ValueError: unknown name; the message lists the valid names.
    """
    if name.startswith(_RG_PREFIX):
        return ReasoningGymSource(name[len(_RG_PREFIX) :], overrides)
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown task source {name!r}; valid names: {', '.join(available_task_sources())}, "
            f"or '{_RG_PREFIX}<dataset>' for any reasoning-gym dataset"
        )
    return _REGISTRY[name](**overrides)


def _reasoning_gym_factory(dataset: str, defaults: dict[str, Any]) -> TaskSourceFactory:
    def factory(**overrides: Any) -> TaskSource:
        return ReasoningGymSource(dataset, {**defaults, **overrides})

    return factory


# Small configs: 2-3 terms of 1-2 digit numbers.
CHAIN_SUM_SMALL: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}
# Keeps reasoning-gym's default allow_parentheses=True: its parenthesis-free generator
# evaluates left to right, ignoring operator precedence, so its answers can be wrong.
BASIC_ARITHMETIC_SMALL: dict[str, Any] = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2}

register_task_source("chain_sum", _reasoning_gym_factory("chain_sum", CHAIN_SUM_SMALL))
register_task_source("basic_arithmetic", _reasoning_gym_factory("basic_arithmetic", BASIC_ARITHMETIC_SMALL))


def _webshop_factory(**overrides: Any) -> TaskSource:
    from selfrl.envs.webshop import WebShopSource  # imported here: it imports this module

    return WebShopSource(**overrides)


register_task_source("webshop", _webshop_factory)


# ---------------------------------------------------------------- splits


def _topup_seed(seed: int, round_: int) -> int:
    """Seed for top-up round ``round_`` (round 0 is ``seed`` itself)."""
    if round_ == 0:
        return seed
    digest = hashlib.sha256(f"selfrl-topup:{seed}:{round_}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def split_tasks(
    source: TaskSource,
    n_train: int,
    n_val: int,
    train_seed: int,
    val_seed: int,
    max_rounds: int = 100,
) -> tuple[list[Task], list[Task]]:
    """Make ``(train, val)`` with no validation question in training; deterministic.

    Validation is ``n_val`` distinct questions (:func:`distinct_sample`), so that a
    held-out success rate is over ``n_val`` tasks, each counted once. Training starts as
    ``source.sample(n_train, train_seed)``; tasks whose id is in validation are
    dropped, and the gap is filled from further seeds derived from
    ``train_seed``, round after round, until training has ``n_train`` tasks.
    Training may repeat a question; validation never reaches it.

    Raises:
        ValueError: after ``max_rounds`` rounds training is still short (the
            source has too few distinct questions outside validation).
    """
    val = distinct_sample(source, n_val, val_seed, max_rounds)
    val_ids = {task.id for task in val}
    train: list[Task] = []
    for round_ in range(max_rounds):
        missing = n_train - len(train)
        if missing <= 0:
            break
        batch = source.sample(missing, _topup_seed(train_seed, round_))
        train.extend(task for task in batch if task.id not in val_ids)
    else:
        if len(train) < n_train:
            raise ValueError(
                f"only {len(train)} of {n_train} training tasks outside validation after {max_rounds} rounds "
                f"from source {source.name!r}; lower n_train or n_val, or widen the source's config"
            )
    assert_disjoint(train, val)
    return train, val


def distinct_sample(source: TaskSource, n: int, seed: int, max_rounds: int = 100) -> list[Task]:
    """``n`` tasks with distinct ids: ``source.sample(n, seed)`` with repeats dropped,
    topped up from seeds derived from ``seed``; deterministic.

    Raises:
        ValueError: the source has fewer than ``n`` distinct questions within ``max_rounds`` rounds.
    """
    out: list[Task] = []
    seen: set[str] = set()
    for round_ in range(max_rounds):
        missing = n - len(out)
        if missing <= 0:
            break
        batch = source.sample(missing, seed if round_ == 0 else _topup_seed(seed, round_))
        for task in batch:
            if task.id not in seen:
                seen.add(task.id)
                out.append(task)
    if len(out) < n:
        raise ValueError(f"source {source.name!r} gave only {len(out)} distinct tasks of the {n} asked for")
    return out[:n]


def assert_disjoint(train: list[Task], val: list[Task]) -> None:
    """Raise ValueError naming the task ids that are in both ``train`` and ``val``."""
    overlap = sorted({task.id for task in train} & {task.id for task in val})
    if overlap:
        shown = ", ".join(overlap[:20]) + (f" ... ({len(overlap)} in all)" if len(overlap) > 20 else "")
        raise ValueError(f"{len(overlap)} task id(s) in both train and validation: {shown}")
