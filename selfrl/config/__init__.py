"""Configuration of ``selfrl run`` and ``selfrl serve``: every settings dataclass, reachable from here.

- :mod:`selfrl.config.base`: the rules every table uses (the error, rule lists, ``Literal``
  choices, finite floats, filling a dataclass from TOML and dotted overrides).
- :mod:`selfrl.config.sections`: the tables ``selfrl run`` and ``selfrl serve`` share, and their checks.
- :mod:`selfrl.config.run`: :class:`RunConfig` and loading it (``load_config``).
- :mod:`selfrl.config.remote`: sampling outside one process (Ray, agents, a remote sampler).
- :mod:`selfrl.config.serve`: :class:`ServeConfig`, the same sections plus the server's own.
- :mod:`selfrl.config.judge`: the LLM judge's table (``[judge]``); its values, never the judge.

Importing it imports no torch.
"""

from __future__ import annotations

from selfrl.config.base import (  # noqa: F401
    ConfigError,
    require,
    one_of,
    check_finite,
    fill,
    non_finite_weights,
    in_range,
    SECONDS_MAX,
    SEED_MAX,
)
from selfrl.config.remote import (  # noqa: F401
    SamplerKind,
    DistributedConfig,
    AgentAdapters,
    AgentConfig,
    SwapCheckConfig,
    SamplerConfig,
)
from selfrl.config.judge import (  # noqa: F401
    JudgeMode,
    Combine,
    StructuredOutput,
    JUDGE_REWARD,
    JUDGE_DETECTORS,
    JudgeEndpoint,
    JudgeConfig,
)
from selfrl.config.run import (  # noqa: F401
    MAX_BATCH,
    MAX_BETA,
    MAX_CONTEXT,
    MAX_LORA_R,
    MAX_TASKS,
    MAX_VAL,
    DEFAULT_MODEL,
    DEFAULT_SYSTEM_PROMPT,
    ScaleRewards,
    ToolsPrompt,
    TaskChoice,
    Constrain,
    SignalCheck,
    WarmStartReference,
    ModelConfig,
    LoraSettings,
    TaskConfig,
    RolloutConfig,
    TrainConfig,
    GateConfig,
    CollapseConfig,
    DetectorConfig,
    WarmStartConfig,
    SHARED_SECTIONS,
    check_sections,
    check_engine,
    check_sampler,
    RunConfig,
    RESUME_FIXED,
    check_resumable,
    CPU_ONLY_ENGINES,
    check_placement,
    load_config,
)
from selfrl.config.serve import (  # noqa: F401
    FamilyConfig,
    LearnerSettings,
    RetentionSettings,
    ServeConfig,
)
