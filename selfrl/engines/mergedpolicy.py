"""The slot engine's sampling view of the policy: each LoRA merged into its layer's weight,
and the products of small batches arranged for the CPU's matrix library.

A decoding step of the embedded model on this machine's CPU is bound by reading the weights
(docs/results/benchmarks.md, "Merged LoRA and the small-batch product"). Three things made it slower than
that read:

- **The unmerged LoRA.** peft computes ``W x + s B (A x)`` in every targeted layer: about 1,000
  of a step's 1,500 operator calls are the LoRA's two small products, its scaling and its sum.
  :class:`MergedPolicy` keeps ``W' = W + s B A`` per layer instead, one product per layer. A
  :class:`~selfrl.engines.weightwatch.WeightWatch` tells it when to merge again (an update in
  place, a swap: seen at the next decoding step) and when to rebuild the view (adapters disabled
  or switched, a tensor replaced, a hook added: seen when rows next join an idle engine).
- **The matrix library.** Where the policy's layers compute through oneDNN
  (``model.cpu_matmul``, :mod:`selfrl.model.matmul`: the CPU default), so do the view's, merged
  weights included: 2 to 3 times faster products than MKL's on this machine's AMD CPU.
- **The orientation of the product** (with ``cpu_matmul = "torch"``). For 2 to 5 rows, MKL
  (torch's CPU BLAS) computes ``(W @ x.T).T`` 1.5 to 3 times faster than ``x @ W.T``
  (``F.linear``) on this CPU: the weights stream at 17-28 GB/s instead of 7.5 to 12. One row is
  a matrix-vector product, as slow either way, unless the row is doubled into a two-row product (1.8 times faster).
  :func:`small_batch_linear` does that for 1 to 10 rows (6 to 10 rows: neutral to 1.3 times)
  and calls ``F.linear`` otherwise. The rule is fixed, not tuned per run, so that a seeded run
  samples the same tokens every time.

None changes more than the rounding of fp32 sums: on the tests' tiny models the sampled
logprobs stay within the conformance suite's 1e-5 (plus 2e-6 of their size) of a full
recomputation by the learner (``tests/test_engine_conformance.py``); on the embedded model with
a perturbed adapter the largest gap measured was 2.9e-5 nats (1.1e-5 unmerged; ``benchmarks/bench_merged.py``). Only
fp32 layers are merged: a merged bf16 weight would round most small updates away.

The view is a copy of the model's module tree whose parameters, buffers, configurations and
hook registries *are* the policy's, except that each merged layer holds its own merged weight
(extra memory: the targeted layers' weights once more, 405 MiB for the embedded model in fp32),
and, where the products go through oneDNN, a packed copy of each merged weight laid out for
oneDNN (:func:`selfrl.model.matmul.pack`; 405 MiB more; 810 MiB in all; :attr:`extra_bytes` counts the
copies that exist). Layers without LoRA (the output layer, projections a LoRA does not target) read
the policy's weight live, unpacked: a packed copy would be a snapshot, and miss a write through
``.data`` that no version counter shows (packing the output layer made the demo's rollouts about
1.5 % faster; docs/history.md, "lean decoder layers").
Decoder layers of Llama, Mistral, Qwen2 and Qwen3 run leaner (:mod:`selfrl.engines.leanlayers`:
stacked products, fewer operators), queries, keys and values then being one merged weight (and
their biases one stacked copy), and gate and up another.
A layer that cannot be merged exactly (DoRA, a LoRA bias, several active adapters, adapters
disabled or merged, a bf16 base, a non-``Linear`` base, hooks inside it) stays peft's layer,
so the view computes what the policy computes.
"""

from __future__ import annotations

import copy
import threading

import torch
import torch.nn.functional as F
from torch import nn

from selfrl.engines.leanlayers import LeanForward, SignedSine, can_be_lean
from selfrl.engines.packedattention import ATTENTION_NAME  # (registers the view's attention)
from selfrl.engines.sharedattention import takes_shared_prefix
from selfrl.engines.weightwatch import WeightWatch, hook_dicts
from selfrl.model.matmul import is_routed, pack, packed_linear

SMALL_BATCH_ROWS = (1, 10)  # rows for which (W @ x.T).T is used on the CPU (docs/results/benchmarks.md)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``(weight @ x.T).T`` when ``x`` holds 1 to 10
    rows on the CPU, one row being doubled (the module docstring; ``benchmarks/bench_merged.py``).

    Args:
        x: (..., in_features) inputs; the rows are all leading dimensions together.
        weight: (out_features, in_features).
        bias: (out_features,) or None.

    Returns:
        (..., out_features); for small batches a non-contiguous view of the transposed product.
    """
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    if x.device.type == "cpu" and SMALL_BATCH_ROWS[0] <= m <= SMALL_BATCH_ROWS[1]:
        rows = x.reshape(m, k)
        if m == 1:  # MKL's matrix-vector product is the slow one: a second copy of the row makes it a product
            y = (weight @ torch.cat([rows, rows]).t())[:, :1].t()
        else:
            y = (weight @ rows.t()).t()
        y = y.reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class SamplingLinear(nn.Module):
    """A linear layer of the sampling view: ``weight`` (out, in) is either the policy's own
    tensor (a layer without LoRA) or a merged copy owned by :class:`MergedPolicy`. With
    ``onednn`` (the policy's layer computes through :func:`selfrl.model.matmul.linear`) it does too;
    otherwise :func:`small_batch_linear`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, onednn: bool = False):
        super().__init__()
        self.weight, self.bias = weight, bias  # plain attributes: nothing here is trained
        self.onednn = onednn
        self.packed: torch.Tensor | None = None  # oneDNN's packed copy of weight, set by MergedPolicy._merge

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.onednn:
            return packed_linear(x, self.weight, self.bias, self.packed)
        return small_batch_linear(x, self.weight, self.bias)


def _mergeable(mod) -> str | None:
    """The adapter name whose delta merges exactly into ``mod``, or None: fp32 base weights only (a
    merged bf16 weight would round most small LoRA updates away), no hooks inside the layer (the
    merged layer has no submodules to run them)."""
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(mod, LoraLinear) or not isinstance(mod.base_layer, nn.Linear) or mod.merged:
        return None
    if mod.base_layer.weight.dtype != torch.float32 or mod.disable_adapters or len(mod.active_adapters) != 1:
        return None
    name = mod.active_adapters[0]
    if name not in mod.lora_A or mod.use_dora.get(name, False) or getattr(mod, "lora_bias", {}).get(name, False):
        return None
    if any(d for sub in mod.modules() if sub is not mod for d in hook_dicts(sub)):
        return None
    return name


class MergedPolicy:
    """A sampling view of ``model`` (a peft model or a plain Hugging Face causal LM) with its
    LoRA merged; call it like the model, under ``torch.no_grad()``.

    The view is a copy of the module tree that shares every tensor, configuration object and
    hook registry with ``model`` (a hook added to the policy later runs in the view too), except
    that each mergeable LoRA layer is a :class:`SamplingLinear` over a merged weight of its own.
    A :class:`~selfrl.engines.weightwatch.WeightWatch` decides when to merge again (a weight
    moved) or rebuild the view (a tensor, module, adapter flag or hook changed): each call looks
    fast (version counters), and :meth:`sync` with ``deep=True`` looks at everything (the slot
    engine's watch does when rows join an idle engine).

    Args:
        model: the policy. Its tensors are shared, never modified.
        watch: the watch over ``model`` to follow (the slot engine shares its own); None: a new one.

    Attributes:
        merged_layers: how many LoRA layers are merged (0 for a model without LoRA).
        lean_layers: decoder layers computed by :class:`~selfrl.engines.leanlayers.LeanForward`
            (0 where the attention layers do not all take the view's attention).
        kept_layers: LoRA layers left as peft computes them (DoRA, a LoRA bias, several active
            adapters, adapters disabled or merged into the base, bf16 base weights, hooks inside).
        merges: how many times the merged weights were computed.
        builds: how many times the view was built (1, then one per structural change).
        extra_bytes: memory of the merged weights and of oneDNN's packed copies (bytes).
        shared_prefix_layers: attention layers of the view that take a shared prefix's keys and values
            (:mod:`selfrl.engines.sharedattention`; all of them, or 0 where any cannot).
        passthrough: True while a hook on a peft wrapper (``PeftModel``, ``LoraModel``) makes the
            view run the policy's own forward pass instead.
    """

    def __init__(self, model, watch: WeightWatch | None = None):
        self.model = model
        self.watch = watch if watch is not None else WeightWatch(model)
        self.merges = self.builds = 0
        self._lock = threading.RLock()  # one merge at a time, never during a forward pass of the view
        self._build()

    def _build(self) -> None:
        base = self.watch.base
        memo = {id(t): t for t in base.parameters()}
        memo.update({id(t): t for t in base.buffers()})
        for m in base.modules():  # shared, not copied: hooks (and their state), configurations, scalings
            memo.update({id(d): d for d in hook_dicts(m)})
            cfg = getattr(m, "config", None)
            if cfg is not None:
                memo[id(cfg)] = cfg
            if isinstance(getattr(m, "scaling", None), dict):  # a layer kept as peft's reads set_scale live
                memo[id(m.scaling)] = m.scaling
        # a hook on a peft model's wrapper runs around the whole forward pass: the view cannot run it
        self.passthrough = any(len(w._forward_hooks) + len(w._forward_pre_hooks) for w in self.watch.wrappers)
        self.view = copy.deepcopy(base, memo)  # the module tree; every tensor shared
        self.view.eval()
        self.merged_layers = self.kept_layers = self.extra_bytes = 0
        self._pairs: list[tuple[nn.Module, str, torch.Tensor]] = []  # (peft layer, adapter, merged weight)
        # oneDNN's packed copies, only of the merged weights (stacked where lean layers stack them), snapshots
        # already (merged again when the watch sees a change): a layer without LoRA reads the policy's tensor
        # live, and a packed copy of it would miss a change the watch cannot see (a .data write into it)
        self._onednn: list[SamplingLinear] = []
        self._bias_copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (rows of a stacked bias, the layer's bias)
        done: list[str] = []  # replaced or kept peft layers: their submodules are theirs
        for name, orig in base.named_modules():
            if not name or any(name.startswith(d + ".") for d in done):
                continue
            adapter = _mergeable(orig)
            if adapter is not None:
                w = orig.base_layer.weight
                with torch.inference_mode(False):  # re-merged outside inference mode too
                    merged = torch.empty_like(w, requires_grad=False)
                self._pairs.append((orig, adapter, merged))
                layer = SamplingLinear(merged, orig.base_layer.bias, is_routed(orig.base_layer))
                self._replace(name, layer, orig)
                if layer.onednn:
                    self._onednn.append(layer)
                self.merged_layers += 1
                self.extra_bytes += merged.numel() * merged.element_size()
                done.append(name)
            elif hasattr(orig, "lora_A"):
                self.kept_layers += 1
                done.append(name)
            elif type(orig) is nn.Linear:  # without LoRA (the output layer): the policy's weight, read live
                self._replace(name, SamplingLinear(orig.weight, orig.bias, is_routed(orig)), orig)
                done.append(name)
        self.shared_prefix_layers = self._point_attention()
        self.lean_layers = self._make_lean() if self.shared_prefix_layers else 0
        self._copies_bytes = self.extra_bytes  # the merged weights and stacked biases; packed copies: _merge
        self.builds += 1
        self._built_at = self.watch.structure_generation
        self._merge()

    def _make_lean(self) -> int:
        """Give each decoder layer of the view that can take it (:func:`~selfrl.engines.leanlayers.can_be_lean`)
        a :class:`~selfrl.engines.leanlayers.LeanForward` as its ``forward``, its query, key and
        value weights stacked into one merged tensor where all three are merged, and its gate and
        up weights likewise; returns how many layers took it."""
        signed_sin = SignedSine()
        count = 0
        for layer in list(self.view.modules()):
            if not can_be_lean(layer, SamplingLinear):
                continue
            attn, mlp = layer.self_attn, layer.mlp
            layer.forward = LeanForward(layer, self._stack([attn.q_proj, attn.k_proj, attn.v_proj]),
                                        self._stack([mlp.gate_proj, mlp.up_proj]), signed_sin)
            count += 1
        return count

    def _stack(self, layers: list[SamplingLinear]) -> SamplingLinear | None:
        """One :class:`SamplingLinear` over the merged weights of ``layers`` stacked (out_1 + out_2 +
        ..., in), each layer's weight becoming a view of its rows (merged in place as before), and
        their biases stacked likewise (copied at each merge: frozen tensors, as of the last merge);
        None where any is not a merged layer, some have a bias and some not, or they differ in inputs
        or library."""
        index = {id(merged): i for i, (_, _, merged) in enumerate(self._pairs)}
        if (any(id(m.weight) not in index for m in layers) or len({m.bias is None for m in layers}) != 1
                or len({(m.weight.shape[1], m.onednn) for m in layers}) != 1):
            return None
        first = layers[0].weight
        with torch.inference_mode(False):
            stacked = torch.empty(sum(m.weight.shape[0] for m in layers), first.shape[1], dtype=first.dtype)
            bias = None if layers[0].bias is None else torch.empty(stacked.shape[0], dtype=first.dtype)
        start = 0
        for m in layers:
            i, rows = index[id(m.weight)], m.weight.shape[0]
            mod, adapter, _ = self._pairs[i]
            m.weight = stacked[start:start + rows]  # the merge writes each layer's rows of the stacked tensor
            self._pairs[i] = (mod, adapter, m.weight)
            if bias is not None:
                self._bias_copies.append((bias[start:start + rows], m.bias))
                self.extra_bytes += m.bias.numel() * m.bias.element_size()
            if m in self._onednn:  # the stacked weight is packed instead
                self._onednn.remove(m)
            start += rows
        fused = SamplingLinear(stacked, bias, layers[0].onednn)
        if fused.onednn:
            self._onednn.append(fused)
        return fused

    def _point_attention(self) -> int:
        """Point every attention layer of the view at :func:`~selfrl.engines.sharedattention.shared_prefix_attention`
        (through a copy of its configuration: the policy's own stays as it is) when all of them can
        take it; returns how many were (0: none, the view attends as the policy does)."""
        layers = [m for m in self.view.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
        if not layers or not all(takes_shared_prefix(m) for m in layers):
            return 0
        copies: dict[int, object] = {}
        for m in layers:
            if id(m.config) not in copies:
                cfg = copy.copy(m.config)
                cfg._attn_implementation = ATTENTION_NAME
                copies[id(m.config)] = cfg
            m.config = copies[id(m.config)]
        return len(layers)

    def _replace(self, name: str, new: nn.Module, orig: nn.Module) -> None:
        for key, value in vars(orig).items():  # the layer's own hooks run on the replacement
            if "hook" in key and isinstance(value, dict):
                object.__setattr__(new, key, value)
        parent, _, leaf = name.rpartition(".")
        setattr(self.view.get_submodule(parent) if parent else self.view, leaf, new)

    def _merge(self) -> None:
        # inference_mode(False) turns gradients back on: no_grad inside it keeps the merged weights
        # out of the LoRA's graph (a merged weight that required a gradient would also miss oneDNN)
        with torch.inference_mode(False), torch.no_grad():
            for mod, adapter, merged in self._pairs:
                merged.copy_(mod.base_layer.weight)
                merged.add_(mod.get_delta_weight(adapter).to(merged.dtype))
            for rows, bias in self._bias_copies:  # stacked biases (lean layers)
                rows.copy_(bias)
            for layer in self._onednn:  # packed again from the merged weights as they are now
                layer.packed = pack(layer.weight)  # (None for a weight that now requires a gradient)
        self.extra_bytes = self._copies_bytes + sum(layer.weight.numel() * layer.weight.element_size()
                                                    for layer in self._onednn if layer.packed is not None)
        self.merges += 1
        self._merged_at = self.watch.generation

    def sync(self, deep: bool = False) -> None:
        """Look for changes (``deep``: everything, see :class:`~selfrl.engines.weightwatch.WeightWatch`)
        and rebuild or merge again as needed. Cost: a merge takes 0.18 s for the embedded model on
        an idle machine, 0.25 s with the packing of oneDNN's copies. Thread-safe: one look and merge
        at a time, never during :meth:`__call__`'s forward pass."""
        with self._lock:
            self.watch.poll(deep)
            if self.watch.structure_generation != self._built_at:
                self._build()
            elif self.watch.generation != self._merged_at:
                self._merge()

    def takes_packed(self) -> bool:
        """Whether the view can run a packed forward pass (:mod:`selfrl.engines.packedattention`): it
        runs its own forward pass (not :attr:`passthrough`) and every attention layer points at the
        view's attention (:attr:`shared_prefix_layers`), after a fast :meth:`sync`."""
        with self._lock:
            self.sync()
            return not self.passthrough and bool(self.shared_prefix_layers)

    def __call__(self, **kwargs):
        """The view's forward pass, after a fast :meth:`sync`; the policy's own forward pass while
        a peft wrapper carries forward hooks (:attr:`passthrough`). A ``cache`` with ``segments`` set
        runs packed (:meth:`takes_packed`, else RuntimeError). A ``cache`` whose ``shared``
        prefix is set (:class:`~selfrl.engines.kvcache.SlotCache`) has it attended once for all rows
        (:mod:`selfrl.engines.sharedattention`) where every attention layer takes it, and has it
        unset otherwise (the cache then hands attention whole rows)."""
        with self._lock:
            self.sync()
            cache = kwargs.get("cache")
            shared = getattr(cache, "shared", None)  # a SlotCache's prefix shared by the pass's rows
            if getattr(cache, "segments", None) is not None:  # a packed pass (selfrl.engines.packedattention)
                if self.passthrough or not self.shared_prefix_layers:  # (synced just above: takes_packed)
                    raise RuntimeError("a packed pass needs the view's own attention in every layer "
                                       "(MergedPolicy.takes_packed); run its passes one by one")
                kwargs["packed_segments"] = cache.segments
            elif shared is not None:
                if self.passthrough or not self.shared_prefix_layers:
                    cache.unshare()  # attention over each row's own columns, the prefix copied in where lent
                else:
                    kwargs["shared_prefix_kv"] = shared
            return (self.model if self.passthrough else self.view)(**kwargs)
