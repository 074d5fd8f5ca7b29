"""The distributed faults of ``scripts/fault_suite.py`` (``selfrl run --ray local``): a rollout
worker killed at each point of a job or stopped (partitioned), and the driver killed then
resumed. See that file's docstring for what "recovered" means; it runs these."""

from __future__ import annotations

import signal
import sqlite3
import time
from pathlib import Path

from fault_runs import (ITERATIONS, PARTITION_TIMEOUT_S, Outcome, check_kill, corrupt_served, final_version,
                        read_run, run_child, snapshot, write_config)

NUM_PROMPTS, NUM_GENERATIONS = 2, 4  # as fault_runs.CONFIG


def groups_check(run_dir: Path) -> tuple[int, int, list[int]]:
    """``(trajectories lost, groups stored twice, staleness of every stored trajectory)`` of a
    finished distributed run: lost are the trajectories missing from iterations that trained
    fewer than ``num_prompts`` whole groups; a group id stored with more than ``num_generations``
    trajectories is stored twice; staleness is ``learner version - sampler version``."""
    db = sqlite3.connect(f"file:{run_dir / 'selfrl.db'}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT iteration, group_id, adapter_version FROM trajectories").fetchall()
        learner = dict(db.execute("SELECT step, value FROM metrics WHERE name = 'sampled_version'").fetchall())
    finally:
        db.close()
    per_group: dict[str, int] = {}
    per_iteration: dict[int, int] = {}
    for it, gid, _ in rows:
        per_group[gid] = per_group.get(gid, 0) + 1
        per_iteration[it] = per_iteration.get(it, 0) + 1
    expected = NUM_PROMPTS * NUM_GENERATIONS
    lost = sum(max(0, expected - per_iteration.get(it, 0)) for it in range(ITERATIONS))
    twice = sum(1 for n in per_group.values() if n > NUM_GENERATIONS)
    lags = [int(learner[it]) - v for it, _, v in rows if it in learner]
    return lost, twice, lags


def check_worker_fault(fault: str, run_dir: Path, final: int | None) -> Outcome:
    """Judge a distributed run in which one worker was killed or stopped (see the module docstring)."""
    r = read_run(run_dir)
    bad = corrupt_served(run_dir, r["versions"], final)
    lost, twice, lags = groups_check(run_dir)
    [totals] = [e["data"] for e in r["events"] if e["kind"] == "distributed"] or [{}]
    losses = [e["message"] for e in r["events"] if e["kind"] == "worker_lost"]
    in_bound = bool(lags) and 0 <= min(lags) and max(lags) <= 1
    ok = len(losses) == 1 and lost == 0 and twice == 0 and in_bound and not bad
    detail = (f"{len(losses)} worker lost, {totals.get('jobs_redone')} jobs redone, {twice} groups stored twice, "
              f"staleness {min(lags, default=None)}..{max(lags, default=None)}")
    return Outcome(fault, ok, lost, len(bad), detail=detail, notes=losses)


def check_driver_kill(fault: str, run_dir: Path, before: dict[str, str], last_good: int | None,
                      final: int | None) -> Outcome:
    """Judge a distributed run whose driver was killed, then resumed (see the module docstring)."""
    out = check_kill(fault, run_dir, before, final)
    _, twice, _ = groups_check(run_dir)
    resumed = [e["message"] for e in read_run(run_dir)["events"] if e["kind"] == "resume"]
    from_good = bool(resumed) and resumed[0].endswith(f"from version {last_good}")
    out.recovered = out.recovered and twice == 0 and from_good
    out.detail += f"; {twice} groups stored twice; {resumed[0] if resumed else 'no resume event'}"
    return out


def newest_servable(run_dir: Path) -> int | None:
    """The version a resume must start from: the newest base or promoted version with a complete folder."""
    from selfrl.record import adapters

    servable = [v["version"] for v in read_run(run_dir)["versions"] if v["status"] in ("promoted", "base")
                and adapters.verify_version(Path(v["path"])) is None]
    return max(servable, default=None)


def run_distributed_fault(fault: str, model_dir: Path, work: Path) -> Outcome:
    """Inject one distributed fault (``worker:...`` or ``ray:kill:...``) into a fresh ``--ray local`` run."""
    t0 = time.perf_counter()
    run_dir = work / fault.replace(":", "_").replace("@", "_at_")
    partition = fault.startswith("worker:stop:")
    config = write_config(work / f"{run_dir.name}.toml", model_dir, distributed=True,
                          job_timeout_s=PARTITION_TIMEOUT_S if partition else 60.0, num_workers=1 if partition else 2)
    args = ["--config", str(config), "--run-dir", str(run_dir)]
    if fault.startswith("worker:"):
        proc = run_child(args, worker_fault=fault.removeprefix("worker:"))
        out = (check_worker_fault(fault, run_dir, final_version(proc.stdout)) if proc.returncode == 0 else
               Outcome(fault, False, detail=f"exit {proc.returncode}: {proc.stderr[-600:]}"))
    else:
        killed = run_child(args, fault.removeprefix("ray:"))
        if killed.returncode != -signal.SIGKILL:
            return Outcome(fault, False, detail=f"not killed: exit {killed.returncode}: {killed.stderr[-400:]}")
        before, last_good = snapshot(run_dir), newest_servable(run_dir)
        proc = run_child(["--config", str(config), "--resume", str(run_dir)])
        out = (check_driver_kill(fault, run_dir, before, last_good, final_version(proc.stdout))
               if proc.returncode == 0 else Outcome(fault, False, detail=f"exit {proc.returncode}: {proc.stderr[-600:]}"))
    out.seconds = time.perf_counter() - t0
    return out


def distributed_faults() -> list[str]:
    """The distributed faults, or none when Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ModuleNotFoundError:
        return []
    from selfrl.run.ray.worker import WORKER_FAULT_POINTS

    return ([f"worker:kill:{p}" for p in WORKER_FAULT_POINTS] + ["worker:stop:mid_rollout"]
            + ["ray:kill:after_store@1", "ray:kill:during_update@1"])
