"""The sampling view's lean decoder layers (selfrl.engines.leanlayers): the rotation by hand,
stacked products, every kind of layer that must keep transformers' forward pass, and hooks."""

from __future__ import annotations

import pytest
import torch

from selfrl.engines.leanlayers import LeanForward, SignedSine, rotate
from selfrl.engines.mergedpolicy import MergedPolicy
from selfrl.testing import add_lora, build_tiny_model
from tests.engine_backends import chat_prompts

ATOL = 1e-5


def _logits(module, ids):
    with torch.no_grad():
        return module(input_ids=ids).logits


def test_rotate_by_hand_and_as_transformers_rotates():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    # d = 4: x = (1, 2, 3, 4), cos = (0.5, 0.25, 0.5, 0.25), sin = (0.75, 0.125, 0.75, 0.125):
    # x cos + rotate_half(x) sin = (1*.5 - 3*.75, 2*.25 - 4*.125, 3*.5 + 1*.75, 4*.25 + 2*.125)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0]).view(1, 1, 1, 4)
    cos = torch.tensor([0.5, 0.25, 0.5, 0.25]).view(1, 1, 1, 4)
    sin = torch.tensor([0.75, 0.125, 0.75, 0.125]).view(1, 1, 4)
    got = rotate(x, cos, SignedSine()(sin).unsqueeze(2))
    assert got.flatten().tolist() == [-1.75, 0.0, 2.25, 1.25]
    torch.manual_seed(0)
    q, k = torch.randn(3, 5, 4, 8), torch.randn(3, 5, 2, 8)  # (b, T, heads, d)
    cos, sin = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    signed = SignedSine()
    torch.testing.assert_close(rotate(q, cos.unsqueeze(2), signed(sin).unsqueeze(2)), want_q.transpose(1, 2),
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(rotate(k, cos.unsqueeze(2), signed(sin).unsqueeze(2)), want_k.transpose(1, 2),
                               atol=1e-6, rtol=0)
    first = signed.signed
    signed(sin)
    assert signed.signed is first  # the same sine: computed once
    signed(sin.clone())
    assert signed.signed is not first


def test_the_stacked_weights_are_the_merged_layers_rows(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    view = MergedPolicy(model)
    lean = view.view.model.layers[1].forward
    assert isinstance(lean, LeanForward) and view.lean_layers == 2
    assert type(view.view.model.layers[1]).__name__ == "LlamaDecoderLayer"  # the layer stays; its forward is lean
    attn, mlp = lean.layer.self_attn, lean.layer.mlp
    assert lean.qkv.weight.shape == (32 + 16 + 16, 32) and lean.gate_up.weight.shape == (128, 32)
    q, k, v = lean.qkv.weight.split([32, 16, 16])
    for part, layer in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)):
        assert part.data_ptr() == layer.weight.data_ptr()  # a view of the stacked rows
    # the rows hold W + s B A of the policy's layer
    peft_q = model.get_base_model().model.layers[1].self_attn.q_proj
    want = peft_q.base_layer.weight + peft_q.get_delta_weight("default")
    torch.testing.assert_close(q, want, atol=1e-6, rtol=0)
    with torch.no_grad():  # an update in place: merged again into the same rows
        peft_q.lora_B["default"].weight.add_(0.25)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[0]] * 3)
    torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
    want = peft_q.base_layer.weight + peft_q.get_delta_weight("default")
    torch.testing.assert_close(lean.qkv.weight[:32], want.detach(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "up_proj"], "all-linear"], ids=["some", "all"])
@pytest.mark.parametrize("cpu_matmul", ["auto", "torch"])
def test_lean_layers_compute_the_policy_with_or_without_stacking(tiny_tokenizer, targets, cpu_matmul):
    from peft import LoraConfig, get_peft_model

    from selfrl.model.matmul import route_frozen_linears

    torch.manual_seed(3)
    model = get_peft_model(build_tiny_model(tiny_tokenizer, seed=2, eos_bias=2.0), LoraConfig(
        r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)).eval()
    route_frozen_linears(model, cpu_matmul)
    view = MergedPolicy(model)
    lean = view.view.model.layers[0].forward
    assert view.lean_layers == 2
    stacked = targets == "all-linear"  # k_proj and gate_proj without LoRA: their own products
    assert (lean.qkv is not None, lean.gate_up is not None) == (stacked, stacked)
    prompts = chat_prompts(tiny_tokenizer)
    for rows in (1, 3, 12):  # the small-batch product's orientations, and F.linear
        ids = torch.tensor([prompts[rows % len(prompts)][:7]] * rows)
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)


def _tiny(tokenizer, family: str, **extra):
    import transformers

    cls = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi": "Phi"}[family]
    cfg = getattr(transformers, cls + "Config")(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return add_lora(getattr(transformers, cls + "ForCausalLM")(cfg).eval(), seed=1)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_mistral_qwen2_and_qwen3_layers_are_lean_too(tiny_tokenizer, family):
    from tests.test_engine_conformance import assert_matches_model

    from selfrl.engines.slots import SlotEngine

    window = {"sliding_window": None} if family == "mistral" else {}  # (Mistral's default is 4096)
    model = _tiny(tiny_tokenizer, family, **window)
    if family == "qwen2":  # biases on q, k and v: make them matter
        with torch.no_grad():
            for layer in model.get_base_model().model.layers:
                layer.self_attn.k_proj.base_layer.bias.normal_()
    view = MergedPolicy(model)
    lean = view.view.model.layers[1].forward
    assert view.lean_layers == 2 and lean.qkv is not None and lean.head_norms == (family == "qwen3")
    assert (lean.qkv.bias is not None) == (family == "qwen2")
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[1][:8]] * 3)
    torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
    if family == "qwen2":  # a frozen bias changed in place: copied into the stacked bias at the next pass
        with torch.no_grad():
            model.get_base_model().model.layers[0].self_attn.v_proj.base_layer.bias.add_(1.0)
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    prompts = chat_prompts(tiny_tokenizer)
    assert engine.merged.lean_layers == 2
    assert_matches_model(engine.generate(prompts, 6, temperature=1.0), prompts, model, 1.0,
                         tiny_tokenizer.eos_token_id, 6)
    engine.close()


@pytest.mark.parametrize("family,extra", [("phi", {}), ("mistral", {"sliding_window": 40})], ids=["phi", "window"])
def test_other_layers_keep_transformers_forward_pass(tiny_tokenizer, family, extra):
    model = _tiny(tiny_tokenizer, family, **extra)  # Phi: another layer; a sliding window: not the view's attention
    view = MergedPolicy(model)
    assert view.lean_layers == 0 and not any(isinstance(vars(m).get("forward"), LeanForward) for m in view.view.modules())
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[1][:8]] * 2)
    torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)


def test_a_hook_on_a_part_of_a_layer_runs_in_the_next_pass(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    view = MergedPolicy(model)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[2][:9]] * 2)
    before = view(input_ids=ids).logits
    layer = model.get_base_model().model.layers[1]
    handles = [layer.self_attn.o_proj.register_forward_hook(lambda mod, args, out: out * 2.0),
               layer.post_attention_layernorm.register_forward_pre_hook(lambda mod, args: (args[0] + 0.5,))]
    # no deep look in between (the engine takes one only when rows join an idle engine): the lean
    # layer finds the hooks at the call and runs transformers' forward pass, which runs them
    after = view(input_ids=ids).logits
    torch.testing.assert_close(after, _logits(model, ids), atol=ATOL, rtol=0)
    assert (after - before).abs().max() > 0.01
    for h in handles:
        h.remove()
    torch.testing.assert_close(view(input_ids=ids).logits, before, atol=ATOL, rtol=0)
    # a hook on the layer itself runs around the lean forward, with the layer as its module
    steer = torch.randn(2, 32)
    for each in model.get_base_model().model.layers:
        each.register_forward_hook(lambda mod, args, out: out + steer[mod.self_attn.layer_idx])
    torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
    assert (view(input_ids=ids).logits - before).abs().max() > 0.01


def test_a_global_module_hook_runs_in_the_view(tiny_tokenizer, tiny_model_factory):
    from torch.nn.modules.module import register_module_forward_hook
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    model = tiny_model_factory(eos_bias=2.0, lora=True)
    view = MergedPolicy(model)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[2][:9]] * 2)
    before = view(input_ids=ids).logits
    handle = register_module_forward_hook(lambda mod, args, out: out * 0.5 if isinstance(mod, LlamaRMSNorm) else None)
    try:
        after = view(input_ids=ids).logits
        torch.testing.assert_close(after, _logits(model, ids), atol=ATOL, rtol=0)
        assert (after - before).abs().max() > 0.01
    finally:
        handle.remove()


def test_transformers_idle_capture_hooks_leave_the_layers_lean(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    view = MergedPolicy(model)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[2][:9]] * 2)
    with torch.no_grad():  # installs transformers' output-capturing hooks on every layer and attention, for good
        want = model(input_ids=ids, output_hidden_states=True, output_attentions=True)
    lean = view.view.model.layers[0].forward
    assert any(lean._hooks) and not lean._hooked()  # there, but idle: the lean path stays on
    torch.testing.assert_close(view(input_ids=ids).logits, want.logits, atol=ATOL, rtol=0)
    from transformers.utils.output_capturing import _active_collector

    token = _active_collector.set({"hidden_states": []})  # a capture under way: the hooks must run
    try:
        assert lean._hooked()
    finally:
        _active_collector.reset(token)


def test_a_part_whose_forward_was_replaced_keeps_the_layer_in_transformers_hands(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    norm = model.get_base_model().model.layers[0].post_attention_layernorm
    original = norm.forward
    norm.forward = lambda h: original(h) * 0.0 + 1.0  # an ablation patch on the policy's instance
    view = MergedPolicy(model)
    assert view.lean_layers == 1 and not isinstance(vars(view.view.model.layers[0]).get("forward"), LeanForward)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[2][:9]] * 2)
    torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)


def test_the_signed_sine_is_kept_per_thread():
    import threading

    signed = SignedSine()
    a, b = torch.tensor([[0.5, 0.25]]), torch.tensor([[1.0, 2.0]])
    first = signed(a)
    assert first.tolist() == [[-0.5, 0.25]]
    seen = {}
    t = threading.Thread(target=lambda: seen.update(b=signed(b)))
    t.start()
    t.join()
    assert seen["b"].tolist() == [[-1.0, 2.0]]
    assert signed(a) is first  # this thread's memo was not replaced by the other's
