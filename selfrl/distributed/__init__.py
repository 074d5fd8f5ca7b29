"""Distributed rollouts on Ray: rollout workers as actors, one learner, asynchronous
sampling with a staleness bound, and several agents sharing one learner.

Importing this package imports no Ray (``selfrl.distributed.driver`` does, on use):
``selfrl run`` without ``--ray`` never loads it. See ``docs/guides/ray.md``.

The settings are :class:`selfrl.config.DistributedConfig` (``[distributed]``).
- :mod:`selfrl.distributed.staleness`: how stale a sample is, and which are trained (pure).
- :mod:`selfrl.distributed.worker`: the rollout worker (one engine per actor).
- :mod:`selfrl.distributed.driver`: the worker pool and the asynchronous run.
- :mod:`selfrl.distributed.agents`: many agents, one learner: per-agent advantage
  balance and the per-agent gate with its conflict report (pure).
"""
