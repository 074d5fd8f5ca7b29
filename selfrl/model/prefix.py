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


def group_repeats(prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """Order ``prompts`` so that each distinct prompt's first occurrence comes first (in order),
    then the repeats; returns ``(order, copies)``, ``order`` the indices of ``prompts`` in that
    order and ``copies[j]`` the position in ``order`` of the first occurrence that the j-th repeat
    repeats (the slot engine prefills the first occurrences and copies the rest).

    >>> group_repeats([[1, 2], [3], [1, 2], [3], [1, 2]])
    ([0, 1, 2, 3, 4], [0, 1, 0])
    >>> group_repeats([[5], [5], [6]])
    ([0, 2, 1], [0])
    """
    seen: dict[tuple[int, ...], int] = {}
    unique, repeats, copies = [], [], []
    for i, p in enumerate(prompts):
        k = seen.setdefault(tuple(p), len(unique))
        if k == len(unique):
            unique.append(i)
        else:
            repeats.append(i)
            copies.append(k)
    return unique + repeats, copies
