"""Choosing the next token of every row from its logits, with the logprob the learner recomputes.

Pure function, one row per sequence; each row has its own temperature, greedy flag
and nucleus. The recorded logprob is always ``log_softmax(logits / temperature)``
at the chosen id over the whole vocabulary (temperature 1 for greedy rows), exactly
what ``selfrl.rl.logprobs.per_token_logps`` recomputes; ``top_p`` only narrows the
set the id is drawn from (as in ``selfrl.engines.reference.Engine``).
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


def next_token_logps(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                     allowed: torch.Tensor | None = None) -> torch.Tensor:
    """(B, V) the distribution each row samples from: ``log_softmax(logits / t)`` with
    ``t = 1`` for greedy rows, over the ids ``allowed`` (B, V) bool leaves (a grammar's
    mask, :mod:`selfrl.chat.constrain`; ``-inf`` elsewhere), or over all ids when None.

    >>> next_token_logps(torch.tensor([[0., 0., 0.]]), torch.tensor([1.]), torch.tensor([False]),
    ...                  torch.tensor([[True, True, False]])).exp().tolist()
    [[0.5, 0.5, 0.0]]
    """
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))  # (B, V)
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)  # (B,)
    return torch.log_softmax(logits.float() / scale[:, None], dim=-1)  # (B, V)


def choose_tokens(logp: torch.Tensor, greedy: torch.Tensor, top_p: torch.Tensor,
                  generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """(B,) long: the argmax of ``logp`` (B, V) for greedy rows, a draw from it (within the
    row's nucleus ``top_p``) for the others, from the row's own generator when it has one.

    Raises:
        ValueError: a row of ``logp`` that is NaN (NaN or infinite logits: a diverged adapter), greedy
            or sampled; such a row would otherwise yield an arbitrary id with a NaN logprob.
    """
    # amax, not argmax, for the NaN check: on this CPU argmax over 64 x 49,152 took 2.4 ms, amax 0.12 ms
    if bool(torch.isnan(logp.amax(dim=-1)).any()):
        raise ValueError("cannot choose a token: a row's log-probabilities are NaN (its logits are NaN or infinite)")
    ids = torch.zeros(logp.shape[0], dtype=torch.long)  # (B,)
    if bool(greedy.any()):
        ids[greedy] = logp[greedy].argmax(dim=-1)
    sampled = ~greedy
    if bool(sampled.any()):
        every = bool(sampled.all())
        probs = (logp if every else logp[sampled]).exp()  # (b, V)
        p = top_p if every else top_p[sampled]
        if bool((p < 1).any()):
            probs = probs.masked_fill(nucleus_mask(probs, p), 0.0)
        rows = sampled.nonzero().squeeze(-1).tolist()
        if generators is None or all(generators[i] is None for i in rows):
            u = torch.rand(len(rows))  # (b,) from torch's global generator
        else:
            u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows])  # (b,) one draw per row
        ids[sampled] = inverse_cdf(probs, u)
    return ids


CDF_BLOCK = 256  # ids per block of inverse_cdf's two-level search (at most; a power of two dividing V)


def _block(vocab: int) -> int:
    """The largest power of two up to :data:`CDF_BLOCK` that divides ``vocab``."""
    block = CDF_BLOCK
    while vocab % block:
        block //= 2
    return block


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(b,) long: for each row of ``probs`` (b, V) >= 0 (unnormalised), the id whose cumulative
    mass first exceeds ``u`` (b,) in [0, 1) times the row's total: a draw from the row's
    distribution (inverse transform sampling) for one uniform number a row.

    ``torch.multinomial`` drew the same distribution at about 0.9 ms a row for SmolLM2's 49,152
    ids on this CPU, 15 % of a rollout batch's time. The search runs on two levels: the sums of
    blocks of up to 256 ids (a vectorised reduction), the cumulative sum of those sums to find the
    block, then the cumulative sum within that block alone. One cumulative sum over the whole
    vocabulary, a serial scan, took 3-4 ms for 64 rows; the two levels about a third of that
    (``benchmarks/bench_choice.py``). The two orders of summation round differently, so a point
    within float rounding of a boundary between two ids may go to the other one; the distribution
    is the same. An id of zero mass is never drawn: its cumulative sum equals its predecessor's, so
    no point falls in it; a point that rounding puts past its block or the total is looked up
    again over the whole row (:func:`inverse_cdf_flat`).

    Raises:
        ValueError: a row whose mass is NaN, infinite or zero (NaN or infinite logits), as
            ``torch.multinomial`` refused it.

    >>> inverse_cdf(torch.tensor([[0.2, 0.0, 0.8], [0.5, 0.5, 0.0]]), torch.tensor([0.1, 0.9])).tolist()
    [0, 1]
    >>> inverse_cdf(torch.tensor([[0.2, 0.0, 0.8, 0.0]]), torch.tensor([0.99999999])).tolist()
    [2]
    """
    b, V = probs.shape
    block = _block(V)
    if block < 16 or b == 0:
        return inverse_cdf_flat(probs, u)
    blocks = probs.view(b, V // block, block)  # (b, nb, block)
    csum = blocks.sum(dim=-1).cumsum(dim=-1)  # (b, nb) the mass up to the end of each block
    total = csum[:, -1]  # (b,)
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # NaN or inf logits (a diverged adapter)
        raise ValueError("cannot sample: a row's probabilities contain NaN or inf, or are all zero "
                         "(its logits are not finite)")
    point = u * total  # (b,)
    at = torch.searchsorted(csum, point[:, None], right=True).squeeze(-1).clamp(max=csum.shape[1] - 1)  # (b,)
    before = torch.where(at > 0, csum.gather(-1, (at - 1).clamp(min=0)[:, None]).squeeze(-1), 0.0)  # (b,)
    inside = blocks[torch.arange(b), at]  # (b, block)
    local = torch.searchsorted(inside.cumsum(dim=-1), (point - before)[:, None], right=True).squeeze(-1)  # (b,)
    ids = at * block + local.clamp(max=block - 1)  # (b,)
    off = (local >= block) | (probs.gather(-1, ids[:, None]).squeeze(-1) <= 0)  # rounding at a block's edge (rare)
    if bool(off.any()):
        ids[off] = inverse_cdf_flat(probs[off], u[off])
    return ids


def inverse_cdf_flat(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`inverse_cdf` by one cumulative sum over the whole row (vocabularies without a block
    size, and the rows whose point rounding put past a block's edge).

    Raises:
        ValueError: as :func:`inverse_cdf`.

    >>> inverse_cdf_flat(torch.tensor([[0.2, 0.0, 0.8, 0.0]]), torch.tensor([0.99999999])).tolist()
    [2]
    """
    cdf = probs.cumsum(dim=-1)  # (b, V)
    total = cdf[:, -1]  # (b,)
    if not bool((torch.isfinite(total) & (total > 0)).all()):  # NaN or inf logits (a diverged adapter)
        raise ValueError("cannot sample: a row's probabilities contain NaN or inf, or are all zero "
                         "(its logits are not finite)")
    ids = torch.searchsorted(cdf, (u * total)[:, None], right=True).squeeze(-1)  # (b,)
    # rounding can put a point at or past the total, past the last id with mass (rare): only then is it looked up
    off = (ids >= probs.shape[-1]) | (probs.gather(-1, ids.clamp(max=probs.shape[-1] - 1)[:, None]).squeeze(-1) <= 0)
    if bool(off.any()):
        last = probs.shape[-1] - 1 - (probs[off].flip(-1) > 0).int().argmax(dim=-1)  # the last id with mass
        ids[off] = torch.minimum(ids[off], last)
    return ids


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
                  top_p: torch.Tensor, generators: list[torch.Generator | None] | None = None,
                  allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next id and its logprob for every row.

    Args:
        logits: (B, V) fp32 next-token logits.
        temperature: (B,) > 0 for sampled rows (ignored for greedy ones).
        greedy: (B,) bool, argmax rows.
        top_p: (B,) in (0, 1]; 1 = the whole vocabulary.
        generators: one per row, or None: a row with its own generator draws from it
            alone, so its samples do not depend on which rows share its batch.
        allowed: (B, V) bool or None: the ids each row may take (a grammar's mask); the
            recorded logprob is then the masked distribution's (see :mod:`selfrl.chat.constrain`).

    Returns:
        ``ids`` (B,) long and ``logps`` (B,) fp32: ``log_softmax(logits / t)[id]`` with
        ``t = 1`` for greedy rows. Sampling draws from the global torch generator
        unless the row has its own (``torch.manual_seed`` makes both repeatable).
    """
    logp = next_token_logps(logits, temperature, greedy, allowed)  # (B, V)
    ids = choose_tokens(logp, greedy, top_p, generators)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
