"""A task's own rollout settings: an ``[[agents]]`` or ``[[families]]`` table's ``rollout = {...}``.

:class:`selfrl.envs.agents.AgentsEnv` tags each agent's (or family's) tasks with its settings in
``metadata["rollout"]``; :func:`selfrl.rollout.agent.rollout` runs each trajectory under the
batch's ``[rollout]`` with the task's own in place (:func:`task_rollout_config`): its grammar
(``constrain``), turn limit, stop at ``</tool_call>``, system prompt, tools and worked example.
The keys that may differ are :data:`selfrl.config.sections.ROLLOUT_OVERRIDES`; the token limit
and temperature stay one per batch (one engine call). Tags are data, so a stored task row or a
rollout worker's task carries its settings with it.
"""

from __future__ import annotations

from typing import Any

from selfrl.config import RolloutConfig
from selfrl.core.tasks import Task

ROLLOUT_KEY = "rollout"  # the task metadata key of its own settings


def task_overrides(task: Task) -> dict[str, Any]:
    """The task's own rollout settings (``metadata["rollout"]``), {} when it has none.

    >>> task_overrides(Task("fc/1", "fc", "q", "a", {"rollout": {"max_turns": 1}}))
    {'max_turns': 1}
    """
    return task.metadata.get(ROLLOUT_KEY) or {}


def task_rollout_config(cfg: RolloutConfig, task: Task) -> RolloutConfig:
    """The settings ``task``'s trajectory runs under: ``cfg`` with the task's own in place
    (``cfg`` itself when it has none).

    Raises:
        selfrl.config.ConfigError: a key that cannot differ per task, or a bad value
            (:meth:`selfrl.config.RolloutConfig.with_overrides`), the task named.
    """
    own = task_overrides(task)
    return cfg.with_overrides(own, f"task {task.id}: rollout.") if own else cfg
