"""The clipped GRPO objective with a k3 KL penalty, as pure functions.

Per token (Shao et al. 2024, "DeepSeekMath", eq. 3, with PPO clipping from
Schulman et al. 2017, eq. 7):

    ratio_t   = exp(logp_t - old_logp_t)
    pg_t      = -min(ratio_t * A, clip(ratio_t, 1 - epsilon_low, 1 + epsilon_high) * A)
    kl_t      = exp(ref_logp_t - logp_t) - (ref_logp_t - logp_t) - 1        (k3, Schulman 2020)
    loss_t    = pg_t + beta * kl_t

Then the tokens are averaged by one of the aggregations in ``LOSS_TYPES``
(names as in TRL's ``loss_type``). Every aggregation takes its normalizer from
the *whole* batch, so that summing the losses of micro-batches gives exactly the
loss of the batch (gradient accumulation changes nothing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference); >= 0; shape as the inputs (B, T).

    >>> float(k3_kl(torch.tensor([0.0]), torch.tensor([0.0])))
    0.0
    """
    delta = ref_per_token_logps - per_token_logps
    return torch.exp(delta) - delta - 1.0


def per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped policy-gradient loss plus ``beta`` times the k3 KL.

    Args:
        per_token_logps: (B, T) log-probs of the sampled tokens under the policy (with grad).
        old_per_token_logps: (B, T) log-probs under the policy that sampled them.
        advantages: (B,) one advantage per sequence.
        ref_per_token_logps: (B, T) log-probs under the reference model; required when beta > 0.
        beta: KL coefficient.
        epsilon_low, epsilon_high: clip range of the ratio (DAPO's asymmetric clip when they differ).

    Returns:
        ``(loss (B, T), parts)`` where ``parts`` holds the (B, T) tensors ``ratio``,
        ``kl`` (zeros when beta == 0 and no reference is given) and ``clipped`` (0/1).

    Raises:
        ValueError: beta > 0 without reference log-probs.
    """
    if beta > 0 and ref_per_token_logps is None:
        raise ValueError("beta > 0 needs ref_per_token_logps")
    adv = advantages.unsqueeze(1)  # (B, 1)
    ratio = torch.exp(per_token_logps - old_per_token_logps)  # (B, T)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # (B, T)
    unclipped_obj = ratio * adv  # (B, T)
    clipped_obj = clipped_ratio * adv  # (B, T)
    loss = -torch.min(unclipped_obj, clipped_obj)  # (B, T)
    if ref_per_token_logps is not None:
        kl = k3_kl(per_token_logps, ref_per_token_logps)  # (B, T)
    else:
        kl = torch.zeros_like(per_token_logps)
    if beta > 0:
        loss = loss + beta * kl
    clipped = (clipped_obj < unclipped_obj).float()  # (B, T): where the clip bound was active
    return loss, {"ratio": ratio.detach(), "kl": kl.detach(), "clipped": clipped.detach()}


@dataclass(frozen=True)
class Normalizer:
    """Counts over the whole batch (all micro-batches) that a loss aggregation divides by.

    Attributes:
        num_tokens: completion tokens in the batch.
        num_sequences: sequences in the batch.
        max_completion_length: the per-sequence completion-token limit (Dr. GRPO's constant).
    """

    num_tokens: int
    num_sequences: int
    max_completion_length: int


def loss_dapo(loss: torch.Tensor, completion_mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Token-level mean over the batch (DAPO, Yu et al. 2025): ``sum(loss * mask) / num_tokens``."""
    return (loss * completion_mask).sum() / max(norm.num_tokens, 1)


def loss_grpo(loss: torch.Tensor, completion_mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Sequence-level mean (original GRPO): mean over tokens of each sequence, then over sequences."""
    per_seq = (loss * completion_mask).sum(dim=1) / completion_mask.sum(dim=1).clamp(min=1)  # (B,)
    return per_seq.sum() / max(norm.num_sequences, 1)


def loss_dr_grpo(loss: torch.Tensor, completion_mask: torch.Tensor, norm: Normalizer) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): ``sum(loss * mask) / (num_sequences * max_completion_length)``."""
    return (loss * completion_mask).sum() / max(norm.num_sequences * norm.max_completion_length, 1)


LOSS_TYPES: dict[str, Callable[[torch.Tensor, torch.Tensor, Normalizer], torch.Tensor]] = {
    "dapo": loss_dapo,
    "grpo": loss_grpo,
    "dr_grpo": loss_dr_grpo,
}


def get_loss_aggregation(name: str):
    """The aggregation registered as ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return LOSS_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown loss_type {name!r}; valid: {', '.join(sorted(LOSS_TYPES))}") from None
