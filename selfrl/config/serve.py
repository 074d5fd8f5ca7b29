"""Settings of ``selfrl serve``: the same sections as ``selfrl run`` (``selfrl.config.sections``),
checked by the same validators, plus the server's own and its learner's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from selfrl.config.base import SECONDS_MAX, SEED_MAX, in_range, non_finite_weights, one_of, require
from selfrl.config.judge import JUDGE_REWARD
from selfrl.config.sections import (
    CollapseConfig,
    DetectorConfig,
    GateConfig,
    LoraSettings,
    ModelConfig,
    RolloutConfig,
    TaskConfig,
    ToolsPrompt,
    TrainConfig,
    check_engine,
    check_sections,
)
from selfrl.engines import DEFAULT_SERVE_ENGINE
from selfrl.engines.base import MAX_TEMPERATURE, MIN_TEMPERATURE


@dataclass
class LearnerSettings:
    """When and how the background learner trains on served traffic."""

    enabled: bool = True  # run the background learner (off: serve and record only)
    min_batch: int = 32  # served turns with a complete reward that trigger an update
    max_batch: int = 64  # most turns used by one update
    feedback_wait_s: float = 120.0  # seconds a turn waits for feedback before it may be trained without it
    poll_s: float = 1.0  # seconds between checks for enough ready turns
    retry_s: float = 1.0  # seconds a learner paused by a storage fault (disk full, ...) waits before a retry
    retry_max_s: float = 60.0  # the wait doubles after each failed retry, up to this many seconds
    temperature: float = 1.0  # temperature of the learner's logprobs (old ones are recomputed at it)
    reward_weights: dict[str, float] = field(
        default_factory=lambda: {"user_feedback": 1.0, "tool_success": 0.2})  # registered rewards (selfrl.envs.rewards)

    def check(self, where: str = "") -> None:
        require([
            (self.min_batch >= 2 and self.max_batch >= self.min_batch,
             f"min_batch must be >= 2 and <= learner.max_batch, got {self.min_batch!r} (max_batch {self.max_batch!r})"),
            in_range(self.max_batch, "max_batch", 2, 65536),
            in_range(self.feedback_wait_s, "feedback_wait_s", 0, SECONDS_MAX),
            in_range(self.poll_s, "poll_s", 0, 3600, low_open=True),
            (0 < self.retry_s <= self.retry_max_s, "retry_s must be > 0 and <= learner.retry_max_s"),
            in_range(self.retry_max_s, "retry_max_s", 0, SECONDS_MAX, low_open=True),
            in_range(self.temperature, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
            (isinstance(self.reward_weights, dict), "reward_weights must be a table of name = weight"),
            (not non_finite_weights(self.reward_weights),
             f"reward_weights must be finite, got {non_finite_weights(self.reward_weights)}"),
            (not isinstance(self.reward_weights, dict) or JUDGE_REWARD not in self.reward_weights,
             f"reward_weights: selfrl serve does not offer the {JUDGE_REWARD!r} reward (it has no [judge] "
             "endpoints to call); train with a judge through selfrl run (docs/guides/judge.md), or weight "
             "user_feedback here"),
        ], where)


@dataclass
class ServeConfig:
    """Everything ``selfrl serve`` needs (defaults serve the embedded SmolLM2 on 127.0.0.1:8000)."""

    run_dir: str = "runs/serve"  # store, adapter versions and logs
    host: str = "127.0.0.1"  # bind address; anything else exposes the server beyond this machine
    port: int = 8000  # TCP port of the server (loopback unless host says otherwise)
    served_model_name: str = "selfrl"  # the model id /v1/models lists; versions are "<name>@v<N>"
    model_aliases: list[str] = field(default_factory=list)  # more ids served as the current version (e.g. a client's hard-coded "gpt-4o"); any other id: 404 model_not_found
    max_batch: int = 32  # rows per engine call
    batch_window_s: float = 0.01  # seconds the batcher waits for more requests before a batch
    max_tokens_default: int = 256  # completion limit when a request sets none
    max_request_bytes: int = 4_000_000  # larger request bodies get a 413 before they are read
    tools_prompt: ToolsPrompt = "compact"  # how request tools are shown to a template without tool support
    seed: int = 0  # seeds the adapter's initialisation; sampling draws a fresh stream per process (restarts, replicas)
    engine: str = DEFAULT_SERVE_ENGINE  # sampling backend: reference (batches) | slots (requests join the running batch)
    replica: bool = False  # serve beside the run_dir's owner: record into its store, follow its versions (selfrl.serve.replica)
    follow_s: float = 1.0  # replica: seconds between two looks at the owner's version ledger
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    train: TrainConfig = field(default_factory=TrainConfig)
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    gate: GateConfig = field(default_factory=lambda: GateConfig(val_size=64))
    task: TaskConfig = field(default_factory=TaskConfig)  # the validation tasks of the gate
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=1.0))  # how validation runs
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # collapse rules and rollback, as in run
    detectors: DetectorConfig = field(default_factory=DetectorConfig)  # reward-hacking detectors, as in run

    @property
    def max_completion_length(self) -> int:
        """Completion tokens one served turn may hold when the request sets no limit (the
        ``dr_grpo`` normaliser of the learner)."""
        return self.max_tokens_default

    def validate(self) -> "ServeConfig":
        """Check every section with ``selfrl run``'s validators, then the server's own fields; returns self.

        Raises:
            selfrl.config.ConfigError: a value out of range, with the field named (names are checked
                at setup: :func:`selfrl.run.setup.check_names`).
        """
        check_sections(self)
        self.learner.check("learner.")
        require([
            (1 <= self.port <= 65535, "port must be in 1..65535"),
            (bool(self.served_model_name) and "@" not in self.served_model_name,
             "served_model_name must be non-empty and hold no '@'"),
            (isinstance(self.model_aliases, list) and all(isinstance(a, str) and a and "@" not in a
                                                          for a in self.model_aliases),
             "model_aliases must be a list of non-empty names without '@'"),
            in_range(self.max_batch, "max_batch", 1, 4096),
            in_range(self.batch_window_s, "batch_window_s", 0, 60),
            # and at most the model's context length (selfrl.model.fit)
            in_range(self.max_tokens_default, "max_tokens_default", 1, 1 << 20),
            in_range(self.max_request_bytes, "max_request_bytes", 1, 2**31 - 1),
            in_range(self.seed, "seed", 0, SEED_MAX),
            in_range(self.follow_s, "follow_s", 0, 3600, low_open=True),
            one_of(self.tools_prompt, ToolsPrompt, "tools_prompt"),
        ])
        check_engine(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
