"""Products with frozen fp32 weights on the CPU through oneDNN instead of torch's BLAS.

torch's CPU wheels compute ``F.linear`` with Intel's MKL. On this machine's AMD EPYC
(AVX-512) MKL takes a slower path: a 4096 x 4096 fp32 product runs at 163-200 GFLOP/s
against 379-437 through oneDNN, the other matrix library in the same wheel; the products of
one forward pass of the embedded model run 1.25 (1 row) to 2.1 times (2,048 rows) faster
through oneDNN, its rollouts 1.4 times and its updates 1.5 times (``benchmarks/bench_matmul.py``).

oneDNN is reached through the operator torch's own compiler uses for CPU linear layers,
``torch.ops.mkldnn._linear_pointwise``: a private operator, so it is used only after
:func:`available` has checked on a probe that it exists and agrees with ``F.linear``, and every
call falls back to ``F.linear`` when it does not apply.

It applies to a product ``x @ weight.T + bias`` on the CPU in fp32 whose ``weight`` (and
``bias``) need no gradient: the frozen base weights of a LoRA policy and its output layer.
The gradient with respect to ``x`` is a second oneDNN product (with ``weight.T``), so an
update's forward and backward passes both take it; a trainable weight (the LoRA matrices
themselves) keeps ``F.linear``.

Only the rounding of fp32 sums differs from MKL: an update's loss agreed to 1e-7 on the demo's
batches. Products of 2 to 4,096 rows give each row the same result, however many rows share the
product; a single row takes another kernel and differs by a few 1e-6 relative (MKL's results
depend on the number of rows too, by about as much).

For sampling, :func:`pack` lays a weight out once in oneDNN's blocked format (a plain weight is
reordered at every call) and :func:`packed_linear` computes with it; the slot engine's merged view
packs its layers at each merge (``selfrl.engines.mergedpolicy``).

``model.cpu_matmul`` chooses it: ``auto`` (oneDNN for such layers where :func:`available`),
``onednn`` (the same, refused where not available), ``torch`` (``F.linear`` everywhere).

Memory: oneDNN builds one primitive (its compiled kernels, about 0.2-2 MB of heap) per product
shape and keeps it in two caches, its own and that of torch's ideep layer, of 1,024 primitives
each by default. A server meets a new row count with nearly every prompt length and batch, so
those caches grew its resident memory by about 0.5 MB per new shape, for hours. So the rows of a
product are padded with zeros to one of eight sizes per doubling (:func:`padded_rows`; at most
1/8 more rows; a product of up to :data:`EXACT_ROWS` rows, a decoding step's, keeps its own),
and importing this module bounds both caches to :data:`PRIMITIVE_CACHE_CAPACITY` primitives
(least recently used out first; a shape met again after its eviction is built again, 1-3 ms;
the library's own default, made explicit: a bound of 64 made one iteration's rollouts 4.4 times
slower, 34.5 s against 7.9 s, in one side-by-side ``benchmarks/bench_engines.py --skip-serve
--engines slots`` on a loaded 2-core machine, so memory is bounded by the padding, not a smaller
cache) by setting their environment variables, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and
``LRU_CACHE_CAPACITY``, unless they are set already: a value given in the environment is kept.
They are read at the process's first oneDNN product, so they apply when this module is imported
before any (selfrl imports it before it builds a model).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import forward_ad

from selfrl.model.device import CPU_MATMULS as CHOICES

PROBE_RTOL = 1e-5  # the probe's largest |oneDNN - F.linear| over the largest |F.linear|
EXACT_ROWS = 16  # products of at most this many rows (a decoding step's) keep their own shape
PRIMITIVE_CACHE_CAPACITY = 1024  # primitives each oneDNN cache keeps (the module docstring's "Memory")
CACHE_CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's, ideep's


def bound_primitive_caches(capacity: int = PRIMITIVE_CACHE_CAPACITY) -> dict[str, str]:
    """Set oneDNN's and ideep's primitive cache capacities to ``capacity`` primitives where the
    environment does not set them already; returns the values in force (variable -> value).
    Effective only before the process's first oneDNN product (the module docstring's "Memory");
    runs when this module is imported."""
    return {name: os.environ.setdefault(name, str(capacity)) for name in CACHE_CAPACITY_VARIABLES}


bound_primitive_caches()


class MatmulError(ValueError):
    """``cpu_matmul = "onednn"`` where oneDNN's product is not available; the message says why."""


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> str | None:
    """Why oneDNN's linear product cannot be used in this process, or None when it can.

    Checks that torch was built with oneDNN, that the operator exists, and that on a fixed probe
    ((5, 96) inputs, (40, 96) weight, a bias, and the product's backward form with a transposed
    weight) it matches ``F.linear`` within :data:`PROBE_RTOL`. Cached: runs once per process."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN (torch.backends.mkldnn.is_available() is False)"
    try:
        op = torch.ops.mkldnn._linear_pointwise
        g = torch.Generator().manual_seed(0)
        x, w, b = (torch.randn(*s, generator=g) for s in ((5, 96), (40, 96), (40,)))
        pairs = [(op(x, w, b, "none", [], ""), F.linear(x, w, b)),
                 (op(x[:, :40], w.t(), None, "none", [], ""), F.linear(x[:, :40], w.t()))]
    except Exception as e:  # an operator missing or changed in this torch
        return f"torch.ops.mkldnn._linear_pointwise failed on a probe: {e!r}"
    for got, want in pairs:
        if got.shape != want.shape or not bool(((got - want).abs().max() <= PROBE_RTOL * want.abs().max())):
            return "torch.ops.mkldnn._linear_pointwise disagrees with F.linear on a probe"
    return None


def available() -> bool:
    """True when oneDNN's linear product can be used here (:func:`unavailable_reason`)."""
    return unavailable_reason() is None


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """True when ``x @ weight.T + bias`` can go through oneDNN: all on the CPU in fp32, no
    gradient for ``weight`` or ``bias``, a 2-D weight, at least one row, matching shapes (else
    ``F.linear`` says what is wrong), no CPU autocast (which would compute ``F.linear`` in its
    own dtype), and :func:`available`."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.dim() == 2 and x.dim() >= 2 and x.numel() > 0
            and x.shape[-1] == weight.shape[1] > 0 and not weight.requires_grad
            and (bias is None or (not bias.requires_grad and bias.dtype == torch.float32 and bias.device.type == "cpu"
                                  and tuple(bias.shape) == (weight.shape[0],)))
            and not torch.is_autocast_enabled("cpu") and available())


def padded_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows is computed with (the module docstring's "Memory"):
    ``rows`` itself up to :data:`EXACT_ROWS`, else rounded up to the next of eight steps per
    doubling (at most 1/8 more rows), so that a server meets a few dozen shapes, not thousands.

    >>> [padded_rows(n) for n in (1, 16, 17, 100, 1000, 4096)]
    [1, 16, 18, 104, 1024, 4096]
    """
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., out) = x @ weight.T + bias through oneDNN (no autograd). The operator honours the
    strides of ``x`` and ``weight`` but not of ``bias``: a strided bias is made contiguous. The
    rows are padded with zeros to :func:`padded_rows` (each row's result is the same however many
    rows share the product) and the padding cut off again."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    rows = x.numel() // x.shape[-1]
    padded = padded_rows(rows)
    if padded == rows:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    flat = x.new_zeros(padded, x.shape[-1])  # (padded, in)
    flat[:rows] = x.reshape(rows, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")  # (padded, out)
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


class _FrozenLinear(torch.autograd.Function):
    """``x @ weight.T + bias`` through oneDNN with derivatives for ``x`` only (the weight is frozen):
    the backward pass is itself a :func:`linear` (so second derivatives are exact), and ``jvp``
    gives forward-mode tangents."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        ctx.save_for_forward(weight)
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:  # (..., out) @ (out, in): a product with the transposed weight
            gx = linear(grad.contiguous(), weight.t())  # differentiable again under create_graph
        return gx, None, None

    @staticmethod
    def jvp(ctx, tx, tw, tb):
        (weight,) = ctx.saved_tensors
        return F.linear(tx, weight)  # the weight and bias are frozen: their tangents are None


def _wants_derivatives(x: torch.Tensor) -> bool:
    """True when a product of ``x`` must carry derivatives: a gradient for ``x`` (backward mode)
    or a forward-mode dual level open (``x`` may carry a tangent)."""
    return (torch.is_grad_enabled() and x.requires_grad) or forward_ad._current_level >= 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN where :func:`takes` says it can.

    Args:
        x: (..., in_features) inputs; a gradient flows to ``x`` when it requires one.
        weight: (out_features, in_features).
        bias: (out_features,) or None.

    Returns:
        (..., out_features) contiguous; within fp32 rounding of ``F.linear`` (the module docstring).

    Raises:
        RuntimeError: mismatched shapes (``F.linear``'s message: such products are left to it).
    """
    if not takes(x, weight, bias):
        return F.linear(x, weight, bias)
    if _wants_derivatives(x):
        return _FrozenLinear.apply(x, weight, bias)
    return _onednn(x, weight, bias)


@functools.lru_cache(maxsize=None)
def packing_available() -> bool:
    """True when :func:`pack` can give oneDNN's packed weights here: :func:`available`, the packing
    operator exists, and a product with a packed probe weight matches ``F.linear`` (cached)."""
    if not available():
        return False
    try:
        g = torch.Generator().manual_seed(1)
        x, w, b = (torch.randn(*s, generator=g) for s in ((2, 3, 96), (40, 96), (40,)))
        got, want = _onednn(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b), F.linear(x, w, b)
    except Exception:  # an operator missing or changed in this torch
        return False
    return got.shape == want.shape and bool((got - want).abs().max() <= PROBE_RTOL * want.abs().max())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a frozen fp32 (out, in) CPU ``weight`` for :func:`packed_linear`,
    or None where :func:`packing_available` says no or the weight does not qualify.

    The copy is laid out once in oneDNN's blocked format, so that a product need not reorder the
    weight at every call: the demo's rollout batches 1.13-1.39 times faster than with plain
    weights (docs/results/benchmarks.md, "The matrix library"). It is a snapshot:
    pack again after the weight changes. Memory: as much as the weight."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 or weight.requires_grad
            or weight.numel() == 0 or not packing_available()):
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``packed`` (:func:`pack` of ``weight``, current) when
    no gradient is wanted for ``x`` and :func:`takes` says it can; else :func:`linear`.

    Args:
        x: (..., in_features); weight: (out_features, in_features); bias: (out_features,) or None.
        packed: the packed copy of ``weight`` as it is now, or None.

    Returns:
        (..., out_features), as :func:`linear` computes it to fp32 rounding.
    """
    if packed is None or _wants_derivatives(x) or not takes(x, weight, bias):
        return linear(x, weight, bias)
    return _onednn(x, packed, bias)


def _routed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias)


def route_frozen_linears(model: nn.Module, choice: str = "auto") -> int:
    """Make the frozen fp32 ``nn.Linear`` layers of ``model`` on the CPU compute through
    :func:`linear` (an instance ``forward``, a ``functools.partial`` of a module-level function,
    so the model still deep-copies and pickles; the module's class, parameters and state dict stay
    as they were); returns how many were routed.

    Each call still checks :func:`takes`, so a layer later unfrozen, cast or moved to a GPU
    computes with ``F.linear``. Trainable layers (a LoRA's A and B) are left alone.

    Args:
        choice: one of :data:`CHOICES`; ``torch`` routes nothing.

    Raises:
        MatmulError: ``choice`` is ``onednn`` and oneDNN is not available, or an unknown choice.
    """
    if choice not in CHOICES:
        raise MatmulError(f"cpu_matmul must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "torch":
        return 0
    reason = unavailable_reason()
    if reason is not None:
        if choice == "onednn":
            raise MatmulError(f"cpu_matmul = 'onednn' cannot be honoured: {reason}; use 'auto' or 'torch'")
        return 0
    n = 0
    for m in model.modules():
        if type(m) is nn.Linear and is_frozen_cpu_fp32(m):
            m.forward = functools.partial(_routed_forward, m)
            n += 1
    return n


def is_frozen_cpu_fp32(layer: nn.Linear) -> bool:
    """True for a linear layer whose weight (and bias) are fp32 on the CPU and frozen."""
    w, b = layer.weight, layer.bias
    return (w.device.type == "cpu" and w.dtype == torch.float32 and not w.requires_grad
            and (b is None or not b.requires_grad))


def is_routed(layer: nn.Module) -> bool:
    """True when :func:`route_frozen_linears` routed ``layer`` (or the layer it was copied from)."""
    fwd = vars(layer).get("forward")
    return isinstance(fwd, functools.partial) and fwd.func is _routed_forward and fwd.args == (layer,)
