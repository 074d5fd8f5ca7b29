"""Settings of ``selfrl serve``: one dataclass per concern, as for ``selfrl run``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from selfrl.collapse import CollapseConfig
from selfrl.config import LoraSettings, ModelConfig, TaskConfig
from selfrl.detectors import DetectorConfig
from selfrl.gate import GateConfig
from selfrl.rollout import RolloutConfig
from selfrl.trainer import TrainConfig


@dataclass
class LearnerSettings:
    """When and how the background learner trains on served traffic."""

    enabled: bool = True  # run the background learner (off: serve and record only)
    min_batch: int = 32  # served turns with a complete reward that trigger an update
    max_batch: int = 64  # most turns used by one update
    feedback_wait_s: float = 120.0  # seconds a turn waits for feedback before it may be trained without it
    poll_s: float = 1.0  # seconds between checks for enough ready turns
    temperature: float = 1.0  # temperature of the learner's logprobs (old ones are recomputed at it)
    reward_weights: dict[str, float] = field(
        default_factory=lambda: {"user_feedback": 1.0, "tool_success": 0.2})  # see selfrl.serve.feedback


@dataclass
class ServeConfig:
    """Everything ``selfrl serve`` needs (defaults serve the embedded SmolLM2 on 127.0.0.1:8000)."""

    run_dir: str = "runs/serve"  # store, adapter versions and logs
    host: str = "127.0.0.1"  # bind address; anything else exposes the server beyond this machine
    port: int = 8000
    served_model_name: str = "selfrl"  # the model id /v1/models lists; versions are "<name>@v<N>"
    max_batch: int = 32  # rows per engine call
    batch_window_s: float = 0.01  # seconds the batcher waits for more requests before a batch
    max_tokens_default: int = 256  # completion limit when a request sets none
    max_request_bytes: int = 4_000_000  # larger request bodies get a 413 before they are read
    tools_prompt: str = "compact"  # how request tools are shown to a template without tool support
    seed: int = 0
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
