"""Attention over a prefix that every row of a decoding pass shares, read once for the batch.

Every rollout of a ``selfrl run`` batch, and every request of a server whose clients send one
system prompt, starts with the same system prompt (with tool descriptions). The slot engine
encodes that prefix once (:class:`~selfrl.engines.kvcache.PrefixStore`), but attention then
read each row's own copy of its keys and values at every decoding step: on the embedded model,
64 rows of about 400 positions read 1.2 GB of keys and values per step, twice the weights, and
attention took a quarter of the step (docs/results/benchmarks.md, "Attention over the shared prefix").

:func:`attend_with_shared_prefix` splits each row's attention in two: its queries against the
shared prefix's keys, computed for all rows at once (one product per key/value head, the prefix
read once), and against the row's own columns after the prefix (a batched product); one softmax
over both parts, so the result is the attention over the whole row, rounding aside. This is
cascade attention (FlashInfer's shared-prefix batch decoding, vLLM's ``use_cascade_attn``): on the
CPU each part is one call of torch's fused attention kernel and the two partial softmaxes are
merged by their log-sum-exps; elsewhere, plain torch products and one exact softmax.

:func:`shared_prefix_attention` is that computation behind transformers' attention interface: the
slot engine's sampling view (:class:`~selfrl.engines.mergedpolicy.MergedPolicy`) points its attention
layers at ``ATTENTION_NAME`` (registered by :mod:`selfrl.engines.packedattention`, which calls it for
every pass that is not packed), and the
engine passes the shared prefix's keys and values as the forward pass's ``shared_prefix_kv``
keyword (:class:`SharedPrefix`) while its cache returns only the columns after the prefix. A pass
without that keyword is plain SDPA: the learner, and every pass the engine runs without a
shared prefix, compute what they computed before.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTENTION_NAME = "selfrl_shared_prefix"  # the view's attention in transformers' AttentionInterface (packedattention)

# attention classes whose forward pass is known to hand the attention function plain queries,
# keys and values (rotary applied, no sliding window, softcap or sink logits passed): the view
# points only these at :func:`shared_prefix_attention`
SUPPORTED_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention", "Qwen3Attention")


@dataclass
class SharedPrefix:
    """The prefix every row of a pass starts with: per layer (kv_heads, >= length, head_dim)
    keys and values (a stored prefix's tensors), of which the first ``length`` columns are used."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    # the pass's masks as the fused kernel takes them, the same for every layer:
    # (attention mask, (its version, groups, length, dtype), fused_masks of it)
    own_masks: tuple | None = field(default=None, compare=False, repr=False)


def attend_with_shared_prefix(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                              key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                              scaling: float,
                              own_masks: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Softmax attention of each row over a shared prefix and then its own columns.

    Args:
        query: (B, H, T, D) the pass's queries, ``H = G x kv_heads`` (grouped-query attention:
            query head ``h`` reads key/value head ``h // G``).
        prefix_key, prefix_value: (kv_heads, P, D) the shared prefix, P >= 1, visible to every query.
        key, value: (B, kv_heads, S, D) each row's columns after the prefix.
        mask: (B, 1, T, S) bool, True where a query may see the column (a query that sees none
            attends to the prefix alone).
        scaling: the factor on the scores (usually ``D ** -0.5``).
        own_masks: :func:`fused_masks` of ``mask``, if already computed (for the fused kernel).

    Returns:
        (B, T, H, D), the layout of transformers' attention functions: what softmax attention
        over ``[prefix | key]`` with mask ``[True | mask]`` gives (the same up to float rounding).

    On the CPU in fp32 or fp64 each part is one call of torch's fused CPU attention kernel
    (``_scaled_dot_product_flash_attention_for_cpu``, which also returns each query's log-sum-exp)
    and the two are merged by their log-sum-exps (FlashInfer's cascade merge): 1.14-1.32x faster
    than products and one softmax at 2-64 rows x 1 query on the embedded model, 1.5-1.7x at a
    prefill's 17-37 queries a row (``benchmarks/bench_shared_attention.py``, its kernel table). Elsewhere, or where that
    private operator is missing, :func:`attend_by_products` computes it.

    >>> q, pk, pv = torch.randn(2, 4, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    >>> k, v, m = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8), torch.rand(2, 1, 3, 6) < 0.5
    >>> m[..., 0] = True
    >>> full_k = torch.cat([pk.expand(2, -1, -1, -1), k], 2).repeat_interleave(2, 1)
    >>> full_v = torch.cat([pv.expand(2, -1, -1, -1), v], 2).repeat_interleave(2, 1)
    >>> full_m = torch.cat([torch.ones(2, 1, 3, 5, dtype=torch.bool), m], -1)
    >>> ref = torch.nn.functional.scaled_dot_product_attention(q, full_k, full_v, attn_mask=full_m)
    >>> torch.allclose(attend_with_shared_prefix(q, pk, pv, k, v, m, 8 ** -0.5), ref.transpose(1, 2), atol=1e-6)
    True
    """
    if fused_kernel_takes(query, prefix_key, key):
        masks = own_masks
        if masks is None:
            masks = fused_masks(mask, query.shape[1] // prefix_key.shape[0], query.dtype)
        return _attend_fused(query, prefix_key, prefix_value, key, value, masks, scaling)
    return attend_by_products(query, prefix_key, prefix_value, key, value, mask, scaling)


def fused_masks(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask`` (B, 1, T, S) bool as the fused kernel takes it for ``groups`` query heads per
    key/value head: the additive mask (B, 1, G T, S) of ``dtype`` (0 where visible, -inf elsewhere)
    and (B, 1, G T) True for the queries that see none of their own columns. The same for every
    layer of a pass: :func:`shared_prefix_attention` computes it once a pass."""
    B, _, T, S = mask.shape
    visible = mask.unsqueeze(2).expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)  # (B, 1, GT, S)
    additive = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return additive, ~visible.any(-1)


_FUSED = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # (out, logsumexp)


@functools.lru_cache(maxsize=None)
def fused_kernel_available() -> bool:
    """Whether torch's fused CPU attention kernel (a private operator) exists in this torch and, on a
    fixed probe with a shared prefix, a fully masked query, grouped heads and strided queries, gives what
    :func:`attend_by_products` gives within 1e-5 (cached: checked once per process)."""
    if _FUSED is None:
        return False
    g = torch.Generator().manual_seed(3)
    q, pk, pv = (torch.randn(*s, generator=g) for s in ((2, 4, 3, 8), (2, 5, 8), (2, 5, 8)))
    q = q.permute(3, 1, 2, 0).contiguous().permute(3, 1, 2, 0)  # a strided last dimension, as transformers' can be
    k, v = torch.randn(2, 2, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)
    m = torch.rand(2, 1, 3, 6, generator=g) < 0.5
    m[0, 0, 0] = False  # a query that sees only the prefix
    try:
        got = _attend_fused(q, pk, pv, k, v, fused_masks(m, 2, q.dtype), 0.3)
    except Exception:  # the operator changed in this torch
        return False
    want = attend_by_products(q, pk, pv, k, v, m, 0.3)
    return got.shape == want.shape and bool((got - want).abs().max() <= 1e-5)


def fused_kernel_takes(query: torch.Tensor, prefix_key: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether :func:`attend_with_shared_prefix` computes through torch's fused CPU attention kernel:
    every tensor on the CPU in one dtype, fp32 or fp64, and :func:`fused_kernel_available`."""
    return (query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
            and prefix_key.dtype == key.dtype == query.dtype and prefix_key.device == key.device == query.device
            and fused_kernel_available())


def _attend_fused(query, prefix_key, prefix_value, key, value, masks, scaling):
    """:func:`attend_with_shared_prefix` by two calls of the fused kernel merged by log-sum-exp;
    ``masks``: :func:`fused_masks` of the mask."""
    B, H, T, D = query.shape
    KV, S = prefix_key.shape[0], key.shape[2]
    G = H // KV
    # the kernel reads its inputs' last dimension as contiguous (SDPA checks that before calling it):
    # transformers' queries come as a transposed view, and a reshape of one can keep a stride of H there
    q, prefix_key, prefix_value, key, value = (_unit_stride(t) for t in (
        query.reshape(B, KV, G * T, D), prefix_key, prefix_value, key, value))  # q (B, KV, GT, D): h = kv * G + g
    # the prefix: every row's queries of a key/value head as one sequence against the prefix, unmasked
    qp = q.transpose(0, 1).reshape(1, KV, B * G * T, D)
    out_p, lse_p = _FUSED(qp, prefix_key[None], prefix_value[None], scale=scaling)  # (1, KV, BGT, D), (1, KV, BGT)
    out_p = out_p.view(KV, B, G * T, D).transpose(0, 1)  # (B, KV, GT, D)
    lse_p = lse_p.view(KV, B, G * T).transpose(0, 1)  # (B, KV, GT)
    # each row's own columns, masked (the kernel takes an additive mask of the queries' dtype)
    additive, hidden = masks  # (B, 1, GT, S), (B, 1, GT)
    out_s, lse_s = _FUSED(q, key, value, attn_mask=additive, scale=scaling)  # (B, KV, GT, D), (B, KV, GT)
    # a query that sees none of its own columns gets the kernel's zeros and a log-sum-exp of 0: weight 0 instead
    lse_s = lse_s.masked_fill(hidden, float("-inf"))  # (B, 1, GT) broadcast over KV
    # the two softmaxes merged: (e^lp out_p + e^ls out_s) / (e^lp + e^ls) = out_p + sigmoid(ls - lp) (out_s - out_p)
    # (lse_p is finite: every query sees the whole prefix)
    out = torch.lerp(out_p, out_s, torch.sigmoid(lse_s - lse_p).unsqueeze(-1))  # (B, KV, GT, D)
    return out.reshape(B, H, T, D).transpose(1, 2)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension is contiguous (stride 1), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def attend_by_products(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                       key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """:func:`attend_with_shared_prefix` (the same arguments and result) by batched products and one
    exact softmax over both parts: the prefix's scores for all rows' queries of a key/value head in
    one product, each row's own in a batched product."""
    B, H, T, D = query.shape
    KV, P, S = prefix_key.shape[0], prefix_key.shape[1], key.shape[2]
    G = H // KV
    q = query.reshape(B, KV, G * T, D)  # (B, KV, GT, D): head h = kv * G + g
    # the prefix: one product per key/value head for every row's queries
    qp = q.transpose(0, 1).reshape(KV, B * G * T, D)  # (KV, B GT, D)
    s_prefix = torch.matmul(qp, prefix_key.transpose(1, 2)).mul_(scaling)  # (KV, B GT, P)
    s_prefix = s_prefix.view(KV, B, G * T, P).transpose(0, 1)  # (B, KV, GT, P)
    # each row's own columns
    s_own = torch.matmul(q, key.transpose(2, 3)).mul_(scaling)  # (B, KV, GT, S)
    visible = mask.unsqueeze(2).expand(B, 1, G, T, S).reshape(B, 1, G * T, S)  # (B, 1, GT, S)
    s_own = s_own.masked_fill_(~visible, float("-inf"))
    top = torch.maximum(s_prefix.amax(-1, keepdim=True), s_own.amax(-1, keepdim=True))  # (B, KV, GT, 1)
    e_prefix, e_own = (s_prefix - top).exp_(), (s_own - top).exp_()
    total = e_prefix.sum(-1, keepdim=True) + e_own.sum(-1, keepdim=True)  # (B, KV, GT, 1)
    out_prefix = torch.matmul(e_prefix.transpose(0, 1).reshape(KV, B * G * T, P), prefix_value)  # (KV, B GT, D)
    out = torch.matmul(e_own, value).add_(out_prefix.view(KV, B, G * T, D).transpose(0, 1))  # (B, KV, GT, D)
    out = out.div_(total).view(B, H, T, D)
    return out.transpose(1, 2)


def shared_prefix_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, shared_prefix_kv: SharedPrefix | None = None, **kwargs):
    """transformers' attention interface: :func:`attend_with_shared_prefix` when the forward pass
    carries ``shared_prefix_kv`` (then ``key`` and ``value`` are the columns after the prefix and
    ``attention_mask`` covers all columns, (B, 1, T, P + S) bool), else transformers' SDPA.

    Returns:
        ((B, T, H, D) output, None), as transformers' attention functions.

    Raises:
        ValueError: a shared prefix with dropout, or without a boolean 4-D mask.
    """
    if shared_prefix_kv is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout or attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        raise ValueError("attention over a shared prefix needs no dropout and a boolean (B, 1, T, W) mask")
    p, i = shared_prefix_kv.length, module.layer_idx
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    prefix_key, prefix_value = shared_prefix_kv.keys[i][:, :p], shared_prefix_kv.values[i][:, :p]
    masks = None
    if fused_kernel_takes(query, prefix_key, key):  # the kernel's masks, once a pass (the same mask every layer)
        groups = query.shape[1] // prefix_key.shape[0]
        stamp = (attention_mask._version, groups, p, query.dtype)  # (a mask changed in place bumps its version)
        memo = shared_prefix_kv.own_masks
        if memo is None or memo[0] is not attention_mask or memo[1] != stamp:
            memo = shared_prefix_kv.own_masks = (attention_mask, stamp,
                                                 fused_masks(attention_mask[..., p:], groups, query.dtype))
        masks = memo[2]
    out = attend_with_shared_prefix(query, prefix_key, prefix_value, key, value, attention_mask[..., p:], scale,
                                    own_masks=masks)
    return out, None



def attention_window(module) -> int | None:
    """The sliding window (tokens) of an attention layer, or None: the layer's own ``sliding_window``
    (Qwen2, Qwen3: set per layer type), else its configuration's (Mistral), unless
    ``use_sliding_window`` is off or ``layer_types`` says the layer attends fully."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window or None
    cfg = getattr(module, "config", None)
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and types[module.layer_idx] != "sliding_attention":
        return None
    return window


def attention_layers(model) -> list:
    """The attention layers of ``model``: its modules with a ``layer_idx`` and a configuration that
    names an attention implementation."""
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(getattr(m, "config", None), "_attn_implementation")]


def model_window(model) -> int | None:
    """The smallest sliding window of ``model``'s attention layers (:func:`attention_window`), or None."""
    windows = [w for m in attention_layers(model) if (w := attention_window(m)) is not None]
    return min(windows) if windows else None


def takes_shared_prefix(module) -> bool:
    """Whether an attention module can be pointed at :func:`shared_prefix_attention`: a supported
    class (``SUPPORTED_ATTENTION``) on SDPA, with no sliding window, in fp32 or fp64."""
    cfg = getattr(module, "config", None)
    if type(module).__name__ not in SUPPORTED_ATTENTION or cfg is None or not hasattr(module, "layer_idx"):
        return False
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or attention_window(module) is not None:
        return False
    weight = getattr(getattr(module, "q_proj", None), "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dtype in (torch.float32, torch.float64)
