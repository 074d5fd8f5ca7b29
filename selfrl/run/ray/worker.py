"""The rollout worker: one engine per worker, sampling jobs sent by the driver.

A worker builds its own policy from the run's config and serves it through any
backend of the engine interface (``selfrl.engines.make_engine``). It never scores,
trains or writes the store: it returns trajectories, and the driver does the rest.
Adapter versions reach it *by version*: each job names the version to sample with
and carries a reference to that version's LoRA tensors in Ray's object store; the
worker fetches and swaps them only when the version differs from the one it holds.

This module imports no Ray: :mod:`selfrl.run.ray.driver` wraps the class with
``ray.remote``. A worker starts at version -1 (nothing loaded), so its first job
always swaps the driver's weights in: workers never rely on building the same
random LoRA initialisation as the driver.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from selfrl.config import RunConfig
from selfrl.core.tasks import Task
from selfrl.core.trajectory import Trajectory

# Fault injection for the fault suite (scripts/fault_suite.py): ``SELFRL_WORKER_FAULT`` in the
# driver's environment, ``kill:<point>`` (SIGKILL) or ``stop:<point>`` (SIGSTOP: alive, silent,
# as a worker partitioned from the driver), fires once per run directory in the first worker
# that reaches the point.
WORKER_FAULT_ENV = "SELFRL_WORKER_FAULT"
WORKER_FAULT_POINTS = ("before_sampling", "mid_rollout", "after_sending")
WORKER_FAULT_KINDS = ("kill", "stop")


def parse_worker_fault(spec: str | None) -> tuple[str, str] | None:
    """``"kill:mid_rollout"`` -> ``("kill", "mid_rollout")``; None for None or "".

    Raises:
        ValueError: an unknown kind or point (the message lists the valid ones).
    """
    if not spec:
        return None
    kind, _, point = spec.partition(":")
    if kind not in WORKER_FAULT_KINDS or point not in WORKER_FAULT_POINTS:
        raise ValueError(f"{WORKER_FAULT_ENV}={spec!r}: expected KIND:POINT, KIND one of {', '.join(WORKER_FAULT_KINDS)}, "
                         f"POINT one of {', '.join(WORKER_FAULT_POINTS)}")
    return kind, point


@dataclass
class Job:
    """One rollout job: ``num_generations`` samples of one task, on one version.

    Attributes:
        job_id: the driver's running number (unique in a run).
        task: the training task.
        group_id: group id of the samples (one GRPO group).
        version: the adapter version to sample with.
    """

    job_id: int
    task: Task
    group_id: str
    version: int


@dataclass
class JobResult:
    """What a worker sends back: the group's trajectories, sampled by ``version``."""

    job_id: int
    version: int
    trajectories: list[Trajectory]
    worker_pid: int
    seconds: float


class RolloutWorker:
    """Samples jobs with its own engine (wrapped as a Ray actor by the driver).

    Args:
        cfg: the run's config (model, LoRA, task source, tools, rollout settings, and
            ``engine``: the registered backend each worker runs, as the driver's).
        threads: torch threads for this worker.
        seed: this worker's sampling seed (the driver gives each worker its own).
        fault: an injected fault, ``kind:point`` (:func:`parse_worker_fault`; the fault suite only).
        fault_mark: the file whose creation claims the fault, so it fires once in all workers.
    """

    def __init__(self, cfg: RunConfig, threads: int = 1, seed: int = 0, fault: str | None = None,
                 fault_mark: str | None = None):
        import torch

        from selfrl.engines import make_engine
        from selfrl.model.load import build_policy
        from selfrl.run.setup import make_source
        from selfrl.core.tools import resolve_tools

        torch.set_num_threads(threads)
        self.cfg = cfg
        model, tok = build_policy(cfg)
        torch.manual_seed(seed)
        self.engine = make_engine(cfg.engine, model, tok, version=-1, driver="caller")
        self.source = make_source(cfg)  # the run's environment, or its agents' ([[agents]])
        self.tools = resolve_tools(cfg.rollout.tools)
        self.fault, self.fault_mark = parse_worker_fault(fault), fault_mark

    def pid(self) -> int:
        """The worker's process id (the fault tests kill it)."""
        return os.getpid()

    def run_job(self, job: Job, weights: list) -> JobResult:
        """Sample ``job``; ``weights`` is ``[ObjectRef]`` of the version's LoRA state (in a
        list, so Ray does not fetch it unless the worker needs it)."""
        from selfrl.rollout.agent import rollout

        t0 = time.perf_counter()
        self.fault_point("before_sampling")
        if self.engine.version != job.version:
            import ray

            self.engine.swap(ray.get(weights[0]), job.version)
        n = self.cfg.num_generations
        trajs = rollout(self.engine, [job.task] * n, [job.group_id] * n, self.tools, self.cfg.rollout,
                        env_factory=self.source.make_env, on_turn=lambda: self.fault_point("mid_rollout"))
        if self.claims("after_sending"):  # dies right after the result has left
            import threading

            threading.Timer(0.5, self._fire).start()
        return JobResult(job.job_id, job.version, trajs, os.getpid(), time.perf_counter() - t0)

    # -- fault injection (the fault suite only) ------------------------------------------

    def claims(self, point: str) -> bool:
        """True once per run directory, for the first worker that reaches the fault's point."""
        if self.fault is None or self.fault[1] != point or self.fault_mark is None:
            return False
        try:
            os.close(os.open(self.fault_mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    def fault_point(self, point: str) -> None:
        if self.claims(point):
            self._fire()

    def _fire(self) -> None:
        import signal

        os.kill(os.getpid(), signal.SIGKILL if self.fault[0] == "kill" else signal.SIGSTOP)
