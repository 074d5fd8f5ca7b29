"""Several passes in one forward pass: their tokens packed into one sequence, attention per pass.

A slot engine step that admits rows while others decode ran two forward passes: the new rows'
prompts (a tool's reply and the next turn's header, about 35 ids a row), then one id for each
running row. On the CPU each pass reads all the weights (540 MB for the embedded model) and pays
the per-operator overhead of every layer, so a step that admits one row while a few decode cost
two small passes (about 110 and 55 ms) where one pass of about 40 ids costs about 85 ms
(docs/results/benchmarks.md, "One forward pass a step"). vLLM schedules the same way (a step's prefill chunks and
decoding tokens in one batch).

Here the tokens of every pass of a step are laid end to end as one sequence (``(1, N)`` input ids and
positions, no padding), so the linear layers, norms and rotary embeddings run once over all of them;
only attention needs to know which row a token belongs to. Each pass is a :class:`Segment`: its slots,
the columns its rows see, its (b, T) grid of queries (a prefill's left-padded prompts, or decoding rows
with their drafted ids) with the mask the engine builds for it, and the stored prefix its rows share,
if any. :func:`packed_attention` scatters a segment's queries into its grid, attends as a single pass
would (:func:`~selfrl.engines.sharedattention.attend_with_shared_prefix` with a shared prefix, SDPA
otherwise) and gathers the results back into the sequence. Each token's attention is therefore the
one its own pass would compute, rounding aside.

:func:`view_attention` is the function the slot engine's sampling view
(:class:`~selfrl.engines.mergedpolicy.MergedPolicy`) points its attention layers at, registered with
transformers' attention interface as ``ATTENTION_NAME``: a forward pass with ``packed_segments`` is
packed, one with ``shared_prefix_kv`` attends to a shared prefix, and any other is plain SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from selfrl.engines.sharedattention import (
    ATTENTION_NAME, SharedPrefix, attend_with_shared_prefix, shared_prefix_attention,
)

__all__ = ["ATTENTION_NAME", "Segment", "packed_attention", "view_attention"]


@dataclass
class Segment:
    """One pass of a packed forward pass.

    Attributes:
        rows: the slots of the pass's rows (contiguous), ``b`` of them.
        width: the cache columns its rows' attention reads (``[0, width)``).
        tokens: (n,) long, where the pass's real queries sit in the packed sequence, in the order of
            ``row`` and ``query``.
        row: (n,) long, each of those queries' row in the pass (0 to b - 1).
        query: (n,) long, its place in the row's grid of ``T`` queries.
        mask: (b, 1, T, width) bool, True where a query of the grid sees a column (the engine's
            ``column <= position``); grid places without a real query are never read back.
        shared: the stored prefix every row of the pass starts with, attended once for all of them
            (:mod:`selfrl.engines.sharedattention`), or None.
    """

    rows: slice
    width: int
    tokens: torch.Tensor
    row: torch.Tensor
    query: torch.Tensor
    mask: torch.Tensor
    shared: SharedPrefix | None = None

    @property
    def grid(self) -> tuple[int, int]:
        """(b, T): the pass's rows and queries a row."""
        return self.mask.shape[0], self.mask.shape[2]


def packed_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     segments: list[Segment], scaling: float) -> torch.Tensor:
    """The attention of a packed forward pass, each segment attended as its own pass would be.

    Args:
        module: the attention layer (its ``layer_idx`` picks a shared prefix's layer; SDPA reads
            its ``num_key_value_groups``).
        query: (1, H, N, D) the packed sequence's queries.
        key, value: (slots, kv_heads, columns, D) the layer's whole cache, the pass's keys and values
            already written (:meth:`selfrl.engines.kvcache.SlotCache.update` in packed mode).
        segments: the passes; together their ``tokens`` cover every query that is read back.
        scaling: the factor on the scores.

    Returns:
        (1, N, H, D), transformers' layout; a place no segment names stays zero.
    """
    _, H, N, D = query.shape
    out = query.new_zeros(N, H, D)
    q_all = query[0].transpose(0, 1)  # (N, H, D)
    for s in segments:
        b, T = s.grid
        if T == 1:  # one real query a row (a decoding pass without drafts): its tokens are its rows, in order
            q = q_all[s.tokens][:, :, None]  # (b, H, 1, D)
        else:
            q = query.new_zeros(b, T, H, D)
            q[s.row, s.query] = q_all[s.tokens]
            q = q.transpose(1, 2)  # (b, H, T, D)
        if s.shared is not None:
            p, i = s.shared.length, module.layer_idx
            k, v = key[s.rows, :, p:s.width], value[s.rows, :, p:s.width]
            o = attend_with_shared_prefix(q, s.shared.keys[i][:, :p], s.shared.values[i][:, :p], k, v,
                                          s.mask[..., p:], scaling)  # (b, T, H, D)
        else:
            o, _ = sdpa_attention_forward(module, q, key[s.rows, :, :s.width], value[s.rows, :, :s.width], s.mask,
                                          scaling=scaling)  # (b, T, H, D)
        out[s.tokens] = o[:, 0] if T == 1 else o[s.row, s.query]
    return out[None]


def view_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   packed_segments: list[Segment] | None = None, **kwargs):
    """transformers' attention interface for the slot engine's sampling view: :func:`packed_attention`
    when the forward pass carries ``packed_segments`` (``attention_mask`` is then unused), else
    :func:`~selfrl.engines.sharedattention.shared_prefix_attention` (a shared prefix, or plain SDPA).

    Returns:
        (output in transformers' (B, T, H, D) layout, None).

    Raises:
        ValueError: a packed pass with dropout.
    """
    if packed_segments is None:
        return shared_prefix_attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                       **kwargs)
    if dropout:
        raise ValueError("a packed forward pass takes no dropout")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return packed_attention(module, query, key, value, packed_segments, scale), None


AttentionInterface.register(ATTENTION_NAME, view_attention)
