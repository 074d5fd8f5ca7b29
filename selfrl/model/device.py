"""Where the policy lives and in what precision: device and dtype resolution, gradient
checkpointing, and the peak memory of an update.

``model.device = "auto"`` picks CUDA when a GPU is visible and the CPU otherwise;
``model.dtype = "auto"`` picks bfloat16 on a GPU that supports it and float32
everywhere else. On a machine without a GPU the defaults therefore resolve to
``cpu`` / ``float32``, exactly what selfrl did before it knew about devices, and a
seeded CPU run gives the same numbers as before.

An impossible setting is refused with :class:`DeviceError` (a ``ValueError``), never
quietly replaced: ``cuda`` with no GPU, ``bfloat16`` on a GPU without bf16 support.
float16 is not offered: a LoRA update in fp16 needs a loss scaler, which the learner
does not have; bfloat16 has fp32's exponent range and needs none.

The LoRA parameters stay float32 in every case (peft's ``autocast_adapter_dtype``):
only the frozen base weights take the reduced precision, and AdamW's state is fp32.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")
CPU_MATMULS = ("auto", "onednn", "torch")  # model.cpu_matmul: selfrl.model.matmul


class DeviceError(ValueError):
    """An impossible device or dtype setting; the message says which and why."""


@dataclass(frozen=True)
class Placement:
    """A resolved device and dtype.

    Attributes:
        device: ``"cpu"`` or ``"cuda"`` (``"cuda"`` means the current CUDA device).
        dtype: ``"float32"`` or ``"bfloat16"``, the dtype of the frozen base weights.
    """

    device: str
    dtype: str

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]


def check_cpu_matmul(choice: str, placement: "Placement") -> None:
    """Raise :class:`DeviceError` when ``model.cpu_matmul = "onednn"`` is asked of a policy that
    is not float32 on the CPU: nothing would take it, and a setting is never silently ignored."""
    if choice == "onednn" and (placement.device, placement.dtype) != ("cpu", "float32"):
        raise DeviceError(f"model.cpu_matmul = 'onednn' applies to a float32 policy on the CPU, and the policy "
                          f"resolves to {placement.dtype} on {placement.device}; use 'auto' or 'torch'")


def check_names(device: str, dtype: str) -> None:
    """Raise :class:`DeviceError` when ``device`` or ``dtype`` is not an allowed name
    (no torch import: config validation calls this)."""
    if device not in DEVICES:
        raise DeviceError(f"model.device must be one of {', '.join(DEVICES)}, got {device!r}")
    if dtype not in DTYPES:
        hint = " (float16 is not supported: use bfloat16)" if dtype in ("float16", "fp16", "half") else ""
        raise DeviceError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}{hint}")


def resolve(device: str = "auto", dtype: str = "auto") -> Placement:
    """Turn the configured names into a :class:`Placement` for this machine.

    >>> resolve("cpu", "auto")
    Placement(device='cpu', dtype='float32')

    Raises:
        DeviceError: an unknown name, ``cuda`` asked with no GPU visible, or
            ``bfloat16`` asked on a GPU without bf16 support.
    """
    import torch

    check_names(device, dtype)
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        why = ("this torch build has no CUDA support" if torch.version.cuda is None
               else "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)")
        raise DeviceError(f"model.device = 'cuda' but {why}; use --device cpu or auto")
    chosen = "cuda" if device == "cuda" or (device == "auto" and has_cuda) else "cpu"
    bf16_ok = chosen == "cpu" or torch.cuda.is_bf16_supported()
    if dtype == "bfloat16" and not bf16_ok:
        raise DeviceError(f"model.dtype = 'bfloat16' but {torch.cuda.get_device_name()} has no bf16 support; "
                          "use float32")
    if dtype == "auto":
        dtype = "bfloat16" if chosen == "cuda" and bf16_ok else "float32"
    return Placement(chosen, dtype)


def model_device(model):
    """The device of the model's first parameter (``torch.device``)."""
    return next(model.parameters()).device


def enable_gradient_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping
    them (less memory for about one more forward's time). Non-reentrant, so the frozen
    embeddings need no ``requires_grad`` trick. Works through peft's wrapper.

    Raises:
        ValueError: the model does not support gradient checkpointing (transformers' message).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if hasattr(base, "activation_checkpointing_enable"):  # transformers >= 5.24; the old name is deprecated there
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def gradient_checkpointing_on(model) -> bool:
    """Whether gradient checkpointing is on (transformers >= 5.24 calls it activation checkpointing)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "is_activation_checkpointing" if hasattr(type(base), "is_activation_checkpointing") else "is_gradient_checkpointing"
    return bool(getattr(base, name, False))


class PeakMemory:
    """Peak memory of a block of work, in bytes (used once per update).

    On CUDA it is ``torch.cuda.max_memory_allocated`` since the block started (the
    counter is reset at the start). On the CPU no such reset exists: it is the
    process's peak resident set size so far (``getrusage``), so it never falls
    between updates; the metric's name says which (:attr:`metric`).
    """

    def __init__(self, device):
        import torch

        self.cuda = getattr(device, "type", str(device)) == "cuda"
        self.metric = "memory/peak_cuda_bytes" if self.cuda else "memory/peak_rss_bytes"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self.device = device

    def read(self) -> float:
        import torch

        if self.cuda:
            return float(torch.cuda.max_memory_allocated(self.device))
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux
