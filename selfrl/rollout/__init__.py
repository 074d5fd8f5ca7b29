"""Rollouts: the policy samples trajectories of tasks, calling tools.

- :mod:`selfrl.rollout.agent`: the agent loop, multi-turn rollouts with tool calls batched
  across trajectories (:func:`~selfrl.rollout.agent.rollout`).
- :mod:`selfrl.rollout.prefetch`: the next batch sampled while the update trains
  (``--async-rollouts``), by a copy of the adapter.
- :mod:`selfrl.rollout.staleness`: how stale a sample is, and which samples are trained.
"""
