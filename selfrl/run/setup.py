"""Setting a run up, once: the names its config refers to, then everything it is built from.

:func:`build_run` makes the :class:`RunSetup` a :class:`selfrl.run.loop.Runner` drives: the
environment and its train/held-out split, the tools and reward weights, the detectors, the
policy and its sampling engine (or a sampler in another process), the learner, the store, the
version ledger and the update cycle. The Ray driver (:mod:`selfrl.run.ray.driver`) builds its
run with it too.

Validation of a config (:meth:`selfrl.config.RunConfig.validate`) checks values only, so
that importing the config imports no environment, detector or reward. The names are checked
here (:func:`check_names`), after the built-in environments have registered theirs
(:func:`selfrl.envs.builtin.load_builtin_envs`) and before any model loads; ``selfrl serve``
(:func:`selfrl.serve.main.serve` and :class:`selfrl.serve.service.Service`) calls it too.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfrl.config import JUDGE_DETECTORS, JUDGE_REWARD, ConfigError, JudgeConfig, RunConfig, check_resumable, require
from selfrl.core.tasks import Task, TaskSource, assert_disjoint, count_distinct
from selfrl.core.tools import Tool, resolve_tools
from selfrl.engines import make_engine
from selfrl.engines.base import SamplingEngine
from selfrl.envs import get_env
from selfrl.envs.builtin import load_builtin_envs
from selfrl.envs.rewards import check_weights, get_preset
from selfrl.model.load import build_policy, check_model_path
from selfrl.core.atomic import write_atomic
from selfrl.record.rundir import check_folder
from selfrl.record.runlock import RunDirLock
from selfrl.record.store import Store
from selfrl.record.versions import Ledger
from selfrl.rl.learner import Learner, kl_reference
from selfrl.rl.losses import get_loss_aggregation
from selfrl.rollout.prefetch import LocalSampler, shadow_policy
from selfrl.run.cycle import UpdateCycle
from selfrl.run.sampler_sync import SamplerSync, check_reachable
from selfrl.safety.collapse import CollapseGuard
from selfrl.safety.detectors import HackingMonitor, check_detectors


def reward_weights(cfg: Any) -> dict[str, float]:
    """The reward weights a run uses: ``reward_weights``, else its preset's.

    Raises:
        ValueError: an unknown preset (the message lists the valid ones).
    """
    return cfg.reward_weights or get_preset(cfg.preset)


def check_names(cfg: Any, weights: dict[str, float] | None = None) -> None:
    """The names ``cfg`` refers to, against their registries: the loss type, the reward
    functions and their weights (``weights``; None: the run's, :func:`reward_weights`), the
    tools (``[rollout]``'s and each agent's or family's own: :func:`check_own_tools`) and the detectors. The built-in environments are loaded first, so the names they
    register (``webshop`` presets, ``run_python``, ``swe_*`` detectors) are known.

    Raises:
        ConfigError: an unknown name (the message lists the valid ones) or a bad weight.
    """
    load_builtin_envs()
    judge = getattr(cfg, "judge", None)  # selfrl run's [judge]; its names are checked without importing it
    try:
        get_loss_aggregation(cfg.train.loss_type)
        named = reward_weights(cfg) if weights is None else weights
        check_weights({n: w for n, w in named.items() if not (judge and n == JUDGE_REWARD)})
        if judge is not None:
            check_judge(judge, named)
        resolve_tools(cfg.rollout.tools)
        check_own_tools(cfg)
        check_detectors([n for n in cfg.detectors.names if not (judge and n in JUDGE_DETECTORS)])
    except (KeyError, ValueError) as e:
        raise ConfigError(str(e).strip("'\"")) from e


def check_own_tools(cfg: Any) -> None:
    """The tools each ``[[agents]]`` (``selfrl run``) or ``[[families]]`` (``selfrl serve``) table names
    in its own ``rollout = { tools = [...] }``, against the tool registry.

    Raises:
        ConfigError: an unknown or repeated tool, the table named
            (``families[0] (web).rollout.tools: unknown tool 'abacus'; available tools: ...``).
    """
    for table in ("agents", "families"):
        for i, item in enumerate(getattr(cfg, table, None) or []):
            if isinstance(item.rollout, dict) and "tools" in item.rollout:
                try:
                    resolve_tools(item.rollout["tools"])
                except (KeyError, ValueError) as e:  # UnknownToolError is one
                    raise ConfigError(f"{table}[{i}] ({item.name or 'unnamed'}).rollout.tools: "
                                      f"{e}") from e


def check_judge(judge: JudgeConfig, weights: dict[str, float]) -> None:
    """The ``judge`` reward is weighted exactly when ``[[judge.endpoints]]`` exist, and its rule
    rewards and floor are registered reward functions.

    Raises:
        ConfigError: a judge without its reward, the reward without a judge, or an unknown rule name.
    """
    require([
        (JUDGE_REWARD in weights or not judge.endpoints, f"[[judge.endpoints]] is set but no reward weights "
         f"{JUDGE_REWARD!r}: add reward_weights = {{{JUDGE_REWARD} = 1.0}} (or drop the endpoints)"),
        (JUDGE_REWARD not in weights or bool(judge.endpoints), f"the reward {JUDGE_REWARD!r} needs a judge: "
         "add a [[judge.endpoints]] table with base_url, model and rubric (docs/guides/judge.md)"),
    ])
    check_weights({n: 1.0 for n in judge.reward_names()})


def check_held_out_size(env, size: int, seed: int, key: str) -> None:
    """``env`` gives at least ``size`` distinct tasks from ``seed`` (:func:`selfrl.core.tasks.count_distinct`:
    a second or two for a source that has few, where drawing the held-out set would take minutes).
    ``selfrl run`` (:func:`check_held_out_sizes`) and ``selfrl serve`` (:mod:`selfrl.serve.families`) call it
    before the model loads.

    Raises:
        ConfigError: fewer tasks than ``size``; the message names ``key`` (the setting
            to lower), the environment and how many distinct tasks it gave.
    """
    if (available := count_distinct(env, size, seed)) < size:
        raise ConfigError(f"{key} = {size}, but environment {env.name!r} gives only {available} distinct tasks "
                          f"(sampled until no new one came): lower it to at most {available}")


def check_held_out_sizes(cfg: RunConfig, source: TaskSource) -> None:
    """The run's held-out set fits its environment (``source``, :func:`make_source`):
    ``gate.val_size`` distinct tasks of ``task.source``, or with ``[[agents]]`` each agent's
    ``val_size`` (else ``gate.val_size``) of its own environment (:func:`check_held_out_size`).

    Raises:
        ConfigError: an environment with fewer distinct tasks than its held-out size; the message
            names the setting to lower (``gate.val_size``, ``agents[0] (math).val_size``, or
            ``agents[0] (math) takes gate.val_size``) and how many tasks there are.
    """
    if not cfg.agents:
        check_held_out_size(source, cfg.gate.val_size, cfg.task.val_seed, "gate.val_size")
        return
    for i, a in enumerate(cfg.agents):
        check_held_out_size(source.envs[a.name], cfg.gate.val_size if a.val_size is None else a.val_size,
                            cfg.task.val_seed if a.val_seed is None else a.val_seed,
                            f"agents[{i}] ({a.name}).val_size" if a.val_size is not None else
                            f"agents[{i}] ({a.name}) takes gate.val_size")


@dataclass
class RunSetup:
    """Everything a run is built from, made once by :func:`build_run`."""

    cfg: RunConfig
    resume: bool
    run_dir: Path
    source: TaskSource
    train: list[Task]
    val: list[Task]
    tools: list[Tool]
    weights: dict[str, float]
    monitor: HackingMonitor
    engine: SamplingEngine
    learner: Learner
    store: Store
    run_id: int
    ledger: Ledger
    cycle: UpdateCycle
    # the sampler kept in step: remote (--sampler) or the local copy (--async-rollouts); None: the engine shares the model
    sampler: SamplerSync | None = None
    lock: RunDirLock | None = None  # the run directory's one-writer lock, held until the run ends (Runner.run)
    judge: object | None = None  # the configured judge reward (selfrl.judge.JudgeReward), or None without [judge]


def build_run(cfg: RunConfig, resume: bool = False) -> RunSetup:
    """Tasks, tools, rewards, the policy and its engine, the learner, the store, the version
    ledger and the update cycle of one run (``cfg.run_dir``).

    The names the config refers to are checked first (:func:`check_names`: nothing is created
    for a config that cannot run). The run directory's lock (:mod:`selfrl.record.runlock`) is
    taken next and held by the returned setup until :meth:`selfrl.run.loop.Runner.run` ends:
    one process writes a run directory at a time.

    Raises:
        FileExistsError / FileNotFoundError: as :func:`selfrl.run.main.run`.
        selfrl.record.rundir.NotAFolder: ``run_dir`` is a file (before anything loads).
        selfrl.record.store.NotAStore: ``resume`` and ``run_dir/selfrl.db`` is not a selfrl store.
        selfrl.config.ConfigError: ``resume`` with settings the stored run cannot change, a
            name no registry knows (:func:`check_names`), or a held-out set larger than its
            environment's distinct tasks (:func:`check_held_out_sizes`); all before any model loads.
        selfrl.record.runlock.RunDirLocked: another process (a run, a resume, a server) writes ``run_dir``.
        ConnectionError: ``sampler.url`` does not answer (before any model loads).
    """
    check_names(cfg)  # before anything is created or loaded: the built-in environments first, then every name
    if cfg.sampler.url is not None:  # a wrong URL fails in seconds, not after the model loads
        check_reachable(cfg.sampler.url, cfg.sampler.kind)
    check_model_path(cfg.model.name)  # a path that does not exist fails now, not after the run directory is made
    run_dir = Path(cfg.run_dir)
    check_folder(run_dir)
    if resume and not (run_dir / "selfrl.db").exists():
        raise FileNotFoundError(f"nothing to resume: no run at {run_dir}")
    if resume:  # a selfrl.db that is not a store fails now, not after the model loads
        Store(run_dir / "selfrl.db", readonly=True).close()
    created = not run_dir.exists()
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = RunDirLock(run_dir, "selfrl run")
    try:
        setup = assemble_run(cfg, resume, run_dir)
    except BaseException:
        if created:  # a run that never started leaves no folder behind (the lock file goes while held)
            lock.path.unlink(missing_ok=True)
        lock.release()
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise
    setup.lock = lock
    return setup


def assemble_run(cfg: RunConfig, resume: bool, run_dir: Path) -> RunSetup:
    """:func:`build_run`'s parts, with the run directory's lock held."""
    db = run_dir / "selfrl.db"
    if not resume and db.exists():
        raise FileExistsError(f"{run_dir} already holds a run; pass --resume or choose another --run-dir")
    stored = run_dir / "config.json"
    if resume and stored.exists():
        check_resumable(json.loads(stored.read_text()), cfg.to_dict())
    source = make_source(cfg)  # the environment (selfrl.envs), or the agents' ([[agents]])
    check_held_out_sizes(cfg, source)  # in seconds, where a held-out set too large took minutes of top-up draws
    train, val = source.split(cfg.task.num_train, cfg.gate.val_size, cfg.task.train_seed, cfg.task.val_seed)
    assert_disjoint(train, val)
    tools = resolve_tools(cfg.rollout.tools)
    judge = setup_judge(cfg)
    weights = reward_weights(cfg)
    monitor = HackingMonitor(cfg.detectors, weights)
    model, tok = build_policy(cfg)
    if cfg.sampler.url is None:  # --async-rollouts: the sampler has its own LoRA copy (selfrl.rollout.prefetch)
        # driver "caller": sampling runs in the thread that waits for it, so that with the learner
        # in the main thread torch runs in one thread (one OpenMP team; SlotEngine's ``driver``)
        engine = make_engine(cfg.engine, shadow_policy(model) if cfg.async_rollouts else model, tok, driver="caller")
    else:  # rollouts in another process; the learner keeps its model here (selfrl.run.sampler_sync)
        from selfrl.run.sampler_sync import connect

        engine = connect(cfg, tok, model)
    learner = Learner(model, cfg.train, cfg.rollout.temperature, tok.pad_token_id, cfg.max_completion_length,
                      ref_state=kl_reference(model, cfg.lora.init_adapter), tokenizer=tok)
    write_atomic(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2))
    store = Store(db)
    run_id = store.start_run(cfg.to_dict())
    ledger = Ledger(store, run_id, run_dir)
    guard = CollapseGuard(cfg.collapse)
    sync = None
    if cfg.sampler.url is not None:
        sync = sampler_sync(cfg, engine, model, tok, ledger)
    elif cfg.async_rollouts:  # the local sampler copy is kept in step and checked like a remote one
        sync = sampler_sync(cfg, LocalSampler(engine), model, tok, ledger)
    cycle = UpdateCycle(ledger, learner, guard, monitor, cfg.collapse, cfg.gate.tolerance, cfg.train.scale_rewards,
                        load=engine.swap if sync is None else sync.load, verify=None if sync is None else sync.verify,
                        agent_of=_agent_of() if cfg.agents else None)
    return RunSetup(cfg, resume, run_dir, source, train, val, tools, weights, monitor, engine, learner, store, run_id,
                    ledger, cycle, sync, judge=judge)


def setup_judge(cfg: RunConfig):
    """The judge reward configured from ``[judge]`` (:func:`selfrl.judge.setup`), or None; the
    judge package is imported (its reward and detectors registered) only when the config names it."""
    from selfrl.config import JUDGE_DETECTORS

    if not cfg.judge.endpoints and not set(cfg.detectors.names) & set(JUDGE_DETECTORS):
        return None
    from selfrl.judge import setup

    return setup(cfg.judge, cfg.run_dir)


def sampler_sync(cfg: RunConfig, engine, model, tokenizer, ledger: Ledger):
    """The :class:`selfrl.run.sampler_sync.SamplerSync` of a run with ``sampler.url``: the swap check's
    tolerance is set by the learner's dtype unless ``swap_check.tolerance`` is given."""
    from selfrl.model.device import resolve
    from selfrl.safety.swap_check import SwapChecker

    checker = None
    if cfg.swap_check.enabled:
        checker = SwapChecker.from_config(cfg.swap_check, tokenizer, resolve(cfg.model.device, cfg.model.dtype).dtype)
    return SamplerSync(engine, model, ledger, checker, by_folder=cfg.sampler.kind == "vllm")


def make_source(cfg: RunConfig) -> TaskSource:
    """The run's environment: ``task.source`` with ``task.options``, or with ``[[agents]]`` their
    :class:`selfrl.envs.agents.AgentsEnv` (also what each rollout worker builds).

    Raises:
        ValueError: an unknown environment or bad options (an agent's is named).
    """
    if cfg.agents:
        from selfrl.envs.agents import AgentsEnv

        return AgentsEnv(cfg.agents, cfg.task, cfg.gate)
    return get_env(cfg.task.source, **cfg.task.options)


def _agent_of():
    from selfrl.envs.agents import agent_of

    return agent_of
