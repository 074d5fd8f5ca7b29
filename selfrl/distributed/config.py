"""Settings of a distributed run (``selfrl run --ray ...``); importing this imports no Ray or torch."""

from __future__ import annotations

from dataclasses import dataclass

from selfrl.config import ConfigError


@dataclass
class DistributedConfig:
    """How rollouts are spread over Ray workers.

    Attributes:
        address: Ray cluster to join: ``"auto"`` (a cluster started by ``ray start``),
            ``"ray://host:port"`` / ``"host:port"``, or ``"local"`` (start a private one here).
        num_workers: rollout worker actors, each with its own engine.
        max_staleness: versions a sample may lag the learner and still be trained; older
            groups are dropped (counted in ``async/dropped_stale``), 0 = on-policy only.
        in_flight: rollout jobs queued per worker (1 keeps each worker busy while the
            learner trains; more hides the driver's latency but makes samples staler).
        engine: registered sampling backend of each worker (``selfrl.engines.ENGINES``).
        worker_threads: torch threads per worker.
        job_timeout_s: a job not back after this long is taken as lost (a partitioned or
            hung worker): that worker is killed and replaced, and its job redone.
        worker_cpus: CPUs Ray reserves per worker actor (fractions let several share a core).
    """

    address: str = "local"
    num_workers: int = 2
    max_staleness: int = 1
    in_flight: int = 1
    engine: str = "reference"
    worker_threads: int = 1
    job_timeout_s: float = 600.0
    worker_cpus: float = 0.5

    def validate(self) -> "DistributedConfig":
        """Check values; returns self.

        Raises:
            ConfigError: a value out of range, with the field named.
        """
        checks = [
            (bool(self.address), "distributed.address must not be empty (auto, local or host:port)"),
            (self.num_workers >= 1, "distributed.num_workers must be >= 1"),
            (self.max_staleness >= 0, "distributed.max_staleness must be >= 0"),
            (self.in_flight >= 1, "distributed.in_flight must be >= 1"),
            (self.worker_threads >= 1, "distributed.worker_threads must be >= 1"),
            (self.job_timeout_s > 0, "distributed.job_timeout_s must be > 0"),
            (self.worker_cpus > 0, "distributed.worker_cpus must be > 0"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        return self
