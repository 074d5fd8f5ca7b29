"""The slot engine's sampling view of the policy: each LoRA merged into its layer's weight,
and the products of small batches arranged for the CPU's matrix library.

A decoding step of the embedded model on this machine's CPU is bound by reading the weights
(docs/benchmarks.md, "Merged LoRA and the small-batch product"). Two things made it slower than
that read:

- **The unmerged LoRA.** peft computes ``W x + s B (A x)`` in every targeted layer: about 1,000
  of a step's 1,500 operator calls are the LoRA's two small products, its scaling and its sum.
  :class:`MergedPolicy` keeps ``W' = W + s B A`` per layer instead, one product per layer, and
  merges again whenever the LoRA's tensors change (an update in place, a swap): the check is
  torch's per-tensor version counter, read before every forward pass, so an update is sampled
  from at the next step, as with the unmerged model.
- **The orientation of the product.** For 2 to 10 rows, MKL (torch's CPU BLAS) computes
  ``(W @ x.T).T`` 1.5 to 3.5 times faster than ``x @ W.T`` (``F.linear``) on this CPU: the
  weights stream at about 35 GB/s instead of 10 to 15. One row is a matrix-vector product,
  as slow either way, unless the row is doubled into a two-row product (2.2 times faster).
  :func:`small_batch_linear` does that for 1 to 10 rows and calls ``F.linear`` otherwise. The rule is fixed, not tuned per run, so that a seeded
  run samples the same tokens every time.

Both change only the order of fp32 sums: logprobs stay within the conformance suite's 1e-5 of
a full recomputation by the learner (``tests/test_engine_conformance.py``).

The view is a copy of the model's module tree whose parameters and buffers *are* the
policy's (no copy), except that each merged layer holds its own merged weight (extra memory:
the targeted layers' weights once more, 424 MB for the embedded model in fp32). A layer that
cannot be merged exactly (DoRA, a LoRA bias, several active adapters, a non-``Linear`` base) is
kept as peft's module, so the view always computes the policy.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

SMALL_BATCH_ROWS = (1, 10)  # rows for which (W @ x.T).T is used on the CPU (docs/benchmarks.md)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, computed as ``(weight @ x.T).T`` when ``x`` holds 1 to 10
    rows on the CPU (one row doubled) (see the module docstring; measured in ``benchmarks/bench_merged.py``).

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
    tensor (a layer without LoRA) or a merged copy owned by :class:`MergedPolicy`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight, self.bias = weight, bias  # plain attributes: nothing here is trained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_batch_linear(x, self.weight, self.bias)


def _mergeable(mod) -> str | None:
    """The adapter name whose delta merges exactly into ``mod``, or None."""
    from peft.tuners.lora import Linear as LoraLinear

    if not isinstance(mod, LoraLinear) or not isinstance(mod.base_layer, nn.Linear) or mod.merged:
        return None
    if mod.disable_adapters or len(mod.active_adapters) != 1:
        return None
    name = mod.active_adapters[0]
    if name not in mod.lora_A or mod.use_dora.get(name, False) or getattr(mod, "lora_bias", {}).get(name, False):
        return None
    return name


class MergedPolicy:
    """A sampling view of ``model`` (a peft model or a plain Hugging Face causal LM) with its
    LoRA merged; call it like the model, under ``torch.no_grad()``.

    Args:
        model: the policy. Its tensors are shared, never modified.

    Attributes:
        merged_layers: how many LoRA layers are merged (0 for a model without LoRA).
        kept_layers: LoRA layers left unmerged (computed by peft, as in the policy).
        merges: how many times the merged weights were computed (1 at construction, then one
            per change of the LoRA tensors).
        extra_bytes: memory of the merged weights.
    """

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        memo = {id(t): t for t in base.parameters()}
        memo.update({id(t): t for t in base.buffers()})
        self.view = copy.deepcopy(base, memo)  # the module tree; every tensor shared
        self.view.eval()
        self.merged_layers = self.kept_layers = self.merges = self.extra_bytes = 0
        self._pairs: list[tuple[nn.Module, str, torch.Tensor]] = []  # (peft layer, adapter, merged weight)
        done: list[str] = []  # replaced or kept peft layers: their submodules are theirs
        for name, orig in base.named_modules():
            if not name or any(name.startswith(d + ".") for d in done):
                continue
            adapter = _mergeable(orig)
            if adapter is not None:
                w = orig.base_layer.weight
                merged = torch.empty_like(w, requires_grad=False)
                self._pairs.append((orig, adapter, merged))
                self._replace(name, SamplingLinear(merged, orig.base_layer.bias))
                self.merged_layers += 1
                self.extra_bytes += merged.numel() * merged.element_size()
                done.append(name)
            elif hasattr(orig, "lora_A"):
                self.kept_layers += 1
                done.append(name)
            elif type(orig) is nn.Linear:
                self._replace(name, SamplingLinear(orig.weight, orig.bias))
                done.append(name)
        self._watched = [m for mod, a, _ in self._pairs for m in (mod.lora_A[a], mod.lora_B[a], mod.base_layer)]
        self._stamp: tuple | None = None
        self.refresh()

    def _replace(self, name: str, new: nn.Module) -> None:
        parent, _, leaf = name.rpartition(".")
        setattr(self.view.get_submodule(parent) if parent else self.view, leaf, new)

    def stamp(self) -> tuple:
        """Changes whenever a LoRA tensor is modified in place or replaced (torch's version
        counters and storage addresses) or a LoRA scaling changes."""
        stamp = [(mod.scaling[a],) for mod, a, _ in self._pairs]
        for layer in self._watched:  # the Linear modules of each merged layer: lora_A, lora_B, base
            w = layer._parameters["weight"]  # read past nn.Module.__getattr__: this runs at every step
            stamp.append((w._version, w.data_ptr()))
        return tuple(stamp)

    @torch.no_grad()
    def refresh(self) -> bool:
        """Merge again if the LoRA changed since the last merge; True if it merged. Cost: one
        (out, r) x (r, in) product and a sum per layer (0.18 s for the embedded model)."""
        stamp = self.stamp()
        if stamp == self._stamp:
            return False
        for mod, adapter, merged in self._pairs:
            merged.copy_(mod.base_layer.weight)
            merged.add_(mod.get_delta_weight(adapter).to(merged.dtype))
        self._stamp = stamp
        self.merges += 1
        return True

    def __call__(self, **kwargs):
        """The view's forward pass (merged first if the LoRA changed)."""
        self.refresh()
        return self.view(**kwargs)
