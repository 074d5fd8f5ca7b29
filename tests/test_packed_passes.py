"""A step's prefill and decoding pass run as one packed forward pass (selfrl.engines.packedattention):
each token attends as its own pass would, the engine samples the same ids and logprobs packed as in
two passes, and where the view cannot pack, the passes run one by one."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfrl.engines.packedattention import Segment, packed_attention
from selfrl.engines.sharedattention import SharedPrefix
from selfrl.engines.slots import SlotEngine
from tests.engine_backends import assert_same_samples
from tests.test_engine_conformance import assert_matches_model
from tests.test_shared_attention import QUESTIONS, two_turns


def test_each_token_attends_to_its_own_row_as_in_its_own_pass(tiny_model_factory):
    # a layer of the tiny Llama (4 query heads over 2 key/value heads of 8); 4 slots of 12 columns.
    # Segment A: slots 0-1 decoding one id each after a 5-column shared prefix (rows at positions 7 and 9).
    # Segment B: slot 2 prefilling 3 ids at positions 4-6 (a grid of 4 places, the first one padding).
    torch.manual_seed(0)
    layer = tiny_model_factory().model.layers[0].self_attn.double()
    H, KV, D = 4, 2, 8
    key, value = torch.randn(4, KV, 12, D, dtype=torch.float64), torch.randn(4, KV, 12, D, dtype=torch.float64)
    pk, pv = key[0, :, :5].clone(), value[0, :, :5].clone()  # the stored prefix, as in each row's first 5 columns
    key[1, :, :5], value[1, :, :5] = pk, pv
    query = torch.randn(1, H, 5, D, dtype=torch.float64)  # tokens 0-1: segment A, 2-4: segment B
    pos_a = torch.tensor([[7], [9]])
    a = Segment(slice(0, 2), 10, torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([0, 0]),
                (torch.arange(10)[None, None, :] <= pos_a[:, :, None])[:, None], SharedPrefix(5, [pk], [pv]))
    pos_b = torch.tensor([[0, 4, 5, 6]])  # the padding place repeats position 0 (never read back)
    b = Segment(slice(2, 3), 7, torch.tensor([2, 3, 4]), torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]),
                (torch.arange(7)[None, None, :] <= pos_b[:, :, None])[:, None])
    out = packed_attention(layer, query, key, value, [a, b], D ** -0.5)  # (1, 5, H, D)
    # by hand: token i of slot s at position p attends softmax-wise to columns 0..p of slot s
    for i, (slot, p) in enumerate([(0, 7), (1, 9), (2, 4), (2, 5), (2, 6)]):
        k = key[slot, :, :p + 1].repeat_interleave(H // KV, 0)  # (H, p + 1, D)
        v = value[slot, :, :p + 1].repeat_interleave(H // KV, 0)
        want = F.scaled_dot_product_attention(query[0, :, i:i + 1], k, v)[:, 0]  # (H, D)
        torch.testing.assert_close(out[0, i], want, atol=1e-12, rtol=0)


def _two_turns(engine, tok, seed):
    """7 rows after one system prompt (in 3 slots, rows are admitted while others decode), then each
    row's next turn."""
    return two_turns(engine, tok, seed, QUESTIONS + ["Name a prime.", "Count to three.", "Is 9 odd?"], limit=12)


def test_packed_steps_sample_what_two_passes_sample(tiny_tokenizer, tiny_model_factory):
    # fp64, so that rounding cannot flip a draw: the same seeds give the same ids and logprobs
    model = tiny_model_factory(eos_bias=2.5, lora=True).double()
    on = SlotEngine(model, tiny_tokenizer, driver="caller", max_slots=3)
    off = SlotEngine(model, tiny_tokenizer, driver="caller", max_slots=3, pack_passes=False)
    prompts, packed = _two_turns(on, tiny_tokenizer, 3)
    _, apart = _two_turns(off, tiny_tokenizer, 3)
    assert on.packed_passes >= 4 and off.packed_passes == 0
    assert_same_samples(packed, apart)
    assert_matches_model(packed, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 12)
    on.close()
    off.close()


def test_fp32_packed_logprobs_stay_exact_with_drafts_and_greedy_rows(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.5, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller", max_slots=3)
    prompts, gens = _two_turns(engine, tiny_tokenizer, 11)
    assert engine.packed_passes > 0 and engine.draft_passes > 0  # drafted passes, packed or alone
    assert_matches_model(gens, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 12)
    greedy = engine.generate(prompts, 5, greedy=True)
    assert_matches_model(greedy, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 5)
    engine.close()


def test_a_view_that_cannot_pack_runs_its_passes_one_by_one(tiny_tokenizer, tiny_model_factory):
    # a hook on the peft wrapper makes the view run the policy's own forward pass; no merged view at all
    hooked = tiny_model_factory(eos_bias=2.5, lora=True)
    hooked.register_forward_hook(lambda mod, args, out: None)
    for model, kw in ((hooked, {}), (tiny_model_factory(eos_bias=2.5, lora=True), {"merge_lora": False})):
        engine = SlotEngine(model, tiny_tokenizer, driver="caller", max_slots=3, **kw)
        prompts, gens = _two_turns(engine, tiny_tokenizer, 5)
        assert engine.packed_passes == 0
        assert_matches_model(gens, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 12)
        engine.close()


def test_padding_stays_out_of_a_packed_pass_when_the_cache_grows_in_it(tiny_tokenizer, tiny_model_factory,
                                                                       monkeypatch):
    # found by a fresh user: the decoding pass is built before the prefill grows the cache's columns,
    # and its padding places pointed at the old scratch column, an ordinary column after the growth;
    # the packed pass took them for real tokens (3 pad ids through the model, written into a row)
    from selfrl.chat.template import prompt_ids
    from selfrl.engines import slotdecode

    model = tiny_model_factory(lora=True).double()
    engine = SlotEngine(model, tiny_tokenizer, driver="caller", max_slots=4)
    # unequal drafts (any draft is exact: it is verified), so the decoding grid has padding places
    monkeypatch.setattr(engine, "_drafts", lambda rows: [[5, 6, 7] if i == 0 and len(rows) >= 2 else []
                                                         for i in range(len(rows))])
    fed: list[int] = []  # tokens of each segment of each packed pass
    real_segment = slotdecode.Segment
    monkeypatch.setattr(slotdecode, "Segment", lambda *a, **kw: fed.append(len(a[2])) or real_segment(*a, **kw))
    first = prompt_ids(tiny_tokenizer, [{"role": "user", "content": "a b c a b c a b c"}])
    other = prompt_ids(tiny_tokenizer, [{"role": "user", "content": "Hi"}])
    running = [engine.submit(first, 40, greedy=True), engine.submit(other, 40, greedy=True)]
    for _ in range(3):
        engine._step()
    capacity = engine.cache.capacity
    engine.submit(other, capacity + 50, greedy=True)  # its columns do not fit: the packed step grows the cache
    engine._step()
    assert engine.cache.capacity > capacity and engine.packed_passes == 1, engine._error
    assert fed[-1] == 4 + 1  # the decoding pass: row 0's last id and 3 drafts, row 1's last id; no padding
    assert all(f.result().token_ids for f in running)
