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

import weakref

import torch
from torch.utils.checkpoint import checkpoint

from selfrl.model.device import gradient_checkpointing_on
from selfrl.model.matmul import is_routed, linear
from selfrl.model.prefix import shared_prefix_len
from selfrl.rl.tree import PrefixTree, build_tree, layout_cost, tree_pays

LAYOUTS = ("auto", "tree", "prefix", "rows")


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits, -1).gather(-1, index)`` for (..., V) logits and (...) index.

    Naive equivalent: ``torch.log_softmax(logits, dim=-1).gather(-1, index.unsqueeze(-1)).squeeze(-1)``.
    """
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _chunk_logps(hidden: torch.Tensor, weight: torch.Tensor, bias, targets: torch.Tensor, temperature: float,
                 allowed: torch.Tensor | None = None, onednn: bool = False):
    product = linear if onednn else torch.nn.functional.linear  # as the output layer computes (selfrl.model.matmul)
    logits = product(hidden, weight, bias).float() / temperature  # (C, V)
    if allowed is not None:  # (C, V) bool: the grammar's masks, replayed (selfrl.chat.constrain.replay_masks)
        logits = logits.masked_fill(~allowed, float("-inf"))
    return selective_log_softmax(logits, targets)  # (C,)


def decoder_and_head(model):
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
    layout: str = "auto",
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
        share_prefix: encode shared prefixes once; exact, gradients included. False: every
            row on its own (``layout`` "rows").
        layout: how the rows are encoded. "tree": all rows as one prefix tree, every shared
            prefix once (:mod:`selfrl.rl.tree`); "prefix": the rows' common prefix once, in a
            key/value cache repeated over the rows (``selfrl.model.prefix``); "rows": the padded
            batch as it is; "auto": the tree on the CPU (:func:`tree_by_default`) when
            :func:`selfrl.rl.tree.tree_pays`, else "prefix" (or "rows" when the model checkpoints
            its gradients, which drops a cache).
        vocab_masks: the grammar masks of constrained tokens (:class:`VocabMasks`): at
            those positions the log-softmax runs over the allowed ids only, as when they
            were sampled; None: every position over the whole vocabulary.

    Returns:
        (B, T) float32 log-probs; 0 where ``completion_mask`` is 0. With no completion
        token at all it is all zeros, still attached to the graph (a backward through it
        gives zero gradients instead of an error).

    Raises:
        ValueError: ``temperature`` not > 0 (the logits are divided by it), an unknown ``layout``,
            or ``layout`` "tree" where :func:`tree_supported` says no.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the logits are divided by it), got {temperature}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    decoder, head = decoder_and_head(model)
    B, T = input_ids.shape
    if not share_prefix:
        layout = "rows"
    cache_ok = not gradient_checkpointing_on(model)  # a checkpointed training forward drops the cache
    start = _prefix_len(input_ids, attention_mask, completion_mask) if layout in ("auto", "prefix") and B > 1 else 0
    tree = None
    if layout == "tree" and not tree_supported(decoder, attention_mask):
        raise ValueError("layout 'tree' needs right-padded, non-empty rows and a decoder that takes a custom 4D "
                         "attention mask exactly (sdpa or eager, fp32 or fp64 weights, no sliding window shorter "
                         "than the rows); use layout 'auto'")
    if layout == "tree" or (layout == "auto" and B > 1 and tree_by_default(decoder)
                            and tree_supported(decoder, attention_mask)):
        lengths = attention_mask.sum(dim=1).tolist()
        tree = build_tree([input_ids[i, :n].tolist() for i, n in enumerate(lengths)], input_ids.device)
        if layout == "auto":
            hidden_size = head.weight.shape[1]
            rows_cost = layout_cost(B, T, start if cache_ok else 0, hidden_size)
            if not tree_pays(tree.num_nodes, rows_cost, hidden_size):
                tree = None
    if tree is not None:
        return _tree_logps(decoder, head, tree, input_ids, completion_mask, temperature, chunk_size, vocab_masks)
    if not cache_ok:
        start = 0
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
    flat = _head_logps(rows, head, targets, temperature, chunk_size, which, vocab_masks)  # (M,)
    out = torch.zeros((B, T), dtype=torch.float32, device=input_ids.device)  # (B, T)
    tail = torch.zeros(mask.shape, dtype=torch.float32, device=input_ids.device)  # (B, T-S-1)
    tail = tail.masked_scatter(mask, flat.float())
    return torch.cat([out[:, :start + 1], tail], dim=1)  # (B, T)


_TREE_CHECKED: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, bool]]" = weakref.WeakKeyDictionary()


def sequence_logprobs(model, token_ids: list[int], temperature: float = 1.0) -> list[float]:
    """(n - 1) log-probs of ``token_ids[1:]``, each given its prefix, under ``model`` (no grad).

    The learner's side of the swap check (:mod:`selfrl.safety.swap_check`), what ``selfrl
    sampler`` answers on ``/sampler/logprobs``, and the old log-probs of a batch sampled one
    update ahead (:mod:`selfrl.rollout.prefetch`).
    """
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)  # (1, n)
    mask = torch.ones_like(ids)  # (1, n)
    completion = mask.clone()
    completion[0, 0] = 0  # the first token is not predicted
    with torch.no_grad():
        logps = per_token_logps(model, ids, mask, completion, temperature)  # (1, n)
    return logps[0, 1:].tolist()


def decoder_takes_tree(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder`` (a causal LM's decoder stack) encodes a packed prefix tree exactly: an
    attention that takes a custom 4D mask (``sdpa`` or ``eager``; FlashAttention ignores one), fp32
    or fp64 weights (in 16 bits the check below cannot tell rounding from a wrong bias), and a
    numerical check on its first call, two short rows through the tree and one by one with no
    gradient and in eval mode (an architecture that builds its own mask fails it, or raises: no). The
    answer is kept for the decoder's life, attention implementation and dtype."""
    config = getattr(decoder, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return False
    dtype = next(decoder.parameters()).dtype
    if dtype not in (torch.float32, torch.float64):
        return False  # in 16 bits the check cannot tell rounding from a slightly wrong bias (ALiBi's, in bf16)
    checked = _TREE_CHECKED.setdefault(decoder, {})  # by attention implementation and dtype, which can change
    key = (implementation, dtype)
    if key not in checked:
        try:
            checked[key] = _tree_matches_rows(decoder)
        except Exception:  # an architecture that cannot take the mask at all (ALiBi builds its bias from a 2D one)
            checked[key] = False
    return checked[key]


TREE_DEVICES = ("cpu",)  # where "auto" takes the tree: it has not run on a GPU yet (the shared prefix there)


def tree_by_default(decoder: torch.nn.Module) -> bool:
    """Whether layout "auto" may take the packed tree for ``decoder``: on a device of
    :data:`TREE_DEVICES` and :func:`decoder_takes_tree`."""
    return next(decoder.parameters()).device.type in TREE_DEVICES and decoder_takes_tree(decoder)


def tree_supported(decoder: torch.nn.Module, attention_mask: torch.Tensor) -> bool:
    """Whether ``decoder`` gives a packed prefix tree the same hidden states as the rows one by one,
    for the rows of ``attention_mask`` (B, T): :func:`decoder_takes_tree`, right padding, and no
    sliding window shorter than the rows (the packed mask would not apply it), and no row of padding only."""
    if not decoder_takes_tree(decoder):
        return False
    window = getattr(decoder.config, "sliding_window", None)
    if window and getattr(decoder.config, "use_sliding_window", True) and attention_mask.shape[1] > window:
        return False
    lengths = attention_mask.sum(dim=1, keepdim=True)  # (B, 1)
    if not bool((lengths > 0).all()):
        return False  # a row of padding only: no node to put it in
    return bool((attention_mask == (torch.arange(attention_mask.shape[1], device=lengths.device) < lengths)).all())


def _tree_matches_rows(decoder: torch.nn.Module) -> bool:
    """Two 12-token rows sharing their first 8 tokens, through the tree and one by one: the same
    hidden states within 1 % of their scale in fp32 (a mask that is ignored or replaced gives
    differences of the order of the values themselves)."""
    device = next(decoder.parameters()).device
    g = torch.Generator().manual_seed(0)
    vocab = int(getattr(decoder.config, "vocab_size", 100))
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    ids[1, :8] = ids[0, :8]
    ids = ids.to(device)
    tree = build_tree(ids.tolist(), device)
    flags = [(m, m.training) for m in decoder.modules()]
    decoder.eval()
    try:
        with torch.no_grad():
            packed = _tree_forward(decoder, tree)  # (N, H)
            rows = decoder(input_ids=ids, use_cache=False).last_hidden_state  # (2, 12, H)
    finally:
        for m, training in flags:
            m.training = training
    got = packed[tree.node_of.flatten()].view_as(rows).float()
    scale = rows.float().abs().max().clamp(min=1e-6)
    return bool(((got - rows.float()).abs().max() / scale) < 1e-2)


def _tree_forward(decoder: torch.nn.Module, tree: PrefixTree) -> torch.Tensor:
    """(N, H) last hidden states of the tree's nodes: one sequence of N tokens, each attending to
    its ancestors, at its depth. ``sdpa`` takes the boolean mask; ``eager`` adds it to the scores,
    so it gets 0 and the dtype's lowest value instead."""
    mask = tree.attention_mask()  # (1, 1, N, N) bool
    if getattr(decoder.config, "_attn_implementation", None) == "eager":
        dtype = next(decoder.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    return decoder(input_ids=tree.token_ids[None], attention_mask=mask, position_ids=tree.position_ids[None],
                   use_cache=False).last_hidden_state[0]


def _tree_logps(decoder, head, tree: PrefixTree, input_ids, completion_mask, temperature, chunk_size,
                vocab_masks) -> torch.Tensor:
    """:func:`per_token_logps` through one pass over the rows' prefix tree; (B, T)."""
    B, T = input_ids.shape
    hidden = _tree_forward(decoder, tree)  # (N, H)
    mask = completion_mask[:, 1:].bool()  # (B, T-1): token t+1 is predicted from the node of token t
    nodes = tree.node_of[:, :-1][mask]  # (M,)
    targets = input_ids[:, 1:][mask]  # (M,)
    which = vocab_masks.index[:, 1:][mask] if vocab_masks is not None else None  # (M,)
    if which is None:  # rows that share a node and a next token share its log-prob: computed once
        pairs, inverse = torch.unique(nodes * head.weight.shape[0] + targets, return_inverse=True)  # (U,), (M,)
        flat = _head_logps(hidden[pairs // head.weight.shape[0]], head, pairs % head.weight.shape[0], temperature,
                           chunk_size, None, None)[inverse]  # (M,)
    else:
        flat = _head_logps(hidden[nodes], head, targets, temperature, chunk_size, which, vocab_masks)  # (M,)
    out = torch.zeros((B, T - 1), dtype=torch.float32, device=input_ids.device).masked_scatter(mask, flat.float())
    return torch.cat([torch.zeros((B, 1), dtype=torch.float32, device=input_ids.device), out], dim=1)  # (B, T)


def _head_logps(rows: torch.Tensor, head, targets: torch.Tensor, temperature: float, chunk_size: int,
                which: torch.Tensor | None, vocab_masks: "VocabMasks | None") -> torch.Tensor:
    """(M,) log-probs of ``targets`` from (M, H) hidden ``rows`` through the output layer, in
    chunks recomputed in the backward pass; still in the graph when M == 0."""
    parts = []
    for s in range(0, rows.shape[0], chunk_size):
        allowed = None
        if which is not None and bool((which[s:s + chunk_size] >= 0).any()):
            allowed = vocab_masks.rows(which[s:s + chunk_size], head.weight.shape[0])  # (C, V)
        args = (rows[s:s + chunk_size], head.weight, head.bias, targets[s:s + chunk_size], temperature, allowed,
                is_routed(head))
        if torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logps, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logps(*args))
    return torch.cat(parts) if parts else rows.sum(dim=-1)  # (M,); (0,) in the graph when M == 0


class VocabMasks:
    """Per-position sets of allowed ids for a (B, T) batch: the grammar masks of the
    constrained tokens, replayed by :func:`selfrl.chat.constrain.replay_masks`.

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
