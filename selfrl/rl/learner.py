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
* Off-policy correction (``tis_cap``, on by default): the PPO ratio is taken against
  the learner's own log-probs before the update (the first pass's forward, detached,
  so no extra forward runs), and each token's policy-gradient term is weighted by
  ``min(exp(old - sampler), tis_cap)`` (truncated importance sampling,
  ``selfrl.rl.off_policy``), as TRL's ``vllm_importance_sampling_correction`` and
  verl's rollout importance sampling do. Where sampler and learner compute the same
  log-probs the weight is exactly 1 and the update is the uncorrected one. With
  ``tis_cap = 0`` the sampler's log-probs are the PPO old log-probs (no correction).
  ``mismatch_kl`` (KL(sampler || learner), k3, per token) is logged either way.
* Sequences without a trainable token (``completion_mask`` all 0) never reach the
  loss, its normaliser or the token metrics.
* Anomaly skip: an update is skipped, weights and AdamW state left exactly as
  they were, when the batch's reward spread, the KL measured in the forward pass
  or the gradient norm before clipping is beyond its threshold, or a loss or the
  gradient norm is not finite (:func:`skip_reason`); the metrics say why
  (:class:`UpdateResult` ``reason``). TRL has no such guard.
* No-gradient skip: a batch whose gradient is exactly zero (every token's ratio
  clipped, every token masked) is not applied either (``no_gradient``): applying it
  would save a new version identical to its parent, or one moved by AdamW's
  momentum alone.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfrl.core import faults
from selfrl.config import TrainConfig
from selfrl.model.device import PeakMemory, enable_gradient_checkpointing, gradient_checkpointing_on, model_device
from selfrl.rl.batch import TensorBatch, collate, micro_batches
from selfrl.rl.logprobs import decoder_and_head, per_token_logps, tree_by_default
from selfrl.rl.losses import Normalizer, get_loss_aggregation, k3_kl, per_token_loss
from selfrl.rl.off_policy import mismatch_kl, tis_weights
from selfrl.core.trajectory import Trajectory


class SkipReason(str, enum.Enum):
    """Why an update was not applied."""

    NO_SIGNAL = "no_signal"  # no sequence has a non-zero advantage
    NO_TOKENS = "no_tokens"  # no sequence with a non-zero advantage has a trainable token
    NO_GROUP = "no_group"  # no group has two or more samples (serve: set task_key, or request n > 1)
    REWARD_SPREAD = "reward_spread"  # max - min reward beyond train.skip_max_reward_spread
    NOT_FINITE = "not_finite"  # a loss or the gradient norm is NaN or inf
    KL = "kl"  # the forward pass's KL beyond train.skip_max_kl
    GRAD_NORM = "grad_norm"  # the gradient norm beyond train.skip_max_grad_norm
    NO_GRADIENT = "no_gradient"  # the gradient is exactly zero (e.g. every token's ratio clipped)


SKIP_REASONS = tuple(r.value for r in SkipReason)


@dataclass
class UpdateResult:
    """What one update did.

    Attributes:
        skipped: True when the weights and AdamW state were left as they were.
        reason: why it was skipped (None when applied).
        stats: ``loss``, ``kl``, ``clip_ratio``, ``ratio_mean``, ``grad_norm``, ``num_sequences``,
            ``num_tokens``, ``reward_spread``, ``time/update_s`` (those that were measured).
    """

    skipped: bool
    reason: SkipReason | None = None
    stats: dict[str, float] = dataclasses.field(default_factory=dict)

    @classmethod
    def skip(cls, reason: SkipReason, **stats: float) -> "UpdateResult":
        return cls(True, SkipReason(reason), dict(stats))

    @property
    def note(self) -> str:
        """Why it was skipped, in words ("" when applied)."""
        if not self.skipped:
            return ""
        s = self.stats
        return {
            SkipReason.NO_SIGNAL: "no group had reward spread",
            SkipReason.NO_TOKENS: "no sequence with a nonzero advantage has a trainable token",
            SkipReason.NO_GROUP: "no group had two or more samples: give related requests the same task_key, "
                                 "or request n > 1 samples",
            SkipReason.REWARD_SPREAD: f"reward spread {s.get('reward_spread', math.nan):.3g} beyond "
                                      "train.skip_max_reward_spread",
            SkipReason.NOT_FINITE: "loss or gradient not finite",
            SkipReason.KL: f"KL {s.get('kl', math.nan):.3g} beyond train.skip_max_kl",
            SkipReason.GRAD_NORM: f"gradient norm {s.get('grad_norm', math.nan):.3g} beyond train.skip_max_grad_norm",
            SkipReason.NO_GRADIENT: f"no gradient (gradient norm 0; clip ratio {s.get('clip_ratio', math.nan):.3g})",
        }.get(self.reason, "unknown")

    def metrics(self) -> dict[str, float]:
        """The flat metrics logged per iteration: ``stats``, ``skipped`` (0/1) and
        ``skip_reason_<reason>`` = 1 when skipped."""
        out = {**self.stats, "skipped": float(self.skipped)}
        if self.reason is not None:
            out[f"skip_reason_{self.reason.value}"] = 1.0
        return out


def reward_spread(trajs: list[Trajectory]) -> float:
    """max - min of the batch's finite rewards (0 for fewer than two); NaN or inf rewards give inf.

    >>> from selfrl.core.trajectory import Trajectory as T
    >>> reward_spread([T("a", "g", 0, reward=r) for r in (0.0, 1.0, None, 0.5)])
    1.0
    """
    rewards = [t.reward for t in trajs if t.reward is not None]
    if any(not math.isfinite(r) for r in rewards):
        return math.inf
    return max(rewards) - min(rewards) if len(rewards) > 1 else 0.0


def skip_reason(loss: float, kl: float, grad_norm: float, cfg: TrainConfig) -> str | None:
    """Why an update must not be applied (checked before ``optimizer.step()``), or None.

    ``loss`` and ``kl`` (mean per-token k3 KL, 0 when ``beta == 0``) from the forward
    pass, ``grad_norm`` the L2 norm before clipping. Order: not finite, KL, grad norm.

    >>> cfg = TrainConfig(skip_max_kl=1.0, skip_max_grad_norm=100.0)
    >>> skip_reason(0.1, 0.01, 2.0, cfg), skip_reason(float("nan"), 0.0, 2.0, cfg), skip_reason(0.1, 3.0, 2.0, cfg)
    (None, 'not_finite', 'kl')
    >>> skip_reason(0.1, 0.01, 500.0, cfg)
    'grad_norm'
    """
    if not (math.isfinite(loss) and math.isfinite(kl) and math.isfinite(grad_norm)):
        return "not_finite"
    if kl > cfg.skip_max_kl:
        return "kl"
    if grad_norm > cfg.skip_max_grad_norm:
        return "grad_norm"
    return None


def kl_reference(model, init_adapter: str | None) -> dict[str, torch.Tensor] | None:
    """The KL reference of a policy just built: the adapter it started from (``lora.init_adapter``),
    copied before anything else is loaded into it, or None for the base model (the adapter
    disabled). ``selfrl run`` and ``selfrl serve`` both use this rule."""
    from selfrl.record.adapters import lora_state

    return lora_state(model) if init_adapter else None


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
        tokenizer: the policy's tokenizer, needed only for trajectories sampled under a
            grammar (``Trajectory.constraints``): their masks are replayed
            (``selfrl.chat.constrain.replay_masks``) so that the policy, old and reference
            log-probabilities of a constrained token are all over the allowed ids.

    Raises:
        ValueError: the model has no trainable parameters, ``temperature`` not > 0,
            ``max_completion_length`` < 1, or ``cfg.tis_cap`` < 0.
    """

    def __init__(self, model, cfg: TrainConfig, temperature: float, pad_token_id: int, max_completion_length: int,
                 ref_state: dict[str, torch.Tensor] | None = None, tokenizer=None):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 (the logits are divided by it), got {temperature}")
        if max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {max_completion_length}")
        if not cfg.tis_cap >= 0:
            raise ValueError(f"train.tis_cap must be >= 0 (0: no correction), got {cfg.tis_cap}")
        self.model = model
        self.cfg = cfg
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.max_completion_length = max_completion_length
        self.ref_state = ref_state
        self.tokenizer = tokenizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no trainable parameters (is the LoRA adapter attached and active?)")
        self.device = model_device(model)
        if cfg.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        self.checkpointing = gradient_checkpointing_on(model)
        self.aggregate = get_loss_aggregation(cfg.loss_type)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)

    def set_hyperparameters(self, learning_rate: float, beta: float) -> None:
        """Change the learning rate (also in AdamW's parameter groups) and ``beta`` from the next update on."""
        self.cfg = dataclasses.replace(self.cfg, learning_rate=learning_rate, beta=beta)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate

    def reset_optimizer(self) -> None:
        """Forget AdamW's moments (after a rollback they point along the rejected path)."""
        self.optimizer.state.clear()

    def grammar_masks(self, traj: Trajectory) -> tuple[list[int], torch.Tensor]:
        """The grammar masks of ``traj``'s constrained turns: (positions, (n, V) allowed ids).

        Raises:
            ValueError: the learner has no tokenizer to replay them with.
        """
        if self.tokenizer is None:
            raise ValueError("this learner has no tokenizer, so it cannot replay the grammar masks of "
                             f"trajectory {traj.id} (sampled under rollout.constrain)")
        from selfrl.chat.constrain import Constraint, replay_masks
        from selfrl.engines.reference import eos_ids

        vocab = self.model.get_output_embeddings().weight.shape[0]
        eos = eos_ids(self.model, self.tokenizer)
        positions: list[int] = []
        blocks = []
        for c in traj.constraints:
            ids = traj.token_ids[c["start"]:c["end"]]
            blocks.append(replay_masks(Constraint(c["kind"], c["grammar"]), ids, self.tokenizer, vocab, eos))
            positions += range(c["start"], c["end"])
        return positions, torch.cat(blocks)

    def _collate(self, trajs: list[Trajectory]) -> TensorBatch:
        return collate(trajs, self.pad_token_id, self.grammar_masks).to(self.device)

    def _ref_logps(self, mb: TensorBatch, constrained: bool = True) -> torch.Tensor:
        """(B, T) log-probs under the reference: the base model, or the starting adapter
        copied in place for the pass and the current weights put back after it (``constrained``
        False: over the whole vocabulary, the grammar's masks not replayed)."""
        args = (mb.input_ids, mb.attention_mask, mb.completion_mask, self.temperature)
        kw = {"vocab_masks": mb.vocab_masks if constrained else None}
        if self.ref_state is None:
            with torch.no_grad(), self.model.disable_adapter():
                return per_token_logps(self.model, *args, **kw)
        from peft import set_peft_model_state_dict

        from selfrl.record.adapters import lora_state

        current = lora_state(self.model)
        try:
            set_peft_model_state_dict(self.model, self.ref_state)
            with torch.no_grad():
                return per_token_logps(self.model, *args, **kw)
        finally:
            set_peft_model_state_dict(self.model, current)

    def micro_batches(self, trajs: list[Trajectory]) -> list[range]:
        """Index ranges of ``trajs`` per forward/backward: ``train.micro_batch_size`` rows, and at
        most ``train.micro_batch_tokens`` padded tokens when set (:func:`selfrl.rl.batch.micro_batches`)."""
        return micro_batches([len(t.token_ids) for t in trajs], self.cfg.micro_batch_size,
                             self.cfg.micro_batch_tokens)

    def probe_kl(self, trajs: list[Trajectory], num_sequences: int) -> float | None:
        """Mean per-token k3 KL(current weights || reference) on the first ``num_sequences``
        trajectories of ``trajs`` with an advantage and completion tokens; None when there is
        none or ``num_sequences`` is 0.

        Costs two no-grad forward passes of that many sequences (policy and reference).
        The loop runs it on a new candidate before it serves, so that a destructive update
        is caught at once (the update's own KL measures the weights *before* its step).

        Over the whole vocabulary, also where a grammar constrained the sampling: a grammar that
        leaves one token makes both log-probs 0 there, which hides what an update did to the
        weights (on grammar-constrained turns a learning rate x1000 probed 0.02 with the masks,
        below a ``max_kl`` of 0.1). The loss itself keeps the masks.
        """
        chosen = [t for t in trajs if t.advantage is not None and any(t.completion_mask)][:num_sequences]
        if not chosen:
            return None
        mb = self._collate(chosen)
        with torch.no_grad():
            logps = per_token_logps(self.model, mb.input_ids, mb.attention_mask, mb.completion_mask, self.temperature)
            kl = k3_kl(logps, self._ref_logps(mb, constrained=False))  # (B, T)
        mask = mb.completion_mask  # (B, T)
        return float((kl * mask).sum() / mask.sum())

    def step(self, trajs: list[Trajectory], on_micro_batch: Callable[[], None] | None = None,
             lr_factor: float = 1.0) -> UpdateResult:
        """One update from scored trajectories (``advantage`` set on each), AdamW's step at
        ``learning_rate x lr_factor`` (the run's schedule: :mod:`selfrl.rl.schedule`).

        Returns:
            an :class:`UpdateResult`; its stats are ``loss``, ``kl``, ``clip_ratio``,
            ``ratio_mean``, ``grad_norm``, ``learning_rate`` (AdamW's, this step's), ``mismatch_kl``
            (mean per-token KL(sampler || learner)), ``tis_weight_mean`` and ``tis_capped`` (share of tokens at the cap; both
            when ``tis_cap`` > 0), ``num_sequences``, ``num_tokens``, ``reward_spread`` (when
            skipped for it), ``time/update_s`` (seconds), and the peak memory in bytes once the
            model ran (``memory/peak_cuda_bytes`` on a GPU, ``memory/peak_rss_bytes`` on the CPU;
            see :class:`selfrl.model.device.PeakMemory`). A skipped update leaves the weights
            and the optimizer state exactly as they were.
        """
        t0 = time.perf_counter()
        spread = reward_spread(trajs)
        if spread > self.cfg.skip_max_reward_spread:
            return UpdateResult.skip(SkipReason.REWARD_SPREAD, reward_spread=spread, num_sequences=0.0,
                                     **{"time/update_s": time.perf_counter() - t0})
        signal = [t for t in trajs if t.advantage is not None and t.advantage != 0.0]
        usable = [t for t in signal if t.num_completion_tokens > 0]  # nothing to train on: not in any count
        if not usable:
            scored = Counter(t.group_id for t in trajs if t.advantage is not None)
            lonely = bool(scored) and max(scored.values()) < 2  # no group to compare a sample with
            reason = SkipReason.NO_TOKENS if signal else SkipReason.NO_GROUP if lonely else SkipReason.NO_SIGNAL
            return UpdateResult.skip(reason, num_sequences=0.0, **{"time/update_s": time.perf_counter() - t0})
        # in token order where the learner takes a packed prefix tree: sequences that share prefixes (a
        # group's prompt, its first turns) fall in one micro-batch, whose tree encodes each once
        # (selfrl.rl.tree); else by length, for less padding
        tree = tree_by_default(decoder_and_head(self.model)[0])
        usable.sort(key=(lambda t: t.token_ids) if tree else (lambda t: len(t.token_ids)))
        peak = PeakMemory(self.device)
        micro = [self._collate(usable[r.start:r.stop]) for r in self.micro_batches(usable)]
        norm = Normalizer.of([m.completion_mask for m in micro], self.max_completion_length)
        refs = [self._ref_logps(m) if self.cfg.beta > 0 else None for m in micro]
        eps_high = self.cfg.epsilon_high if self.cfg.epsilon_high is not None else self.cfg.epsilon
        totals = {"loss": 0.0, "kl": 0.0, "clipped": 0.0, "ratio": 0.0}
        # the learner's own log-probs before the update (first pass, detached) and the TIS weights
        olds: list[torch.Tensor | None] = [None] * len(micro)
        weights: list[torch.Tensor | None] = [None] * len(micro)
        off = {"mismatch_kl": 0.0, "tis_weight_mean": 0.0, "tis_capped": 0.0}
        grad_norm = 0.0
        # a skip must leave the weights as they were, also when an earlier pass already stepped
        backup = None
        if self.cfg.num_iterations > 1:
            backup = ([p.detach().clone() for p in self.params], copy.deepcopy(self.optimizer.state_dict()))
        self.model.train()
        for epoch in range(self.cfg.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            totals = dict.fromkeys(totals, 0.0)
            for k, (mb, ref) in enumerate(zip(micro, refs)):
                logps = per_token_logps(self.model, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                        self.temperature, vocab_masks=mb.vocab_masks)
                if olds[k] is None:
                    olds[k] = logps.detach()  # (B, T): the weights have not moved yet in the first pass
                    gap = mismatch_kl(olds[k], mb.old_per_token_logps)  # (B, T)
                    off["mismatch_kl"] += self._token_mean(gap, mb, norm)
                    if self.cfg.tis_cap > 0:
                        weights[k] = tis_weights(olds[k], mb.old_per_token_logps, self.cfg.tis_cap)  # (B, T)
                        off["tis_weight_mean"] += self._token_mean(weights[k], mb, norm)
                        off["tis_capped"] += self._token_mean((weights[k] >= self.cfg.tis_cap).float(), mb, norm)
                old = olds[k] if self.cfg.tis_cap > 0 else mb.old_per_token_logps
                loss_t, parts = per_token_loss(
                    logps, old, mb.advantages, ref, self.cfg.beta, self.cfg.epsilon, eps_high, weights[k]
                )
                loss = self.aggregate(loss_t, mb.completion_mask, norm)
                if faults.active("nan_loss"):
                    loss = loss * float("nan")
                loss.backward()
                faults.point("during_update")
                if on_micro_batch is not None:
                    on_micro_batch()
                totals["loss"] += float(loss.detach())
                totals["kl"] += self._token_mean(parts["kl"], mb, norm)
                totals["clipped"] += self._token_mean(parts["clipped"], mb, norm)
                totals["ratio"] += self._token_mean(parts["ratio"], mb, norm)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.max_grad_norm))
            reason = skip_reason(totals["loss"], totals["kl"], grad_norm, self.cfg)
            if reason is None and grad_norm == 0.0:
                if epoch > 0:  # an earlier pass moved the weights; this one has nothing to add
                    break
                reason = SkipReason.NO_GRADIENT.value
            if reason is not None:
                self.optimizer.zero_grad(set_to_none=True)
                if backup is not None:
                    with torch.no_grad():
                        for p, saved in zip(self.params, backup[0]):
                            p.copy_(saved)
                    self.optimizer.load_state_dict(backup[1])
                self.model.eval()
                return UpdateResult.skip(SkipReason(reason), loss=totals["loss"], kl=totals["kl"],
                                         clip_ratio=totals["clipped"], grad_norm=grad_norm,
                                         num_sequences=float(len(usable)), mismatch_kl=off["mismatch_kl"],
                                         **{"time/update_s": time.perf_counter() - t0, peak.metric: peak.read()})
            step_lr = self.cfg.learning_rate * lr_factor * (1000.0 if faults.active("lr_x1000") else 1.0)
            for group in self.optimizer.param_groups:
                group["lr"] = step_lr
            self.optimizer.step()
            for group in self.optimizer.param_groups:
                group["lr"] = self.cfg.learning_rate
        self.model.eval()
        return UpdateResult(False, None, {
            "loss": totals["loss"], "kl": totals["kl"], "clip_ratio": totals["clipped"],
            "ratio_mean": totals["ratio"], "grad_norm": grad_norm,
            "num_sequences": float(len(usable)), "num_tokens": float(norm.num_tokens),
            "mismatch_kl": off["mismatch_kl"], "learning_rate": step_lr,
            **({"tis_weight_mean": off["tis_weight_mean"], "tis_capped": off["tis_capped"]}
               if self.cfg.tis_cap > 0 else {}),
            "time/update_s": time.perf_counter() - t0, peak.metric: peak.read(),
        })

    @staticmethod
    def _token_mean(values: torch.Tensor, mb: TensorBatch, norm: Normalizer) -> float:
        """This micro-batch's share of the batch's per-token mean of (B, T) ``values``
        (the shares of all micro-batches add up to the mean; ``num_tokens`` >= 1 here)."""
        return float((values * mb.completion_mask).sum()) / max(norm.num_tokens, 1)
