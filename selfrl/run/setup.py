"""Setting a run up, once: the names a config refers to, checked against the registries.

Validation of a config (:meth:`selfrl.config.RunConfig.validate`) checks values only, so
that importing the config imports no environment, detector or reward. The names are checked
here, at setup, after the built-in environments have registered theirs
(:func:`selfrl.envs.builtin.load_builtin_envs`) and before any model loads: ``selfrl run``
(:func:`selfrl.run.loop.build_run`) and ``selfrl serve`` (:func:`selfrl.serve.main.serve`
and :class:`selfrl.serve.service.Service`) both call :func:`check_names`.
"""

from __future__ import annotations

from typing import Any

from selfrl.config import ConfigError
from selfrl.core.tools import resolve_tools
from selfrl.envs.builtin import load_builtin_envs
from selfrl.envs.rewards import check_weights, get_preset
from selfrl.rl.losses import get_loss_aggregation
from selfrl.safety.detectors import check_detectors


def reward_weights(cfg: Any) -> dict[str, float]:
    """The reward weights a run uses: ``reward_weights``, else its preset's.

    Raises:
        ValueError: an unknown preset (the message lists the valid ones).
    """
    return cfg.reward_weights or get_preset(cfg.preset)


def check_names(cfg: Any, weights: dict[str, float] | None = None) -> None:
    """The names ``cfg`` refers to, against their registries: the loss type, the reward
    functions and their weights (``weights``; None: the run's, :func:`reward_weights`), the
    tools and the detectors. The built-in environments are loaded first, so the names they
    register (``webshop`` presets, ``run_python``, ``swe_*`` detectors) are known.

    Raises:
        ConfigError: an unknown name (the message lists the valid ones) or a bad weight.
    """
    load_builtin_envs()
    try:
        get_loss_aggregation(cfg.train.loss_type)
        check_weights(reward_weights(cfg) if weights is None else weights)
        resolve_tools(cfg.rollout.tools)
        check_detectors(cfg.detectors.names)
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip("'\"")) from e
