"""The driver of a distributed run: a pool of Ray rollout workers feeding one learner.

What runs where:

- **driver** (the ``selfrl run --ray`` process): the store, the learner (the GRPO
  update on the one trained model), the validation gate and the version folders;
  everything of :class:`selfrl.run.loop.Runner` except where rollouts come from.
- **workers** (Ray actors, anywhere in the cluster): one :class:`RolloutWorker`
  each, with its own engine; they sample and send trajectories back.

The run is asynchronous: every worker always holds ``in_flight`` jobs, so workers
keep sampling while the driver scores and trains; each group records the version
that sampled it, and groups older than ``max_staleness`` are dropped
(:mod:`selfrl.rollout.staleness`). The rest go through the loop's usual update,
whose truncated importance correction takes the sampler's recorded log-probs as the
behaviour policy.

Faults: a job whose worker died (``ray.exceptions.RayActorError``: killed, its node
lost) or that is not back within ``job_timeout_s`` (a partitioned or hung worker,
which is then killed) is redone on a fresh worker that replaces the lost one; each
is a ``worker_lost`` event. Trajectories reach the store only through the driver,
after a job returned whole, so a lost worker loses no stored sample and leaves no
half-written one. The learner's crash safety (atomic versions, ``--resume``) is the
loop's, unchanged.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.exceptions import OutOfMemoryError, RayActorError, WorkerCrashedError

from selfrl.record import adapters
from selfrl.config import DistributedConfig, RunConfig
from selfrl.rollout.staleness import staleness
from selfrl.run.ray.worker import WORKER_FAULT_ENV, Job, JobResult, RolloutWorker, parse_worker_fault
from selfrl.run.loop import Runner
from selfrl.run.order import iteration_tasks
from selfrl.run.setup import build_run
from selfrl.run.progress import PlainProgress, Progress
from selfrl.core.trajectory import Trajectory
from selfrl.record.versions import EventKind


# Errors that mean "the worker (process) is gone", not "the job is wrong": the job is redone.
LOST = (RayActorError, OutOfMemoryError, WorkerCrashedError)
# A job lost this many times stops the run: something kills every worker that takes it.
MAX_LOSSES_PER_JOB = 3

# Extra seconds a worker may take to start (Ray worker process, imports, model load) before
# its first job's clock runs.
STARTUP_GRACE_S = 600.0


def connect(address: str, num_cpus: int | None = None) -> None:
    """Join (``"auto"``, ``host:port``, ``ray://...``) or start (``"local"``) a Ray cluster,
    unless this process is already connected. A local cluster listens on loopback only."""
    if ray.is_initialized():
        return
    if address == "local":
        ray.init(num_cpus=num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
                 log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)


@dataclass
class PoolStats:
    """What the pool counted (logged as ``async/*`` metrics and in the report)."""

    jobs_done: int = 0
    workers_lost: int = 0
    jobs_redone: int = 0
    dropped_stale: int = 0


class WorkerPool:
    """``num_workers`` rollout actors, each kept busy with ``in_flight`` jobs.

    Args:
        cfg: the run's config (sent to every worker).
        dist: the distributed settings.
        on_event: ``on_event(message)`` for each lost worker (the driver records a ``worker_lost`` event).
    """

    def __init__(self, cfg: RunConfig, dist: DistributedConfig, on_event: Callable[[str], None],
                 fault: str | None = None):
        self.cfg, self.dist, self.on_event = cfg, dist, on_event
        # the fault suite's injected worker fault (selfrl.run.ray.worker.WORKER_FAULT_ENV), checked here
        self.fault = os.environ.get(WORKER_FAULT_ENV) if fault is None else fault
        parse_worker_fault(self.fault)
        self.fault_mark = str(Path(cfg.run_dir) / ".worker_fault_fired")
        self.remote_cls = ray.remote(num_cpus=dist.worker_cpus, max_restarts=0)(RolloutWorker)
        self.spawned = 0
        self.workers: list = []
        self.starting: list = []  # per worker: ObjectRef that resolves once it is built, None after
        self.since: list[float] = []  # per worker: when it last became ready, got work while idle, or answered
        for i in range(dist.num_workers):
            self.workers.append(None), self.starting.append(None), self.since.append(0.0)
            self._spawn(i)
        self.pending: dict = {}  # ObjectRef -> (worker index, job, weights box)
        self.losses: dict[int, int] = {}  # job id -> times it was lost with its worker
        self.stats = PoolStats()

    def _spawn(self, i: int) -> None:
        self.spawned += 1
        self.workers[i] = self.remote_cls.remote(self.cfg, self.dist.worker_threads,
                                                 self.cfg.seed + 1000 * self.spawned, self.fault, self.fault_mark)
        self.starting[i], self.since[i] = self.workers[i].pid.remote(), time.monotonic()

    def load(self, i: int) -> int:
        return sum(1 for w, *_ in self.pending.values() if w == i)

    def submit(self, i: int, job: Job, weights: list) -> None:
        if self.load(i) == 0:
            self.since[i] = time.monotonic()
        ref = self.workers[i].run_job.remote(job, weights)
        self.pending[ref] = (i, job, weights)

    def fill(self, next_job: Callable[[], tuple[Job, list]]) -> None:
        """Give every worker jobs until it holds ``in_flight``."""
        for i in range(len(self.workers)):
            while self.load(i) < self.dist.in_flight:
                self.submit(i, *next_job())

    def pids(self, timeout_s: float = 300.0) -> list[int]:
        """Process ids of the live workers (for the fault tests).

        Raises:
            ray.exceptions.GetTimeoutError: a worker did not answer within ``timeout_s`` (stopped, or still
                being built).
        """
        return ray.get([w.pid.remote() for w in self.workers], timeout=timeout_s)

    def deadline(self, i: int) -> float:
        """When worker ``i``, busy, counts as lost: ``job_timeout_s`` after it last showed
        progress, plus ``STARTUP_GRACE_S`` while it is still being built."""
        return self.since[i] + self.dist.job_timeout_s + (STARTUP_GRACE_S if self.starting[i] is not None else 0.0)

    def next_result(self) -> JobResult:
        """The next finished job. A worker that died (its job raises ``RayActorError``) or
        shows no progress for ``job_timeout_s`` while busy (partitioned or hung: it is
        killed) is replaced by a fresh one, and all its jobs are redone there."""
        while True:
            now = time.monotonic()
            for i, ref in enumerate(self.starting):
                if ref is not None and ray.wait([ref], timeout=0)[0]:
                    self.starting[i], self.since[i] = None, now
            busy = {i for i, *_ in self.pending.values()}
            overdue = [i for i in busy if now > self.deadline(i)]
            if overdue:
                self._replace(overdue[0], f"no result within {self.dist.job_timeout_s:.0f} s", kill=True)
                continue
            wait_s = min(self.deadline(i) for i in busy) - now
            if any(self.starting[i] is not None for i in busy):
                wait_s = min(wait_s, 1.0)  # look again soon: its clock starts when it is built
            ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=max(wait_s, 0.0))
            if not ready:
                continue
            ref = ready[0]
            i = self.pending[ref][0]
            try:
                result = ray.get(ref)
            except LOST as e:  # Ray's OOM killer, a crash, a kill: the process is gone
                self._replace(i, type(e).__name__, kill=True)
                continue
            del self.pending[ref]
            self.since[i] = time.monotonic()
            self.stats.jobs_done += 1
            return result

    def _replace(self, i: int, why: str, kill: bool) -> None:
        """Replace worker ``i`` with a fresh one and resubmit every job it held, in order.

        Raises:
            RuntimeError: a job was lost ``MAX_LOSSES_PER_JOB`` times.
        """
        if kill:
            ray.kill(self.workers[i], no_restart=True)
        lost = [(r, j, w) for r, (k, j, w) in self.pending.items() if k == i]
        for r, j, _ in lost:
            del self.pending[r]
            self.losses[j.job_id] = self.losses.get(j.job_id, 0) + 1
            if self.losses[j.job_id] >= MAX_LOSSES_PER_JOB:
                raise RuntimeError(f"rollout job {j.job_id} was lost with its worker {self.losses[j.job_id]} times "
                                   f"(last: {why}); stopping rather than retrying forever")
        self._spawn(i)
        self.stats.workers_lost += 1
        for _, j, w in sorted(lost, key=lambda x: x[1].job_id):
            self.submit(i, j, w)
        self.stats.jobs_redone += len(lost)
        self.on_event(f"worker {i} lost ({why}); jobs {sorted(j.job_id for _, j, _ in lost)} redone on a fresh worker")

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.pending.clear()


class AsyncRunner(Runner):
    """The loop of :class:`selfrl.run.loop.Runner` with rollouts from a :class:`WorkerPool`.

    Each iteration takes the first ``num_prompts`` groups that come back within the
    staleness bound; the jobs still in flight keep sampling while the driver trains.

    Args:
        on_result: test hook, called with the pool after each job returns (the fault
            test kills a worker from it).
    """

    def __init__(self, cfg: RunConfig, resume: bool = False, progress: Progress | None = None,
                 on_result: Callable[[WorkerPool], None] | None = None):
        super().__init__(build_run(cfg, resume), progress or PlainProgress())
        self.dist, self.on_result = cfg.distributed, on_result
        self.loaded: list[int] = []  # versions the learner's weights held, in order
        self.published: dict[int, list] = {}  # version -> [ObjectRef of its LoRA state]
        self.job_count = 0
        self.pool = WorkerPool(cfg, self.dist, lambda msg: self.s.ledger.event(EventKind.WORKER_LOST, msg))
        self.iteration_stats: dict[str, float] = {}

    def start(self) -> int:
        """The loop's start; a resumed run's task walk continues where the stored iterations left
        it, and its job numbers after the last stored one, so no group id is ever stored twice
        (a driver killed between storing an iteration and training on it leaves those groups
        stored, never trained; the resumed run samples that iteration again under new ids)."""
        first = super().start()
        with self.s.store.lock:
            groups = [r[0] for r in self.s.store.conn.execute("SELECT DISTINCT group_id FROM trajectories")]
        stored = [int(m.group(1)) for g in groups if (m := re.fullmatch(r"j(\d+)", g))]
        self.job_count = max(first * self.cfg.num_prompts, max(stored, default=-1) + 1)
        return first

    def note_version(self) -> int:
        """Record the learner's current version (after an update, a rejection or a rollback)
        and publish its LoRA tensors to the object store once; returns it."""
        v = self.s.engine.version
        if not self.loaded or self.loaded[-1] != v:
            self.loaded.append(v)
        if v not in self.published:
            self.published = {k: r for k, r in self.published.items() if k in self.loaded[-(self.dist.max_staleness + 2):]}
            self.published[v] = [ray.put(adapters.lora_state(self.s.engine.model))]
        return v

    def next_job(self) -> tuple[Job, list]:
        """The next task of the deterministic walk through the training set, on the current version."""
        k, v = self.job_count, self.loaded[-1]
        self.job_count += 1
        task = iteration_tasks(self.s.train, k, 1, self.cfg.task.train_seed)[0]
        return Job(k, task, f"j{k}", v), self.published[v]

    def rollouts(self, it: int) -> tuple[list[Trajectory], float]:
        """The first ``num_prompts`` groups back from the workers within the staleness bound
        (older ones are dropped and counted); returns their trajectories and the seconds waited."""
        t0 = time.perf_counter()
        self.note_version()
        self.progress.phase(f"iteration {it}: rollouts (groups)", self.cfg.num_prompts)
        groups: list[JobResult] = []
        dropped = 0
        while len(groups) < self.cfg.num_prompts:
            self.pool.fill(self.next_job)
            res = self.pool.next_result()
            if self.on_result is not None:
                self.on_result(self.pool)
            lag = staleness(res.version, self.loaded)
            if lag > self.dist.max_staleness:
                dropped += 1
                continue
            groups.append(res)
            self.progress.advance()
        self.pool.fill(self.next_job)  # keep the workers sampling while the learner trains
        self.pool.stats.dropped_stale += dropped
        lags = [staleness(g.version, self.loaded) for g in groups]
        self.iteration_stats = {"async/dropped_stale": float(dropped), "async/mean_staleness": sum(lags) / len(lags),
                                "async/max_staleness": float(max(lags)),
                                "async/workers_lost": float(self.pool.stats.workers_lost)}
        return [t for g in groups for t in g.trajectories], time.perf_counter() - t0

    def iteration(self, it: int) -> dict[str, float]:
        metrics = super().iteration(it)
        metrics.update(self.iteration_stats)
        return metrics

    def finish(self, stopped: bool):
        s = self.pool.stats
        self.s.ledger.event(EventKind.DISTRIBUTED, (
            f"{self.dist.num_workers} workers: {s.jobs_done} jobs done, {s.dropped_stale} groups dropped as "
            f"staler than {self.dist.max_staleness}, {s.workers_lost} workers lost, {s.jobs_redone} jobs redone"),
            {"jobs_done": s.jobs_done, "dropped_stale": s.dropped_stale, "workers_lost": s.workers_lost,
             "jobs_redone": s.jobs_redone, "max_staleness": self.dist.max_staleness})
        self.pool.shutdown()
        result = super().finish(stopped)
        result.summary.update({"workers": self.dist.num_workers, "dropped_stale": s.dropped_stale,
                               "workers_lost": s.workers_lost, "jobs_redone": s.jobs_redone})
        return result


def run_distributed(cfg: RunConfig, resume: bool = False, progress: Progress | None = None,
                    on_result: Callable[[WorkerPool], None] | None = None):
    """:func:`selfrl.run.main.run` with rollouts on the Ray workers of ``cfg.distributed`` (see
    the module docstring); :func:`selfrl.run.main.run` calls it when ``distributed.address`` is set.

    Raises:
        as :func:`selfrl.run.main.run`; ``selfrl.config.ConfigError`` without ``distributed.address``;
        ``ConnectionError`` when the cluster cannot be reached.
    """
    from selfrl.config import ConfigError

    cfg.validate()
    if cfg.distributed.address is None:
        raise ConfigError("distributed.address is not set (auto, local or host:port)")
    connect(cfg.distributed.address)
    return AsyncRunner(cfg, resume, progress, on_result).run()
