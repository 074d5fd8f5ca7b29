"""The sampling view's decoder layers computed without the library's module calls: fused
products, a one-operator norm and one rotation for queries and keys together.

A decoding step of the embedded model with 8 to 16 rows spent about 31 ms in its products and
as long again in everything else: 13 module calls a layer through ``nn.Module.__call__`` and
transformers' wrappers, a norm of five operators, a rotation of ten, seven products where four
do. :class:`LeanForward` computes what transformers' ``LlamaDecoderLayer`` (and Mistral's, Qwen2's
and Qwen3's, the same layer with biases or per-head norms) computes, in this order:

- ``torch.rms_norm`` (one operator) for the layer's two ``LlamaRMSNorm``;
- queries, keys and values as one product with the three weights (and biases) stacked, and gate
  and up as one (when :class:`~selfrl.engines.mergedpolicy.MergedPolicy` could stack them: all
  three, or both, merged LoRA layers; separate products otherwise);
- Qwen3's per-head norms of queries and keys (``torch.rms_norm`` each);
- the rotary embedding of queries and keys together, ``x cos + roll(x, d/2) sin'`` with
  ``sin'`` the sine with its first half negated: the same products and sums as transformers'
  ``x cos + rotate_half(x) sin``;
- the view's own attention (:func:`~selfrl.engines.packedattention.view_attention`) and the
  cache's ``update``, called as transformers' ``LlamaAttention`` calls them, with the same
  keyword arguments.

Only the rounding of fp32 sums differs (the norm's, a fused multiply-add, the stacked
products'): the conformance suite's 1e-5 holds (``tests/test_lean_layers.py``). It applies to
the layers of :data:`FAMILIES` (Llama 2 and 3, SmolLM2, Mistral, Qwen2 and 2.5, Qwen3) whose parts
are exactly that family's transformers classes, in fp32, with the view's attention and no sliding
window; any other layer keeps transformers' forward pass.
A forward hook or pre-hook on any part of the layer (transformers' idle output-capturing hooks
aside) or a global module hook, found at a call, makes that call run transformers' forward pass
of the layer (the hooks then run as they would). The lean forward is installed on the view's copy
of the layer (an instance ``forward``), so hooks on the layer run around either with the layer
itself as their module. ``benchmarks/bench_checkouts.py`` measures what it saves.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as torch_module

from selfrl.engines.packedattention import ATTENTION_NAME, view_attention
from selfrl.engines.sharedattention import attention_window


# the decoder layers computed lean: transformers' module, and whether queries and keys are normed per head
FAMILIES = {"LlamaDecoderLayer": ("llama", "Llama", False), "MistralDecoderLayer": ("mistral", "Mistral", False),
            "Qwen2DecoderLayer": ("qwen2", "Qwen2", False), "Qwen3DecoderLayer": ("qwen3", "Qwen3", True)}


def _family(layer: nn.Module) -> tuple | None:
    """(decoder, attention, MLP, norm classes, per-head norms) of ``layer``'s family, or None."""
    entry = FAMILIES.get(type(layer).__name__)
    if entry is None:
        return None
    import importlib

    module, prefix, head_norms = entry
    try:
        m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        classes = tuple(getattr(m, prefix + suffix) for suffix in ("DecoderLayer", "Attention", "MLP", "RMSNorm"))
    except (ImportError, AttributeError):  # another transformers
        return None
    return (*classes, head_norms)


def can_be_lean(layer: nn.Module, linear_type: type) -> bool:
    """Whether ``layer`` of a sampling view can take a :class:`LeanForward`: a decoder layer of
    :data:`FAMILIES` (Llama, Mistral, Qwen2, Qwen3) whose attention, MLP and norms are exactly that
    family's transformers classes, with a SiLU MLP, an even head size, no sliding window, the view's
    attention (``ATTENTION_NAME``), all seven projections ``linear_type`` (the view's
    :class:`~selfrl.engines.mergedpolicy.SamplingLinear`) over fp32 weights, and no ``forward``
    replaced on the layer or any other part of it."""
    family = _family(layer)
    if family is None:
        return False
    decoder, attention, mlp, norm, head_norms = family
    attn, ff = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer) is not decoder or type(attn) is not attention or type(ff) is not mlp:
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if head_norms:
        norms += [getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)]
    if any(type(n) is not norm for n in norms):
        return False
    if getattr(attn.config, "_attn_implementation", None) != ATTENTION_NAME or attn.head_dim % 2:
        return False
    if attention_window(attn) is not None or type(ff.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, ff.gate_proj, ff.up_proj, ff.down_proj)
    if not all(type(p) is linear_type and p.weight.dtype == torch.float32 for p in projections):
        return False
    # a forward replaced on the instance (a patch the policy runs) must run in the view too
    return not any("forward" in vars(m) for m in layer.modules() if type(m) is not linear_type)


class SignedSine(threading.local):
    """``sin'`` (the sine with its first half negated) of the last ``sin`` seen in this thread: every
    layer of a forward pass gets the same ``sin`` tensor, so it is computed once a pass (per thread:
    the view's module tree may run forward passes in two threads, an engine's and a swap check's)."""

    sin: torch.Tensor | None = None
    signed: torch.Tensor | None = None

    def __call__(self, sin: torch.Tensor) -> torch.Tensor:
        if self.sin is not sin:
            half = sin.shape[-1] // 2
            self.signed = torch.cat([-sin[..., :half], sin[..., half:]], -1)
            self.sin = sin
        return self.signed


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``x`` (b, T, heads, d): ``x cos + roll(x, d/2) sin'``, which is
    transformers' ``x cos + rotate_half(x) sin`` (Su et al. 2021, "RoFormer", eq. 34, halves
    layout) with the sign moved into ``sin'``. ``cos``, ``signed_sin``: (b or 1, T, 1, d).
    Returns a contiguous (b, T, heads, d) tensor."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


def _capture_hook_idle(hook) -> bool:
    """Whether ``hook`` is transformers' output-capturing hook with no capture under way: installed
    for good on every layer and attention module once any call asks for hidden states or attentions
    (``output_hidden_states=True``), it does nothing otherwise."""
    name, module = getattr(hook, "__name__", ""), getattr(hook, "__module__", "") or ""
    if name != "output_capturing_hook" or "output_capturing" not in module:
        return False
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers: count it as a hook
        return False
    return _active_collector.get() is None


class LeanForward:
    """The ``forward`` of a decoder layer of the sampling view (Llama, Mistral, Qwen2, Qwen3),
    computed as the module docstring says; installed on the view's own copy of the layer (an
    instance attribute), so hooks on the layer see the layer itself.

    Args:
        layer: the view's decoder layer (:func:`can_be_lean`); its class's ``forward`` runs instead
            whenever a forward hook (other than transformers' idle output-capturing one) sits on
            one of its parts, or a global module hook is registered.
        qkv: one linear layer over the stacked query, key and value weights, or None (three).
        gate_up: one over the stacked gate and up weights, or None (two).
        signed_sin: the view's :class:`SignedSine`, shared by its layers.
    """

    def __init__(self, layer: nn.Module, qkv: nn.Module | None, gate_up: nn.Module | None, signed_sin: SignedSine):
        self.layer, self.qkv, self.gate_up = layer, qkv, gate_up
        attn = layer.self_attn
        self.head_dim = attn.head_dim
        self.q_width, self.kv_width = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
        self.signed_sin = signed_sin
        self.head_norms = _family(layer)[4]  # Qwen3's q_norm and k_norm
        # the forward hook registries of its parts (shared with the policy's modules: a hook added there shows)
        self._hooks = [d for m in layer.modules() if m is not layer for d in (m._forward_hooks, m._forward_pre_hooks)]

    def _hooked(self) -> bool:
        """Whether a hook must run: one on a part of the layer, or a global module hook."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return True
        return any(d for d in self._hooks) and any(not _capture_hook_idle(h) for d in self._hooks for h in d.values())

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, cache=None, **kwargs):
        """The decoder layer's ``forward``: (b, T, hidden) in, (b, T, hidden) out."""
        cos, sin = position_embeddings
        if self._hooked() or hidden_states.dtype != torch.float32 or cos.shape[-1] != self.head_dim:
            return type(self.layer).forward(self.layer, hidden_states, attention_mask=attention_mask,
                                            position_embeddings=position_embeddings, cache=cache, **kwargs)
        layer, attn, d = self.layer, self.layer.self_attn, self.head_dim
        b, t = hidden_states.shape[:2]
        norm = layer.input_layernorm
        h = torch.rms_norm(hidden_states, norm.weight.shape, norm.weight, norm.variance_epsilon)
        if self.qkv is not None:
            qkv = self.qkv.forward(h)  # (b, T, q + 2 kv)
            qk, v = qkv[..., :self.q_width + self.kv_width], qkv[..., self.q_width + self.kv_width:]
        else:
            qk = torch.cat([attn.q_proj.forward(h), attn.k_proj.forward(h)], -1)
            v = attn.v_proj.forward(h)
        heads = self.q_width // d
        qk = qk.reshape(b, t, -1, d)
        if self.head_norms:  # Qwen3: queries and keys normed per head before the rotation
            qn, kn = attn.q_norm, attn.k_norm
            qk = torch.cat([torch.rms_norm(qk[:, :, :heads], qn.weight.shape, qn.weight, qn.variance_epsilon),
                            torch.rms_norm(qk[:, :, heads:], kn.weight.shape, kn.weight, kn.variance_epsilon)], 2)
        qk = rotate(qk, cos.unsqueeze(2), self.signed_sin(sin).unsqueeze(2))
        q, k = qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2)  # (b, H, T, d), (b, KV, T, d)
        v = v.reshape(b, t, -1, d).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        out, _ = view_attention(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        x = hidden_states + attn.o_proj.forward(out.reshape(b, t, -1))
        norm = layer.post_attention_layernorm
        h = torch.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
        mlp = layer.mlp
        if self.gate_up is not None:
            gate, up = self.gate_up.forward(h).chunk(2, -1)
        else:
            gate, up = mlp.gate_proj.forward(h), mlp.up_proj.forward(h)
        return x + mlp.down_proj.forward(F.silu(gate) * up)
