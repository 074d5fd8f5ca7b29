"""The learner: one GRPO update of the LoRA adapter from scored trajectories.

Departures from TRL's GRPOTrainer, each on purpose:

* Sequences whose advantage is exactly 0 (groups with no reward spread) are not
  run through the model at all. With ``beta == 0`` their gradient is exactly
  zero, so this changes nothing but the time; with ``beta > 0`` the KL is
  estimated on the sequences that carry a learning signal only. A batch with no
  such sequence skips the update (TRL still runs the full forward and backward).
* The reference model is the adapter the run started from; with no starting
  adapter it is the base model, reached by ``disable_adapter()`` (no second copy).
* Log-probs are computed only at completion positions (``selfrl.rl.logprobs``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfrl.rl.batch import TensorBatch, collate
from selfrl.rl.logprobs import per_token_logps
from selfrl.rl.losses import Normalizer, get_loss_aggregation, per_token_loss
from selfrl.trajectory import Trajectory


@dataclass
class TrainConfig:
    """GRPO update settings (names as in TRL's GRPOConfig)."""

    learning_rate: float = 1e-4  # AdamW learning rate for the LoRA parameters
    beta: float = 0.02  # KL coefficient to the reference model (k3 estimator); 0 disables the reference pass
    epsilon: float = 0.2  # lower clip of the importance ratio
    epsilon_high: float | None = None  # upper clip (None = epsilon; DAPO uses 0.28)
    loss_type: str = "dapo"  # token aggregation: dapo | grpo | dr_grpo
    max_grad_norm: float = 1.0  # gradient clipping (L2 norm)
    num_iterations: int = 1  # optimisation passes over each batch (PPO epochs)
    micro_batch_size: int = 8  # sequences per forward/backward (memory bound)
    weight_decay: float = 0.0  # AdamW weight decay
    scale_rewards: str = "group"  # advantage scaling: group (GRPO) | none (Dr. GRPO)


class Learner:
    """Holds the optimizer over the LoRA parameters and runs updates.

    Args:
        model: a ``peft.PeftModel`` whose trainable parameters are the LoRA weights.
        cfg: :class:`TrainConfig`.
        temperature: the sampling temperature (logits are divided by it, as when sampling).
        pad_token_id: id used to pad batches.
        max_completion_length: per-sequence completion-token limit (for ``dr_grpo``).
        ref_state: LoRA state dict of the reference adapter, or None when the
            reference is the base model (the adapter disabled).

    Raises:
        ValueError: the model has no trainable parameters.
    """

    def __init__(self, model, cfg: TrainConfig, temperature: float, pad_token_id: int, max_completion_length: int,
                 ref_state: dict[str, torch.Tensor] | None = None):
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.max_completion_length = max_completion_length
        self.ref_state = ref_state
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (is the LoRA adapter attached and active?)")
        self.aggregate = get_loss_aggregation(cfg.loss_type)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (after a rollback they point along the rejected path)."""
        self.optimizer.state.clear()

    def _ref_logps(self, mb: TensorBatch) -> torch.Tensor:
        """(B, T) log-probs under the reference: the base model, or the starting adapter
        copied in place for the pass and the current weights put back after it."""
        args = (mb.input_ids, mb.attention_mask, mb.completion_mask, self.temperature)
        if self.ref_state is None:
            with torch.no_grad(), self.model.disable_adapter():
                return per_token_logps(self.model, *args)
        from peft import set_peft_model_state_dict

        from selfrl.adapters import lora_state

        current = lora_state(self.model)
        try:
            set_peft_model_state_dict(self.model, self.ref_state)
            with torch.no_grad():
                return per_token_logps(self.model, *args)
        finally:
            set_peft_model_state_dict(self.model, current)

    def step(self, trajs: list[Trajectory], on_micro_batch: Callable[[], None] | None = None) -> dict[str, float]:
        """One update from scored trajectories (``advantage`` set on each).

        Returns:
            metrics: ``loss``, ``kl``, ``clip_ratio``, ``ratio_mean``, ``grad_norm``,
            ``num_sequences``, ``num_tokens``, ``skipped`` (1 when nothing carried signal
            or a value was not finite), ``time/update_s`` (seconds).
        """
        t0 = time.perf_counter()
        usable = [t for t in trajs if t.advantage is not None and t.advantage != 0.0]
        if not usable:
            return {"skipped": 1.0, "skip_reason_no_signal": 1.0, "num_sequences": 0.0, "time/update_s": time.perf_counter() - t0}
        usable.sort(key=lambda t: len(t.token_ids))  # similar lengths per micro-batch: less padding
        micro = [collate(usable[i:i + self.cfg.micro_batch_size], self.pad_token_id)
                 for i in range(0, len(usable), self.cfg.micro_batch_size)]
        norm = Normalizer(sum(m.num_tokens for m in micro), len(usable), self.max_completion_length)
        refs = [self._ref_logps(m) if self.cfg.beta > 0 else None for m in micro]
        eps_high = self.cfg.epsilon_high if self.cfg.epsilon_high is not None else self.cfg.epsilon
        totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "ratio": 0.0}
        grad_norm = 0.0
        # a skip must leave the weights as they were, also when an earlier pass already stepped
        backup = None
        if self.cfg.num_iterations > 1:
            backup = ([p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict()))
        self.model.train()
        for _ in range(self.cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            totals = dict.fromkeys(totals, 0.0)
            for mb, ref in zip(micro, refs):
                logps = per_token_logps(self.model, mb.input_ids, mb.attention_mask, mb.completion_mask, self.temperature)
                loss_t, parts = per_token_loss(
                    logps, mb.old_per_token_logps, mb.advantages, ref, self.cfg.beta, self.cfg.epsilon, eps_high
                )
                loss = self.aggregate(loss_t, mb.completion_mask, norm)
                loss.backward()
                if on_micro_batch is not None:
                    on_micro_batch()
                m = mb.completion_mask
                totals["loss"] += float(loss.detach())
                totals["kl"] += float((parts["kl"] * m).sum()) / max(norm.num_tokens, 1)
                totals["clipped"] += float((parts["clipped"] * m).sum()) / max(norm.num_tokens, 1)
                totals["ratio"] += float((parts["ratio"] * m).sum()) / max(norm.num_tokens, 1)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
            if not (math.isfinite(grad_norm) and math.isfinite(totals["loss"])):
                self.optimizer.zero_grad(set_to_none=True)
                if backup is not None:
                    with torch.no_grad():
                        for p, saved in zip(self.params, backup[0]):
                            p.copy_(saved)
                    self.optimizer.load_state_dict(backup[1])
                self.model.eval()
                return {"skipped": 1.0, "skip_reason_not_finite": 1.0, "loss": totals["loss"],
                        "grad_norm": grad_norm, "time/update_s": time.perf_counter() - t0}
            self.optimizer.step()
        self.model.eval()
        return {
            "loss": totals["loss"], "kl": totals["kl"], "clip_ratio": totals["clipped"],
            "ratio_mean": totals["ratio"], "grad_norm": grad_norm, "skipped": 0.0,
            "num_sequences": float(len(usable)), "num_tokens": float(norm.num_tokens),
            "time/update_s": time.perf_counter() - t0,
        }
