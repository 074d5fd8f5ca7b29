"""The environment API: one object bundles what a task kind needs to be learned.

An ``Env`` is a ``selfrl.core.tasks.TaskSource`` (tasks and their verifier) that also
carries

* ``split``: its train/held-out split, checked disjoint (``assert_disjoint``);
* ``make_env(task)``: the per-trajectory state behind stateful tools (an
  ``EnvState``), or None when the tools are stateless;
* ``config_defaults``: the run settings it needs (system prompt, tool names,
  turns, reward preset), applied under the user's config file and flags;
* ``preset``: its reward template, one of ``selfrl.envs.rewards.PRESETS``;
* ``description``: one line for ``selfrl envs``.

It is verifiers' ``Environment`` (dataset + rubric + tools) with the rubric
named by preset, and nanochat's ``Task`` (``reward(conversation, response)``)
as the verifier. The tool-call parsing and the chat layout stay in
``selfrl.rollout.agent``, so an environment only supplies tasks, tools, state and a
verdict. Environments are found by name in ``selfrl.envs.registry``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from selfrl.core.tasks import EnvState, Task, TaskSource, assert_disjoint, split_tasks  # EnvState: re-exported
from selfrl.core.tools import Tool

__all__ = ["Env", "EnvState"]


class Env(TaskSource):
    """A task source that is also a whole environment (see the module docstring).

    Subclasses set ``name``, ``description`` and implement ``sample`` and
    ``score`` (``TaskSource``); everything else has a default: a split by
    content hash, no per-trajectory state, the ``verified`` preset, no settings.
    """

    description: ClassVar[str] = ""
    preset: ClassVar[str] = "verified"
    # Dotted run-config keys -> values, applied under the config file and flags
    # (selfrl.envs.registry.load_run_config); e.g. {"rollout.tools": ["run_python"]}.
    config_defaults: ClassVar[dict[str, Any]] = {}

    def split(self, n_train: int, n_val: int, train_seed: int, val_seed: int) -> tuple[list[Task], list[Task]]:
        """``(train, val)`` with no held-out task in training.

        The default is ``selfrl.core.tasks.split_tasks`` (for generators); a fixed
        benchmark overrides it with a split of its own items.

        Raises:
            ValueError: the split cannot be made (too few distinct tasks), or it overlaps.
        """
        train, val = split_tasks(self, n_train, n_val, train_seed, val_seed)
        assert_disjoint(train, val)
        return train, val
