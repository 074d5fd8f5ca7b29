"""The environment of a run with several agents (``[[agents]]``): each agent's tasks, tagged
with its name, routed to the agent's own environment.

A run with agents trains one learner on every agent's tasks (the conflict policy is in
:mod:`selfrl.run.agents`). The loop, the rollout workers and the gate see one
environment, :class:`AgentsEnv`; it keeps the agents apart by task id: an agent's task
``t`` becomes ``"<agent>/<t.id>"``, with ``metadata["agent"]`` naming the agent and, when the
agent sets its own ``rollout = {...}``, ``metadata["rollout"]`` holding those settings (each of its
trajectories runs under them: :mod:`selfrl.rollout.overrides`). Every
call that takes a task (verifier, per-trajectory state, answer extraction, label-free
agreement) is answered by that agent's environment on the original task, so an
environment never sees another agent's tasks or a changed id. The tagging is stateless,
so a rollout worker that builds the same ``AgentsEnv`` from the run's config routes the
tasks the driver sends it, and a stored task row routes again on resume.

Each agent has its own split (its ``num_train``, ``val_size`` and seeds, else the run's):
the training set interleaves the agents' tasks round-robin, and the held-out set is the
agents' held-out sets one after the other, so ``selfrl.safety.gate.validate`` scores each agent
on its own tasks and :func:`agent_results` splits the results per agent.
"""

from __future__ import annotations

from itertools import zip_longest
from typing import Any

from selfrl.config import AgentConfig, GateConfig, TaskConfig
from selfrl.envs.base import Env
from selfrl.core.tasks import Task, assert_disjoint
from selfrl.rollout.overrides import ROLLOUT_KEY

AGENT_KEY = "agent"  # the metadata key that names a task's agent


def agent_of(task_id: str) -> str:
    """The agent of a tagged task id.

    >>> agent_of("math/3f2a")
    'math'

    Raises:
        ValueError: the id carries no agent (not made by :class:`AgentsEnv`).
    """
    agent, sep, _ = task_id.partition("/")
    if not sep or not agent:
        raise ValueError(f"task id {task_id!r} names no agent (expected '<agent>/<id>')")
    return agent


def tag(agent: str, task: Task, rollout: dict[str, Any] | None = None) -> Task:
    """``task`` as the agent's: id ``"<agent>/<id>"``, ``metadata["agent"]`` and, when ``rollout``
    (the agent's own ``[rollout]`` settings) is not empty, ``metadata["rollout"]``.

    Raises:
        ValueError: the environment's task metadata already uses the key ``"agent"`` (or
            ``"rollout"``, when the agent sets its own).
    """
    taken = [k for k in (AGENT_KEY, ROLLOUT_KEY if rollout else None) if k is not None and k in task.metadata]
    if taken:
        raise ValueError(f"agent {agent}: its environment's tasks already carry metadata[{taken[0]!r}]")
    extra = {ROLLOUT_KEY: dict(rollout)} if rollout else {}
    return Task(f"{agent}/{task.id}", task.source, task.question, task.answer,
                {**task.metadata, AGENT_KEY: agent, **extra})


def untag(task: Task) -> Task:
    """The agent's original task (inverse of :func:`tag`)."""
    agent = agent_of(task.id)
    meta = {k: v for k, v in task.metadata.items() if k not in (AGENT_KEY, ROLLOUT_KEY)}
    return Task(task.id[len(agent) + 1:], task.source, task.question, task.answer, meta)


def agent_results(results: list[tuple[str, bool, Any]] | dict[str, bool]) -> dict[str, dict[str, bool]]:
    """Held-out results split per agent: ``{agent: {task id: solved}}``.

    Args:
        results: ``EvalResult.results`` (``(task id, correct, answer)`` per task) or a stored
            evaluation (``{task id: correct}``, ``selfrl.record.store.Store.evaluation``).
    """
    pairs = results.items() if isinstance(results, dict) else ((t, c) for t, c, _ in results)
    out: dict[str, dict[str, bool]] = {}
    for task_id, correct in pairs:
        out.setdefault(agent_of(task_id), {})[task_id] = bool(correct)
    return out


class AgentsEnv(Env):
    """Several agents' environments as one (see the module docstring).

    Args:
        agents: the ``[[agents]]`` of the run (at least one).
        task: the run's ``[task]`` (defaults for each agent's ``num_train`` and seeds).
        gate: the run's ``[gate]`` (defaults for ``val_size`` and ``tolerance``).

    Raises:
        ValueError: no agents, an agent's environment cannot be built (unknown name, bad options),
            or its ``rollout.tools`` names an unknown tool (the valid ones listed).
    """

    name = "agents"
    description = "several agents, each on its own environment, into one learner ([[agents]])"

    def __init__(self, agents: list[AgentConfig], task: TaskConfig | None = None, gate: GateConfig | None = None):
        from selfrl.envs.registry import build_env

        if not agents:
            raise ValueError("AgentsEnv needs at least one agent")
        self.agents, self.task, self.gate = agents, task or TaskConfig(), gate or GateConfig()
        self.envs: dict[str, Env] = {}
        for a in agents:
            try:
                self.envs[a.name] = build_env(a.source, a.options, f"[[agents]] {a.name!r}")
            except ValueError as e:
                raise ValueError(f"agent {a.name}: {e}") from e
            if "tools" in a.rollout:
                from selfrl.core.tools import resolve_tools

                try:
                    resolve_tools(a.rollout["tools"])
                except ValueError as e:  # UnknownToolError is one
                    raise ValueError(f"agent {a.name}: rollout.tools: {e}") from e

    @property
    def tolerance(self) -> dict[str, float]:
        """``{agent: largest allowed held-out drop}``."""
        return {a.name: self.gate.tolerance if a.tolerance is None else a.tolerance for a in self.agents}

    def env(self, task: Task) -> tuple[Env, Task]:
        """The agent's environment and its original task."""
        agent = agent_of(task.id)
        if agent not in self.envs:
            raise ValueError(f"task {task.id}: unknown agent {agent!r}; agents: {', '.join(self.envs)}")
        return self.envs[agent], untag(task)

    # -- tasks ---------------------------------------------------------------------------

    def split(self, n_train: int, n_val: int, train_seed: int, val_seed: int) -> tuple[list[Task], list[Task]]:
        """Each agent's own split (its settings, else these), tagged; training interleaved round-robin."""
        trains, val = [], []
        for a in self.agents:
            t, v = self.envs[a.name].split(n_train if a.num_train is None else a.num_train,
                                           n_val if a.val_size is None else a.val_size,
                                           train_seed if a.train_seed is None else a.train_seed,
                                           val_seed if a.val_seed is None else a.val_seed)
            trains.append([tag(a.name, x, a.rollout) for x in t])
            val += [tag(a.name, x, a.rollout) for x in v]
        train = [x for row in zip_longest(*trains) for x in row if x is not None]
        assert_disjoint(train, val)
        return train, val

    def sample(self, n: int, seed: int) -> list[Task]:
        """``n`` tasks, the agents in turn (agent ``k`` samples its share from ``seed``)."""
        k = len(self.agents)
        per = [self.envs[a.name].sample(n // k + (i < n % k), seed) for i, a in enumerate(self.agents)]
        tagged = [[tag(a.name, x, a.rollout) for x in p] for a, p in zip(self.agents, per)]
        return [x for row in zip_longest(*tagged) for x in row if x is not None]

    def probe_tasks(self) -> list[Task]:
        return [tag(a.name, t, a.rollout) for a in self.agents for t in self.envs[a.name].probe_tasks()]

    # -- verifier and state, answered by the task's agent --------------------------------

    def score(self, task: Task, answer: str | None) -> float:
        env, inner = self.env(task)
        return env.score(inner, answer)

    def correct(self, task: Task, answer: str | None) -> bool:
        env, inner = self.env(task)
        return env.correct(inner, answer)

    def trajectory_answer(self, traj) -> str | None:
        return self.envs[self._agent(traj.task_id)].trajectory_answer(traj)

    def make_env(self, task: Task):
        env, inner = self.env(task)
        return env.make_env(inner)

    def agreement_scores(self, task: Task, group: list) -> dict[str, float | None]:
        """The agent's label-free agreement scores (``selfrl.envs.rewards.agreement``); an agent whose
        environment has none gets ``self_consistency``, as ``agreement`` gives a single environment."""
        from selfrl.envs.rewards import RewardContext, self_consistency

        env, inner = self.env(task)
        if hasattr(env, "agreement_scores"):
            return env.agreement_scores(inner, group)
        ctx = RewardContext(inner, env, group)
        return {t.id: self_consistency(t, ctx) for t in group}

    def _agent(self, task_id: str) -> str:
        agent = agent_of(task_id)
        if agent not in self.envs:
            raise ValueError(f"task {task_id}: unknown agent {agent!r}; agents: {', '.join(self.envs)}")
        return agent
