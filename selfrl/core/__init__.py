"""The records every stage passes along, and the few helpers every floor uses; imports nothing
of selfrl outside this package.

- :mod:`selfrl.core.trajectory`: the typed trajectory record (token ids, ``completion_mask``,
  ``logprobs``, tool calls, rewards, the version that sampled it).
- :mod:`selfrl.core.tasks`: tasks, the task source and its verifier, the per-trajectory state
  protocol (``EnvState``), the train/held-out split.
- :mod:`selfrl.core.tools`: tools and their registry (the safe calculator among them).
- :mod:`selfrl.core.errors`: ``ConfigError``, a setting that cannot be honoured, raised on any floor.
- :mod:`selfrl.core.atomic`: atomic small-file writes.
- :mod:`selfrl.core.stats`: confidence intervals for success rates and their changes (Wilson,
  paired, Newcombe), for the gates and the reports.
- :mod:`selfrl.core.faults`: fault injection for the crash-safety tests (``SELFRL_FAULT``).
- :mod:`selfrl.core.wording`: counts in messages (``1 time``, ``2 times``).
"""
