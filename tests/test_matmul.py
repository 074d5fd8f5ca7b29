"""Frozen fp32 products through oneDNN (selfrl.model.matmul): the values and gradients of F.linear, the
layers that take it and those that do not, and the settings that choose it."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import add_lora, build_tiny_model, save_tiny_phi

import selfrl.model.matmul as mm
from selfrl.config import ConfigError, RunConfig, load_config
from selfrl.engines.mergedpolicy import MergedPolicy, SamplingLinear
from selfrl.model.load import build_policy
from selfrl.rl.logprobs import per_token_logps

needs_onednn = pytest.mark.skipif(not mm.available(), reason=f"oneDNN not available: {mm.unavailable_reason()}")


@pytest.fixture
def calls(monkeypatch):
    """How many products went through oneDNN (selfrl.model.matmul._onednn) since the test began."""
    box = [0]
    real = mm._onednn

    def counting(*args):
        box[0] += 1
        return real(*args)

    monkeypatch.setattr(mm, "_onednn", counting)
    return box


@needs_onednn
@pytest.mark.parametrize("shape", [(7, 96), (2, 3, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_is_f_linear_through_onednn(calls, shape, with_bias):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(*shape, generator=g), torch.randn(40, 96, generator=g)
    b = torch.randn(40, generator=g) if with_bias else None
    y = mm.linear(x, w, b)
    assert calls[0] == 1 and y.shape == (*shape[:-1], 40)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)


@needs_onednn
def test_the_gradient_for_the_input_is_f_linears(calls):
    g = torch.Generator().manual_seed(2)
    w, b = torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    x = torch.randn(3, 5, 96, generator=g, requires_grad=True)
    up = torch.randn(3, 5, 40, generator=g)  # d loss / d y
    (mm.linear(x, w, b) * up).sum().backward()
    assert calls[0] == 2  # the forward product and the backward one (with the transposed weight)
    mine, x.grad = x.grad, None
    (F.linear(x, w, b) * up).sum().backward()
    torch.testing.assert_close(mine, x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(mine, up @ w, atol=1e-5, rtol=1e-5)  # by hand: dL/dx = dL/dy W


@needs_onednn
def test_products_it_does_not_take_are_f_linears(calls):
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    trainable = w.clone().requires_grad_()
    y = mm.linear(x, trainable)
    y.sum().backward()
    torch.testing.assert_close(trainable.grad, x.sum(0).expand(6, 8))  # the weight's gradient, by hand
    for args in [(x.bfloat16(), w.bfloat16()), (x[0], w), (x[:0], w), (x, w, torch.zeros(6, requires_grad=True))]:
        assert not mm.takes(*args)
        mm.linear(*args)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # F.linear's message, not oneDNN's
        mm.linear(torch.randn(4, 5), w)
    assert not mm.takes(x, w, torch.zeros(1))  # a broadcast bias: F.linear's
    assert calls[0] == 0
    assert mm.takes(x.requires_grad_(), w)  # a frozen weight and an input that needs a gradient: it takes it


@needs_onednn
def test_route_frozen_linears_routes_the_frozen_layers_only(tiny_tokenizer, calls):
    plain = add_lora(build_tiny_model(tiny_tokenizer, seed=3), seed=4, cpu_matmul="torch")
    assert not any(mm.is_routed(m) for m in plain.modules())
    model = copy.deepcopy(plain)
    n = mm.route_frozen_linears(model, "auto")
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    frozen = [m for m in linears if not m.weight.requires_grad]
    assert n == len(frozen) > 0 and len(linears) > len(frozen)  # the LoRA's A and B are trainable: left alone
    assert all(mm.is_routed(m) == (m in frozen) for m in linears)
    assert model.get_base_model().lm_head in frozen  # the output layer too
    assert mm.route_frozen_linears(copy.deepcopy(plain), "torch") == 0

    ids = torch.randint(3, 200, (2, 9))
    mask, comp = torch.ones_like(ids), torch.zeros_like(ids)
    comp[:, 4:] = 1
    losses = {}
    for name, m in [("torch", plain), ("onednn", model)]:
        calls[0] = 0
        lp = per_token_logps(m, ids, mask, comp, 0.7)  # (2, 9)
        (lp * comp).sum().backward()
        losses[name] = (lp.detach(), {k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad})
        assert (calls[0] > 0) == (name == "onednn")
    torch.testing.assert_close(losses["onednn"][0], losses["torch"][0], atol=1e-5, rtol=0)
    for k, grad in losses["torch"][1].items():  # the LoRA's gradients, through the other library
        torch.testing.assert_close(losses["onednn"][1][k], grad, atol=1e-5, rtol=1e-4)


def test_a_setting_that_cannot_be_honoured_is_refused(tiny_tokenizer, monkeypatch):
    model = add_lora(build_tiny_model(tiny_tokenizer), cpu_matmul="torch")
    with pytest.raises(mm.MatmulError, match="cpu_matmul must be one of"):
        mm.route_frozen_linears(model, "mkl")
    monkeypatch.setattr(mm, "unavailable_reason", lambda: "no oneDNN here")
    with pytest.raises(mm.MatmulError, match="no oneDNN here"):
        mm.route_frozen_linears(model, "onednn")
    assert mm.route_frozen_linears(model, "auto") == 0  # auto: F.linear where oneDNN is not available
    with pytest.raises(ConfigError, match="cpu_matmul must be one of"):
        load_config(overrides={"model.cpu_matmul": "mkl"})
    with pytest.raises(ConfigError, match="applies to a float32 policy on the CPU"):
        load_config(overrides={"model.cpu_matmul": "onednn", "model.device": "cpu", "model.dtype": "bfloat16"})


@needs_onednn
@pytest.mark.parametrize("setting", ["auto", "onednn", "torch"])
def test_build_policy_honours_cpu_matmul(tmp_path, tiny_tokenizer, setting):
    cfg = RunConfig()
    cfg.model.name, cfg.lora.r, cfg.model.cpu_matmul = str(save_tiny_phi(tmp_path / "m", tiny_tokenizer)), 4, setting
    model, _ = build_policy(cfg)
    routed = sum(mm.is_routed(m) for m in model.modules())
    frozen = sum(type(m) is torch.nn.Linear and not m.weight.requires_grad for m in model.modules())
    assert routed == (0 if setting == "torch" else frozen) and frozen > 0


@needs_onednn
def test_the_sampling_view_computes_as_the_policys_layers(tiny_tokenizer, calls):
    model = add_lora(build_tiny_model(tiny_tokenizer, seed=5), seed=6)
    view = MergedPolicy(model)
    layers = [m for m in view.view.modules() if isinstance(m, SamplingLinear)]
    assert layers and all(m.onednn for m in layers)
    # the merged weights are outside the LoRA's graph (they required a gradient once, and missed oneDNN)
    assert not any(m.weight.requires_grad for m in layers)
    ids = torch.randint(3, 200, (2, 6))
    with torch.no_grad():
        got = view(input_ids=ids).logits
        calls[0] = 0
        view(input_ids=ids)
        # 2 lean layers (selfrl.engines.leanlayers) of 4 products each (q, k and v stacked, o, gate and up
        # stacked, down), and the output layer
        assert view.lean_layers == 2 and calls[0] == 2 * 4 + 1
        torch.testing.assert_close(got, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    plain = MergedPolicy(add_lora(build_tiny_model(tiny_tokenizer, seed=5), seed=6, cpu_matmul="torch"))
    assert not any(m.onednn for m in plain.view.modules() if isinstance(m, SamplingLinear))


@needs_onednn
def test_a_routed_model_copies_and_pickles_with_its_layers_routed(tiny_tokenizer, calls):
    import io

    model = add_lora(build_tiny_model(tiny_tokenizer, seed=7), seed=8)
    buf = io.BytesIO()
    torch.save(model, buf)  # a bound method of the module would not pickle
    buf.seek(0)
    for other in (torch.load(buf, weights_only=False), copy.deepcopy(model)):
        routed = [m for m in other.modules() if mm.is_routed(m)]
        assert len(routed) == sum(mm.is_routed(m) for m in model.modules()) > 0
        assert all(m.forward.args[0] is m for m in routed)  # each computes with its own weights
        ids = torch.randint(3, 200, (1, 6))
        calls[0] = 0
        with torch.no_grad():
            torch.testing.assert_close(other(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
        assert calls[0] == 2 * len(routed)


@needs_onednn
def test_a_strided_bias_is_honoured(calls):
    # the operator ignores a bias's strides: a bias split from a fused tensor along columns was 4 off
    layer = torch.nn.Linear(96, 40).requires_grad_(False)
    layer.bias = torch.nn.Parameter(torch.randn(40, 3)[:, 1], requires_grad=False)  # stride 3
    assert not layer.bias.is_contiguous() and mm.route_frozen_linears(layer) == 1
    x = torch.randn(4, 96)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)
    assert calls[0] == 1


@needs_onednn
def test_second_derivatives_and_forward_mode_match_f_linear():
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(3)
    w, v = torch.randn(40, 96, generator=g), torch.randn(3, 96, generator=g)
    x = torch.randn(3, 96, generator=g, requires_grad=True)
    hvps = []
    for lin in (mm.linear, F.linear):  # a Hessian-vector product through a non-linearity
        (gx,) = torch.autograd.grad((torch.tanh(lin(x, w)) ** 2).sum(), x, create_graph=True)
        hvps.append(torch.autograd.grad((gx * v).sum(), x)[0])
    torch.testing.assert_close(hvps[0], hvps[1], atol=1e-4, rtol=1e-5)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x.detach(), v)
        tangent = fwAD.unpack_dual(mm.linear(dual, w)).tangent
        assert tangent is not None
        torch.testing.assert_close(tangent, v @ w.t(), atol=1e-5, rtol=1e-5)  # by hand: d(xW^T) = v W^T


@needs_onednn
def test_cpu_autocast_is_honoured(calls):
    x, w = torch.randn(4, 96), torch.randn(40, 96)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mm.linear(x, w).dtype == torch.bfloat16  # as F.linear computes under autocast
    assert calls[0] == 0


def test_the_cli_takes_and_checks_cpu_matmul(capsys, tmp_path):
    from selfrl.cli import main

    assert main(["run", "--cpu-matmul", "mkl", "--run-dir", str(tmp_path / "r")]) == 2
    assert "model.cpu_matmul must be one of auto, onednn, torch" in capsys.readouterr().err
    assert main(["run", "--cpu-matmul", "onednn", "--device", "cpu", "--dtype", "bfloat16",
                 "--run-dir", str(tmp_path / "r")]) == 2
    assert "applies to a float32 policy on the CPU" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # refused before anything was written


@needs_onednn
def test_the_view_samples_through_packed_weights_packed_again_after_each_change(tiny_tokenizer, calls):
    from selfrl.model.matmul import pack, packed_linear

    w, x = torch.randn(40, 96), torch.randn(2, 3, 96)
    p = pack(w)
    assert p is not None and pack(w.clone().requires_grad_()) is None and pack(w.bfloat16()) is None
    torch.testing.assert_close(packed_linear(x, w, None, p), F.linear(x, w), atol=1e-5, rtol=1e-5)
    xg = x.clone().requires_grad_()
    packed_linear(xg, w, None, p).sum().backward()  # a gradient wanted: the plain product, which has one
    torch.testing.assert_close(xg.grad, w.sum(0).expand(2, 3, 96), atol=1e-5, rtol=1e-5)

    model = add_lora(build_tiny_model(tiny_tokenizer, seed=9), seed=10)
    view = MergedPolicy(model)
    layers = [m for m in view.view.modules() if isinstance(m, SamplingLinear)]
    head = model.get_base_model().lm_head.weight
    # the merged weights are packed (q, k and v stacked into one, gate and up into another, in the lean
    # layers); the output layer (no LoRA) reads the policy's tensor live, unpacked
    lean = [vars(m)["forward"] for m in view.view.modules() if hasattr(vars(m).get("forward"), "qkv")]
    stacked = [f.qkv for f in lean] + [f.gate_up for f in lean]
    assert len(stacked) == 4 and all(m.packed is not None for m in stacked)
    parts = {id(p) for f in lean for p in (f.layer.self_attn.q_proj, f.layer.self_attn.k_proj, f.layer.self_attn.v_proj,
                                            f.layer.mlp.gate_proj, f.layer.mlp.up_proj)}
    assert all((m.packed is None) == (m.weight is head or id(m) in parts) for m in layers)
    assert any(m.weight is head for m in layers)
    ids = torch.randint(3, 200, (2, 6))
    lora_b = next(p for n, p in model.named_parameters() if "lora_B" in n)
    # a LoRA update; a frozen weight edited; a .data write into it, which the weight watch cannot see
    for change in (lambda: lora_b.add_(0.05), lambda: head.mul_(1.5), lambda: head.data.mul_(0.5)):
        with torch.no_grad():
            change()
            torch.testing.assert_close(view(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------- memory: oneDNN's primitive caches

_SHAPES_CHILD = """
import gc, sys
import torch
import selfrl.model.matmul as mm
torch.set_num_threads(1)

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

w, b = torch.randn(64, 64), torch.randn(64)
for rows in range(17, 60):  # warm up: the allocator's first pages, the first buckets
    mm._onednn(torch.randn(rows, 64), w, b)
gc.collect()
before = rss_mb()
for rows in range(60, 360):  # 300 row counts a server would meet: prompts of as many lengths
    mm._onednn(torch.randn(rows, 64), w, b)
gc.collect()
print(rss_mb() - before)
"""


@needs_onednn
def test_products_of_many_row_counts_keep_a_few_primitives():
    # before: oneDNN built and kept one primitive (~0.5 MB of heap) per row count, up to 1,024 per
    # cache: these 300 products grew the process by about 170 MB; padded to 8 sizes per doubling,
    # they meet 22 shapes
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _SHAPES_CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout.split()[-1]) < 40.0
    assert len({mm.padded_rows(n) for n in range(60, 360)}) == 22


@needs_onednn
@pytest.mark.parametrize("rows", [1, 16, 17, 100, 1000, 5000])
def test_padded_rows_give_each_row_the_exact_result_of_its_own_shape(rows):
    g = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(2, rows, 96, generator=g)[1], torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    y = mm._onednn(x, w, b)
    exact = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    assert y.shape == (rows, 40) and y.is_contiguous() and torch.equal(y, exact)
    assert mm.padded_rows(rows) >= rows and mm.padded_rows(rows) <= rows * 9 // 8 + 1


def test_importing_it_bounds_onednns_caches_and_keeps_a_value_given():
    import os
    import subprocess
    import sys

    code = ("import os, selfrl.model.matmul; "
            "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'], os.environ['LRU_CACHE_CAPACITY'])")
    env = {k: v for k, v in os.environ.items() if k not in mm.CACHE_CAPACITY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == [str(mm.PRIMITIVE_CACHE_CAPACITY)] * 2, out.stderr
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env | {"LRU_CACHE_CAPACITY": "7"})
    assert out.stdout.split() == [str(mm.PRIMITIVE_CACHE_CAPACITY), "7"], out.stderr
