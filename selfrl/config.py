"""Run configuration: dataclasses split by concern, loaded from a TOML file and flags.

A config file has one table per concern, named as the fields of
:class:`RunConfig` (``[model]``, ``[lora]``, ``[task]``, ``[rollout]``,
``[train]``, ``[gate]``, ``[collapse]``, ``[detectors]``) plus top-level keys. Unknown keys are errors that list
the valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrl.collapse import CollapseConfig
from selfrl.detectors import DetectorConfig
from selfrl.gate import GateConfig
from selfrl.model import DEFAULT_MODEL
from selfrl.rollout import RolloutConfig
from selfrl.trainer import TrainConfig


class ConfigError(ValueError):
    """An invalid configuration value or key; the message names it."""


@dataclass
class ModelConfig:
    """Which policy to load."""

    name: str = DEFAULT_MODEL  # Hugging Face id, local path, or embedded:smollm2-135m-instruct


@dataclass
class LoraSettings:
    """LoRA adapter shape (passed to peft.LoraConfig)."""

    r: int = 16  # rank
    lora_alpha: int = 32  # scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA input (0 keeps sampling and training identical)
    target_modules: list[str] | str = "all-linear"  # module names, or "all-linear"
    modules_to_save: list[str] | None = None  # rejected: hot-swap serves LoRA tensors only
    init_adapter: str | None = None  # start from this saved adapter folder (also the KL reference)


@dataclass
class TaskConfig:
    """Where tasks come from."""

    source: str = "chain_sum"  # registered task source (see selfrl.tasks.available_task_sources)
    options: dict[str, Any] = field(default_factory=dict)  # overrides of the source's generator config
    train_seed: int = 1000  # seed of training tasks
    val_seed: int = 2000  # seed of held-out tasks (disjointness is checked)
    num_train: int = 2000  # training tasks generated


@dataclass
class RunConfig:
    """Everything one ``selfrl run`` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # collapse rules and rollback (selfrl.collapse)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)  # reward-hacking detectors (selfrl.detectors)
    run_dir: str = "runs/default"  # where the store, adapters, metrics and report go
    iterations: int = 16  # rollout + update cycles
    num_prompts: int = 8  # tasks per iteration
    num_generations: int = 8  # samples per task (the GRPO group size)
    preset: str = "verified"  # reward preset: verified | label-free
    reward_weights: dict[str, float] | None = None  # explicit weights; overrides the preset
    seed: int = 0  # torch seed for sampling and LoRA init

    @property
    def max_completion_length(self) -> int:
        """Completion tokens one trajectory may hold: ``max_new_tokens`` per turn times ``max_turns``
        (the ``dr_grpo`` normaliser)."""
        return self.rollout.max_new_tokens * self.rollout.max_turns

    def validate(self) -> "RunConfig":
        """Check values; returns self.

        Raises:
            ConfigError: a value out of range, with the field named.
        """
        checks = [
            (self.iterations >= 1, "iterations must be >= 1"),
            (self.num_prompts >= 1, "num_prompts must be >= 1"),
            (self.num_generations >= 2, "num_generations must be >= 2 (a group of one has no advantage)"),
            (self.lora.r >= 1, "lora.r must be >= 1"),
            (0 <= self.lora.lora_dropout < 1, "lora.lora_dropout must be in [0, 1)"),
            (not self.lora.modules_to_save, "lora.modules_to_save is not supported: hot-swap copies LoRA "
             "tensors only, so a saved embedding or head could not be served; leave it empty"),
            (self.train.learning_rate > 0, "train.learning_rate must be > 0"),
            (self.train.beta >= 0, "train.beta must be >= 0"),
            (0 < self.train.epsilon < 1, "train.epsilon must be in (0, 1)"),
            (self.train.num_iterations >= 1, "train.num_iterations must be >= 1"),
            (self.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
            (self.train.max_grad_norm > 0, "train.max_grad_norm must be > 0"),
            (self.rollout.temperature > 0, "rollout.temperature must be > 0"),
            (self.rollout.max_turns >= 1, "rollout.max_turns must be >= 1"),
            (self.rollout.max_new_tokens >= 1, "rollout.max_new_tokens must be >= 1"),
            (self.gate.val_size >= 1, "gate.val_size must be >= 1"),
            (self.gate.eval_every >= 1, "gate.eval_every must be >= 1"),
            (self.gate.tolerance >= 0, "gate.tolerance must be >= 0"),
            (self.train.skip_max_reward_spread > 0, "train.skip_max_reward_spread must be > 0"),
            (self.train.skip_max_kl > 0, "train.skip_max_kl must be > 0"),
            (self.train.skip_max_grad_norm > 0, "train.skip_max_grad_norm must be > 0"),
            (self.collapse.baseline_window >= 1, "collapse.baseline_window must be >= 1"),
            (0 <= self.collapse.entropy_min_ratio < 1 < self.collapse.entropy_max_ratio,
             "collapse needs 0 <= entropy_min_ratio < 1 < entropy_max_ratio"),
            (self.collapse.max_kl > 0 and self.collapse.degenerate_rise > 0 and self.collapse.heldout_drop > 0,
             "collapse.max_kl, degenerate_rise and heldout_drop must be > 0"),
            (self.collapse.max_rollbacks >= 0, "collapse.max_rollbacks must be >= 0"),
            (0 < self.collapse.lr_factor <= 1, "collapse.lr_factor must be in (0, 1]"),
            (self.collapse.beta_factor >= 1 and self.collapse.beta_min >= 0,
             "collapse.beta_factor must be >= 1 and collapse.beta_min >= 0"),
            (self.collapse.repeat_ngram >= 1 and 0 < self.collapse.repeat_share <= 1,
             "collapse.repeat_ngram must be >= 1 and collapse.repeat_share in (0, 1]"),
        ]
        checks += [
            (self.task.num_train >= 1, "task.num_train must be >= 1"),
            (self.gate.batch_size >= 1, "gate.batch_size must be >= 1"),
            (self.train.micro_batch_size >= 1, "train.micro_batch_size must be >= 1"),
            (self.train.scale_rewards in ("group", "none"), "train.scale_rewards must be 'group' or 'none'"),
            (self.rollout.tools_prompt in ("compact", "json"), "rollout.tools_prompt must be 'compact' or 'json'"),
            (isinstance(self.rollout.tools, list), "rollout.tools must be a list of tool names"),
            (self.reward_weights is None or isinstance(self.reward_weights, dict),
             "reward_weights must be a table of name = weight"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        self._check_names()
        return self

    def _check_names(self) -> None:
        """Names that refer to registries (loss type, preset, reward functions, tools)."""
        from selfrl.detectors import check_detectors
        from selfrl.rewards import check_weights, get_preset
        from selfrl.rl.losses import get_loss_aggregation
        from selfrl.tools import resolve_tools

        try:
            get_loss_aggregation(self.train.loss_type)
            check_weights(self.reward_weights if self.reward_weights is not None else get_preset(self.preset))
            resolve_tools(self.rollout.tools)
            check_detectors(self.detectors.names)
        except (KeyError, ValueError) as e:
            raise ConfigError(str(e).strip("'\"")) from e

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _apply(obj, values: dict[str, Any], where: str) -> None:
    """Set dataclass fields from a dict, recursing into nested dataclasses."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"unknown key {where}{key!r}; valid: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}{key} must be a table")
            _apply(current, value, f"{where}{key}.")
            continue
        # the declared type, not the default's: "all-linear" must not forbid a list of modules
        declared = fields[key].type if isinstance(fields[key].type, str) else getattr(fields[key].type, "__name__", "")
        expected = {"int": int, "float": float, "str": str, "bool": bool}.get(declared)
        if expected in (int, float) and isinstance(value, bool):
            raise ConfigError(f"{where}{key} must be a number, got {value!r}")
        if expected is float and isinstance(value, int):
            value = float(value)
        if expected in (int, float, str, bool) and not isinstance(value, expected):
            raise ConfigError(f"{where}{key} must be {expected.__name__}, got {value!r}")
        setattr(obj, key, value)


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None, base: dict[str, Any] | None = None
) -> RunConfig:
    """Build a :class:`RunConfig` from defaults, ``base``, a TOML file, then dotted overrides.

    Args:
        path: TOML file, or None.
        overrides: e.g. ``{"train.learning_rate": 1e-4, "iterations": 4}``; None values are skipped.
        base: a stored config (``RunConfig.to_dict()``), e.g. the ``config.json`` of a run to resume.

    Raises:
        ConfigError: unreadable file, unknown key, wrong type or invalid value.
    """
    return fill(RunConfig(), path, overrides, base).validate()


def fill(cfg, path: str | Path | None = None, overrides: dict[str, Any] | None = None,
         base: dict[str, Any] | None = None):
    """Set the fields of a config dataclass from ``base``, then a TOML file, then dotted
    ``overrides`` (None values skipped); returns ``cfg``. Shared by ``selfrl run`` and
    ``selfrl serve``.

    Raises:
        ConfigError: unreadable file, unknown key or wrong type.
    """
    if base is not None:
        _apply(cfg, base, "")
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        _apply(cfg, data, "")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        *parents, leaf = dotted.split(".")
        nested: dict[str, Any] = {leaf: value}
        for p in reversed(parents):
            nested = {p: nested}
        _apply(cfg, nested, "")
    return cfg
