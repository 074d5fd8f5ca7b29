"""Per-token log-probabilities of given tokens, without materialising full-vocabulary
logits for every position.

A forward pass over B x T tokens with a 49,152-token vocabulary would hold
B*T*V floats of logits and as many of their log-softmax (FINDINGS: 12.5 GB peak
for 32 x 128 tokens). We run the decoder once for hidden states, then apply the
output layer only at the positions whose next token is a completion token, in
chunks, each recomputed in the backward pass (``torch.utils.checkpoint``), so
memory grows with the number of completion tokens times the chunk, not T x V.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from selfrl.prefix import shared_prefix_len


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index)`` for (..., V) logits and (...) index.

    Naive equivalent: ``torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)``.
    """
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float,
                 allowed: torch.Tensor | None = None):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature  # (C, V)
    if allowed is not None:  # (C, V) bool: the grammar's masks, replayed (selfrl.constrain.replay_masks)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return selective_log_softmax(logits, targets)  # (C,)


def _decoder_and_head(model):
    """(decoder, lm_head) of a causal LM, through peft's wrapper when there is one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def per_token_logps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 512,
    share_prefix: bool = True,
    vocab_masks: "VocabMasks | None" = None,
) -> torch.Tensor:
    """Log-prob of each token given its prefix, at completion positions only.

    Args:
        model: a causal LM (or a peft model wrapping one).
        input_ids: (B, T) right-padded token ids.
        attention_mask: (B, T) 1 on real tokens.
        completion_mask: (B, T) 1 where the token was sampled by the policy; position 0
            is never a completion token.
        temperature: logits are divided by it, as at sampling time.
        chunk_size: rows of the output layer computed at once.
        share_prefix: encode the rows' common prefix once (``selfrl.prefix``); exact,
            gradients included.
        vocab_masks: the grammar masks of constrained tokens (:class:`VocabMasks`): at
            those positions the log-softmax runs over the allowed ids only, as when they
            were sampled; None: every position over the whole vocabulary.

    Returns:
        (B, T) float32 log-probs; 0 where ``completion_mask`` is 0. With no completion
        token at all it is all zeros, still attached to the graph (a backward through it
        gives zero gradients instead of an error).

    Raises:
        ValueError: ``temperature`` not > 0 (the logits are divided by it).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the logits are divided by it), got {temperature}")
    decoder, head = _decoder_and_head(model)
    B, T = input_ids.shape
    start = _prefix_len(input_ids, attention_mask, completion_mask) if share_prefix and B > 1 else 0
    if start:
        cache = decoder(input_ids=input_ids[:1, :start], use_cache=True).cache
        cache.batch_repeat_interleave(B)
        positions = torch.arange(start, T, device=input_ids.device).unsqueeze(0).expand(B, -1)  # (B, T-S)
        hidden = decoder(
            input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=positions,
            cache=cache, use_cache=True,
        ).last_hidden_state  # (B, T-S, H): positions start..T-1
    else:
        hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state  # (B, T, H)
    mask = completion_mask[:, start + 1:].bool()  # (B, T-S-1): token t+1 is predicted from hidden t
    rows = hidden[:, :-1][mask]  # (M, H)
    targets = input_ids[:, start + 1:][mask]  # (M,)
    which = vocab_masks.index[:, start + 1:][mask] if vocab_masks is not None else None  # (M,) -1 or mask row
    parts = []
    for s in range(0, rows.shape[0], chunk_size):
        allowed = None
        if which is not None and bool((which[s:s + chunk_size] >= 0).any()):
            allowed = vocab_masks.rows(which[s:s + chunk_size], head.weight.shape[0])  # (C, V)
        args = (rows[s:s + chunk_size], head.weight, head.bias, targets[s:s + chunk_size], temperature, allowed)
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logps(*args))
    flat = torch.cat(parts) if parts else rows.sum(dim=-1)  # (M,); (0,) in the graph when M == 0
    out = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device)  # (B, T)
    tail = torch.zeros(mask.shape, dtype=torch.float32, device=input_ids.device)  # (B, T-S-1)
    tail = tail.masked_scatter(mask, flat.float())
    return torch.cat([out[:, :start + 1], tail], dim=1)  # (B, T)


class VocabMasks:
    """Per-position sets of allowed ids for a (B, T) batch: the grammar masks of the
    constrained tokens, replayed by :func:`selfrl.constrain.replay_masks`.

    Args:
        index: (B, T) long, ``k`` where the token at ``(b, t)`` was sampled under mask
            row ``k`` of ``allowed``, -1 where no mask applied.
        allowed: (K, V) bool, the allowed ids of each masked position.
    """

    def __init__(self, index: torch.Tensor, allowed: torch.Tensor):
        self.index, self.allowed = index, allowed

    def rows(self, which: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(C, V) bool for C positions (``which``: (C,) mask row or -1 for no mask)."""
        out = torch.ones(len(which), vocab_size, dtype=torch.bool, device=self.allowed.device)  # (C, V)
        hit = which >= 0
        out[hit] = self.allowed[which[hit]]
        return out

    def to(self, device) -> "VocabMasks":
        return VocabMasks(self.index.to(device), self.allowed.to(device))


def _prefix_len(input_ids: torch.Tensor, attention_mask: torch.Tensor, completion_mask: torch.Tensor) -> int:
    """Common prefix of the rows that ends before any row's first completion token
    (so every completion token is predicted from a hidden state of the batched pass)."""
    lengths = attention_mask.sum(dim=1).tolist()
    has = completion_mask.bool().any(dim=1)
    firsts = completion_mask.float().argmax(dim=1)[has]
    limit = int(firsts.min()) - 1 if len(firsts) else min(lengths) - 1
    rows = [input_ids[i, :n].tolist() for i, n in enumerate(lengths)]
    return shared_prefix_len(rows, limit=limit)
