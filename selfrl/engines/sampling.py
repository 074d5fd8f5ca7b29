"""Choosing the next token of every row from its logits, with the logprob the learner recomputes.

Pure function, one row per sequence; each row has its own temperature, greedy flag
and nucleus. The recorded logprob is always ``log_softmax(logits / temperature)``
at the chosen id over the whole vocabulary (temperature 1 for greedy rows), exactly
what ``selfrl.rl.logprobs.per_token_logps`` recomputes; ``top_p`` only narrows the
set the id is drawn from (as in ``selfrl.engine.Engine``).
"""

from __future__ import annotations

import torch


def nucleus_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """(B, V) True for the ids outside each row's nucleus: the smallest set of most
    probable ids whose probability reaches ``top_p`` (B,); the top id is always kept
    (the rule of Hugging Face's ``TopPLogitsWarper``: drop the ids whose ascending
    cumulative probability is <= 1 - top_p).

    >>> nucleus_mask(torch.tensor([[0.5, 0.3, 0.2]]), torch.tensor([0.7])).tolist()
    [[False, False, True]]
    """
    sorted_p, order = probs.sort(dim=-1)  # ascending (B, V)
    drop_sorted = sorted_p.cumsum(dim=-1) <= (1 - top_p)[:, None]  # (B, V)
    drop_sorted[:, -1] = False
    return drop_sorted.scatter(-1, order, drop_sorted)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next id and its logprob for every row.

    Args:
        logits: (B, V) fp32 next-token logits.
        temperature: (B,) > 0 for sampled rows (ignored for greedy ones).
        greedy: (B,) bool, argmax rows.
        top_p: (B,) in (0, 1]; 1 = the whole vocabulary.

    Returns:
        ``ids`` (B,) long and ``logps`` (B,) fp32: ``log_softmax(logits / t)[id]`` with
        ``t = 1`` for greedy rows. Sampling draws from the global torch generator
        (``torch.manual_seed`` makes it repeatable).
    """
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # (B,)
    logp = torch.log_softmax(logits.float() / scale[:, None], dim=-1)  # (B, V)
    ids = logits.argmax(dim=-1)  # (B,)
    sampled = ~greedy
    if bool(sampled.any()):
        probs = logp[sampled].exp()  # (b, V)
        p = top_p[sampled]
        if bool((p < 1).any()):
            probs = probs.masked_fill(nucleus_mask(probs, p), 0.0)
        ids[sampled] = torch.multinomial(probs, 1).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
