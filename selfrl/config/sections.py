"""The settings tables ``selfrl run`` and ``selfrl serve`` share, each checked beside its fields:
``[model]``, ``[lora]``, ``[task]``, ``[rollout]``, ``[train]``, ``[gate]``, ``[collapse]``,
``[detectors]`` (:data:`SHARED_SECTIONS`), and ``selfrl run``'s ``[warm_start]``; the checks both
configs run on them (:func:`check_sections`, :func:`check_engine`, :func:`check_placement`).

Part of :mod:`selfrl.config` (which re-exports every name): :class:`selfrl.config.RunConfig`
(:mod:`selfrl.config.run`) and :class:`selfrl.config.ServeConfig` (:mod:`selfrl.config.serve`)
compose these tables. Values only: the names a table refers to (tools, detectors, a loss type)
are checked at setup (:func:`selfrl.run.setup.check_names`). Imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from selfrl.config.base import SEED_MAX, ConfigError, at_most, check_finite, in_range, one_of, require
from selfrl.engines import ENGINES  # the backend registry (imports no torch)
from selfrl.engines.base import MAX_TEMPERATURE, MIN_TEMPERATURE
from selfrl.model import DEFAULT_MODEL
from selfrl.record.serve_rule import ServeRule  # gate.rule's values (imports no torch)

DEFAULT_SYSTEM_PROMPT = "You are a careful assistant. Give the final answer as <answer>NUMBER</answer>."

# Upper bounds of the settings that have no natural one (see each table's ``check``); the bounds a
# model sets (LoRA rank <= hidden size, token limits <= context length) are checked by
# selfrl.model.fit once the model's config is read, before its weights load.
MAX_LORA_R = 65536  # above every released model's hidden size
MAX_CONTEXT = 1 << 20  # tokens: above every released model's context length
MAX_TASKS = 1_000_000  # tasks generated and held in memory (about 1 kB each)
MAX_VAL = 100_000  # held-out tasks validated at every gate
MAX_BATCH = 65536  # sequences in one batch, micro-batch or iteration
MAX_BETA = 1000.0  # KL coefficient
DAY_S = 86400.0  # seconds in a day (the bound of a time window)

ScaleRewards = Literal["group", "none"]  # advantage scaling: group (GRPO) | none (Dr. GRPO)
LrSchedule = Literal["constant", "linear", "cosine"]  # selfrl.rl.schedule.SCHEDULES
ToolsPrompt = Literal["compact", "json"]  # how tool schemas are shown to a template without tool support
TaskChoice = Literal["cycle", "signal"]  # task choice: a shuffled walk | skip tasks predicted to give constant groups
Constrain = Literal["none", "tool_call"]  # grammar-constrained rollouts (selfrl.chat.constrain)
SignalCheck = Literal["warn", "stop", "off"]  # the pre-flight signal check before the first update
WarmStartReference = Literal["warm_start", "initial"]  # RL's KL reference after a promoted warm start


@dataclass
class ModelConfig:
    """Which policy to load."""

    name: str = DEFAULT_MODEL  # Hugging Face id, local path, or embedded:smollm2-135m-instruct
    device: str = "auto"  # auto | cpu | cuda: where the policy, learner and reference pass run (auto: cuda if present)
    dtype: str = "auto"  # auto | float32 | bfloat16: base weights' dtype (auto: bf16 on a GPU that has it, else fp32)
    cpu_matmul: str = "auto"  # auto | onednn | torch: frozen fp32 products on the CPU through oneDNN (selfrl.model.matmul)

    def check(self, where: str = "") -> None:
        from selfrl.model.device import CPU_MATMULS

        require([(bool(self.name), "name must not be empty"),
                 (self.cpu_matmul in CPU_MATMULS, f"cpu_matmul must be one of {', '.join(CPU_MATMULS)}")], where)


@dataclass
class LoraSettings:
    """LoRA adapter shape (passed to peft.LoraConfig)."""

    r: int = 16  # rank
    lora_alpha: int = 32  # scaling numerator (scale = alpha / r)
    lora_dropout: float = 0.0  # dropout on the LoRA input (0 keeps sampling and training identical)
    target_modules: list[str] | str = "all-linear"  # module names, or "all-linear"
    modules_to_save: list[str] | None = None  # rejected: hot-swap serves LoRA tensors only
    init_adapter: str | None = None  # start from this saved adapter folder (also the KL reference)

    def check(self, where: str = "") -> None:
        require([
            in_range(self.r, "r", 1, MAX_LORA_R),  # and at most the model's hidden size (selfrl.model.fit)
            in_range(self.lora_alpha, "lora_alpha", 0, 2**20, low_open=True),
            in_range(self.lora_dropout, "lora_dropout", 0, 1, high_open=True, interval=True),
            (not self.modules_to_save, "modules_to_save is not supported: hot-swap copies LoRA tensors only, "
             "so a saved embedding or head could not be served; leave it empty"),
            (self.init_adapter is None or Path(self.init_adapter).is_dir(),
             f"init_adapter {self.init_adapter!r} is not a folder"),
        ], where)


@dataclass
class TaskConfig:
    """Where tasks come from."""

    source: str = "chain_sum"  # the environment: a name (selfrl envs), rg:<dataset>, or package.module:Name
    options: dict[str, Any] = field(default_factory=dict)  # overrides of the source's generator config
    train_seed: int = 1000  # seed of training tasks
    val_seed: int = 2000  # seed of held-out tasks (disjointness is checked)
    num_train: int = 2000  # training tasks generated
    choice: TaskChoice = "cycle"  # task choice: cycle (a shuffled walk) | signal (skip tasks predicted to give constant groups)
    min_spread: float = 0.4  # choice = "signal": skip a seen task whose chance of a group with reward spread is below this
    retry_after: int = 4  # choice = "signal": iterations before a skipped task is tried again
    signal_check: SignalCheck = "warn"  # before the first update: warn | stop (end the run when no group has signal) | off

    def check(self, where: str = "") -> None:
        require([in_range(self.num_train, "num_train", 1, MAX_TASKS),
                 in_range(self.train_seed, "train_seed", 0, SEED_MAX),
                 in_range(self.val_seed, "val_seed", 0, SEED_MAX),
                 (isinstance(self.options, dict), "options must be a table"),
                 one_of(self.choice, TaskChoice, "choice"),
                 in_range(self.min_spread, "min_spread", 0, 1, high_open=True, interval=True),
                 in_range(self.retry_after, "retry_after", 1, 10**6),
                 one_of(self.signal_check, SignalCheck, "signal_check")], where)


@dataclass
class RolloutConfig:
    """How the agent samples (one line of help per field)."""

    max_turns: int = 3  # assistant turns per trajectory (tool round-trips + final answer)
    max_new_tokens: int = 64  # token limit of one assistant turn
    temperature: float = 1.0  # sampling temperature (the learner uses the same value)
    system_prompt: str = DEFAULT_SYSTEM_PROMPT  # instruction placed before the tool descriptions
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # registered tool names
    tools_prompt: ToolsPrompt = "compact"  # how tool schemas are shown when the template can't: compact | json
    demonstration: bool = True  # show DEMONSTRATION (one worked tool call) before the task
    stop_at_tool_call: bool = False  # end a turn right after "</tool_call>" (one call per turn; see rollout)
    constrain: Constrain = "none"  # none | tool_call (every turn is one call to an offered tool, by grammar; the learner replays the masks)

    @property
    def max_completion_length(self) -> int:
        """Completion tokens one trajectory may hold (``max_new_tokens`` per turn, ``max_turns`` turns)."""
        return self.max_new_tokens * self.max_turns

    def check(self, where: str = "") -> None:
        require([
            in_range(self.temperature, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
            in_range(self.max_turns, "max_turns", 1, 1000),
            # and at most the model's context length (selfrl.model.fit)
            in_range(self.max_new_tokens, "max_new_tokens", 1, MAX_CONTEXT),
            one_of(self.tools_prompt, ToolsPrompt, "tools_prompt"),
            one_of(self.constrain, Constrain, "constrain"),
            (isinstance(self.tools, list), "tools must be a list of tool names"),
        ], where)

    def with_overrides(self, overrides: dict[str, Any], where: str = "rollout.") -> "RolloutConfig":
        """This config with one agent's or family's own values (``rollout = {...}`` of an
        ``[[agents]]`` or ``[[families]]`` table) in place of these; keys it does not set keep
        these values. Only :data:`ROLLOUT_OVERRIDES` may differ per task: the others are one
        batch's (the token limit and temperature of each engine call).

        >>> RolloutConfig().with_overrides({"constrain": "tool_call", "max_turns": 1}).max_turns
        1

        Raises:
            ConfigError: a key that is no ``[rollout]`` setting (named with its table, ``where``
                without its dot, and the valid keys listed), a ``[rollout]`` setting not in
                :data:`ROLLOUT_OVERRIDES` (one per batch), a value of the wrong type, or one
                ``RolloutConfig.check`` refuses; ``where`` prefixes the other messages.
        """
        from dataclasses import replace

        require([(isinstance(overrides, dict), "must be a table of [rollout] settings")], where)
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - fields)
        table = where.rstrip(".")
        require([(not unknown, f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} in "
                  f"{table}; valid keys: {', '.join(ROLLOUT_OVERRIDES)}")])
        refused = sorted(set(overrides) - set(ROLLOUT_OVERRIDES))
        require([(not refused, f"{', '.join(refused)} cannot differ per agent or family (one value for every "
                  f"trajectory of a batch); the keys that can: {', '.join(ROLLOUT_OVERRIDES)}")], where)
        v = overrides
        require([
            (not isinstance(v.get("constrain", "none"), bool), "constrain must be a string"),
            (isinstance(v.get("stop_at_tool_call", False), bool), "stop_at_tool_call must be true or false"),
            (isinstance(v.get("demonstration", False), bool), "demonstration must be true or false"),
            (isinstance(v.get("system_prompt", ""), str), "system_prompt must be a string"),
            (isinstance(v.get("tools", []), list) and all(isinstance(t, str) for t in v.get("tools", [])),
             "tools must be a list of tool names"),
        ], where)
        out = replace(self, **overrides)
        out.check(where)
        return out


# The [rollout] settings an agent or family may set for its own tasks (rollout = {...} in
# [[agents]] / [[families]]); each trajectory's turns run under them (selfrl.rollout.agent).
ROLLOUT_OVERRIDES = ("constrain", "max_turns", "stop_at_tool_call", "system_prompt", "tools", "demonstration")


@dataclass
class TrainConfig:
    """GRPO update settings (names as in TRL's GRPOConfig)."""

    learning_rate: float = 1e-4  # AdamW learning rate for the LoRA parameters
    lr_scheduler_type: LrSchedule = "constant"  # the learning rate over selfrl run's updates (selfrl.rl.schedule): constant | linear | cosine (decay over the run's iterations, toward 0 after the last); selfrl serve takes only constant
    warmup_ratio: float = 0.0  # share of the run's updates that ramp the learning rate up, in [0, 1) (selfrl.rl.schedule); selfrl serve takes only 0
    beta: float = 0.02  # KL coefficient to the reference model (k3 estimator); 0 disables the reference pass
    epsilon: float = 0.2  # lower clip of the importance ratio
    epsilon_high: float | None = None  # upper clip (None = epsilon; DAPO uses 0.28)
    loss_type: str = "dapo"  # token aggregation: dapo | grpo | dr_grpo (selfrl.rl.losses registry)
    max_grad_norm: float = 1.0  # gradient clipping (L2 norm)
    num_iterations: int = 1  # optimisation passes over each batch (PPO epochs)
    micro_batch_size: int = 8  # sequences per forward/backward (memory bound)
    micro_batch_tokens: int = 0  # most padded tokens (rows x longest row) per forward/backward: long turns go in smaller micro-batches (same gradient, bounded memory); 0: micro_batch_size alone
    weight_decay: float = 0.0  # AdamW weight decay
    scale_rewards: ScaleRewards = "group"  # advantage scaling: group (GRPO) | none (Dr. GRPO)
    skip_max_reward_spread: float = 10.0  # skip when the batch's max - min reward exceeds this (a broken reward)
    skip_max_kl: float = 1.0  # skip when the mean per-token KL to the reference (forward pass) exceeds this; beta > 0 only
    skip_max_grad_norm: float = 100.0  # skip when the gradient L2 norm before clipping exceeds this
    tis_cap: float = 2.0  # cap of the per-token weight exp(learner - sampler logprob) (TIS, Yao et al. 2025); 0: off
    gradient_checkpointing: bool = False  # recompute decoder activations in the backward pass (less memory, ~1 more forward)

    def check(self, where: str = "") -> None:
        require([
            in_range(self.learning_rate, "learning_rate", 0, 1, low_open=True),
            one_of(self.lr_scheduler_type, LrSchedule, "lr_scheduler_type"),
            in_range(self.warmup_ratio, "warmup_ratio", 0, 1, high_open=True),
            in_range(self.beta, "beta", 0, MAX_BETA),
            in_range(self.epsilon, "epsilon", 0, 1, low_open=True, high_open=True, interval=True),
            in_range(self.epsilon_high, "epsilon_high", 0, 10, low_open=True) if self.epsilon_high is not None
            else (True, ""),
            in_range(self.num_iterations, "num_iterations", 1, 100),
            in_range(self.micro_batch_size, "micro_batch_size", 1, MAX_BATCH),
            in_range(self.micro_batch_tokens, "micro_batch_tokens", 0, 10**9),
            in_range(self.max_grad_norm, "max_grad_norm", 0, low_open=True),  # huge: no clipping
            in_range(self.weight_decay, "weight_decay", 0, 1),
            one_of(self.scale_rewards, ScaleRewards, "scale_rewards"),
            # thresholds: any finite value (a huge one never skips)
            in_range(self.skip_max_reward_spread, "skip_max_reward_spread", 0, low_open=True),
            in_range(self.skip_max_kl, "skip_max_kl", 0, low_open=True),
            in_range(self.skip_max_grad_norm, "skip_max_grad_norm", 0, low_open=True),
            (self.tis_cap >= 0, f"tis_cap must be >= 0 (0 turns the off-policy correction off), got {self.tis_cap!r}"),
        ], where)


@dataclass
class GateConfig:
    """Validation settings."""

    val_size: int = 128  # held-out tasks (pass@1, greedy)
    eval_every: int = 4  # updates between validations (run's default; serve's is 1: every candidate validated)
    tolerance: float = 0.02  # a candidate may trail the best by at most this (absolute)
    batch_size: int = 64  # trajectories per generation batch during validation
    rule: str = "newest"  # served at the end of selfrl run: newest (promoted) | best (highest held-out success)

    def check(self, where: str = "") -> None:
        rules = [r.value for r in ServeRule]
        require([
            in_range(self.val_size, "val_size", 1, MAX_VAL),  # and at most the source's tasks (its split)
            in_range(self.eval_every, "eval_every", 1, 10**6),
            in_range(self.tolerance, "tolerance", 0, 1),  # success rates are in [0, 1]; 1 never rejects
            in_range(self.batch_size, "batch_size", 1, MAX_BATCH),
            (self.rule in rules, f"rule must be one of {', '.join(map(repr, rules))}, got {self.rule!r}"),
        ], where)


@dataclass
class CollapseConfig:
    """Collapse rules, thresholds and what a rollback changes (see docs/concepts/versions-gate-rollback.md)."""

    enabled: bool = True  # run the rules; False leaves only the gate and the anomaly skip
    kl_probe_size: int = 4  # sequences on which a new candidate's KL is measured right after its update (0: off)
    baseline_window: int = 2  # the first N updates of the run are the baseline for entropy and degenerate share (in serve, of each family)
    family_min_turns: int = 4  # serve: an update judges a family, or counts toward its baseline, only with this many of its turns
    max_kl: float = 0.5  # kl: mean per-token KL to the reference (sampling version or new candidate) above this
    entropy_min_ratio: float = 0.25  # entropy_collapse: entropy below this times the baseline entropy ...
    entropy_reward_gain: float = 0.1  # ... unless the training reward rose at least this much over its baseline
    entropy_min_drop: float = 0.25  # entropy_collapse also needs the entropy this many nats/token below the baseline (grammar-constrained turns: a near-0 baseline, noisy from update to update)
    entropy_max_ratio: float = 3.0  # entropy_blowup: entropy above this times the baseline (weights turned to noise) and above baseline + entropy_max_rise
    entropy_max_rise: float = 0.5  # entropy_blowup also needs the entropy this many nats/token above the baseline (grammar-constrained turns: a near-0 baseline)
    degenerate_rise: float = 0.35  # degenerate: share of degenerate rollouts above the baseline share plus this
    heldout_drop: float = 0.10  # heldout_drop: held-out success below best minus this (a fall well beyond gate.tolerance)
    reward_rise: float = 0.10  # reward_vs_heldout: training reward up by this since the best version while held-out fell
    repeat_ngram: int = 4  # a rollout loops when the share of repeated n-grams of its completion exceeds repeat_share
    repeat_share: float = 0.5  # see repeat_ngram
    max_rollbacks: int | None = None  # unset: never stop (back off, pause); N: stop for good once collapses exceed N (the old per-run rule)
    lr_factor: float = 0.5  # after a rollback: learning rate times this (one backoff level)
    beta_factor: float = 2.0  # after a rollback: beta times this ...
    beta_min: float = 0.01  # ... and at least this (so beta = 0 becomes beta_min)
    lr_floor: float = 0.0  # backing off never lowers the learning rate below this (at most train.learning_rate; a schedule's factor applies on top)
    beta_max: float = 1.0  # backing off never raises beta above this (or above train.beta when larger); at least beta_min
    stable_updates: int = 20  # updates without a collapse that earn one step back toward the configured setting ...
    stable_s: float = 3600.0  # ... or seconds without a collapse or step back, whichever comes first
    window_s: float = 3600.0  # collapses are counted over a sliding window of this many seconds ...
    max_per_window: int = 3  # ... and one more than this many pauses updates for cooldown_s (serving goes on)
    cooldown_s: float = 1800.0  # the pause after the window budget is exceeded, seconds (then learning resumes)

    def check(self, where: str = "") -> None:
        require([
            in_range(self.kl_probe_size, "kl_probe_size", 0, 4096),
            in_range(self.baseline_window, "baseline_window", 1, 10**6),
            in_range(self.family_min_turns, "family_min_turns", 1, 10**6),
            in_range(self.entropy_min_ratio, "entropy_min_ratio", 0, 1, high_open=True, interval=True),
            in_range(self.entropy_reward_gain, "entropy_reward_gain", 0),
            in_range(self.entropy_min_drop, "entropy_min_drop", 0, 10**6),
            in_range(self.entropy_max_ratio, "entropy_max_ratio", 1, 10**6, low_open=True),
            in_range(self.entropy_max_rise, "entropy_max_rise", 0, 10**6),
            in_range(self.max_kl, "max_kl", 0, low_open=True),
            in_range(self.degenerate_rise, "degenerate_rise", 0, 1, low_open=True),  # a share rises by 1 at most
            in_range(self.heldout_drop, "heldout_drop", 0, 1, low_open=True),
            in_range(self.reward_rise, "reward_rise", 0),
            in_range(self.max_rollbacks, "max_rollbacks", 0, 1000) if self.max_rollbacks is not None else (True, ""),
            in_range(self.lr_floor, "lr_floor", 0, 1),
            in_range(self.beta_max, "beta_max", 0, MAX_BETA),
            in_range(self.stable_updates, "stable_updates", 1, 10**9),
            in_range(self.stable_s, "stable_s", 0, DAY_S * 3650, low_open=True),
            in_range(self.window_s, "window_s", 0, DAY_S * 3650, low_open=True),
            in_range(self.max_per_window, "max_per_window", 1, 10**6),
            in_range(self.cooldown_s, "cooldown_s", 0, DAY_S * 365),
            in_range(self.lr_factor, "lr_factor", 0, 1, low_open=True, interval=True),
            in_range(self.beta_factor, "beta_factor", 1, 1000),
            in_range(self.beta_min, "beta_min", 0, MAX_BETA),
            in_range(self.repeat_ngram, "repeat_ngram", 1, 1000),
            in_range(self.repeat_share, "repeat_share", 0, 1, low_open=True, interval=True),
        ], where)
        require([at_most(self.beta_min, f"{where}beta_min", self.beta_max, f"{where}beta_max")])


@dataclass
class DetectorConfig:
    """Which detectors run and their thresholds (one line of help per field)."""

    names: list[str] = field(default_factory=list)  # detectors to apply (see available_detectors()); empty: none
    max_identical_calls: int = 2  # repeated_action: times one identical successful call (name + arguments) may occur
    once_only_tools: list[str] = field(default_factory=lambda: ["confirm"])  # repeated_action: may succeed once
    single_tags: list[str] = field(default_factory=lambda: ["answer"])  # format_gaming: once at most in final answer
    nest_tags: list[str] = field(default_factory=lambda: ["answer", "tool_call"])  # format_gaming: never nested
    length_ratio: float = 3.0  # length_exploitation: flag above this times the group's median completion tokens ...
    length_min_tokens: int = 32  # ... and above this many tokens, when also paid more than the group's median
    paid_reward: float = 0.5  # verifier_disagreement: a reward at or above this is "paid as a success"
    dominance_window: int = 4  # component_dominance: iterations compared (first against last)
    dominance_share: float = 0.8  # component_dominance: one component's rise is at least this share of the total's ...
    dominance_min_fall: float = 0.05  # ... while another weighted component falls by at least this much
    probe_tolerance: float = 0.1  # probe_regression: flag a version this far below the best earlier probe score
    length_bias_corr: float = 0.8  # judge_length_bias: flag a group whose judge score rises with length (Spearman >= this) ...
    length_bias_ratio: float = 2.0  # ... when its longest completion is at least this times its shortest
    vacuous_stock_phrases: int = 2  # judge_vacuous: a paid answer with this many stock phrases and fewer task terms

    def check(self, where: str = "") -> None:
        require([(isinstance(self.names, list), "names must be a list of detector names"),
                 in_range(self.max_identical_calls, "max_identical_calls", 1, 10**6),
                 in_range(self.length_ratio, "length_ratio", 0, 1000, low_open=True),
                 in_range(self.length_min_tokens, "length_min_tokens", 0, MAX_CONTEXT),
                 in_range(self.dominance_window, "dominance_window", 2, 10**6),
                 in_range(self.dominance_share, "dominance_share", 0, 1, low_open=True, interval=True),
                 in_range(self.dominance_min_fall, "dominance_min_fall", 0),
                 in_range(self.probe_tolerance, "probe_tolerance", 0, 1),
                 in_range(self.length_bias_corr, "length_bias_corr", -1, 1),
                 in_range(self.length_bias_ratio, "length_bias_ratio", 1, 1000),
                 in_range(self.vacuous_stock_phrases, "vacuous_stock_phrases", 1, 10**6)], where)


@dataclass
class WarmStartConfig:
    """A warm start before the first RL update: rejection-sampled own successes on training tasks,
    fine-tuned by NLL, gated like any update (``selfrl.run.warm_start``, docs/guides/warm-start.md); off by default."""

    enabled: bool = False  # run the warm start before RL iteration 0 (once per run; a resume never repeats it)
    required: bool = False  # stop the run with an error when no success is found (False: say so, go on with plain RL)
    num_tasks: int = 64  # training tasks sampled (at most the run's training set; never a held-out task)
    samples_per_task: int = 8  # rollouts per task
    temperature: float = 1.0  # sampling temperature of the warm start's rollouts (the SFT log-probs use rollout.temperature)
    min_reward: float = 0.0  # a kept trajectory is verified correct, unflagged, and has at least this reward
    max_per_task: int = 4  # successes kept per task after dropping identical completions (0: all)
    epochs: int = 2  # passes over the kept trajectories
    learning_rate: float = 1e-4  # AdamW learning rate of the fine-tune (its own optimizer; RL's is untouched)
    batch_size: int = 8  # trajectories per optimizer step (micro-batched by train.micro_batch_size)
    kl_reference: WarmStartReference = "warm_start"  # RL's KL reference once it is promoted: warm_start | initial (the base or lora.init_adapter)

    def check(self, where: str = "") -> None:
        require([
            in_range(self.num_tasks, "num_tasks", 1, MAX_TASKS),
            in_range(self.samples_per_task, "samples_per_task", 1, 1024),
            in_range(self.temperature, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
            in_range(self.max_per_task, "max_per_task", 0, MAX_TASKS),  # 0: keep every distinct success
            in_range(self.epochs, "epochs", 1, 1000),
            in_range(self.learning_rate, "learning_rate", 0, 1, low_open=True),
            in_range(self.batch_size, "batch_size", 1, MAX_BATCH),
            one_of(self.kl_reference, WarmStartReference, "kl_reference"),
        ], where)


# The sections both `selfrl run` and `selfrl serve` hold, checked the same way in both.
SHARED_SECTIONS = ("model", "lora", "task", "rollout", "train", "gate", "collapse", "detectors")


def check_sections(cfg: Any, names: tuple[str, ...] = SHARED_SECTIONS) -> None:
    """Run ``check`` of every section ``names`` of ``cfg``, each message prefixed with its section.

    Raises:
        ConfigError: the first rule that does not hold.
    """
    check_finite(cfg)
    for name in names:
        getattr(cfg, name).check(f"{name}.")
    if "collapse" in names and "train" in names:
        require([at_most(cfg.collapse.lr_floor, "collapse.lr_floor", cfg.train.learning_rate, "train.learning_rate")])


def check_engine(cfg: Any) -> None:
    """``cfg.engine`` is a registered sampling backend and fits ``cfg.model``'s placement.

    Raises:
        ConfigError: an unknown engine, device or dtype, or a CPU-only engine on a GPU.
    """
    require([(cfg.engine in ENGINES, f"engine must be one of {sorted(ENGINES)}, got {cfg.engine!r}")])
    check_placement(cfg.model, cfg.engine)



# Sampling backends that keep their tensors on the CPU (the slot engine's cache and batches).
CPU_ONLY_ENGINES = ("slots",)


def check_placement(model: ModelConfig, engine: str | None = None) -> None:
    """Raise ConfigError for an unknown ``model.device``/``model.dtype``, a device this
    machine does not have (``cuda`` with no GPU), or a CPU-only engine on a GPU: refused
    before the model loads."""
    from selfrl.model.device import DeviceError, check_cpu_matmul, check_names, resolve

    try:
        check_names(model.device, model.dtype)
        if model.device != "auto" or model.dtype != "auto" or engine in CPU_ONLY_ENGINES:
            placement = resolve(model.device, model.dtype)
            if engine in CPU_ONLY_ENGINES and placement.device != "cpu":
                raise DeviceError(f"engine {engine!r} runs on the CPU only, and model.device resolves to "
                                  f"{placement.device!r}; use --engine reference, or --device cpu")
        if model.cpu_matmul == "onednn":  # it applies to fp32 on the CPU only: refused where nothing would take it
            check_cpu_matmul(model.cpu_matmul, resolve(model.device, model.dtype))
    except DeviceError as e:
        raise ConfigError(str(e)) from e
