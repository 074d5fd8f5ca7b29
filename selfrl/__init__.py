"""selfrl: continual self-improvement of LLM agents by online reinforcement learning.

The packages follow the data flow, bottom floor first; each imports only from its own floor
and those below it (``tests/test_import_graph.py`` holds it):

- :mod:`selfrl.core`: the trajectory record, tasks and their verifier, tools.
- :mod:`selfrl.model`: loading the policy with its LoRA adapter, its device and products.
- :mod:`selfrl.chat`: chat templates to token ids, tool calls in text, grammars.
- :mod:`selfrl.record`: the store, the version ledger, the adapter folders.
- :mod:`selfrl.engines`: the sampling backends behind one interface.
- :mod:`selfrl.config`: every settings table; it checks values only.
- :mod:`selfrl.rl`: the RL math (advantages, losses, logprobs) and the learner.
- :mod:`selfrl.rollout`: the agent loop that samples trajectories.
- :mod:`selfrl.safety`: the gate, collapse rules, reward-hacking detectors, swap check.
- :mod:`selfrl.envs`: the environments, each whole, with the rewards and sandbox they use.
- :mod:`selfrl.judge`: rewards where no verifier exists (an LLM judge) and its detectors.
- :mod:`selfrl.report`: reports read from the store.
- :mod:`selfrl.run` and :mod:`selfrl.serve`: the two recipes, ``selfrl run`` and ``selfrl serve``.
- :mod:`selfrl.cli`: the console script.
"""

__version__ = "0.1.0"
