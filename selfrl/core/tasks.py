"""Task sources: where questions come from and how an answer is checked.

A ``TaskSource`` samples ``Task`` records deterministically from a seed and
scores a final answer against one of them (the verifier). Concrete sources are
environments (``selfrl.envs``), found by name in ``selfrl.envs.registry``; this
module holds only what every environment shares, and imports none of them: the task,
the task source and its verifier, the per-trajectory state protocol (``EnvState``) that
the rollout drives, and the train/held-out split.

``split_tasks`` builds a train/validation split with no validation question in
training. Procedural generators reuse questions across seeds (reasoning-gym
seeds item ``i`` of seed ``s`` with ``s + i``, and small configs have few
distinct questions), so the split removes leaks by question content, not seed.
"""

from __future__ import annotations

import abc
import hashlib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from selfrl.core.tools import Tool

__all__ = [
    "EnvState",
    "Task",
    "TaskSource",
    "assert_disjoint",
    "count_distinct",
    "distinct_sample",
    "extract_answer",
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
        """Pull the final answer out of the model's final text; see ``selfrl.core.tasks.extract_answer``."""
        return extract_answer(text)

    def trajectory_answer(self, traj) -> str | None:
        """The answer a ``Trajectory`` gave, for ``score``: by default
        ``extract_answer(final_answer)``; an environment's source reads ``traj.env_state``."""
        return self.extract_answer(traj.final_answer or "")

    def make_env(self, task: Task):
        """A fresh per-trajectory ``selfrl.envs.Environment`` for ``task``, or None (stateless tools only)."""
        return None

    def probe_tasks(self) -> list[Task]:
        """Adversarial tasks whose right behaviour is known (``selfrl.safety.detectors.probe_regression``); none by default."""
        return []


@runtime_checkable
class EnvState(Protocol):
    """Per-trajectory state plus the tools that act on it (made by ``Env.make_env(task)``).

    ``selfrl.rollout.agent.rollout`` dispatches a trajectory's calls to its own state's
    tools, asks ``is_completed()`` after each turn (the episode may end before
    ``max_turns``) and records ``state()`` on the trajectory
    (``Trajectory.env_state``), which is what the environment scores. A state
    that holds resources (a real browser) may also have ``close()``, which the
    rollout calls after ``state()`` (``selfrl.rollout.agent.close_env``); it is left
    out of the protocol so that states without one still match it.
    This is verifiers' ``MultiTurnEnv`` (``env_response`` + ``is_completed``).

    Attributes:
        tools: this trajectory's tools, bound to this state.
        demonstration: a worked example as chat messages, shown before the task
            instead of the calculator's ``selfrl.rollout.agent.DEMONSTRATION``; None
            for that default.

    Optional: ``turn_tools() -> list[Tool] | None``, the tools as a grammar
    (``rollout.constrain``) should offer them this turn, their schemas narrowed to the
    current state (``selfrl.rollout.agent.offered_tools``); asked before every turn.
    """

    tools: list[Tool]
    demonstration: list[dict[str, str]] | None

    def is_completed(self) -> bool:
        """True when the episode is over (checked after each turn's tool calls)."""
        ...

    def state(self) -> dict[str, Any]:
        """JSON-serializable summary of the final state, stored as ``Trajectory.env_state``."""
        ...


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
    topped up from seeds derived from ``seed``; deterministic. Before topping up, a source
    with fewer than ``n`` distinct tasks is found out at once (:func:`count_distinct`), not after
    ``max_rounds`` rounds of the missing count.

    Raises:
        ValueError: the source has fewer than ``n`` distinct questions (the message gives how many
            it gave), or they were not found within ``max_rounds`` rounds.
    """
    out: list[Task] = []
    seen: set[str] = set()
    for round_ in range(max_rounds):
        missing = n - len(out)
        if missing <= 0:
            break
        if round_ == 1 and (available := count_distinct(source, n, seed)) < n:
            raise ValueError(f"source {source.name!r} gave only {available} distinct tasks of the {n} asked for "
                             "(sampled until no new one came)")
        batch = source.sample(missing, seed if round_ == 0 else _topup_seed(seed, round_))
        for task in batch:
            if task.id not in seen:
                seen.add(task.id)
                out.append(task)
    if len(out) < n:
        raise ValueError(f"source {source.name!r} gave only {len(out)} distinct tasks of the {n} asked for")
    return out[:n]


PROBE_CHUNK = 2048  # tasks count_distinct draws at a time
PROBE_PATIENCE = 3  # draws in a row without a new task after which count_distinct stops


def count_distinct(source: TaskSource, n: int, seed: int) -> int:
    """How many distinct tasks ``source`` gives, counted up to ``n``: it is sampled
    :data:`PROBE_CHUNK` tasks at a time, from seeds derived from ``seed``, until ``n`` distinct ids
    are seen or :data:`PROBE_PATIENCE` draws in a row add none (the source is exhausted). Costs
    about ``n`` sampled tasks (at least one draw) when the source has them, a few draws when it has
    few; deterministic, and the count of a source that has fewer is the same whatever ``n``.

    Returns:
        ``n`` when the source gave ``n`` distinct tasks, else the number it gave (< ``n``).
    """
    seen: set[str] = set()
    stale = 0
    for k in itertools.count():
        before = len(seen)
        seen.update(t.id for t in source.sample(PROBE_CHUNK, _topup_seed(seed, 1_000_000 + k)))
        if len(seen) >= n:
            return n
        stale = stale + 1 if len(seen) == before else 0
        if stale >= PROBE_PATIENCE:
            return len(seen)
    raise AssertionError("unreachable")


def assert_disjoint(train: list[Task], val: list[Task]) -> None:
    """Raise ValueError naming the task ids that are in both ``train`` and ``val``."""
    overlap = sorted({task.id for task in train} & {task.id for task in val})
    if overlap:
        shown = ", ".join(overlap[:20]) + (f" ... ({len(overlap)} in all)" if len(overlap) > 20 else "")
        raise ValueError(f"{len(overlap)} task id(s) in both train and validation: {shown}")
