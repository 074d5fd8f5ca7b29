"""Settings bounded by the model: checked once its config is read, before its weights load.

Config validation (:mod:`selfrl.config`) checks values alone, against bounds that hold for
any model. A few settings are bounded by the model itself, and are checked here from its
``config.json`` (``transformers.AutoConfig``: a few milliseconds, no weights), by
:func:`selfrl.model.load.build_policy` right before the weights load:

* ``lora.r`` at most the hidden size (a LoRA of rank r on a d-wide layer has at most rank
  d: a larger r only allocates more memory; ``--lora-r 1000000000`` tried to allocate 128 GB);
* ``rollout.max_new_tokens`` (``selfrl run``), ``max_tokens_default`` (``selfrl serve``) and
  ``swap_check.probe_tokens`` at most the context length (``max_position_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from selfrl.core.errors import ConfigError


@dataclass(frozen=True)
class ModelLimits:
    """What a model's config bounds.

    Attributes:
        hidden_size: width of the residual stream (``hidden_size``, ``n_embd`` or ``d_model``).
        context: positions it attends to (``max_position_embeddings``, ``n_positions`` or
            ``max_sequence_length``), or None when the config names none.
    """

    hidden_size: int | None
    context: int | None


def limits_of(model_config: Any) -> ModelLimits:
    """The :class:`ModelLimits` of a ``transformers.PretrainedConfig`` (its text config for a
    multimodal one)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config

    def first(*names):
        for n in names:
            value = getattr(text, n, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    return ModelLimits(first("hidden_size", "n_embd", "d_model"),
                       first("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"))


def check_fits(cfg, limits: ModelLimits, model_name: str) -> None:
    """Raise ConfigError, one line naming the field, its value and the model's bound, for the
    first setting of ``cfg`` (a ``RunConfig`` or a ``ServeConfig``) that the model cannot take.

    >>> from selfrl.config import RunConfig
    >>> cfg = RunConfig(); cfg.lora.r = 1000
    >>> check_fits(cfg, ModelLimits(576, 8192), "m")
    Traceback (most recent call last):
    ...
    selfrl.core.errors.ConfigError: lora.r must be <= 576 (the hidden size of m), got 1000
    """
    rules = []
    if limits.hidden_size is not None:
        rules.append(("lora.r", cfg.lora.r, limits.hidden_size, "the hidden size"))
    if limits.context is not None:
        rules.append(("rollout.max_new_tokens", cfg.rollout.max_new_tokens, limits.context, "the context length"))
        if hasattr(cfg, "max_tokens_default"):
            rules.append(("max_tokens_default", cfg.max_tokens_default, limits.context, "the context length"))
        if hasattr(cfg, "swap_check") and getattr(cfg, "sampler", None) is not None and cfg.sampler.url:
            rules.append(("swap_check.probe_tokens", cfg.swap_check.probe_tokens, limits.context, "the context length"))
    for name, value, bound, what in rules:
        if value > bound:
            raise ConfigError(f"{name} must be <= {bound} ({what} of {model_name}), got {value}")


def check_model_fit(cfg, path: str) -> None:
    """:func:`check_fits` with the limits read from the model folder or id ``path`` (``config.json``
    only). A config that cannot be read is left to the weights' loader to report.

    Raises:
        ConfigError: a setting the model cannot take.
    """
    from transformers import AutoConfig

    try:
        model_config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return
    check_fits(cfg, limits_of(model_config), cfg.model.name)
