"""Environments: each module here is one task kind, with its task source (train and
held-out splits), tools, per-trajectory state, verifier, reward template and worked
example (``selfrl.envs.base.Env``).

Importing this package registers the built-in environments (``selfrl envs`` lists
them): ``arithmetic`` (with the aliases ``chain_sum``, ``basic_arithmetic``),
``webshop``, ``code``, ``function_calling``, ``swe`` and ``web``. Others load by dotted path or entry
point (``selfrl.envs.registry``). Generic modules (the loop, the rollout, rewards)
never import a particular environment.
"""

from __future__ import annotations

from selfrl.envs.base import Env, EnvState
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

# Built-in environments register themselves on import (after the names above exist).
from selfrl.envs import arithmetic, webshop  # noqa: E402,F401  isort: skip
from selfrl.envs import code, function_calling  # noqa: E402,F401  isort: skip
from selfrl.envs import swe, web  # noqa: E402,F401  isort: skip

get_task_source = get_env  # the name before environments existed

__all__ = [
    "Env",
    "EnvState",
    "Environment",
    "available_envs",
    "describe_envs",
    "env_config_defaults",
    "get_env",
    "get_task_source",
    "load_run_config",
    "register_env",
]
