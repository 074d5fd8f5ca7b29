"""``selfrl run``: the batch recipe, composing the components below it.

- :mod:`selfrl.run.main`: the entry (:func:`~selfrl.run.main.run`), in this process or on Ray.
- :mod:`selfrl.run.setup`: everything a run is built from, once, and the names its config
  refers to, checked against the registries.
- :mod:`selfrl.run.loop`: the loop body, a handful of named calls per iteration (:class:`~selfrl.run.loop.Runner`).
- :mod:`selfrl.run.order`: the order the iterations walk the training set.
- :mod:`selfrl.run.result`: what a run ends with (the version served, the report's totals).
- :mod:`selfrl.run.cycle`: one update cycle, shared with ``selfrl serve``: detectors,
  advantages, the GRPO update, the candidate, the collapse rules, the gate.
- :mod:`selfrl.run.warm_start`: rejection-sampling fine-tuning before RL.
- :mod:`selfrl.run.signal`: where the learning signal is (task choice, the pre-flight check).
- :mod:`selfrl.run.sampler_sync`: a sampler in another process kept in step with the learner.
- :mod:`selfrl.run.agents`: several agents, one learner (advantage balance, per-agent gate).
- :mod:`selfrl.run.metrics`: where a run's numbers go (store, ``metrics.jsonl``, TensorBoard), an
  iteration's numbers and its progress line.
- :mod:`selfrl.run.progress`, :mod:`selfrl.run.shutdown`: what the user sees while a run goes,
  and SIGTERM or SIGHUP stopping it (or a server) as Ctrl-C does.
- :mod:`selfrl.run.ray`: rollouts on Ray workers (``--ray``).
"""
