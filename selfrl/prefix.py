"""The common token prefix of a batch: encoded once instead of once per row.

Every rollout of a run starts with the same system prompt and demonstration, and
every member of a GRPO group with the same task. Both the engine (sampling) and
the learner (log-probs with gradient) encode that prefix once and share its
key/value cache across the batch; with the gradient this is exact, since the
cache is repeated with a differentiable op and its gradients sum over rows.
"""

from __future__ import annotations


MIN_SHARED_PREFIX = 16  # tokens; shorter common prefixes are not worth a separate pass


def shared_prefix_len(prompts: list[list[int]], limit: int | None = None) -> int:
    """Length of the common prefix of all prompts, leaving every prompt at least one
    token of its own, and at most ``limit``; 0 when under ``MIN_SHARED_PREFIX`` or
    for a single prompt.

    >>> shared_prefix_len([[1] * 20 + [2], [1] * 20 + [3, 4]])
    20
    """
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    if limit is not None:
        n = min(n, limit)
    first = prompts[0]
    for i in range(n):
        if any(p[i] != first[i] for p in prompts):
            n = i
            break
    return n if n >= MIN_SHARED_PREFIX else 0


