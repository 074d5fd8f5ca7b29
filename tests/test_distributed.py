"""Distributed rollouts on a local Ray cluster: the staleness bound checked from the
store, a worker killed mid-run, and Ray never imported without ``--ray``.

The model and reward are those of ``tests/test_loop.py`` (a tiny Phi saved to disk,
the ``short`` test reward that differs within groups, so updates happen). The cluster
is started on loopback with 2 CPUs, 2 workers of half a CPU each.
"""

import os
import signal
import subprocess
import sys

import pytest
from conftest import save_tiny_phi

from selfrl.config import ConfigError, DistributedConfig, load_config
from selfrl.rollout.staleness import staleness, within_bound
from selfrl.record.store import Store


def test_staleness_counts_weight_changes():
    assert staleness(4, [0, 1, 2, 3, 4]) == 0
    assert staleness(2, [0, 1, 2, 3, 4]) == 2
    # candidate 3 rejected, champion 2 back: the learner changed once since 3 and 2
    assert staleness(3, [0, 1, 2, 3, 2]) == 1
    assert staleness(2, [0, 1, 2, 3, 2]) == 0
    assert staleness(9, [0, 1]) == float("inf")
    assert within_bound([4, 3, 2, 9], [0, 1, 2, 3, 4], 1) == [True, True, False, False]
    assert within_bound([4, 3], [0, 1, 2, 3, 4], 0) == [True, False]
    with pytest.raises(ValueError, match="max_staleness"):
        within_bound([1], [1], -1)
    with pytest.raises(ValueError, match="no version"):
        staleness(0, [])


def test_distributed_config_from_flags_and_its_checks():
    cfg = load_config(None, {"distributed.address": "auto", "distributed.max_staleness": 3})
    assert (cfg.distributed.address, cfg.distributed.max_staleness, cfg.distributed.num_workers) == ("auto", 3, 2)
    assert load_config().distributed.address is None  # off by default: no Ray
    with pytest.raises(ConfigError, match="distributed.num_workers must be >= 1"):
        load_config(None, {"distributed.num_workers": 0})
    with pytest.raises(ConfigError, match="distributed.max_staleness must be >= 0"):
        load_config(None, {"distributed.max_staleness": -1})


def test_no_ray_without_the_flag():
    code = ("import sys, selfrl.cli, selfrl.run.loop, selfrl.run.ray, selfrl.rollout.staleness, "
            "selfrl.run.agents, selfrl.run.ray.worker; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_run_hands_a_distributed_config_to_the_driver(monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("selfrl.run.ray.driver")
    fake.run_distributed = lambda cfg, resume, progress: calls.append((cfg.distributed.address, resume)) or "ran"
    monkeypatch.setitem(sys.modules, "selfrl.run.ray.driver", fake)
    from selfrl.run.main import run

    cfg = load_config(None, {"distributed.address": "auto"})
    assert run(cfg, resume=True) == "ran" and calls == [("auto", True)]


@pytest.fixture(scope="module")
def short_model(tmp_path_factory, tiny_tokenizer):
    """(model folder, make_cfg) of tests/test_loop.py, with its ``short`` reward registered."""
    from test_loop import make_cfg, short

    from selfrl.envs.rewards import REWARD_FUNCS

    mp = pytest.MonkeyPatch()
    mp.setitem(REWARD_FUNCS, "short", short)
    yield save_tiny_phi(tmp_path_factory.mktemp("model"), tiny_tokenizer), make_cfg
    mp.undo()


@pytest.fixture(scope="module")
def ray_cluster():
    import ray  # in the test extra: CI runs this test, never skips it

    # Ray's memory monitor kills workers when the *machine* is near full, whoever uses the
    # memory; on a shared CI machine that would fail these tests for others' load.
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_memory_monitor_refresh_ms", "0")
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()
    mp.undo()


def test_async_run_bounds_staleness_and_survives_a_killed_worker(tmp_path, short_model, ray_cluster):
    from selfrl.run.ray.driver import run_distributed

    model_dir, make_cfg = short_model
    cfg = make_cfg(model_dir, tmp_path / "run", iterations=4)
    cfg.gate.eval_every = 100  # one validation, at the end, and no collapse rollbacks:
    cfg.collapse.enabled = False  # versions only grow, so staleness = learner version - sampler version
    cfg.distributed = dist = DistributedConfig(address="local", num_workers=2, max_staleness=1, job_timeout_s=120)
    killed = []

    def kill_one_mid_job(pool):  # after the third result, SIGKILL a worker that holds a job
        if pool.stats.jobs_done == 3 and not killed:
            busy = next(i for i, *_ in pool.pending.values())
            pid = ray_cluster.get(pool.workers[busy].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    result = run_distributed(cfg, on_result=kill_one_mid_job)
    assert killed and result.summary["workers_lost"] == 1 and result.summary["jobs_redone"] >= 1

    store = Store(tmp_path / "run" / "selfrl.db")
    learner_version = {m["step"]: int(m["value"]) for m in store.metrics() if m["name"] == "sampled_version"}
    trajs = store.trajectories()
    # every iteration trained num_prompts whole groups: nothing lost to the killed worker
    for it in range(4):
        assert len(store.trajectories(iteration=it)) == cfg.num_prompts * cfg.num_generations
    assert all(t.error is None and t.token_ids for t in trajs)
    lags = []
    for it in range(4):
        for t in store.trajectories(iteration=it):
            lags.append(learner_version[it] - t.adapter_version)
    assert max(lags) <= dist.max_staleness and min(lags) >= 0
    assert max(lags) == 1  # asynchronous for real: some groups were sampled while the learner trained
    assert learner_version[3] >= 2  # updates happened (versions grow)
    events = [e for e in store.events() if e["kind"] == "worker_lost"]
    assert len(events) == 1
    store.close()


def test_a_partitioned_worker_is_timed_out_replaced_and_its_job_redone(tmp_path, short_model, ray_cluster):
    from selfrl.record import adapters
    from selfrl.run.ray.driver import WorkerPool
    from selfrl.run.ray.worker import Job
    from selfrl.model.load import build_policy
    from selfrl.envs import get_env

    model_dir, make_cfg = short_model
    cfg = make_cfg(model_dir, tmp_path / "run")
    events = []
    pool = WorkerPool(cfg, DistributedConfig(num_workers=1, job_timeout_s=3), events.append)
    weights = [ray_cluster.put(adapters.lora_state(build_policy(cfg)[0]))]
    task = get_env("chain_sum").sample(1, seed=0)[0]
    [stopped] = pool.pids()
    os.kill(stopped, signal.SIGSTOP)  # partitioned: alive, never answers
    try:
        pool.submit(0, Job(7, task, "g7", 0), weights)
        result = pool.next_result()
    finally:
        pool.shutdown()
    assert result.job_id == 7 and result.version == 0 and result.worker_pid != stopped
    assert len(result.trajectories) == cfg.num_generations and all(t.adapter_version == 0 for t in result.trajectories)
    assert pool.stats.workers_lost == 1 and pool.stats.jobs_redone == 1
    assert events == ["worker 0 lost (no result within 3 s); jobs [7] redone on a fresh worker"]


def test_rollouts_drop_groups_older_than_the_bound():
    """AsyncRunner.rollouts on a stand-in pool: with max_staleness 0 only groups sampled by the
    current version are kept; the others are counted as dropped, and the loop's batch is whole."""
    from types import SimpleNamespace

    from selfrl.run.ray.driver import AsyncRunner
    from selfrl.run.ray.worker import JobResult
    from selfrl.run.progress import PlainProgress
    from selfrl.core.trajectory import Trajectory

    versions = [3, 1, 3, 2, 3]  # the versions of the groups, in the order they come back

    class Pool:
        stats = SimpleNamespace(workers_lost=0, dropped_stale=0)
        filled = 0

        def fill(self, next_job):
            self.filled += 1

        def next_result(self):
            k = len(versions) - len(self.left)
            v = self.left.pop(0)
            return JobResult(k, v, [Trajectory(f"t{k}", f"j{k}", v) for _ in range(2)], 0, 0.0)

    pool = Pool()
    pool.left = list(versions)
    runner = object.__new__(AsyncRunner)
    runner.s = SimpleNamespace(engine=SimpleNamespace(version=3))
    runner.cfg = SimpleNamespace(num_prompts=3)
    runner.dist = DistributedConfig(address="local", max_staleness=0)
    runner.progress, runner.pool, runner.on_result = PlainProgress(), pool, None
    runner.loaded, runner.published = [0, 1, 2], {3: ["ref"]}
    trajs, _ = runner.rollouts(0)
    assert runner.loaded == [0, 1, 2, 3]
    assert [t.task_id for t in trajs] == ["t0", "t0", "t2", "t2", "t4", "t4"]
    assert {t.adapter_version for t in trajs} == {3}
    assert runner.iteration_stats["async/dropped_stale"] == 2.0 and pool.stats.dropped_stale == 2
    assert runner.iteration_stats["async/max_staleness"] == 0.0
    # with a bound of 2 the same stream keeps the first three groups, staleness 0, 2 and 0
    pool.left, runner.dist = list(versions), DistributedConfig(address="local", max_staleness=2)
    trajs, _ = runner.rollouts(1)
    assert [t.task_id for t in trajs][::2] == ["t0", "t1", "t2"]
    assert runner.iteration_stats["async/mean_staleness"] == pytest.approx(2 / 3)


def test_several_agents_run_on_ray_workers_into_one_learner(tmp_path, short_model, ray_cluster):
    """[[agents]] with --ray: the workers build the agents' environment from the run's config
    and sample both agents' tagged tasks; jobs alternate between the agents (an iteration takes
    the first groups back, so its own mix may vary), and each agent's held-out success is logged."""
    from selfrl.config import AgentConfig
    from selfrl.envs.agents import agent_of
    from selfrl.run.ray.driver import run_distributed

    model_dir, make_cfg = short_model
    cfg = make_cfg(model_dir, tmp_path / "run", iterations=2)
    cfg.agents = [AgentConfig("one", "chain_sum", {"min_digits": 1, "max_digits": 1}, val_size=3),
                  AgentConfig("three", "chain_sum", {"min_digits": 3, "max_digits": 3}, val_size=2)]
    cfg.gate.eval_every, cfg.collapse.enabled = 2, False
    cfg.distributed = DistributedConfig(address="local", num_workers=2, max_staleness=1, job_timeout_s=120)
    run_distributed(cfg)
    with Store(tmp_path / "run" / "selfrl.db") as store:
        by_job = {int(t.group_id[1:]): agent_of(t.task_id) for t in store.trajectories()}
        for it in range(2):
            assert len(store.trajectories(iteration=it)) == 2 * 3  # whole groups
        assert set(by_job.values()) == {"one", "three"}
        assert len({a for k, a in by_job.items() if k % 2 == 0}) == len({a for k, a in by_job.items() if k % 2}) == 1
        assert {a for k, a in by_job.items() if k % 2 == 0} != {a for k, a in by_job.items() if k % 2}
        assert sorted(agent_of(t) for t in store.evaluation(0)) == ["one"] * 3 + ["three"] * 2
        names = {m["name"] for m in store.metrics()}
        assert {"val/one", "val/three"} <= names


@pytest.mark.parametrize("point", ["before_sampling", "mid_rollout", "after_sending"])
def test_a_worker_killed_at_each_point_of_a_job_loses_nothing(point, tmp_path, short_model, ray_cluster):
    """The worker SIGKILLs itself at ``point`` of its first job (SELFRL_WORKER_FAULT, once per run
    directory). Before or during sampling, that job is redone on a fresh worker; after sending,
    its result arrives from the dead worker and the next job, sent to it, is redone. Every job
    comes back exactly once, whole."""
    import time

    from selfrl.record import adapters
    from selfrl.run.ray.driver import WorkerPool
    from selfrl.run.ray.worker import Job
    from selfrl.model.load import build_policy
    from selfrl.envs import get_env

    model_dir, make_cfg = short_model
    cfg = make_cfg(model_dir, tmp_path / "run")
    (tmp_path / "run").mkdir()
    events = []
    pool = WorkerPool(cfg, DistributedConfig(num_workers=1, job_timeout_s=120), events.append, fault=f"kill:{point}")
    weights = [ray_cluster.put(adapters.lora_state(build_policy(cfg)[0]))]
    tasks = get_env("chain_sum").sample(2, seed=0)
    [first_pid] = pool.pids()
    results = []
    try:
        for k, task in enumerate(tasks):
            pool.submit(0, Job(k, task, f"j{k}", 0), weights)
            results.append(pool.next_result())
            time.sleep(1.0)  # after_sending: the worker is dead before the next job reaches it
    finally:
        pool.shutdown()
    assert [r.job_id for r in results] == [0, 1]
    assert all(len(r.trajectories) == cfg.num_generations for r in results)
    assert all(t.group_id == f"j{r.job_id}" for r in results for t in r.trajectories)
    assert pool.stats.workers_lost == 1 and pool.stats.jobs_redone == 1
    redone = 1 if point == "after_sending" else 0  # the job that was lost with the worker
    assert results[redone].worker_pid != first_pid
    assert (results[0].worker_pid == first_pid) == (point == "after_sending")
    [event] = events  # the error's name is Ray's: ActorDiedError, a RayActorError
    assert event.startswith("worker 0 lost (") and event.endswith(f"); jobs [{redone}] redone on a fresh worker")
    assert (tmp_path / "run" / ".worker_fault_fired").exists()  # fired once: the fresh worker ran clean


def test_worker_fault_specs_are_checked():
    from selfrl.run.ray.worker import parse_worker_fault

    assert parse_worker_fault("stop:mid_rollout") == ("stop", "mid_rollout") and parse_worker_fault("") is None
    with pytest.raises(ValueError, match="POINT one of before_sampling, mid_rollout, after_sending"):
        parse_worker_fault("kill:after_store")


@pytest.mark.slow
def test_a_killed_driver_resumes_from_the_last_good_version_with_nothing_lost_or_stored_twice(tmp_path):
    """``selfrl run --ray local`` SIGKILLed right after storing iteration 1 (before training on
    it), then ``--resume``: scripts/fault_suite.py's check (every trajectory stored before the
    kill unchanged, all iterations trained, no group id stored twice, resumed from the newest
    servable version, no corrupt version served). About 80 s on 2 shared cores."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    from fault_distributed import run_distributed_fault
    from fault_runs import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model")
    out = run_distributed_fault("ray:kill:after_store@1", model_dir, tmp_path)
    assert out.recovered, out
    assert out.trajectories_lost == 0 and out.corrupt_versions_served == 0
    assert "0 groups stored twice" in out.detail and "resumed at iteration 1 from version" in out.detail
