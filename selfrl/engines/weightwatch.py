"""Whether a policy's weights or adapter state changed since an engine last looked.

The slot engine keeps things computed from the weights: stored prefixes' keys and values, and
the merged LoRA of its sampling view (:mod:`selfrl.engines.mergedpolicy`). Using them after the
weights moved would sample from stale weights with no error, the failure this field's users
report most. :class:`WeightWatch` counts changes at two depths:

- **fast** (every decoding step and every finished row, about 0.3 ms for the embedded model):
  torch's version counter and storage address of every parameter (the adapter's, trainable or
  frozen, and the frozen base weights: a ``load_state_dict`` or an in-place op into them), and
  peft's LoRA scalings. An optimizer step (``torch.optim`` without ``fused=True``),
  ``load_state_dict`` and ``copy_`` bump the counters.
- **deep** (when rows join an idle engine, about 20 ms for the embedded model on an idle machine):
  also the identity, storage, dtype, device and ``requires_grad`` of every parameter and buffer,
  the buffers' version counters, the modules themselves, the forward hooks on each module and on a peft model's wrappers, peft's
  adapter flags (disabled, merged, active adapter), and the watched tensors' *contents*, compared
  bit for bit with a copy taken at the last look. This catches what leaves the counters alone:
  fused optimizers, writes through ``.data``, ``merge_adapter`` and ``unmerge_adapter``,
  ``disable_adapter()``, ``set_adapter``, a replaced norm or embedding, ``model.to(dtype)``.

The content copy is kept only while the watched tensors total at most ``CONTENT_CHECK_BYTES``
(a LoRA: 20 MB for the embedded model at rank 16); for larger trainable sets (a fully trainable
model) the deep check relies on the counters, addresses and structure.
"""

from __future__ import annotations

import torch

CONTENT_CHECK_BYTES = 256 * 2**20


def hook_dicts(module) -> list[dict]:
    """The hook registries of one module (``_forward_hooks``, ``_forward_pre_hooks``, ...); the
    watch counts the forward ones (the only ones a no-grad forward pass runs)."""
    return [v for k, v in vars(module).items() if "hook" in k and isinstance(v, dict)]


def adapter_layers(base) -> list:
    """The peft LoRA layers of ``base`` (modules with ``lora_A``), in module order."""
    return [m for m in base.modules() if hasattr(m, "lora_A") and hasattr(m, "active_adapters")]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (a NaN equals itself, 0.0 differs from -0.0), unlike ``torch.equal``."""
    if a.is_contiguous() and b.is_contiguous() and a.dtype == b.dtype and a.shape == b.shape:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


class WeightWatch:
    """Counts changes of ``model``'s weights and adapter state (see the module docstring).

    Attributes:
        generation: increases by one at each look that found any change.
        structure_generation: increases at each look that found a structural change (a
            replaced tensor or module, a dtype, an adapter flag, a hook); such a change also
            counts in ``generation``.
    """

    def __init__(self, model):
        self.base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # a peft model's wrappers around the base: their hooks run in the policy's forward pass
        self.wrappers = [w for w in (model, getattr(model, "base_model", None)) if w is not None and w is not self.base]
        self.generation = self.structure_generation = 0
        try:
            self._take_structure()
        except RuntimeError as e:
            if "Inference tensors" not in str(e):
                raise
            raise ValueError("the policy's tensors were created under torch.inference_mode(), which keeps no "
                             "version counters, so an engine cannot tell when they change; create the model "
                             "outside inference mode (torch.no_grad() is enough), or use the reference engine") from e

    def _take_structure(self) -> None:
        # the adapter's tensors, trainable or frozen (a served adapter is often frozen), and anything trainable
        self._trainable = [p for n, p in self.base.named_parameters() if p.requires_grad or "lora_" in n]
        self._params = list(self.base.parameters())  # every one, frozen too: their version counters
        self._layers = adapter_layers(self.base)
        self._structure = self._structure_stamp()
        self._fast = self._fast_stamp()
        size = sum(p.numel() * p.element_size() for p in self._trainable)
        with torch.inference_mode(False), torch.no_grad():  # in this order: inference_mode(False) turns gradients on
            self._snapshot = [p.detach().clone() for p in self._trainable] if size <= CONTENT_CHECK_BYTES else None

    def _fast_stamp(self) -> tuple:
        return (tuple((p._version, p.data_ptr()) for p in self._params),
                tuple(tuple(m.scaling.items()) for m in self._layers))

    def _structure_stamp(self) -> tuple:
        stamp: list = [len(w._forward_hooks) + len(w._forward_pre_hooks) for w in self.wrappers]
        for m in self.base.modules():  # one pass, reading the registries directly (2,500 modules: a few ms)
            stamp.append((id(m), len(m._forward_hooks) + len(m._forward_pre_hooks)))
            for t in m._parameters.values():  # (their version counters are the fast stamp's)
                if t is not None:
                    stamp.append((id(t), t.data_ptr(), t.dtype, t.device, t.requires_grad))
            for t in m._buffers.values():
                if t is not None:
                    stamp.append((id(t), t.data_ptr(), t.dtype, t.device, t._version))
        stamp.extend((m.disable_adapters, m.merged, tuple(m.active_adapters)) for m in self._layers)
        return tuple(stamp)

    def poll(self, deep: bool = False) -> int:
        """Look for changes (fast, or ``deep``); returns :attr:`generation`."""
        fast = self._fast_stamp()
        changed = fast != self._fast
        if deep:
            if self._structure_stamp() != self._structure:
                self.structure_generation += 1
                self.generation += 1
                self._take_structure()
                return self.generation
            if not changed and self._snapshot is not None:
                changed = any(not _same_bits(p, s) for p, s in zip(self._trainable, self._snapshot))
        if changed:
            self.generation += 1
            self._fast = fast
            if self._snapshot is not None:
                with torch.inference_mode(False), torch.no_grad():  # this order: no_grad last
                    for p, s in zip(self._trainable, self._snapshot):
                        s.copy_(p)
        return self.generation
