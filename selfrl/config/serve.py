"""Settings of ``selfrl serve``: the same sections as ``selfrl run`` (``selfrl.config.sections``),
checked by the same validators, plus the server's own and its learner's."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from difflib import get_close_matches
from dataclasses import dataclass, field
from typing import Any, Literal

from selfrl.config.base import (
    NAME_MAX, SECONDS_MAX, SEED_MAX, ConfigError, at_most, in_range, name_length, one_of, require,
    negative_weights_problem, weights_problem,
)
from selfrl.config.judge import JUDGE_REWARD
from selfrl.config.sections import (
    MAX_VAL,
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
from selfrl.config.remote import SamplerConfig, SwapCheckConfig
from selfrl.engines import DEFAULT_SERVE_ENGINE
from selfrl.engines.base import MAX_TEMPERATURE, MIN_TEMPERATURE

KV_MB_MAX = 1 << 20  # 1 TiB: the largest key/value bound in MB a setting takes
FEEDBACK_REWARD = "user_feedback"  # the users' verdict on a served turn (selfrl.serve.feedback)
# the rewards a served turn carries: its users' verdict and what the turn itself shows (its tool calls, its
# answer tag, its length). The learner scores served turns against no task (selfrl.serve.feedback.SERVED),
# so a reward that reads a task's answer or environment would score every turn alike.
SERVE_REWARDS = (FEEDBACK_REWARD, "tool_success", "format", "length_penalty")
_NO_ANSWER = ("it checks a task's reference answer, which a served turn lacks, so every turn would score 0 "
              "(a [[families]] environment's verifier validates candidates on its held-out tasks, never served turns)")
_NO_TASK = ("it compares the samples of one task, and a served group holds different users' turns (of different "
            "prompts under a task_key)")
SERVE_REFUSED_REWARDS = {  # why serve cannot use each built-in reward outside SERVE_REWARDS
    "verifier": _NO_ANSWER,
    "partial_credit": _NO_ANSWER,
    "self_consistency": _NO_TASK,
    "agreement": _NO_TASK,
    "user_correction": ("it reads the user messages after the first answer of the turn's own messages, which in a "
                        "served turn correct an earlier answer of its conversation; serve already counts a "
                        "correcting next message as user_feedback"),
}
LearnerOrder = Literal["newest", "oldest"]  # which ready turns an update takes first (selfrl.serve.late_feedback)
CorrectionUse = Literal["off", "calls", "all"]  # which corrections train as demonstrations (selfrl.serve.corrections)


@dataclass
class LearnerSettings:
    """When and how the background learner trains on served traffic."""

    enabled: bool = True  # run the background learner (off: serve and record only)
    min_batch: int = 32  # served turns with a complete reward that trigger an update
    max_batch: int = 64  # most turns used by one update
    order: LearnerOrder = "newest"  # which ready turns an update takes first: newest (fresh data; a backlog's older turns wait, and once past the age rule are only recorded) | oldest (arrival order)
    feedback_wait_s: float = 120.0  # seconds a turn waits for feedback before it may be trained without it
    poll_s: float = 1.0  # seconds between checks for enough ready turns
    retry_s: float = 1.0  # seconds a learner paused by a storage fault (disk full, ...) waits before a retry
    retry_max_s: float = 60.0  # the wait doubles after each failed retry, up to this many seconds
    temperature: float = 1.0  # temperature of the learner's logprobs (old ones are recomputed at it)
    max_feedback_age_versions: int = 4  # a turn trains only while the learner's weights changed at most this many times since its version
    max_feedback_age_s: float = 604800.0  # ... and only while it is at most this many seconds old; older feedback is only recorded
    idle_kv_cache_mb: int = 0  # the learner's own slot engine (it samples the held-out gate once an update) keeps at most this many MB of key/value cache between updates (0: freed after each; the next gate allocates its own)
    learn_from_corrections: CorrectionUse = "off"  # which corrections that say what the answer should have been also train as a demonstration in their turn's group (selfrl.serve.corrections): off | calls (only those with correction_tool_calls: the call is the whole answer) | all (text too: a final answer alone can teach skipping the tools that reach it); only for users you trust: a correction is trained on as written
    feedback_tis_cap: float = 2.0  # cap C of a late turn's weight min(exp(sum of log-ratios since its version), C) (truncated, as TIS)
    reward_weights: dict[str, float] = field(
        default_factory=lambda: {"user_feedback": 1.0, "tool_success": 0.2})  # rewards a served turn carries (SERVE_REWARDS): user_feedback (weight > 0), tool_success, format, length_penalty; weights >= 0

    def check(self, where: str = "") -> None:
        weights_bad = weights_problem(self.reward_weights)
        require([
            in_range(self.min_batch, "min_batch", 2, 65536),
            in_range(self.max_batch, "max_batch", 2, 65536),
            one_of(self.order, LearnerOrder, "order"),
            one_of(self.learn_from_corrections, CorrectionUse, "learn_from_corrections"),
            in_range(self.feedback_wait_s, "feedback_wait_s", 0, SECONDS_MAX),
            in_range(self.poll_s, "poll_s", 0, 3600, low_open=True),
            in_range(self.retry_s, "retry_s", 0, SECONDS_MAX, low_open=True),
            in_range(self.retry_max_s, "retry_max_s", 0, SECONDS_MAX, low_open=True),
            in_range(self.temperature, "temperature", MIN_TEMPERATURE, MAX_TEMPERATURE),
            in_range(self.max_feedback_age_versions, "max_feedback_age_versions", 0, 10**6),
            in_range(self.max_feedback_age_s, "max_feedback_age_s", 0, SECONDS_MAX * 10, low_open=True),
            in_range(self.feedback_tis_cap, "feedback_tis_cap", 0, 1000, low_open=True),
            in_range(self.idle_kv_cache_mb, "idle_kv_cache_mb", 0, KV_MB_MAX),
            (isinstance(self.reward_weights, dict), "reward_weights must be a table of name = weight"),
            (not weights_bad, weights_bad or ""),
            (not isinstance(self.reward_weights, dict) or JUDGE_REWARD not in self.reward_weights,
             f"reward_weights: selfrl serve does not offer the {JUDGE_REWARD!r} reward (it has no [judge] "
             "endpoints to call); train with a judge through selfrl run (docs/guides/judge.md), or weight "
             "user_feedback here"),
        ], where)
        if isinstance(self.reward_weights, dict):
            require(serve_reward_problems(self.reward_weights), where)
        require([at_most(self.min_batch, f"{where}min_batch", self.max_batch, f"{where}max_batch"),
                 at_most(self.retry_s, f"{where}retry_s", self.retry_max_s, f"{where}retry_max_s")])


def serve_reward_problems(weights: dict[str, Any]) -> list[tuple[bool, str]]:
    """The rules ``learner.reward_weights`` of ``selfrl serve`` meets (:func:`selfrl.config.base.require`'s
    ``(ok, message)`` pairs): only rewards a served turn carries (:data:`SERVE_REWARDS`), a positive
    ``user_feedback`` weight, and no negative weight (``selfrl run`` keeps its own rules). A name
    that differs from a known reward's only in case, or by a letter or two, is called unknown, with
    the name it is likely to mean."""
    usable = ", ".join(SERVE_REWARDS)
    known = sorted({*SERVE_REWARDS, *SERVE_REFUSED_REWARDS, JUDGE_REWARD})
    rules = []
    for name in weights:
        if name in SERVE_REWARDS or name == JUDGE_REWARD:  # the judge has its own message
            continue
        like = [] if name in known else ([k for k in known if k.lower() == str(name).lower()]
                                         or get_close_matches(str(name), known, 1, cutoff=0.8))
        if like:  # a misspelt name, not a reward of its own (format_strict is no typo of format)
            rules.append((False, f"reward_weights: unknown reward {name!r} (did you mean {like[0]}?); "
                                 f"selfrl serve uses only {usable}"))
            continue
        if name not in known:  # an environment's own reward (web_naive, ...), or a name nothing registers
            rules.append((False, f"reward_weights: selfrl serve cannot use {name!r} on served turns: it is no "
                                 "built-in reward, and an environment's own reward needs its task, which a served "
                                 f"turn does not run; use only {usable} (docs/concepts/serving.md), or train with "
                                 f"{name!r} through selfrl run where an environment registers it"))
            continue
        why = SERVE_REFUSED_REWARDS[name]
        rules.append((False, f"reward_weights: selfrl serve cannot use the {name!r} reward on served turns: {why}; "
                             f"use only {usable} (docs/concepts/serving.md), or train with {name!r} through "
                             "selfrl run"))
    negative = negative_weights_problem(weights, "selfrl serve")
    rules.append((negative is None, negative or ""))
    feedback = weights.get(FEEDBACK_REWARD, 0)
    rules.append((feedback > 0, f"reward_weights: {dict(weights)} has no positive {FEEDBACK_REWARD!r} weight, and "
                  f"selfrl serve learns from its users' feedback: add {FEEDBACK_REWARD} = 1.0 (the default table "
                  f"is {{ {FEEDBACK_REWARD} = 1.0, tool_success = 0.2 }})"))
    return rules


@dataclass
class FamilyConfig:
    """One family of ``selfrl serve``'s traffic (``[[families]]``; :mod:`selfrl.safety.families`): requests
    whose ``metadata.family`` names it, a held-out set of its environment's tasks and a tolerance.
    Once the learner has trained on one of its turns, no candidate that drops it beyond its
    tolerance is promoted. Unset fields take ``[gate]``'s and ``[task]``'s values."""

    name: str = ""  # the family's name, as clients send it in metadata.family: unique, no "/", at most 64 characters
    source: str = "chain_sum"  # its environment: a name (selfrl envs), rg:<dataset>, or package.module:Name
    options: dict[str, Any] = field(default_factory=dict)  # the environment's options (as [task] options)
    tolerance: float | None = None  # largest held-out drop this family accepts (None: gate.tolerance)
    val_size: int | None = None  # its held-out tasks (None: gate.val_size)
    val_seed: int | None = None  # seed of its held-out tasks (None: task.val_seed); training traffic must come from other tasks
    # its own [rollout] settings for validating it (constrain, max_turns, stop_at_tool_call, system_prompt,
    # tools, demonstration); a key not set takes [rollout]'s value
    rollout: dict[str, Any] = field(default_factory=dict)

    def check(self, where: str = "") -> None:
        require([
            (isinstance(self.name, str) and bool(self.name) and "/" not in self.name,
             "name must be a non-empty name without '/'"),
            name_length(self.name, "it names the metrics family/<name>/... and val/<name>"),
            (isinstance(self.source, str) and bool(self.source), "source must not be empty"),
            (isinstance(self.options, dict), "options must be a table"),
            *[in_range(value, key, low, high) for key, value, low, high in (
                ("tolerance", self.tolerance, 0, 1), ("val_size", self.val_size, 1, MAX_VAL),
                ("val_seed", self.val_seed, 0, SEED_MAX)) if value is not None],
        ], where)


# [task] keys of selfrl run that selfrl serve has no use for: it draws no training tasks (its
# traffic is what it trains on), so it has no task choice and no pre-flight signal check.
RUN_ONLY_TASK_KEYS = ("num_train", "choice", "min_spread", "retry_after", "signal_check")
FAMILY_TASK_KEYS = ("source", "options")  # replaced by each family's own with [[families]]


def check_families(cfg: "ServeConfig", given: Collection[str] = ()) -> None:
    """``[[families]]``: each family's fields, unique names, and no ``[task]`` source or options
    beside them (the held-out sets are the families'), whether they hold a value of their own
    or were set (``given``, the keys the file and flags set: :func:`selfrl.config.fill`) to the default.

    Raises:
        selfrl.config.ConfigError: a bad field (named; ``rollout``'s keys with ``[rollout]``'s values:
            :meth:`selfrl.config.RolloutConfig.with_overrides`), a repeated name, ``task.source`` /
            ``task.options`` set beside families, or ``gate.val_size`` / ``task.val_seed`` set when
            every family sets its own (they would have no effect).
    """
    names = [f.name for f in cfg.families]
    for i, fam in enumerate(cfg.families):
        fam.check(f"families[{i}] ({fam.name or 'unnamed'}).")
        cfg.rollout.with_overrides(fam.rollout, f"families[{i}] ({fam.name or 'unnamed'}).rollout.")
    set_here = [f"task.{k}" for k in FAMILY_TASK_KEYS if f"task.{k}" in given
                or getattr(cfg.task, k) != getattr(TaskConfig(), k)]
    # a default the families take only where they set none: with every family setting its own, it does nothing
    shadowed = [(key + flag, field_) for key, flag, field_ in (("gate.val_size", " (--val-size)", "val_size"),
                                                              ("task.val_seed", "", "val_seed"))
                if key in given and cfg.families and all(getattr(f, field_) is not None for f in cfg.families)]
    require([
        *[(False, f"{key} has no effect: every [[families]] sets {field_}; set it there (or leave {field_} out of "
           "a family to have it take this value)") for key, field_ in shadowed],
        (len(set(names)) == len(names), f"family names must be unique, got {names}"),
        (not cfg.families or not set_here,
         f"{' and '.join(set_here)} cannot be set with [[families]] (nor --task): each family's held-out set "
         "comes from its own source and options; remove [task]'s and list that environment as a [[families]] "
         "table instead"),
    ])


@dataclass
class RetentionSettings:
    """What a server that runs for weeks keeps (``selfrl.record.retention``), applied by the learner
    after every update: adapter version folders, and served turns (exported, then pruned:
    :mod:`selfrl.serve.retention` says which turns may go)."""

    keep_newest: int = 0  # keep the newest N versions' folders, every base, promoted, pinned and served one, and those whose turns may still train (learner.max_feedback_age_versions); 0: keep all
    keep_promoted: int = 0  # with keep_newest: keep only the newest M promoted versions (and the champion); 0: every promoted one
    delete: bool = False  # delete the pruned folders (False: move them to adapters/.pruned, to delete by hand)
    trajectories_max_age_s: float = 0.0  # export, then prune, served turns older than this (>= learner.max_feedback_age_s); 0: keep all
    trajectories_export_dir: str = ""  # where the exports go (JSONL + .sha256); "": <run_dir>/exports; a relative path is under run_dir
    trajectories_per_pass: int = 256  # most turns one pass exports and prunes (>= learner.max_batch, so that pruning keeps up)

    def check(self, where: str = "") -> None:
        require([in_range(self.keep_newest, "keep_newest", 0, 10**6),
                 in_range(self.keep_promoted, "keep_promoted", 0, 10**6),
                 (not self.keep_promoted or self.keep_newest,
                  "keep_promoted applies only with keep_newest >= 1 (0 keeps every version): set keep_newest too"),
                 in_range(self.trajectories_max_age_s, "trajectories_max_age_s", 0, SECONDS_MAX * 10),
                 in_range(self.trajectories_per_pass, "trajectories_per_pass", 1, 10**6),
                 (isinstance(self.trajectories_export_dir, str), "trajectories_export_dir must be a path")], where)


def check_retention(cfg: "ServeConfig") -> None:
    """``[retention]``'s turn pruning against the settings it depends on: a turn is pruned only
    once no feedback can make it trainable, by the learner, between its updates (a replica
    prunes nothing: its owner prunes the store they share).

    Raises:
        selfrl.config.ConfigError: a combination that cannot be honoured (the message says what to change).
    """
    rc, lc = cfg.retention, cfg.learner
    if not rc.trajectories_max_age_s:
        return
    require([
        (rc.trajectories_max_age_s >= lc.max_feedback_age_s,
         f"retention.trajectories_max_age_s = {rc.trajectories_max_age_s:g} s is below learner.max_feedback_age_s = "
         f"{lc.max_feedback_age_s:g} s: a younger turn may still get feedback and be trained on; raise it, or lower "
         "learner.max_feedback_age_s"),
        (rc.trajectories_per_pass >= lc.max_batch,
         f"retention.trajectories_per_pass = {rc.trajectories_per_pass} is below learner.max_batch = {lc.max_batch}: "
         "one pass after each update would prune fewer turns than an update can take, and old turns would pile up; "
         "raise it"),
        (lc.enabled or cfg.replica, "retention.trajectories_max_age_s needs the background learner (it prunes "
         "after each update), but learner.enabled = false: enable the learner, or set "
         "retention.trajectories_max_age_s = 0"),
    ])  # a replica prunes nothing: the owner of the run directory prunes the store they share


def check_chain(cfg: "ServeConfig") -> None:
    """``gate.eval_every`` against the age rule: the k-th update of a chain (``selfrl.serve.chain``)
    trains on turns sampled by the champion, k - 1 weight changes of the learner behind.

    Raises:
        selfrl.config.ConfigError: ``learner.max_feedback_age_versions`` below ``gate.eval_every - 1``:
            every turn would be too old for the chain's later updates, and no chain would reach the gate.
    """
    every, ages = cfg.gate.eval_every, cfg.learner.max_feedback_age_versions
    require([(every - 1 <= ages, f"gate.eval_every = {every} trains {every - 1} unvalidated candidates before the "
              f"gate, but learner.max_feedback_age_versions = {ages}: the served turns (sampled by the champion, "
              f"up to {every - 1} weight changes behind by then) would be too old to train on and no candidate would "
              f"reach the gate; raise learner.max_feedback_age_versions to {every - 1} or more, or lower "
              f"gate.eval_every to {ages + 1} or less")])


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
    idle_kv_cache_mb: int = 2048  # the serving slot engine keeps its key/value cache up to this many MB while no request runs (a larger one is freed; 0: always freed)
    kv_continuation_mb: int = 1024  # key/value MB of finished turns a slot engine keeps so that a conversation's next turn prefills only what is new (0: none kept)
    replica: bool = False  # serve beside the run_dir's owner: record into its store, follow its versions (selfrl.serve.replica)
    follow_s: float = 1.0  # replica: seconds between two looks at the owner's version ledger
    log_max_bytes: int = 10_000_000  # run_dir/serve.log rotates at this size (serve.log.1, ...); 0: no log file
    log_backups: int = 5  # rotated log files kept beside serve.log (the oldest is deleted)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)
    train: TrainConfig = field(default_factory=TrainConfig)
    learner: LearnerSettings = field(default_factory=LearnerSettings)
    # eval_every 1: every candidate validated before it may be served (run's default is 4; selfrl.serve.chain)
    gate: GateConfig = field(default_factory=lambda: GateConfig(val_size=64, eval_every=1))
    task: TaskConfig = field(default_factory=TaskConfig)  # the validation tasks of the gate (with [[families]]: only val_seed, their default)
    # families of traffic, each with its own held-out set and tolerance ([[families]] tables; empty: [task]'s)
    families: list[FamilyConfig] = field(default_factory=list, metadata={"table_of": FamilyConfig})
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(temperature=1.0))  # how validation runs
    collapse: CollapseConfig = field(default_factory=CollapseConfig)  # collapse rules and rollback, as in run
    detectors: DetectorConfig = field(default_factory=DetectorConfig)  # reward-hacking detectors, as in run
    # sample through a vLLM server instead of in process (selfrl.serve.remote; docs/guides/vllm.md)
    sampler: SamplerConfig = field(default_factory=lambda: SamplerConfig(kind="vllm"))
    swap_check: SwapCheckConfig = field(default_factory=SwapCheckConfig)  # each version loaded into vLLM, proved
    retention: RetentionSettings = field(default_factory=RetentionSettings)  # which version folders and served turns are kept

    @property
    def max_completion_length(self) -> int:
        """Completion tokens one served turn may hold when the request sets no limit (the
        ``dr_grpo`` normaliser of the learner)."""
        return self.max_tokens_default

    def validate(self, given: Collection[str] = ()) -> "ServeConfig":
        """Check every section with ``selfrl run``'s validators, then the server's own fields; returns self.

        Args:
            given: the dotted keys the config file and flags set (:func:`selfrl.config.fill`): a
                setting that has no effect in ``selfrl serve`` is refused when it was set.

        Raises:
            selfrl.config.ConfigError: a value out of range, with the field named (names are checked
                at setup: :func:`selfrl.run.setup.check_names`), or a setting that would have no effect.
        """
        check_sections(self)
        self.learner.check("learner.")
        self.retention.check("retention.")
        check_retention(self)
        check_chain(self)
        check_families(self, given)
        unused = [f"task.{k}" for k in RUN_ONLY_TASK_KEYS if f"task.{k}" in given]
        require([(not unused, f"{', '.join(unused)}: selfrl run's task settings, which selfrl serve does not "
                  "use (it draws no training tasks: its traffic is what it trains on); remove "
                  f"{'it' if len(unused) == 1 else 'them'} from [task]")])
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
            in_range(self.idle_kv_cache_mb, "idle_kv_cache_mb", 0, KV_MB_MAX),
            in_range(self.kv_continuation_mb, "kv_continuation_mb", 0, KV_MB_MAX),
            in_range(self.log_max_bytes, "log_max_bytes", 0, 2**40),
            in_range(self.log_backups, "log_backups", 1, 1000),
            one_of(self.tools_prompt, ToolsPrompt, "tools_prompt"),
            (self.train.lr_scheduler_type == "constant" and self.train.warmup_ratio == 0,
             f"train.lr_scheduler_type = {self.train.lr_scheduler_type!r} with train.warmup_ratio = "
             f"{self.train.warmup_ratio:g} shapes the learning rate over selfrl run's iterations; selfrl serve "
             "learns with no last update to decay toward: drop both (the collapse budget lowers the rate "
             "after a collapse)"),
            (self.gate.rule == "newest", f"gate.rule = {self.gate.rule!r} chooses what selfrl run serves at its end; "
             "selfrl serve serves its newest promoted version (roll back to another through the admin API): "
             "drop gate.rule"),
        ])
        check_engine(self)
        check_serve_sampler(self, given)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_serve_sampler(cfg: ServeConfig, given: Collection[str] = ()) -> None:
    """``[sampler]`` and ``[swap_check]`` of ``selfrl serve``: a vLLM server (``kind = "vllm"``, the
    only kind serve takes) samples when ``sampler.url`` is set, and the server keeps no replica of
    another's run directory; without ``sampler.url``, no ``[sampler]`` or ``[swap_check]`` key may be
    set (``given``: the keys the file and flags set), as neither would have an effect.

    Raises:
        selfrl.config.ConfigError: a bad value, a combination serve cannot honour, or a setting that
            would have no effect (the message says which).
    """
    require([(cfg.sampler.kind == "vllm", f"sampler.kind must be 'vllm', got {cfg.sampler.kind!r}: selfrl serve "
              "samples remotely through a vLLM server only (--sampler-kind vllm, or leave it out); selfrl "
              "sampler serves selfrl run")])
    cfg.sampler.check("sampler.")
    try:
        cfg.swap_check.validate()
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if cfg.sampler.url is None:
        flags = {"sampler.kind": " (--sampler-kind)", "swap_check.deadline_s": " (--swap-check-deadline)"}
        unused = [k + flags.get(k, "") for k in sorted(given) if k.startswith(("sampler.", "swap_check."))]
        require([(not unused, f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect without "
                  "sampler.url: selfrl serve samples in process unless --sampler URL names a vLLM server; add "
                  f"--sampler URL, or leave {'it' if len(unused) == 1 else 'them'} out")])
        return
    require([
        (not cfg.replica, "replica = true and sampler.url (--sampler) cannot be combined: a replica samples in "
         "its own process; point one selfrl serve at the vLLM server"),
        ("idle_kv_cache_mb" not in given, f"idle_kv_cache_mb = {cfg.idle_kv_cache_mb} bounds the in-process "
         "serving engine, and with sampler.url (--sampler) vLLM samples and holds its own cache "
         "(VLLM_CPU_KVCACHE_SPACE, --gpu-memory-utilization): drop idle_kv_cache_mb"),
    ])
