"""The slot engine's cache between batches and its lent prefixes (kvcache.SlotCache.lend/fill, one
tensor for every layer), and the two-level search of a sampled id (sampling.inverse_cdf)."""

from __future__ import annotations

import pytest
import torch

from selfrl.engines.kvcache import SlotCache
from selfrl.engines.slots import SlotEngine
from tests.test_engine_conformance import assert_matches_model
from tests.test_slot_engine import prompts_with_system


def test_the_two_level_search_draws_the_id_whose_cumulative_mass_first_exceeds_the_point():
    from selfrl.engines.sampling import _block, inverse_cdf, inverse_cdf_flat

    assert [_block(v) for v in (49_152, 151_936, 128_256, 64, 50_257)] == [256, 128, 256, 64, 1]
    probs = torch.zeros(3, 5 * 16)  # 80 ids: 5 blocks of 16
    probs[0, [3, 17, 40, 63]] = 1.0  # one id in each of the first 4 blocks
    probs[1, 16:32] = 1.0  # all mass in the second block
    probs[2, [0, 62]] = torch.tensor([3.0, 1.0])
    # row 0: total 4, point 1.2 -> block 1, id 17; row 1: total 16, point 6.4 -> id 16 + 6; row 2: 3.2 -> id 62
    assert inverse_cdf(probs, torch.tensor([0.30, 0.40, 0.80])).tolist() == [17, 22, 62]
    assert inverse_cdf(probs, torch.full((3,), 0.25)).tolist() == [17, 20, 0]  # on a boundary: the next id
    for point in (0.0, 0.2499, 0.25, 0.7499, 0.75, 0.9999):
        u = torch.full((3,), point)
        assert inverse_cdf(probs, u).tolist() == inverse_cdf_flat(probs, u).tolist()
    with pytest.raises(ValueError, match="NaN or inf"):
        inverse_cdf(torch.full((1, 64), float("nan")), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="all zero"):
        inverse_cdf(torch.zeros(1, 64), torch.tensor([0.5]))
    # a block's sum and the cumulative sum within it round differently: a point between the two falls past
    # the block's last id, and is looked up again over the whole row
    g = torch.Generator().manual_seed(1)
    for _ in range(10_000):
        row = torch.rand(1, 256, generator=g) ** 8 * 1000  # (a wide range of masses; one block of 256)
        total, scanned = row.sum(), row.cumsum(-1)[0, -1]
        u = torch.tensor([float((scanned.double() + total.double()) / 2 / total.double())])
        if u < 1 and u * total > scanned:  # a point between the block's sum and its scan
            break
    else:
        pytest.fail("no row whose block sum and scan differ found")
    ids = inverse_cdf(row, u)
    assert ids.tolist() == inverse_cdf_flat(row, u).tolist() and row[0, ids[0]] > 0


def test_an_idle_engine_keeps_its_cache_up_to_idle_cache_bytes(tiny_tokenizer, tiny_model_factory):
    # the next batch writes into the kept cache (no allocation, no zero-fill); over the bound it is freed
    model = tiny_model_factory(lora=True)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "What is 17+25?"]) * 8
    sizes = {}
    for bound in (2**30, 0):
        engine = SlotEngine(model, tiny_tokenizer, driver="caller", idle_cache_bytes=bound)
        engine.generate(prompts, 4, temperature=1.0)
        kept = engine.cache
        engine.generate(prompts, 4, temperature=1.0)
        sizes[bound] = (engine.cache is kept, engine.cache.slots, kept.slots)
        engine.close()
    assert sizes[2**30] == (True, 16, 16)
    assert sizes[0][0] is False and sizes[0][1] == 8  # freed after each batch: a small one in its place
    with pytest.raises(ValueError, match="idle_cache_bytes"):
        SlotEngine(model, tiny_tokenizer, idle_cache_bytes=-1)


def test_a_lent_prefix_is_copied_in_only_where_a_pass_reads_it():
    from selfrl.engines.kvcache import Lent
    from selfrl.engines.sharedattention import SharedPrefix

    pk = [torch.arange(1 * 4 * 2, dtype=torch.float).view(1, 4, 2) + 1]  # one layer: a stored prefix of 4 columns
    pv = [-pk[0]]
    cache = SlotCache(slots=3, capacity=6)
    cache.lend(0, pk, pv, 3)  # slot 0 reads columns 0-2 from the store
    cache.load_prefix(1, pk, pv, 4)  # slot 1 holds all 4
    cache.lend(2, pk, pv, 3)
    rows, cols = torch.arange(2)[:, None], torch.tensor([[3], [4]])
    cache.set_pass(slice(0, 2), 5, rows, cols, shared=SharedPrefix(3, pk, pv))  # attends to the prefix apart
    keys, _ = cache.update(torch.full((2, 1, 1, 2), 7.0), torch.full((2, 1, 1, 2), 8.0), 0)
    assert keys.shape == (2, 1, 2, 2)  # columns 3-4 only
    assert cache.k[0][0, :, :3].abs().sum() == 0 and cache.lent[0].length == 3  # nothing copied
    cache.set_pass(slice(0, 1), 5, rows[:1], cols[:1], shared=SharedPrefix(1, pk, pv))  # a shorter shared part
    assert cache.k[0][0, :, :1].abs().sum() == 0 and torch.equal(cache.k[0][0, :, 1:3], pk[0][:, 1:3])
    assert cache.lent[0] == Lent(pk, pv, 1)
    kept = cache.read_row(0, 4)  # a row kept for its next turn: the columns it holds, and what it was lent
    assert (kept.start, kept.length, kept.lent.length) == (1, 4, 1)
    assert torch.equal(kept.keys[0][:, :2], pk[0][:, 1:3]) and torch.equal(kept.keys[0][:, 2], torch.full((1, 2), 7.0))
    cache.move_row(0, 2, 4)  # compaction: own columns copied, the lent ones lent again
    assert cache.lent[2] == Lent(pk, pv, 1) and cache.k[0][2, :, :1].abs().sum() == 0
    assert torch.equal(cache.k[0][2, :, 1:4], cache.k[0][0, :, 1:4])
    cache.set_pass(slice(0, 3), 5, torch.arange(3)[:, None], torch.full((3, 1), 6), shared=None)  # whole rows read
    assert all(lent is None for lent in cache.lent)
    assert torch.equal(cache.k[0][0, :, :3], pk[0][:, :3]) and torch.equal(cache.v[0][2, :, :1], pv[0][:, :1])
    cache.lend(1, pk, pv, 2)
    cache.set_pass(slice(1, 2), 5, rows[:1] + 1, cols[:1], shared=SharedPrefix(2, pk, pv))
    cache.unshare()  # a view that cannot attend to the prefix apart: copied in, the pass reads whole rows
    assert cache.shared is None and cache.lent[1] is None and torch.equal(cache.k[0][1, :, :2], pk[0][:, :2])
    cache.lend(0, pk, pv, 3)
    cache.read_prefix(0, 3)  # (a copy of the whole row: filled first)
    assert cache.lent[0] is None and torch.equal(cache.k[0][0, :, :3], pk[0][:, :3])


def test_rows_lent_the_system_prompt_continue_exactly_and_keep_only_their_own_columns(tiny_tokenizer,
                                                                                   tiny_model_factory):
    # a batch's rows all start with the stored system prompt: their slots are lent it, never hold it; the
    # kept rows hold only their own columns, and the next turns (several rows, then one row alone, whose
    # pass reads its whole row) sample what an engine without shared-prefix attention samples
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    prompts = prompts_with_system(tiny_tokenizer, ["What is 17+25?", "Hi", "Add 3 and 4.", "2+2?"])
    reply = tiny_tokenizer.encode("<tool_response>42</tool_response>", add_special_tokens=False)
    out = {}
    for shared in (True, False):
        engine = SlotEngine(model, tiny_tokenizer, driver="caller", shared_prefix_attention=shared)
        engine.generate(prompts[:1], 2, temperature=1.0)  # the system prompt becomes a stored prefix
        lent = []
        step = engine._step

        def watched_step():
            step()
            lent.extend(engine.cache.lent[i] is not None for i in range(len(engine._rows)))

        engine._step = watched_step

        def run(ps, seeds):  # submitted together: admitted in one step
            futures = [engine.submit(p, 6, temperature=1.0, seed=seed) for p, seed in zip(ps, seeds)]
            return [fut.result(timeout=60) for fut in futures]

        first = run(prompts, [1, 2, 3, 4])
        kept = [k for k, _ in engine._continuations.items.values()][-4:]  # the first turn's rows (the newest)
        second_prompts = [p + g.token_ids + reply for p, g in zip(prompts, first)]
        second = run(second_prompts, [5, 6, 7, 8])
        third = run([second_prompts[0] + second[0].token_ids + reply], [9])
        out[shared] = (first, second, third, lent, kept, engine._continuations.hits)
        engine.close()
    (f, s, t, lent, kept, hits), (f0, s0, t0, lent0, kept0, hits0) = out[True], out[False]
    for a, b in zip(f + s + t, f0 + s0 + t0):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert hits == hits0 >= 4
    assert any(lent) and not any(lent0)
    assert len(kept) == 4 and all(k.start > 0 and k.lent is not None for k in kept)
    assert all(k.start == 0 for k in kept0)
    own = {k.length: k.keys[0].shape[1] for k in kept0}
    assert all(k.keys[0].shape[1] == k.length - k.start < own[k.length] for k in kept)
    assert_matches_model(t, [second_prompts[0] + second[0].token_ids + reply], model, 1.0,
                         tiny_tokenizer.eos_token_id, 6)
