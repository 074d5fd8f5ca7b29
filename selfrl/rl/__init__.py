"""The RL math, in pure functions with shapes in their docstrings, and the learner that applies it.

- :mod:`selfrl.rl.advantages`: group advantages (GRPO and how we depart from it).
- :mod:`selfrl.rl.losses`: the per-token clipped loss, the KL estimate (``k3_kl``) and the
  loss aggregations.
- :mod:`selfrl.rl.logprobs`: per-token log-probabilities without full-vocabulary logits.
- :mod:`selfrl.rl.off_policy`: truncated importance sampling and the sampler mismatch;
  :mod:`selfrl.rl.feedback_age`: what a judgement that arrives late is worth now.
- :mod:`selfrl.rl.batch`, :mod:`selfrl.rl.tree`: the tensor batch, and the prefix tree of a group.
- :mod:`selfrl.rl.learner`: one GRPO update of the LoRA adapter.
"""
