"""``selfrl run``'s configuration: :class:`RunConfig`, the tables it holds, and loading it.

A config file has one table per concern, named as the fields of :class:`RunConfig`
(``[model]``, ``[lora]``, ``[task]``, ``[rollout]``, ``[train]``, ``[gate]``,
``[collapse]``, ``[detectors]``, ``[distributed]``, ``[sampler]``, ``[swap_check]``, ``[warm_start]``,
``[judge]``) plus top-level keys; ``selfrl serve`` reads the same shared tables into
:class:`selfrl.config.serve.ServeConfig`. Unknown keys are errors that list the valid ones, so a
typo never silently falls back to a default.

Each table checks its own fields in ``check(where)``, beside them (:mod:`selfrl.config.sections`);
``RunConfig`` and ``ServeConfig`` both call those checks (:func:`check_sections`), so a rule of
``run`` that applies to ``serve`` holds there too. Validation checks *values* only: the names a
config refers to (reward preset and functions, tools, detectors, loss type) are checked against
their registries at setup, once the built-in environments have registered theirs
(:func:`selfrl.run.setup.check_names`), so importing the config imports no environment, detector
or reward. Allowed values are ``Literal`` types, defined once; derived values are properties.
The rules every table uses (:class:`ConfigError`, ``require``, filling from TOML) live in
:mod:`selfrl.config.base`; the tables for sampling outside one process (``[distributed]``,
``[[agents]]``, ``[sampler]``, ``[swap_check]``) in :mod:`selfrl.config.remote`, the LLM judge's
(``[judge]``) in :mod:`selfrl.config.judge`. All are re-exported by :mod:`selfrl.config`.
Importing this module imports no torch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfrl.config.base import (  # noqa: F401  (re-exported)
    SECONDS_MAX,
    SEED_MAX,
    ConfigError,
    check_finite,
    fill,
    in_range,
    negative_weights_problem,
    weights_problem,
    one_of,
    require,
)
from selfrl.config.judge import (  # noqa: F401  (re-exported)
    JUDGE_DETECTORS, JUDGE_REWARD, JudgeConfig, JudgeEndpoint,
)
from selfrl.config.remote import (  # noqa: F401  (re-exported: every settings table is reachable from here)
    AgentAdapters, AgentConfig, DistributedConfig, SamplerConfig, SamplerKind, SwapCheckConfig,
)
from selfrl.config.sections import (  # noqa: F401  (re-exported: the tables RunConfig holds)
    CPU_ONLY_ENGINES, DEFAULT_SYSTEM_PROMPT, MAX_BATCH, MAX_BETA, MAX_CONTEXT, MAX_LORA_R, MAX_TASKS, MAX_VAL,
    SHARED_SECTIONS, CollapseConfig, Constrain, DetectorConfig, GateConfig, LoraSettings, ModelConfig, RolloutConfig,
    ScaleRewards, SignalCheck, TaskChoice, TaskConfig, ToolsPrompt, TrainConfig, WarmStartConfig,
    WarmStartReference, check_engine, check_placement, check_sections,
)
from selfrl.engines import DEFAULT_ENGINE  # the backend registry (imports no torch)
from selfrl.model import DEFAULT_MODEL  # noqa: F401  (re-exported)



def check_sampler(cfg: Any, given: Collection[str] = ()) -> None:
    """The swap check's settings, and, with ``sampler.url``, no setting that needs the policy
    in this process's engine; without it, no ``[sampler]`` key set (``given``: the keys the file
    and flags set, :func:`selfrl.config.fill`), as it would have no effect.

    Raises:
        ConfigError: a bad ``[sampler]`` or ``[swap_check]`` value, a combination the remote
            sampler cannot honour (the message names both settings), or a ``[sampler]`` key
            without ``sampler.url``.
    """
    cfg.sampler.check("sampler.")
    try:
        cfg.swap_check.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.sampler.url is None:
        unused = [k + (" (--sampler-kind)" if k == "sampler.kind" else "") for k in sorted(given)
                  if k.startswith("sampler.")]
        require([(not unused, f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without "
                  "sampler.url: the run samples in process unless --sampler URL names a sampler (selfrl sampler, "
                  f"or a vLLM server); add --sampler URL, or leave {'it' if len(unused) == 1 else 'them'} out")])
        return
    require([
        (cfg.distributed.address is None, "sampler.url (--sampler) and distributed.address (--ray) are two ways "
         "to sample outside this process; set one"),
        (cfg.engine == DEFAULT_ENGINE, f"engine = {cfg.engine!r} picks an in-process backend, and sampler.url "
         "(--sampler) samples in another process (selfrl sampler serves the reference engine); drop one "
         f"(a run resumed from before {DEFAULT_ENGINE!r} was the default stored 'reference': add "
         f"--engine {DEFAULT_ENGINE})"),
        (cfg.rollout.constrain == "none", f"rollout.constrain = {cfg.rollout.constrain!r} needs the in-process "
         "engine's grammar constraints; a remote sampler (--sampler) has none"),
        *[(a.rollout.get("constrain", "none") == "none", f"agents[{i}] ({a.name}).rollout.constrain = "
           f"{a.rollout['constrain']!r} needs the in-process engine's grammar constraints; a remote sampler "
           "(--sampler) has none") for i, a in enumerate(cfg.agents)],
    ])


@dataclass
class RunConfig:
    """Everything one ``selfrl run`` needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    gate: GateConfig = field(default_factory=GateConfig)
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # collapse rules and rollback (selfrl.safety.collapse)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)  # reward-hacking detectors (selfrl.safety.detectors)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # Ray workers (selfrl.run.ray)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)  # a remote sampler over HTTP (selfrl.run.sampler_sync)
    swap_check: SwapCheckConfig = field(default_factory=SwapCheckConfig)  # each push to the sampler, proved (selfrl.safety.swap_check)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)  # own successes fine-tuned first (selfrl.run.warm_start)
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the LLM judge reward (selfrl.judge, docs/guides/judge.md)
    run_dir: str = "runs/default"  # where the store, adapters, metrics and report go
    iterations: int = 16  # rollout + update cycles
    num_prompts: int = 8  # tasks per iteration
    num_generations: int = 8  # samples per task (the GRPO group size)
    preset: str = "verified"  # reward preset: a name of selfrl.envs.rewards.PRESETS (environments register theirs; an unknown name lists them)
    reward_weights: dict[str, float] | None = None  # explicit weights; overrides the preset
    seed: int = 0  # torch seed for sampling and LoRA init
    engine: str = DEFAULT_ENGINE  # sampling backend: reference | slots | auto (slots on the CPU, reference on a GPU)
    # sample the next iteration's rollouts while the update trains (one batch ahead, staleness <= 1, TIS-corrected);
    # a copy of the LoRA samples, checked by the swap check after every push (selfrl.rollout.prefetch)
    async_rollouts: bool = False
    # several agents into one learner ([[agents]] tables; empty: one agent, [task]); selfrl.run.agents
    agents: list[AgentConfig] = field(default_factory=list, metadata={"table_of": AgentConfig})
    agent_adapters: AgentAdapters = "shared"  # with [[agents]]: shared (one adapter, per-agent advantage normalisation)

    @property
    def max_completion_length(self) -> int:
        """Completion tokens one trajectory may hold (the ``dr_grpo`` normaliser)."""
        return self.rollout.max_completion_length

    def validate(self, given: Collection[str] = ()) -> "RunConfig":
        """Check every section and the run's own fields; returns self.

        Args:
            given: the dotted keys the config file and flags set (:func:`selfrl.config.fill`): a
                setting that would have no effect is refused when it was set.

        Raises:
            ConfigError: a value out of range, with the field named, or a setting that would have no effect.
        """
        check_sections(self)
        self.distributed.check("distributed.")
        self.warm_start.check("warm_start.")
        self.judge.check("judge.")
        require([(not (self.warm_start.enabled and self.distributed.address is not None),
                  "warm_start.enabled with distributed.address (--ray) is not supported: the warm start samples "
                  "with the driver's engine, and its Ray workers would not get the warm-started weights; "
                  "run without --ray, or turn the warm start off")])
        require([(not (self.async_rollouts and self.distributed.address is not None),
                  "async_rollouts (--async-rollouts) with distributed.address (--ray): --ray already samples "
                  "asynchronously, bounded by distributed.max_staleness; drop one")])
        weights = self.reward_weights  # one problem each: a weight no finite number, or negative, then none above 0
        weights_bad = weights_problem(weights) or negative_weights_problem(weights, "selfrl run")
        none_positive = (isinstance(weights, dict) and bool(weights) and weights_bad is None
                         and not any(w > 0 for w in weights.values()))
        # selfrl.rl.schedule.warmup_updates: ceil(ratio x iterations) updates ramp up (0 when iterations is
        # out of range, which its own rule names)
        warmup = math.ceil(self.train.warmup_ratio * self.iterations) if 1 <= self.iterations <= ITERATIONS_MAX else 0
        require([
            in_range(self.iterations, "iterations", 1, ITERATIONS_MAX),
            in_range(self.num_prompts, "num_prompts", 1, MAX_BATCH),
            (self.num_generations >= 2, f"num_generations must be >= 2 (a group of one has no advantage), "
             f"got {self.num_generations!r}"),
            in_range(self.num_generations, "num_generations", 2, 1024),
            in_range(self.num_prompts * self.num_generations, "num_prompts * num_generations (rollouts per "
                     "iteration, all held in memory)", 2, MAX_BATCH),
            in_range(self.seed, "seed", 0, SEED_MAX),
            (self.reward_weights is None or isinstance(self.reward_weights, dict),
             "reward_weights must be a table of name = weight"),
            (weights_bad is None, weights_bad or ""),
            (self.reward_weights != {}, "reward_weights = {} names no reward: leave it out to use the preset's "
             f"weights ({self.preset}), or name at least one reward with a weight above 0"),
            (not none_positive, f"reward_weights: {self.reward_weights} has no weight above 0, so every rollout "
             "would score 0: weight at least one reward above 0"),
            (warmup < self.iterations or not 1 < self.iterations <= ITERATIONS_MAX,
             f"train.warmup_ratio = {self.train.warmup_ratio:g} of {self.iterations} iterations is "
             f"{warmup} warmup updates, so none would run after the warmup: lower warmup_ratio, or raise iterations"),
        ])
        self.check_agents()
        check_engine(self)
        check_sampler(self, given)
        return self

    def check_agents(self) -> None:
        """``[[agents]]``: each agent's fields, unique names, one shared adapter.

        Raises:
            ConfigError: a bad agent field (its ``rollout`` keys with ``[rollout]``'s values:
                :meth:`RolloutConfig.with_overrides`), a repeated name, ``task.options`` beside agents
                (each agent has its own), or ``agent_adapters`` other than "shared".
        """
        names = [a.name for a in self.agents]
        for i, agent in enumerate(self.agents):
            agent.check(f"agents[{i}] ({agent.name or 'unnamed'}).")
            self.rollout.with_overrides(agent.rollout, f"agents[{i}] ({agent.name or 'unnamed'}).rollout.")
        require([
            (self.agent_adapters != "per_agent",
             "agent_adapters = 'per_agent' is not offered: several agents train one shared adapter with "
             "per-agent advantage normalisation, and each agent's gate guards it (docs/guides/many-agents.md); "
             "for separate adapters run one selfrl run per agent"),
            one_of(self.agent_adapters, AgentAdapters, "agent_adapters"),
            (len(set(names)) == len(names), f"agent names must be unique, got {names}"),
            (not self.agents or not self.task.options,
             "task.options does not apply with [[agents]]: give each agent its own options"),
        ])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


ITERATIONS_MAX = 10**7  # iterations of one selfrl run

# Settings a resumed run must share with the run it continues: the same policy, tasks,
# held-out set, agent and reward (the judge is part of the reward). Anything else
# (iterations, learning rate, ...) may change.
RESUME_FIXED = ("model", "lora", "task", "rollout", "preset", "reward_weights", "agents", "judge")
# Fields of a [[judge.endpoints]] table that say how the judge is reached and paid for, not what
# it pays: a resumed run may change them (its verdicts stay the same judge's, by the cache key).
JUDGE_RESUME_FREE = ("api_key_env", "deadline_s", "retries", "max_concurrency", "price_input_per_m",
                     "price_output_per_m")


def judge_identity(judge: dict | None) -> dict:
    """The stored ``[judge]`` table as a resumed run compares it: without the fields of
    :data:`JUDGE_RESUME_FREE` and ``cache``; a run stored before ``[judge]`` existed had none.

    >>> judge_identity(None)["endpoints"]
    []
    >>> judge_identity({"endpoints": [{"rubric": "r", "deadline_s": 9.0}], "cache": False})
    {'endpoints': [{'rubric': 'r'}]}
    """
    judge = dataclasses.asdict(JudgeConfig()) if judge is None else judge
    out = {k: v for k, v in judge.items() if k != "cache"}
    if isinstance(out.get("endpoints"), list):
        out["endpoints"] = [{k: v for k, v in e.items() if k not in JUDGE_RESUME_FREE} if isinstance(e, dict) else e
                            for e in out["endpoints"]]
    return out


def check_resumable(stored: dict, new: dict) -> None:
    """Raise ConfigError naming the settings that differ from the stored run's.

    Raises:
        ConfigError: a key of ``RESUME_FIXED`` (of ``[judge]``, a field not in
            :data:`JUDGE_RESUME_FREE`) or ``gate.val_size`` differs.
    """
    def same(a, b) -> bool:  # a table compares on the stored keys: fields added since then keep their defaults
        if isinstance(a, dict) and isinstance(b, dict):
            return all(k in b and same(v, b[k]) for k, v in a.items())
        if isinstance(a, list) and isinstance(b, list):  # e.g. [[judge.endpoints]]: table by table
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b

    compared = {"judge": judge_identity}  # the judge's reachability may change, what it pays may not
    changed = [k for k in RESUME_FIXED
               if not same(*(compared.get(k, lambda v: v)(d.get(k)) for d in (stored, new)))]
    if stored.get("gate", {}).get("val_size") != new.get("gate", {}).get("val_size"):
        changed.append("gate.val_size")
    if changed:
        raise ConfigError(f"--resume cannot change {', '.join(changed)} of the stored run; "
                          "start a new run (another --run-dir) for that")
    check_schedule_resumable(stored, new)


def check_schedule_resumable(stored: dict, new: dict) -> None:
    """A run with a learning-rate schedule (:mod:`selfrl.rl.schedule`) resumes only with the same
    schedule over the same ``iterations``: the schedule is a function of the total, so another total
    would move every later update's rate (a linear decay over 16 resumed to 32 would jump from
    0.0625 to 0.5 of the rate), and another schedule would too. A constant rate without warmup on
    both sides may change ``iterations`` freely.

    Raises:
        ConfigError: naming the stored and the new setting, and what to do instead.
    """
    def plan(d: dict) -> tuple:
        train = d.get("train", {})
        return train.get("lr_scheduler_type", "constant"), train.get("warmup_ratio", 0.0), d.get("iterations")

    (kind0, warm0, n0), (kind1, warm1, n1) = plan(stored), plan(new)
    if (kind0, warm0) == (kind1, warm1) == ("constant", 0.0) or (kind0, warm0, n0) == (kind1, warm1, n1):
        return
    raise ConfigError(f"--resume cannot change the learning-rate schedule of the stored run: it was "
                      f"train.lr_scheduler_type = {kind0!r}, warmup_ratio = {warm0:g} over {n0} iterations, and this "
                      f"would be {kind1!r}, {warm1:g} over {n1}, which changes the rate of every update still to come; "
                      f"resume with --iterations {n0} and the stored schedule, or start a new run (another --run-dir)")

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
    given: set[str] = set()  # the keys the file and flags set (not base's): a setting with no effect is refused
    return fill(RunConfig(), path, overrides, base, given).validate(given)
