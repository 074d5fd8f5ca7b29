"""The slot engine's sampling view (selfrl.engines.mergedpolicy): merged LoRA and the
small-batch product compute the policy's own logits, and follow every change of the LoRA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfrl.engines.mergedpolicy import SMALL_BATCH_ROWS, MergedPolicy, small_batch_linear
from selfrl.engines.slots import SlotEngine
from selfrl.model.matmul import packing_available
from tests.engine_backends import chat_prompts
from tests.test_engine_conformance import assert_matches_model

ATOL = 1e-5


@pytest.mark.parametrize("lead", [(1,), (1, 1), (2,), (3, 1), (2, 5), (10,), (11,), (4, 7), (0,)])
def test_small_batch_linear_is_linear_and_takes_the_transposed_product_for_1_to_10_rows(lead):
    torch.manual_seed(0)
    x, w, b = torch.randn(*lead, 24), torch.randn(40, 24), torch.randn(40)
    y = small_batch_linear(x, w, b)
    assert y.shape == (*lead, 40)
    torch.testing.assert_close(y, F.linear(x, w, b), atol=ATOL, rtol=0)
    rows = x.numel() // 24
    # without a bias, (w @ x.T).T is a transposed view; F.linear's result is contiguous
    small = small_batch_linear(x, w)
    torch.testing.assert_close(small, F.linear(x, w), atol=ATOL, rtol=0)
    assert small.is_contiguous() == (not SMALL_BATCH_ROWS[0] <= rows <= SMALL_BATCH_ROWS[1])


def _logits(module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return module(input_ids=ids).logits


def test_the_view_computes_the_policy_and_shares_its_tensors(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)  # A and B random: the LoRA moves every logit
    before = {k: v.clone() for k, v in model.state_dict().items()}
    view = MergedPolicy(model)
    base = model.get_base_model()
    # tiny Llama: 2 layers x 7 linear layers, each (out, in) of q 32x32, k 16x32, v 16x32, o 32x32,
    # gate 64x32, up 64x32, down 32x64 = 9,216 weights per layer, 2 layers, 4 bytes
    assert (view.merged_layers, view.kept_layers, view.merges) == (14, 0, 1)
    # and oneDNN's packed copies (selfrl.model.matmul.pack) of those 14 merged weights (q, k and v stacked in one,
    # gate and up in another; not of the output layer, read live)
    packed = 2 * 9216 * 4 if packing_available() else 0
    assert view.extra_bytes == 2 * 9216 * 4 + packed
    assert view.lean_layers == 2
    assert view.view.model.embed_tokens.weight is base.model.embed_tokens.weight
    assert view.view.lm_head.weight is base.lm_head.weight and view.view.lm_head.bias is base.lm_head.bias
    prompts = chat_prompts(tiny_tokenizer)
    for ids in (torch.tensor([prompts[0]]), torch.tensor([prompts[0][:5]] * 3), torch.tensor([prompts[1][:1]] * 4)):
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the policy is never modified


def test_every_change_of_the_lora_is_merged_before_the_next_pass(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    view = MergedPolicy(model)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[1][:6]] * 2)  # 2 rows: the small-batch product
    with torch.no_grad():
        view(input_ids=ids)
        view(input_ids=ids)
        assert view.merges == 1  # nothing changed: no merge
        lora = [p for n, p in model.named_parameters() if "lora_B" in n]
        lora[0].add_(0.5 * torch.randn_like(lora[0]))  # an optimizer step, in place
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
        assert view.merges == 2
        q = model.get_base_model().model.layers[1].self_attn.q_proj
        q.scaling["default"] *= 3.0  # peft's set_scale: seen at the next step
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
        assert (view.merges, view.builds) == (3, 1)
        # what no version counter sees, seen by the deep look the engine takes at each admission:
        # a write through .data (a fused optimizer's kind), and a tensor replaced
        lora[1].data.add_(0.5)
        view.sync(deep=True)
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
        assert (view.merges, view.builds) == (4, 1)
        q.lora_A["default"].weight = torch.nn.Parameter(torch.randn_like(q.lora_A["default"].weight))
        view.sync(deep=True)
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
        assert (view.merges, view.builds) == (5, 2)  # a rebuild merges too


def test_layers_that_cannot_be_merged_stay_peft_layers(tiny_tokenizer, tiny_model_factory):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    dora = get_peft_model(tiny_model_factory(eos_bias=2.0), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", use_dora=True, init_lora_weights=False)).eval()
    plain = tiny_model_factory(eos_bias=2.0)
    ids = torch.tensor([chat_prompts(tiny_tokenizer)[2][:9]] * 3)
    for model, merged, kept in ((dora, 0, 14), (plain, 0, 0)):
        view = MergedPolicy(model)
        assert (view.merged_layers, view.kept_layers, view.extra_bytes) == (merged, kept, 0)
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)


def test_the_engine_samples_from_the_view_unless_told_not_to(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    merged, unmerged = SlotEngine(model, tiny_tokenizer), SlotEngine(model, tiny_tokenizer, merge_lora=False)
    assert merged.sampling_model is merged.merged.view and merged.merged.merged_layers == 14
    assert unmerged.merged is None and unmerged.sampling_model is model
    prompts = chat_prompts(tiny_tokenizer)
    a, b = merged.generate(prompts, 6, greedy=True), unmerged.generate(prompts, 6, greedy=True)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0)
    merged.close()
    unmerged.close()


# ---------------------------------------------------------------- found by a fresh user trying to break it
# Every way a policy can change after the engine was built: the engine must sample what the
# policy now computes (its stored prefixes and its merged view both follow), merged or not.


def _lora(model):
    return [p for n, p in model.named_parameters() if "lora_" in n]


def _fused_adamw_step(model, tok):
    ids = torch.tensor([chat_prompts(tok)[2]])
    opt = torch.optim.AdamW(_lora(model), lr=0.05, fused=True)  # fused: no version counter moves
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def _replace_norm(model, tok):
    base = model.get_base_model()
    base.model.norm.weight = torch.nn.Parameter(base.model.norm.weight * 3)


def _add_and_set_adapter(model, tok):
    from peft import LoraConfig

    torch.manual_seed(5)
    model.add_adapter("other", LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    model.set_adapter("other")


def _hook_after(model, tok):
    model.get_base_model().model.layers[0].register_forward_hook(lambda mod, args, out: (out[0] + 1, *out[1:])
                                                                 if isinstance(out, tuple) else out + 1)


def _merge_then_unmerge(model, tok):
    model.base_model.merge_adapter(safe_merge=True)
    model.base_model.unmerge_adapter()


def _load_into_frozen_base(model, tok):
    model.load_state_dict({k: v + 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()
                           if "base_layer.weight" in k}, strict=False)


def _unfreeze_and_train_a_base_weight(model, tok):
    w = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    w.requires_grad_(True)
    ids = torch.tensor([chat_prompts(tok)[2]])
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([w], lr=1.0).step()


def _hook_on_the_peft_wrapper(model, tok):
    model.register_forward_hook(lambda mod, args, out: setattr(out, "logits", out.logits * 0.5) or out)


MUTATIONS = {
    "load_state_dict into frozen base weights": _load_into_frozen_base,
    "in-place op on the frozen embedding": lambda m, tok: torch.no_grad()(
        m.get_base_model().model.embed_tokens.weight.mul_)(2.0),
    "a base weight unfrozen and trained": _unfreeze_and_train_a_base_weight,
    "hook on the PeftModel wrapper": _hook_on_the_peft_wrapper,
    "fused optimizer step": _fused_adamw_step,
    "write through .data": lambda m, tok: [p.data.add_(0.5) for p in _lora(m)],
    "LoRA scaling": lambda m, tok: [l.scaling.update(default=3.0) for l in m.modules() if hasattr(l, "lora_A")],
    "replaced norm": _replace_norm,
    "another adapter": _add_and_set_adapter,
    "hook added": _hook_after,
    "merge then unmerge": _merge_then_unmerge,
}


@pytest.mark.parametrize("merge_lora", [True, False], ids=["merged", "unmerged"])
@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_every_change_after_the_engine_was_built_is_sampled(tiny_tokenizer, tiny_model_factory, mutation, merge_lora):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller", merge_lora=merge_lora)
    prompts = chat_prompts(tiny_tokenizer)
    engine.generate(prompts, 3, greedy=True)  # prefixes stored, weights merged
    model.train()
    MUTATIONS[mutation](model, tiny_tokenizer)
    model.eval()
    gens = engine.generate(prompts, 6, temperature=1.0)
    assert_matches_model(gens, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 6)
    engine.close()


@pytest.mark.parametrize("merge_lora", [True, False], ids=["merged", "unmerged"])
def test_adapters_disabled_or_merged_are_followed(tiny_tokenizer, tiny_model_factory, merge_lora):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    prompts = chat_prompts(tiny_tokenizer)
    with model.disable_adapter():  # built while the base model answers, used after
        engine = SlotEngine(model, tiny_tokenizer, driver="caller", merge_lora=merge_lora)
        assert_matches_model(engine.generate(prompts, 5, temperature=1.0), prompts, model, 1.0,
                             tiny_tokenizer.eos_token_id, 5)
    assert_matches_model(engine.generate(prompts, 5, temperature=1.0), prompts, model, 1.0,
                         tiny_tokenizer.eos_token_id, 5)
    model.base_model.merge_adapter()  # peft's merge into the base weights: the LoRA must count once
    assert_matches_model(engine.generate(prompts, 5, temperature=1.0), prompts, model, 1.0,
                         tiny_tokenizer.eos_token_id, 5)
    if merge_lora:
        assert engine.merged.kept_layers == 14 and engine.merged.merged_layers == 0
    engine.close()


def test_bf16_layers_are_not_merged_and_odd_hooks_do_not_stop_the_engine(tiny_tokenizer, tiny_model_factory):
    import threading

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(tiny_model_factory(eos_bias=2.0).to(torch.bfloat16), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)).eval()

    class Monitor:  # a hook holding a lock: cannot be deep-copied, must be shared
        def __init__(self):
            self.lock, self.calls = threading.Lock(), 0

        def __call__(self, mod, args, out):
            self.calls += 1

    monitor = Monitor()
    model.get_base_model().model.layers[0].register_forward_hook(monitor)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    # a merged bf16 weight rounds most small LoRA updates away: bf16 layers stay peft's
    assert (engine.merged.merged_layers, engine.merged.kept_layers) == (0, 14)
    engine.generate(chat_prompts(tiny_tokenizer), 3, greedy=True)
    assert monitor.calls > 0  # the policy's own hook object ran in the view
    engine.close()


def test_an_engine_built_under_inference_mode_merges_again_outside_it(tiny_tokenizer, tiny_model_factory):
    from peft import get_peft_model_state_dict

    model = tiny_model_factory(eos_bias=2.0, lora=True)
    with torch.inference_mode():
        engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    engine.swap({k: v + 0.5 for k, v in get_peft_model_state_dict(model).items()}, 1)
    prompts = chat_prompts(tiny_tokenizer)
    assert_matches_model(engine.generate(prompts, 5, temperature=1.0), prompts, model, 1.0,
                         tiny_tokenizer.eos_token_id, 5)
    engine.close()


@pytest.mark.parametrize("merge_lora", [True, False], ids=["merged", "unmerged"])
def test_a_swap_into_a_frozen_adapter_is_sampled(tiny_tokenizer, tiny_model_factory, tmp_path, merge_lora):
    # PeftModel.from_pretrained freezes the adapter (is_trainable=False): a server's usual policy
    from peft import PeftModel, get_peft_model_state_dict

    tiny_model_factory(eos_bias=2.0, lora=True, seed=1).save_pretrained(tmp_path)
    model = PeftModel.from_pretrained(tiny_model_factory(eos_bias=2.0), tmp_path).eval()
    engine = SlotEngine(model, tiny_tokenizer, driver="caller", merge_lora=merge_lora)
    prompts = chat_prompts(tiny_tokenizer)
    engine.generate(prompts, 3, greedy=True)
    engine.swap({k: v + 0.3 * torch.randn_like(v) for k, v in get_peft_model_state_dict(model).items()}, 1)
    gens = engine.generate(prompts, 6, temperature=1.0)
    assert all(g.adapter_version == 1 for g in gens)
    assert_matches_model(gens, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 6)
    engine.close()


def test_a_scaling_change_reaches_layers_kept_as_peft_layers(tiny_tokenizer, tiny_model_factory):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = get_peft_model(tiny_model_factory(eos_bias=2.0), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", use_dora=True, init_lora_weights=False)).eval()
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    assert engine.merged.kept_layers == 14
    prompts = chat_prompts(tiny_tokenizer)
    engine.generate(prompts, 3, greedy=True)
    for layer in model.modules():
        if hasattr(layer, "set_scale"):
            layer.set_scale("default", 3.0)
    assert_matches_model(engine.generate(prompts, 6, temperature=1.0), prompts, model, 1.0,
                         tiny_tokenizer.eos_token_id, 6)
    engine.close()


def test_no_change_means_no_merge_even_with_a_nan(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    with torch.no_grad():
        _lora(model)[1][0, 0] = float("nan")  # torch.equal(nan, nan) is False: compared bit for bit
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    for _ in range(3):  # the NaN reaches the logits: each request fails (never an arbitrary token)
        with pytest.raises(ValueError, match="NaN"):
            engine.generate(chat_prompts(tiny_tokenizer), 2, greedy=True)
    assert (engine.merged.merges, engine.merged.builds, engine.watch.generation) == (1, 1, 0)
    engine.close()


def test_a_model_made_under_inference_mode_is_refused_with_the_reason(tiny_tokenizer, tiny_model_factory):
    with torch.inference_mode():
        model = tiny_model_factory(eos_bias=2.0, lora=True)
    with pytest.raises(ValueError, match="inference_mode.*outside inference mode"):
        SlotEngine(model, tiny_tokenizer, driver="caller")


def test_the_watch_and_the_view_hold_no_graph_of_the_lora(tiny_tokenizer, tiny_model_factory):
    # inference_mode(False) turns gradients on: a copy made under it from a trainable tensor joined its graph
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    engine.generate(chat_prompts(tiny_tokenizer), 2, greedy=True)
    with torch.no_grad():
        _lora(model)[1].add_(0.01)  # an update in place: the watch's snapshot is copied again, the view re-merged
    engine.generate(chat_prompts(tiny_tokenizer), 2, greedy=True)
    assert engine.watch.generation == 1 and engine.merged.merges == 2
    snaps = engine.watch._snapshot
    assert snaps and not any(s.requires_grad or s.grad_fn is not None for s in snaps)
    merged = [w for _, _, w in engine.merged._pairs]
    assert merged and not any(w.requires_grad or w.grad_fn is not None for w in merged)
    engine.close()
