"""Off-policy correction between the sampler and the learner: truncated importance
sampling (TIS) and the sampler/learner mismatch KL, as pure functions.

The tokens of a batch were drawn by the *sampler* (the behaviour policy mu: the
serving engine, a quantized or bf16 server, or an older version), whose log-probs
are recorded on the trajectory. The learner recomputes the same tokens under its own
numerics (pi_old, the proximal policy of the PPO ratio). When the two differ, the
policy gradient is biased; each token's PG term is reweighted by

    w_t = min(exp(old_logp_t - sampler_logp_t), cap)

(Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"; the decoupled PPO objective of Hilton et al. 2021 with the behaviour ratio
truncated as in Espeholt et al. 2018's IMPALA). verl's rollout importance sampling
(token level, ``rollout_is_threshold`` 2.0), TRL's
``vllm_importance_sampling_correction`` (cap 2.0, 3.0 in later versions), ART and SkyRL do
the same.

Departures, and why:

* The log-ratio is clamped to [-20, 20] before the exponential
  (``selfrl.rl.losses.LOG_RATIO_BOUND``, as verl does), so a token the sampler gave
  probability 0 (log-prob -inf) gets the cap, not inf * 0 = NaN. NaN stays NaN, so
  a corrupt sampler log-prob is caught by the learner's not-finite guard.
* Token level only (no sequence-level product, no rejection of outliers): the
  sequence-level weight's variance grows with length, and the caps of the field
  are per token by default.
* When the two numerics are identical the weight is exactly 1.0 and the update is
  the one without correction, bit for bit.
"""

from __future__ import annotations

import torch

from selfrl.rl.losses import LOG_RATIO_BOUND, safe_exp_log_ratio


def tis_weights(old_per_token_logps: torch.Tensor, sampler_per_token_logps: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old - sampler), cap)`` per token, no gradient.

    Args:
        old_per_token_logps: (B, T) log-probs of the sampled tokens under the learner
            before the update (pi_old).
        sampler_per_token_logps: (B, T) log-probs recorded by the sampler (mu).
        cap: the truncation C > 0 (``TrainConfig.tis_cap``).

    Returns:
        (B, T) float weights in [0, cap] (NaN where an input is NaN); 1.0 exactly where
        the two log-probs are equal. Positions outside ``completion_mask`` are
        meaningless and must be masked by the caller.

    Raises:
        ValueError: ``cap`` not > 0, or the shapes differ.

    >>> tis_weights(torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-1.0, -2.0, -0.5]]), 2.0)
    tensor([[1.0000, 2.0000, 0.6065]])
    """
    if not cap > 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    if old_per_token_logps.shape != sampler_per_token_logps.shape:
        raise ValueError(f"shapes differ: {tuple(old_per_token_logps.shape)} and {tuple(sampler_per_token_logps.shape)}")
    weights = safe_exp_log_ratio((old_per_token_logps - sampler_per_token_logps).detach())  # (B, T)
    return torch.clamp(weights, max=cap)  # (B, T)


def mismatch_kl(old_per_token_logps: torch.Tensor, sampler_per_token_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(sampler || learner) on tokens drawn by the sampler; >= 0; (B, T).

    With ``r = pi_old / mu = exp(old - sampler)`` (log-ratio clamped to [-20, 20]),
    ``k3 = r - 1 - log r`` (Schulman 2020): unbiased for KL(mu || pi_old) because the
    tokens come from mu, never negative, and 0 exactly when the log-probs are equal.
    verl logs the same quantity as ``rollout_corr/k3_kl``. Not capped: it is a
    measurement, not a loss term. Computed in float64 with ``expm1``: a float32
    mismatch of 1e-4 per token has k3 = 5e-9, which ``exp(x) - 1 - x`` in float32
    cancels to 0 (or below).

    >>> round(float(mismatch_kl(torch.tensor([-1.0]), torch.tensor([-2.0]))), 6)  # e^1 - 1 - 1
    0.718282
    """
    log_ratio = (old_per_token_logps - sampler_per_token_logps).detach().double()  # (B, T)
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.expm1(log_ratio) - log_ratio  # (B, T) float64
