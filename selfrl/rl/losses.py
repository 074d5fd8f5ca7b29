"""The clipped GRPO objective with a k3 KL penalty, as pure functions.

Per token (Shao et al. 2024, "DeepSeekMath", eq. 3, with PPO clipping from
Schulman et al. 2017, eq. 7):

    ratio_t   = exp(clamp(logp_t - old_logp_t, -20, 20))
    pg_t      = -w_t * min(ratio_t * A, clip(ratio_t, 1 - epsilon_low, 1 + epsilon_high) * A)
    d_t       = clamp(ref_logp_t - logp_t, -20, 20)
    kl_t      = min(exp(d_t) - d_t - 1, 10)                                   (k3, Schulman 2020)
    loss_t    = pg_t + beta * kl_t

``w_t`` is the truncated importance weight of the off-policy correction
(``selfrl.rl.off_policy.tis_weights``), 1 when there is none.

Departures from the formulas as published, and why:

* Every log-ratio is clamped to [-LOG_RATIO_BOUND, LOG_RATIO_BOUND] = [-20, 20]
  before its exponential, and the k3 value is capped at KL_BOUND = 10, as verl
  (``verl/trainer/ppo/core_algos.py``: the PPO ratio and ``kl_penalty`` "low_var_kl")
  and OpenRLHF (``compute_approx_kl``) do. Without the clamp, one token whose policy
  log-prob is -100 against a reference at 0 gives exp(100) = inf, and the whole update
  is thrown away as not finite. e^20 = 4.9e8 is far beyond any ratio that the clip
  range lets through; a k3 of 10 is reached at a probability ratio of about 13.5
  (policy below reference) or e^11 (above). Where a bound is active the token's
  gradient through that term is 0 (the clamp is flat there). A NaN stays NaN, so
  corrupt inputs are still caught by the learner's not-finite guard.

Then the tokens are averaged by one of the aggregations in ``LOSS_TYPES``
(names as in TRL's ``loss_type``). Every aggregation takes its normalizer from
the *whole* batch, so that summing the losses of micro-batches gives exactly the
loss of the batch (gradient accumulation changes nothing). A sequence without a
completion token adds nothing to any sum and is not counted by the normalizer
(:meth:`Normalizer.of`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

LOG_RATIO_BOUND = 20.0  # |log-ratio| limit before any exp (verl core_algos, OpenRLHF compute_approx_kl)
KL_BOUND = 10.0  # upper limit of the per-token k3 value (verl "low_var_kl", OpenRLHF "k3")


def safe_exp_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """``exp(clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))``: finite for any finite or
    infinite input, NaN for NaN; same shape as the input.

    >>> float(safe_exp_log_ratio(torch.tensor(0.0))), bool(torch.isfinite(safe_exp_log_ratio(torch.tensor(1e4))))
    (1.0, True)
    """
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))


def k3_kl(per_token_logps: torch.Tensor, ref_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(policy || reference), in [0, KL_BOUND]; shape as the inputs (B, T).

    ``d = clamp(ref - logp, -20, 20)``, ``k3 = min(e^d - d - 1, 10)`` (Schulman 2020,
    "Approximating KL divergence"; the bounds are verl's and OpenRLHF's, see the module
    docstring). NaN in, NaN out. ``e^d - 1`` is computed as ``expm1(d)``: for a small ``d``
    (1e-3, a policy close to its reference) ``exp(d) - 1`` in float32 loses about 4 of its
    7 digits, and k3 (5e-7) is then mostly rounding error.

    >>> float(k3_kl(torch.tensor([0.0]), torch.tensor([0.0])))
    0.0
    >>> float(k3_kl(torch.tensor([-100.0]), torch.tensor([0.0])))  # e^100 would overflow
    10.0
    """
    delta = torch.clamp(ref_per_token_logps - per_token_logps, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)  # (B, T)
    return torch.clamp(torch.expm1(delta) - delta, max=KL_BOUND)  # (B, T)


def per_token_loss(
    per_token_logps: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    ref_per_token_logps: torch.Tensor | None = None,
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped policy-gradient loss plus ``beta`` times the k3 KL.

    Args:
        per_token_logps: (B, T) log-probs of the sampled tokens under the policy (with grad).
        old_per_token_logps: (B, T) log-probs under the policy that sampled them.
        advantages: (B,) one advantage per sequence.
        ref_per_token_logps: (B, T) log-probs under the reference model; required when beta > 0.
        beta: KL coefficient.
        epsilon_low, epsilon_high: clip range of the ratio (DAPO's asymmetric clip when they differ).
        is_weights: (B, T) per-token weights of the policy-gradient term (truncated importance
            sampling, ``selfrl.rl.off_policy.tis_weights``), no gradient; None means 1.
            The KL term is not weighted (as in TRL and verl).

    Returns:
        ``(loss (B, T), parts)`` where ``parts`` holds the (B, T) tensors ``ratio``,
        ``kl`` (zeros when beta == 0 and no reference is given) and ``clipped`` (0/1).

    Raises:
        ValueError: beta > 0 without reference log-probs.
    """
    if beta > 0 and ref_per_token_logps is None:
        raise ValueError("beta > 0 needs ref_per_token_logps")
    adv = advantages.unsqueeze(1)  # (B, 1)
    ratio = safe_exp_log_ratio(per_token_logps - old_per_token_logps)  # (B, T)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)  # (B, T)
    unclipped_obj = ratio * adv  # (B, T)
    clipped_obj = clipped_ratio * adv  # (B, T)
    loss = -torch.min(unclipped_obj, clipped_obj)  # (B, T)
    if is_weights is not None:
        loss = loss * is_weights.detach()  # (B, T)
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

    def __post_init__(self):
        if self.num_tokens < 0 or self.num_sequences < 0:
            raise ValueError(f"negative counts: {self.num_tokens} tokens, {self.num_sequences} sequences")
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length}")

    @classmethod
    def of(cls, completion_masks: list[torch.Tensor], max_completion_length: int) -> "Normalizer":
        """Counts of the micro-batches' (B_i, T_i) masks together: every masked token, and the
        sequences with at least one (a sequence with nothing to train on is not counted).

        >>> Normalizer.of([torch.tensor([[0, 1, 1], [0, 0, 0]]), torch.tensor([[1, 0]])], 4)
        Normalizer(num_tokens=3, num_sequences=2, max_completion_length=4)
        """
        return cls(int(sum(float(m.sum()) for m in completion_masks)),
                   sum(int((m.sum(dim=1) > 0).sum()) for m in completion_masks), max_completion_length)


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
