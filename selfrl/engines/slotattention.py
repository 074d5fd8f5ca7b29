"""Which attention the slot engine can sample exactly: it builds its own 4-D masks
(``column <= position``, :mod:`selfrl.engines.slots`), which SDPA takes as booleans and eager
attention as an additive mask; no other implementation, and no sliding window, is in them."""

from __future__ import annotations

import torch

from selfrl.engines.sharedattention import attention_layers, model_window

SLOT_ATTENTION = ("sdpa", "eager")  # attention implementations the slot engine's own masks are right for


def slot_attention(model) -> tuple[str, int | None]:
    """``(implementation, sliding window or None)`` of ``model``'s attention layers, as the slot engine
    needs them: it builds its own 4-D masks (``column <= position``), boolean for SDPA and additive
    for eager attention, and no other kind; a sliding window (the smallest, where layers differ) is
    not in its masks, so it refuses requests longer than the window.

    Raises:
        ValueError: an attention implementation other than SDPA or eager (the reason, and what to use).
    """
    layers = attention_layers(model)
    kinds = {m.config._attn_implementation for m in layers} or {model.config._attn_implementation}
    if not kinds <= set(SLOT_ATTENTION) or len(kinds) > 1:
        raise ValueError(f"the slot engine builds masks for SDPA or eager attention only, and this model's attention "
                         f"is {', '.join(sorted(map(str, kinds)))}: load it with attn_implementation='sdpa', or use "
                         "the reference engine (--engine reference)")
    return kinds.pop(), model_window(model)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form of a boolean attention mask (True: visible) for eager attention, which adds
    its mask to the scores: 0 where visible, the dtype's minimum elsewhere; the same shape.

    >>> additive_mask(torch.tensor([True, False]), torch.float32).tolist()[0]
    0.0
    """
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min)
