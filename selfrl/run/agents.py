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
* **Every agent gates the candidate** (``selfrl.run.loop.Runner.agents_gate``), by the
  no-forgetting rule :mod:`selfrl.safety.families` that ``selfrl serve``'s families use too:
  each agent has its own held-out set and tolerance, and a candidate is promoted only if no
  agent's held-out success falls by more than its tolerance below the best any promoted
  version (or the base) had on that agent's set. Otherwise the candidate is rejected and
  each conflict is reported: which agent lost, by how much (with Wilson intervals and the
  paired difference), and on which tasks (the held-out tasks the reference solved and the
  candidate did not).

Per-agent adapters over a shared one are not implemented (docs/guides/many-agents.md).
"""

from __future__ import annotations

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
