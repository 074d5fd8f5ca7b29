"""Many agents, one learner: how their samples are weighed, and the per-agent gate.

Several agents (different environments, task sets, or users of different
``selfrl serve`` processes) send trajectories to one learner. Our conflict policy:

* **One shared adapter**, trained on every agent's groups, with **per-agent
  advantage normalisation** (:func:`balance_agents`). GRPO's advantages are already
  normalised within a group (one task of one agent); on top of that each agent's
  advantages are divided by their standard deviation over the agent's batch, and
  weighted by ``N / (K * N_agent)``, so each of the K agents carries the same share
  of the update whatever its reward scale and however many samples it sent. This is
  the task balancing of multi-task RL (PopArt, Hessel et al. 2019, normalises the
  scale per task; here per agent, over the batch, without the running statistics).
* **Every agent gates the candidate** (:func:`judge_agents`): each has its own held-out
  set and tolerance, and a candidate is promoted only if no agent's held-out success
  falls by more than its tolerance below the champion's on that agent's set. Otherwise
  the candidate is rejected and each conflict is reported: which agent lost, by how
  much, and on which tasks (the held-out tasks the champion solved and the candidate
  did not).

Per-agent adapters over a shared one are not implemented (docs/guides/many-agents.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from selfrl.rl.advantages import mean_std


def balance_agents(advantages: list[float | None], agents: list[str]) -> list[float | None]:
    """Per-agent advantage normalisation: ``A * N / (K * N_a) / std_a`` (see the module docstring).

    Args:
        advantages: one GRPO advantage per trajectory (None: not trained, left as is).
        agents: the agent of each trajectory.

    Returns:
        the balanced advantages, same order; an agent whose advantages are all equal
        (std 0, no signal) keeps them unchanged (zeros stay zeros).

    Raises:
        ValueError: the lists differ in length.

    >>> [round(a, 4) for a in balance_agents([1.0, -1.0, 2.0, -2.0, 0.0, 0.0], ["a", "a", "b", "b", "b", "b"])]
    [1.5, -1.5, 1.0607, -1.0607, 0.0, 0.0]
    """
    if len(advantages) != len(agents):
        raise ValueError(f"{len(advantages)} advantages but {len(agents)} agents")
    by_agent: dict[str, list[float]] = {}
    for a, g in zip(advantages, agents):
        if a is not None:
            by_agent.setdefault(g, []).append(a)
    n, k = sum(len(v) for v in by_agent.values()), len(by_agent)
    std = {g: mean_std(vals)[1] for g, vals in by_agent.items()}  # finite for any finite advantages
    weight = {g: n / (k * len(vals)) for g, vals in by_agent.items()}
    # a / std first: |a - mean| / std <= sqrt(N_a), so no step overflows (weight / std could, for a tiny std)
    return [None if a is None else (a / std[g] * weight[g] if std[g] > 0 else a) for a, g in zip(advantages, agents)]


@dataclass
class Conflict:
    """One agent the candidate hurts beyond its tolerance.

    Attributes:
        agent: the agent's name.
        champion_success / candidate_success: held-out success on the agent's set (0..1).
        drop: ``champion_success - candidate_success`` (> tolerance).
        tolerance: the agent's tolerance.
        lost_tasks: held-out task ids the champion solved and the candidate failed.
    """

    agent: str
    champion_success: float
    candidate_success: float
    drop: float
    tolerance: float
    lost_tasks: list[str] = field(default_factory=list)

    def message(self) -> str:
        return (f"agent {self.agent}: held-out {self.candidate_success:.3f} < {self.champion_success:.3f} "
                f"- {self.tolerance} (down {self.drop:.3f}); lost tasks {', '.join(self.lost_tasks) or 'none'}")


@dataclass
class AgentsVerdict:
    """The gate's decision over all agents.

    Attributes:
        promoted: no agent lost more than its tolerance.
        success: ``{agent: (champion, candidate)}`` held-out success rates.
        conflicts: the agents that block the promotion (empty when promoted).
    """

    promoted: bool
    success: dict[str, tuple[float, float]]
    conflicts: list[Conflict]

    def report(self) -> str:
        """One line per agent: its two success rates, and the conflicts' details."""
        head = "promoted" if self.promoted else f"rejected: {len(self.conflicts)} agent(s) would lose"
        lines = [head] + [f"  {a}: {c:.3f} -> {n:.3f}" for a, (c, n) in self.success.items()]
        return "\n".join(lines + [f"  conflict: {c.message()}" for c in self.conflicts])


def judge_agents(champion: dict[str, dict[str, bool]], candidate: dict[str, dict[str, bool]],
                 tolerance: dict[str, float]) -> AgentsVerdict:
    """Gate a candidate on every agent's held-out set (see the module docstring).

    Args:
        champion / candidate: ``{agent: {held-out task id: solved}}`` for the champion and
            the candidate (per task, as ``selfrl.safety.gate.evaluate`` records them).
        tolerance: ``{agent: largest allowed drop in held-out success}`` (>= 0).

    Returns:
        the verdict; agents in sorted order; conflicts with their lost tasks sorted.

    Raises:
        ValueError: the agents of the three arguments differ, an agent's held-out tasks
            differ between champion and candidate, a set is empty, or a tolerance < 0.
    """
    if not (set(champion) == set(candidate) == set(tolerance)) or not champion:
        raise ValueError(f"agents differ: champion {sorted(champion)}, candidate {sorted(candidate)}, "
                         f"tolerance {sorted(tolerance)}")
    success, conflicts = {}, []
    for agent in sorted(champion):
        old, new, tol = champion[agent], candidate[agent], tolerance[agent]
        if set(old) != set(new) or not old:
            raise ValueError(f"agent {agent}: champion and candidate were evaluated on different (or no) tasks")
        if tol < 0:
            raise ValueError(f"agent {agent}: tolerance must be >= 0, got {tol}")
        before, after = sum(old.values()) / len(old), sum(new.values()) / len(new)
        success[agent] = (before, after)
        if after < before - tol:
            lost = sorted(t for t in old if old[t] and not new[t])
            conflicts.append(Conflict(agent, before, after, before - after, tol, lost))
    return AgentsVerdict(not conflicts, success, conflicts)
