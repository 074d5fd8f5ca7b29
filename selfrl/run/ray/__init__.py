"""Distributed rollouts on Ray: rollout workers as actors, one learner, asynchronous
sampling with a staleness bound, and several agents sharing one learner.

Importing this package imports no Ray (``selfrl.run.ray.driver`` does, on use):
``selfrl run`` without ``--ray`` never loads it. See ``docs/guides/ray.md``.

The settings are :class:`selfrl.config.DistributedConfig` (``[distributed]``).
- :mod:`selfrl.run.ray.worker`: the rollout worker (one engine per actor).
- :mod:`selfrl.run.ray.driver`: the worker pool and the asynchronous run.

What they use from below: :mod:`selfrl.rollout.staleness` (how stale a sample is, and
which are trained), :mod:`selfrl.run.agents` (many agents, one learner: per-agent advantage
balance and the per-agent gate) and :mod:`selfrl.envs.agents` (the agents' environments).
"""
