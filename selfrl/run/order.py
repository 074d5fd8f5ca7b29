"""The order a run walks its training set: shuffled by ``task.train_seed``, agents taking turns,
``num_prompts`` tasks an iteration (:func:`iteration_tasks`); the signal-aware chooser
(:mod:`selfrl.run.signal`) walks the same order (:func:`shuffled`)."""

from __future__ import annotations

import random
from itertools import zip_longest

from selfrl.core.tasks import Task

__all__ = ["iteration_tasks", "shuffled", "walk_order"]


def walk_order(train: list[Task], seed: int) -> list[int]:
    """The order the iterations walk the training set: shuffled by ``seed``; tasks tagged with
    an agent (``metadata["agent"]``, ``[[agents]]``) then take turns, agent by agent, so every
    batch of ``num_prompts`` holds the agents in equal numbers (when it is a multiple of them)."""
    order = list(range(len(train)))
    random.Random(seed).shuffle(order)
    by_agent: dict[str, list[int]] = {}
    for i in order:
        by_agent.setdefault(train[i].metadata.get("agent", ""), []).append(i)
    if len(by_agent) < 2:
        return order
    return [i for row in zip_longest(*by_agent.values()) for i in row if i is not None]


def shuffled(train: list[Task], seed: int) -> list[Task]:
    """The training set in the order the iterations walk it."""
    return [train[i] for i in walk_order(train, seed)]


def iteration_tasks(train: list[Task], iteration: int, num_prompts: int, seed: int) -> list[Task]:
    """The tasks of one iteration: a deterministic walk through the shuffled training set (:func:`walk_order`)."""
    order = walk_order(train, seed)
    start = (iteration * num_prompts) % len(order)
    idx = (order + order)[start:start + num_prompts]
    return [train[i] for i in idx]
