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
* **Every agent gates the candidate** (:func:`agents_gate`), by the
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

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from selfrl.record.versions import EventKind
from selfrl.rl.advantages import mean_std

if TYPE_CHECKING:
    from selfrl.record.versions import Ledger
    from selfrl.safety.gate import EvalResult


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


def agents_gate(ledger: Ledger, tolerance: Mapping[str, float], step: int, res: EvalResult,
                log: Callable[[str], None]) -> tuple[str, dict] | None:
    """Each agent's gate on its own held-out tasks, by the no-forgetting rule
    (:func:`selfrl.safety.families.judge_families`) against the best stored result of a
    promoted version (or the base) per agent: logs ``val/<agent>`` and records one
    ``agent_conflict`` event per agent the candidate hurts beyond its tolerance (``tolerance``:
    agent -> the largest drop allowed, the task source's); says each agent's change through ``log``; returns the veto (the conflicts' message,
    and the ``reject`` event's data), or None when no agent loses."""
    from selfrl.envs.agents import agent_results
    from selfrl.safety.families import best_per_family, judge_families

    candidate = agent_results(res.results)
    refs = {v: agent_results(ev) for v, ev in ledger.reference_evaluations().items()}
    reference, versions = best_per_family(refs, candidate)
    verdict = judge_families(reference, candidate, tolerance, reference_version=versions)
    ledger.store.log_metrics(ledger.run_id, step, {f"val/{a}": new for a, (_, new) in verdict.success.items()})
    for c in verdict.dropped:
        ledger.event(EventKind.AGENT_CONFLICT, f"iteration {step}: version {res.version}: {c.message('agent')}", {
            "version": res.version, "champion": ledger.champion.version, "agent": c.family, **c.to_dict()})
    log(f"iteration {step}: agents' gate for version {res.version}: " +
        "; ".join(f"{a} {old:.3f} -> {new:.3f}" for a, (old, new) in verdict.success.items()))
    if verdict.passed:
        return None
    return verdict.message("agent"), {"agents": [c.to_dict() for c in verdict.dropped]}
