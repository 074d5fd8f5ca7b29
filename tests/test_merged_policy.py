"""The slot engine's sampling view (selfrl.engines.mergedpolicy): merged LoRA and the
small-batch product compute the policy's own logits, and follow every change of the LoRA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfrl.engines.mergedpolicy import SMALL_BATCH_ROWS, MergedPolicy, small_batch_linear
from selfrl.engines.slots import SlotEngine
from tests.engine_backends import chat_prompts

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
    assert view.extra_bytes == 2 * 9216 * 4
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
        # a tensor replaced rather than written (load_state_dict(assign=True), a new Parameter)
        q = model.get_base_model().model.layers[1].self_attn.q_proj
        q.lora_A["default"].weight = torch.nn.Parameter(torch.randn_like(q.lora_A["default"].weight))
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
        assert view.merges == 3
        q.scaling["default"] *= 3.0  # peft's set_scale
        torch.testing.assert_close(view(input_ids=ids).logits, _logits(model, ids), atol=ATOL, rtol=0)
        assert view.merges == 4


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
