"""Trajectories -> one padded tensor batch for the update."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfrl.rl.logprobs import VocabMasks
from selfrl.core.trajectory import Trajectory

# trajectory -> (positions in token_ids, (n, V) bool allowed ids at each): its grammar masks
MaskReplay = Callable[[Trajectory], tuple[list[int], torch.Tensor]]


@dataclass
class TensorBatch:
    """Right-padded tensors for B trajectories of at most T tokens.

    Attributes:
        input_ids: (B, T) long, the exact sampled/prompt ids; pad elsewhere.
        attention_mask: (B, T) long, 1 on real tokens.
        completion_mask: (B, T) float, 1 on policy-sampled tokens.
        old_per_token_logps: (B, T) float, sampling log-probs (0 where mask is 0).
        advantages: (B,) float.
        vocab_masks: the grammar masks of constrained tokens, or None when no
            trajectory was sampled under a grammar (``Trajectory.constraints``).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    old_per_token_logps: torch.Tensor
    advantages: torch.Tensor
    vocab_masks: VocabMasks | None = None

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device) -> "TensorBatch":
        """The same batch on ``device`` (itself when it is already there)."""
        if self.input_ids.device == torch.device(device):
            return self
        return TensorBatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.completion_mask,
                                                    self.old_per_token_logps, self.advantages)),
                           None if self.vocab_masks is None else self.vocab_masks.to(device))

    @property
    def num_tokens(self) -> int:
        """Completion tokens in the batch."""
        return int(self.completion_mask.sum())


def micro_batches(lengths: list[int], max_sequences: int, max_tokens: int = 0) -> list[range]:
    """Consecutive index ranges that cut rows of ``lengths`` tokens into micro-batches of at most
    ``max_sequences`` rows and, with ``max_tokens`` > 0, at most ``max_tokens`` padded tokens
    (rows x the longest row, what one forward and backward holds); a row longer than
    ``max_tokens`` goes alone. The loss's whole-batch normaliser makes the gradient the same
    however the rows are cut (``selfrl.rl.losses.Normalizer``): this bounds memory only.

    Like verl's dynamic batch size (``ppo_max_token_len_per_gpu``), but the rows keep their order.

    Raises:
        ValueError: ``max_sequences`` < 1 or ``max_tokens`` < 0.

    >>> micro_batches([10, 10, 30, 5], 8, 40)
    [range(0, 2), range(2, 3), range(3, 4)]
    >>> micro_batches([10, 10, 30, 5], 3)
    [range(0, 3), range(3, 4)]
    """
    if max_sequences < 1 or max_tokens < 0:
        raise ValueError(f"max_sequences must be >= 1 and max_tokens >= 0, got {max_sequences} and {max_tokens}")
    out: list[range] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        rows, wide = i - start + 1, max(longest, n)
        if i > start and (rows > max_sequences or (max_tokens and rows * wide > max_tokens)):
            out.append(range(start, i))
            start, wide = i, n
        longest = wide
    if lengths:
        out.append(range(start, len(lengths)))
    return out


def collate(trajs: list[Trajectory], pad_token_id: int, replay: MaskReplay | None = None) -> TensorBatch:
    """Pad trajectories on the right into a :class:`TensorBatch`.

    ``replay`` recomputes the grammar masks of trajectories with ``constraints``
    (``selfrl.chat.constrain.replay_masks`` behind it; the learner passes it).

    Raises:
        ValueError: empty list, a trajectory without an advantage, inconsistent
            token-level lengths, a completion token at position 0, or a trajectory
            with ``constraints`` and no ``replay``.
    """
    if not trajs:
        raise ValueError("collate needs at least one trajectory")
    width = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    input_ids = torch.full((B, width), pad_token_id, dtype=torch.long)  # (B, T)
    attention_mask = torch.zeros((B, width), dtype=torch.long)  # (B, T)
    completion_mask = torch.zeros((B, width), dtype=torch.float32)  # (B, T)
    old = torch.zeros((B, width), dtype=torch.float32)  # (B, T)
    adv = torch.zeros(B, dtype=torch.float32)  # (B,)
    for i, t in enumerate(trajs):
        t.check()
        if t.advantage is None:
            raise ValueError(f"trajectory {t.id} has no advantage; score and group it first")
        if t.completion_mask and t.completion_mask[0]:
            raise ValueError(f"trajectory {t.id}: the first token cannot be a completion token")
        n = len(t.token_ids)
        input_ids[i, :n] = torch.tensor(t.token_ids)
        attention_mask[i, :n] = 1
        completion_mask[i, :n] = torch.tensor(t.completion_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
        adv[i] = t.advantage
    masks = None
    if any(t.constraints for t in trajs):
        if replay is None:
            raise ValueError("trajectories sampled under a grammar need the learner's mask replay (a tokenizer)")
        index = torch.full((B, width), -1, dtype=torch.long)  # (B, T)
        blocks, k = [], 0
        for i, t in enumerate(trajs):
            if not t.constraints:
                continue
            positions, allowed = replay(t)  # (n,), (n, V)
            index[i, positions] = torch.arange(k, k + len(positions))
            blocks.append(allowed)
            k += len(positions)
        masks = VocabMasks(index, torch.cat(blocks))
    return TensorBatch(input_ids, attention_mask, completion_mask, old, adv, masks)
