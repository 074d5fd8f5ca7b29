"""Environments: each module here is one task kind, with its task source (train and
held-out splits), tools, per-trajectory state, verifier, reward template and worked
example (``selfrl.envs.base.Env``), plus the parts only environments use (the sandbox,
code execution, BFCL's data, the reward functions and presets).

The built-in environments (``selfrl envs`` lists them) are ``arithmetic`` (with the
aliases ``chain_sum``, ``basic_arithmetic``), ``webshop``, ``code``, ``function_calling``,
``swe`` and ``web``; :mod:`selfrl.envs.builtin` loads them, explicitly, before the first
name is looked up, and one that fails to import is named with its reason while the others
load. Others load by dotted path or entry point (``selfrl.envs.registry``). Generic
modules (the loop, the rollout, the rewards) never import a particular environment.

What an environment of your own needs is importable from here::

    from selfrl.envs import Env, Task, Tool, register_env
"""

from __future__ import annotations

from selfrl.core.tasks import Task, TaskSource
from selfrl.core.tools import Tool, ToolError, register_tool
from selfrl.core.trajectory import Trajectory
from selfrl.envs.base import Env, EnvState
from selfrl.envs.builtin import load_builtin_envs
from selfrl.envs.registry import (
    available_envs,
    describe_envs,
    env_config_defaults,
    get_env,
    load_run_config,
    register_env,
)

# The per-trajectory state protocol's name before ``Env`` existed.
Environment = EnvState
get_task_source = get_env  # the name before environments existed

__all__ = [
    "Env",
    "EnvState",
    "Environment",
    "Task",
    "TaskSource",
    "Tool",
    "ToolError",
    "Trajectory",
    "available_envs",
    "describe_envs",
    "env_config_defaults",
    "get_env",
    "get_task_source",
    "load_builtin_envs",
    "load_run_config",
    "register_env",
    "register_tool",
]
