"""Speculative decoding from a row's own context: drafts looked up in the ids a row already holds,
and their exact verification.

A decoding step of few rows on the CPU is bound by reading the weights: on the embedded model a
pass of 1 row took 46 ms and a pass of 1 row x 9 ids 54 ms, 4 rows x 5 ids 76 against 66 ms
(docs/results/benchmarks.md, "Drafts from the row's own context"). So the slot engine feeds a small pass a
few drafted ids after each row's last one and keeps those the model itself would have chosen:
several ids for about the price of one.

- **Drafts** (:func:`lookup_draft`): the ids that followed the latest earlier occurrence of the row's
  last ``n`` ids (``n`` from 4 down to 1) in its prompt and completion. This is prompt lookup
  decoding (Saxena, 2023; vLLM's ``ngram`` speculative method): no draft model, and agents copy a
  lot (tool names and JSON keys from the system prompt, arguments from the task, numbers from a
  tool's reply).
- **How many** (:func:`draft_width`): each row of the pass gets at most ``k`` drafted ids, with
  rows x (1 + k) at most a budget of ids a pass, so that a pass stays in the regime where it
  reads the weights once.
- **Verification** (:func:`verify_drafts`): position ``j`` of a row's pass gives the distribution
  of the id after its ``j`` first drafted ids. The row's id there is chosen exactly as a decoding
  step chooses it (:func:`~selfrl.engines.sampling.choose_tokens`: argmax for greedy rows, one
  uniform number from the row's own generator for the others), and the row goes on to ``j + 1``
  only while that id equals the drafted one. A draft is one fixed sequence (a point mass), so
  this acceptance rule samples exactly the model's distribution: each id kept is a draw from its
  own position's distribution, and each draws one number from the row's generator, as one
  decoding step per id would. A seeded row therefore samples the same ids with or without drafts
  (up to the rounding of the pass's fp32 sums), and its logprobs are the same
  ``log_softmax(logits / temperature)`` at each id. This is the special case of speculative
  sampling (Leviathan et al., 2023, Algorithm 1; Chen et al., 2023) for a deterministic draft.
"""

from __future__ import annotations

import torch

from selfrl.engines.sampling import choose_tokens

MAX_NGRAM = 4  # the longest tail looked up (the longest match is taken)
DRAFT_IDS = 4  # drafted ids a row at most (the slot engine's draft_ids default)
DRAFT_BUDGET = 16  # ids a pass at most, rows x (1 + drafted) (the slot engine's draft_budget default)


def lookup_draft(ids: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Up to ``k`` ids that followed the latest earlier occurrence of the last ``n`` ids of
    ``ids`` (``n = max_ngram`` down to 1; the first ``n`` that occurs gives the draft), or [].

    >>> lookup_draft([5, 6, 7, 9, 5, 6], 3)
    [7, 9, 5]
    >>> lookup_draft([5, 6, 7, 8, 6, 1, 5, 6], 2)   # the tail [5, 6] wins over a later [6]
    [7, 8]
    >>> lookup_draft([1, 2, 3], 4)
    []
    """
    L = len(ids)
    if k <= 0 or L < 2:
        return []
    last = ids[-1]
    for n in range(min(max_ngram, L - 1), 0, -1):
        tail = ids[L - n:]
        for s in range(L - n - 1, -1, -1):  # the occurrence's start, latest first (never the tail itself)
            if ids[s + n - 1] == last and ids[s:s + n] == tail:
                return ids[s + n:s + n + k]
    return []


def draft_width(rows: int, k: int = DRAFT_IDS, budget: int = DRAFT_BUDGET) -> int:
    """Drafted ids a row for a pass of ``rows`` rows: the most, at most ``k``, with
    ``rows * (1 + width) <= budget``; 0 when not even one fits.

    >>> [draft_width(r, 4, 32) for r in (1, 4, 8, 9, 16, 17)]
    [4, 4, 3, 2, 1, 0]
    """
    if rows < 1:
        return 0
    return max(0, min(k, budget // rows - 1))


def verify_drafts(logp: torch.Tensor, drafts: list[list[int]], greedy: torch.Tensor, top_p: torch.Tensor,
                  generators: list[torch.Generator | None] | None = None) -> list[list[int]]:
    """The ids each row keeps from a pass over its last id and its drafted ids (the module docstring).

    Args:
        logp: (B, T, V) each row's sampling distribution (``next_token_logps``) at each position of
            the pass: position ``j`` follows the row's last id and its first ``j`` drafted ids.
        drafts: per row, its drafted ids (at most ``T - 1``; may be empty).
        greedy: (B,) bool; top_p: (B,) in (0, 1]; generators: one per row, or None (torch's global
            generator), as in :func:`~selfrl.engines.sampling.choose_tokens`.

    Returns:
        per row, the ids chosen, in order: 1 to ``len(drafts[i]) + 1`` of them, all but the last equal
        to the drafted ones; the last is the first choice that differs from the draft, or the choice
        after the whole draft. A row whose distribution at a position past its first is NaN keeps
        the ids before it (the next step fails the row, as it fails any NaN row).

    Raises:
        ValueError: a row whose first position is NaN (as ``choose_tokens``); a draft longer than
            ``T - 1``.
    """
    B, T, _ = logp.shape
    if any(len(d) > T - 1 for d in drafts):
        raise ValueError(f"a draft is longer than the pass allows ({T - 1} ids)")
    chosen: list[list[int]] = [[] for _ in range(B)]
    nan = torch.isnan(logp).any(dim=-1).tolist()  # (B, T)
    active = list(range(B))
    for j in range(T):
        if j:
            active = [i for i in active if not nan[i][j]]
        if not active:
            break
        idx = torch.tensor(active)
        ids = choose_tokens(logp[idx, j], greedy[idx], top_p[idx],
                            None if generators is None else [generators[i] for i in active])
        still = []
        for i, t in zip(active, ids.tolist()):
            chosen[i].append(t)
            if j < len(drafts[i]) and t == drafts[i][j]:
                still.append(i)
        active = still
    return chosen
