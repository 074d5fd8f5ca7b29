"""Attention over a shared prefix read once for all rows (selfrl.engines.sharedattention): the same
attention as over each row's own copy, the slot engine sampling the same ids with it as without
it, and the policy (what the learner runs) left as it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfrl.engines import sharedattention
from selfrl.engines.sharedattention import (
    ATTENTION_NAME, attend_by_products, attend_with_shared_prefix, fused_kernel_available, takes_shared_prefix,
)
from selfrl.engines.slots import SlotEngine
from tests.engine_backends import assert_same_samples
from tests.test_engine_conformance import assert_matches_model
from tests.test_slot_engine import prompts_with_system


@pytest.mark.parametrize("groups,T", [(1, 1), (3, 1), (3, 4)])
def test_attention_equals_attention_over_the_whole_rows(groups, T):
    # 3 rows, 2 key/value heads, a 7-column prefix and 5 own columns, causal-like masks
    torch.manual_seed(0)
    B, KV, P, S, D = 3, 2, 7, 5, 8
    H = KV * groups
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    pk, pv = torch.randn(KV, P, D, dtype=torch.float64), torch.randn(KV, P, D, dtype=torch.float64)
    k, v = torch.randn(B, KV, S, D, dtype=torch.float64), torch.randn(B, KV, S, D, dtype=torch.float64)
    lengths = torch.tensor([5, 3, 4])  # own columns in use per row; query t sees own columns < length - T + t + 1
    cols = torch.arange(S)
    mask = cols[None, None, :] < (lengths[:, None, None] - T + 1 + torch.arange(T)[None, :, None])  # (B, T, S)
    mask = mask[:, None]  # (B, 1, T, S)
    full_k = torch.cat([pk.expand(B, -1, -1, -1), k], 2).repeat_interleave(groups, 1)  # (B, H, P + S, D)
    full_v = torch.cat([pv.expand(B, -1, -1, -1), v], 2).repeat_interleave(groups, 1)
    full_mask = torch.cat([torch.ones(B, 1, T, P, dtype=torch.bool), mask], -1)
    ref = F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=full_mask).transpose(1, 2)  # (B, T, H, D)
    out = attend_with_shared_prefix(q, pk, pv, k, v, mask, D ** -0.5)
    assert out.shape == (B, T, H, D)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    # a column masked out changes nothing; a prefix column does (every query sees the prefix)
    k2 = k.clone()
    k2[1, :, 4] += 100.0  # row 1 uses 3 own columns: column 4 is never seen
    torch.testing.assert_close(attend_with_shared_prefix(q, pk, pv, k2, v, mask, D ** -0.5), out, atol=1e-12, rtol=0)
    pk2 = pk.clone()
    pk2[:, 0] += 1.0
    assert not torch.allclose(attend_with_shared_prefix(q, pk2, pv, k, v, mask, D ** -0.5), out)


@pytest.mark.skipif(not fused_kernel_available(), reason="torch's fused CPU attention kernel is not available")
@pytest.mark.parametrize("T", [1, 3])
def test_the_fused_kernel_gives_what_products_give_on_the_cache_s_views(T, monkeypatch):
    # the cache hands attention strided views (a window of rows and columns of a larger tensor); row 2's
    # first query sees none of its own columns (only the prefix); 9 query heads over 3 key/value heads
    torch.manual_seed(1)
    B, KV, G, P, S, D = 4, 3, 3, 11, 6, 16
    store_k, store_v = torch.randn(B + 2, KV, S + 9, D), torch.randn(B + 2, KV, S + 9, D)  # (slots, kv, columns, D)
    k, v = store_k[1:B + 1, :, 4:4 + S], store_v[1:B + 1, :, 4:4 + S]  # (B, KV, S, D) views, not contiguous
    prefix = torch.randn(KV, P + 5, D), torch.randn(KV, P + 5, D)
    pk, pv = prefix[0][:, :P], prefix[1][:, :P]  # a stored prefix's first P columns
    q = torch.randn(B, KV * G, T, D)
    lengths = torch.tensor([6, 2, T - 1, 4])  # own columns each row's last query sees (row 2: T - 1)
    mask = torch.arange(S)[None, None, :] < (lengths[:, None, None] - T + 1 + torch.arange(T)[None, :, None])
    mask = mask[:, None]  # (B, 1, T, S); row 2's first query sees no own column
    assert not mask[2, 0, 0].any()
    calls = []
    real = sharedattention._FUSED
    monkeypatch.setattr(sharedattention, "_FUSED", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    fused = attend_with_shared_prefix(q, pk, pv, k, v, mask, D ** -0.5)
    assert len(calls) == 2  # the prefix part and the rows' own part
    want = attend_by_products(q, pk, pv, k, v, mask, D ** -0.5)
    assert fused.shape == want.shape == (B, T, KV * G, D)
    torch.testing.assert_close(fused, want, atol=2e-6, rtol=0)
    # the same values in layouts whose last dimension is strided (the small-batch product's transposed
    # rows give such queries; the kernel read them as garbage, up to 7.6e34 off, until they were copied)
    odd_q = q.permute(3, 1, 2, 0).contiguous().permute(3, 1, 2, 0)  # strides (1, ..., ..., B)
    odd_k, odd_v = (t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in (k, v))
    assert odd_q.stride(-1) != 1 and odd_k.stride(-1) != 1
    torch.testing.assert_close(attend_with_shared_prefix(odd_q, pk, pv, odd_k, odd_v, mask, D ** -0.5), want,
                               atol=2e-6, rtol=0)
    # the query that sees only the prefix: softmax attention over the prefix alone
    alone = F.scaled_dot_product_attention(q[2:3, :, :1], pk.repeat_interleave(G, 0)[None], pv.repeat_interleave(G, 0)[None])
    torch.testing.assert_close(fused[2, 0], alone[0, :, 0], atol=2e-6, rtol=0)


@pytest.mark.skipif(not fused_kernel_available(), reason="torch's fused CPU attention kernel is not available")
def test_the_kernel_s_masks_are_computed_once_a_pass_and_anew_for_the_next():
    from types import SimpleNamespace

    from selfrl.engines.sharedattention import SharedPrefix, fused_masks, shared_prefix_attention

    # by hand: 1 row, 2 query heads a key/value head, 1 query, 2 own columns, the second one hidden
    additive, hidden = fused_masks(torch.tensor([[[[True, False]]]]), 2, torch.float32)
    assert additive.tolist() == [[[[0.0, float("-inf")], [0.0, float("-inf")]]]] and hidden.tolist() == [[[False, False]]]
    assert fused_masks(torch.zeros(1, 1, 1, 2, dtype=torch.bool), 1, torch.float32)[1].tolist() == [[[True]]]
    torch.manual_seed(2)
    B, KV, G, P, S, D = 3, 2, 2, 4, 5, 8
    shared = SharedPrefix(P, [torch.randn(KV, P, D)] * 2, [torch.randn(KV, P, D)] * 2)
    k, v, q = torch.randn(B, KV, S, D), torch.randn(B, KV, S, D), torch.randn(B, KV * G, 1, D)
    first = torch.rand(B, 1, 1, P + S) < 0.6
    second = ~first  # the next pass: another mask
    first[..., :P] = second[..., :P] = True
    for mask in (first, second):
        for layer in (0, 1):  # two layers of one pass: the same mask object
            out, _ = shared_prefix_attention(SimpleNamespace(layer_idx=layer), q, k, v, mask, scaling=D ** -0.5,
                                             shared_prefix_kv=shared)
            want = attend_by_products(q, shared.keys[layer], shared.values[layer], k, v, mask[..., P:], D ** -0.5)
            torch.testing.assert_close(out, want, atol=2e-6, rtol=0)
            assert shared.own_masks[0] is mask and shared.own_masks[1][1] == G
        kept = shared.own_masks
        shared_prefix_attention(SimpleNamespace(layer_idx=0), q, k, v, mask, scaling=D ** -0.5, shared_prefix_kv=shared)
        assert shared.own_masks is kept  # computed once for the pass
    # the same mask tensor changed in place (its version moves): its masks anew
    second[..., P:] = ~second[..., P:]
    out, _ = shared_prefix_attention(SimpleNamespace(layer_idx=0), q, k, v, second, scaling=D ** -0.5,
                                     shared_prefix_kv=shared)
    want = attend_by_products(q, shared.keys[0], shared.values[0], k, v, second[..., P:], D ** -0.5)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=0)


def test_without_the_fused_kernel_products_compute_it(monkeypatch):
    monkeypatch.setattr(sharedattention, "_FUSED", None)
    sharedattention.fused_kernel_available.cache_clear()
    try:
        assert not fused_kernel_available()
        torch.manual_seed(2)
        q, pk, pv = torch.randn(2, 4, 1, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 8)
        k, v, m = torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8), torch.ones(2, 1, 1, 3, dtype=torch.bool)
        torch.testing.assert_close(attend_with_shared_prefix(q, pk, pv, k, v, m, 0.3),
                                   attend_by_products(q, pk, pv, k, v, m, 0.3), atol=0, rtol=0)
    finally:
        monkeypatch.undo()
        sharedattention.fused_kernel_available.cache_clear()
    assert fused_kernel_available() == (sharedattention._FUSED is not None)


QUESTIONS = ["What is 17+25?", "Add 1, 2, 3 and 4.", "Hi", "What is 2*21?"]


def two_turns(engine, tok, seed, questions=QUESTIONS, limit: int = 6):
    """A batch with one system prompt, then each row's next turn (its prompt, its ids and a reply: a
    continuation of the kept row, only the reply prefilled); (all prompts, all generations)."""
    first = prompts_with_system(tok, questions)
    torch.manual_seed(seed)
    gens = engine.generate(first, limit, temperature=0.9)
    reply = tok("<tool_response>42</tool_response>", add_special_tokens=False)["input_ids"]
    second = [p + g.token_ids + reply for p, g in zip(first, gens)]
    torch.manual_seed(seed + 1)
    return first + second, gens + engine.generate(second, limit, temperature=0.9)


def test_the_slot_engine_samples_the_same_ids_with_it_as_without(tiny_tokenizer, tiny_model_factory):
    # fp64, so that rounding cannot flip a draw: the same seeds give the same ids and logprobs, with
    # the prefix attended once (decoding and the next turn's prefill) or by every row
    model = tiny_model_factory(eos_bias=1.0, lora=True).double()
    on = SlotEngine(model, tiny_tokenizer, driver="caller")
    off = SlotEngine(model, tiny_tokenizer, driver="caller", shared_prefix_attention=False)
    assert on.merged.shared_prefix_layers == 2  # both layers of the tiny Llama
    prompts, with_it = two_turns(on, tiny_tokenizer, 5)
    _, without = two_turns(off, tiny_tokenizer, 5)
    assert on.shared_prefix_passes >= 6 and off.shared_prefix_passes == 0
    assert_same_samples(with_it, without)
    assert_matches_model(with_it, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 6)
    on.close()
    off.close()


def test_fp32_logprobs_stay_exact_and_the_policy_keeps_its_attention(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    prompts, gens = two_turns(engine, tiny_tokenizer, 7)
    assert engine.shared_prefix_passes > 0
    assert_matches_model(gens, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 6)
    # only the sampling view's attention layers were pointed elsewhere: the learner's model is untouched
    assert model.config._attn_implementation == "sdpa"
    assert all(m.config._attn_implementation == "sdpa" for m in model.modules() if hasattr(m, "layer_idx"))
    view_layers = [m for m in engine.merged.view.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    assert [m.config._attn_implementation for m in view_layers] == [ATTENTION_NAME] * 2
    engine.close()


def test_a_pass_the_view_cannot_take_it_in_attends_over_whole_rows(tiny_tokenizer, tiny_model_factory):
    # a hook on the peft wrapper makes the view run the policy's own forward pass (attention over the
    # rows' own columns): the cache's shared prefix is unset for such passes and sampling stays exact
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    model.register_forward_hook(lambda mod, args, out: None)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    prompts, gens = two_turns(engine, tiny_tokenizer, 9)
    assert engine.merged.passthrough and engine.shared_prefix_passes == 0
    assert_matches_model(gens, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 6)
    engine.close()


def test_only_supported_attention_takes_a_shared_prefix(tiny_model_factory):
    layer = tiny_model_factory().model.layers[0].self_attn
    assert takes_shared_prefix(layer)
    layer.config._attn_implementation = "eager"  # (a config of its own would be the model's too: rebuild)
    assert not takes_shared_prefix(layer)
    layer = tiny_model_factory().model.layers[0].self_attn
    layer.sliding_window = 16
    assert not takes_shared_prefix(layer)
    assert not takes_shared_prefix(tiny_model_factory().bfloat16().model.layers[0].self_attn)
    assert not takes_shared_prefix(tiny_model_factory().model.layers[0].mlp)
