"""The learner's three ways to encode a batch (selfrl.rl.tree, selfrl.rl.logprobs): a packed
prefix tree, a shared-prefix cache, and the padded rows give the same log-probs and the same
gradients; the tree is used only where it is exact and cheaper."""

from __future__ import annotations

import pytest
import torch

from selfrl.rl import logprobs as lp
from selfrl.rl.logprobs import VocabMasks, per_token_logps, tree_supported
from selfrl.rl.tree import MAX_TREE_NODES, build_tree, layout_cost, tree_pays

TEMPERATURE = 0.7
PAD = 0


def batch(rows: list[list[int]], completion: list[list[int]]):
    """Right-padded (B, T) ids, attention mask and completion mask from rows and, per row, the
    positions of its completion tokens."""
    T = max(map(len, rows))
    ids = torch.full((len(rows), T), PAD, dtype=torch.long)
    att = torch.zeros((len(rows), T), dtype=torch.long)
    comp = torch.zeros((len(rows), T))
    for i, (r, c) in enumerate(zip(rows, completion)):
        ids[i, :len(r)] = torch.tensor(r)
        att[i, :len(r)] = 1
        comp[i, c] = 1.0
    return ids, att, comp


def shared_rows(seed: int = 0):
    """Six rows of a GRPO-like batch: a 20-token shared system prompt, two tasks of three samples,
    one sample repeated exactly, one row a prefix of another, one of another length."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(5, 400, (n,), generator=g).tolist()  # noqa: E731
    system, task_a, task_b = rand(20), rand(6), rand(9)
    first, turn = rand(7), rand(5)
    rows = [
        system + task_a + first,
        system + task_a + first,  # the same sample twice
        system + task_a + first + turn,  # the first row is a prefix of this one
        system + task_a + rand(11),
        system + task_b + rand(4),
        system + task_b + first[:3] + rand(8),
    ]
    completion = [list(range(26, len(r))) if i < 4 else list(range(29, len(r))) for i, r in enumerate(rows)]
    completion[2] = list(range(26, 33)) + list(range(35, 38))  # a tool result (33, 34) is not a completion token
    return rows, completion


def logps_and_grads(model, ids, att, comp, layout, weights, vocab_masks=None):
    model.zero_grad(set_to_none=True)
    out = per_token_logps(model, ids, att, comp, TEMPERATURE, layout=layout, vocab_masks=vocab_masks)  # (B, T)
    (out * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads


def test_build_tree_numbers_nodes_depth_first_and_maps_every_token():
    rows = [[1, 2, 3], [1, 4], [1, 2, 3, 5], [7], [1, 2, 3]]
    t = build_tree(rows)
    assert t.token_ids.tolist() == [1, 2, 3, 5, 4, 7]
    assert t.position_ids.tolist() == [0, 1, 2, 3, 1, 0]
    assert t.end.tolist() == [5, 4, 4, 4, 5, 6]
    assert t.node_of.tolist() == [[0, 1, 2, -1], [0, 4, -1, -1], [0, 1, 2, 3], [5, -1, -1, -1], [0, 1, 2, -1]]
    for r, nodes in zip(rows, t.node_of.tolist()):  # each row reads back its own tokens
        assert t.token_ids[[n for n in nodes if n >= 0]].tolist() == r
    mask = t.attention_mask()[0, 0]  # (N, N): ancestors and self
    expect = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                           [1, 1, 1, 1, 0, 0], [1, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mask, expect)
    with pytest.raises(ValueError, match="at least one token"):
        build_tree([[1], []])


@pytest.mark.parametrize("other", ["prefix", "rows"])
def test_tree_gives_the_padded_batchs_logps_and_gradients(tiny_peft_model, other):
    rows, completion = shared_rows()
    ids, att, comp = batch(rows, completion)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * comp  # (B, T)
    tree_lp, tree_g = logps_and_grads(tiny_peft_model, ids, att, comp, "tree", weights)
    ref_lp, ref_g = logps_and_grads(tiny_peft_model, ids, att, comp, other, weights)
    assert build_tree(rows).num_nodes == 20 + 6 + 7 + 5 + 11 + 9 + 4 + 11  # each shared prefix once
    assert torch.allclose(tree_lp, ref_lp, atol=1e-5, rtol=0)
    assert bool((tree_lp[comp == 0] == 0).all()) and bool((tree_lp[comp == 1] < 0).all())
    assert torch.equal(tree_lp[0], tree_lp[1])  # the repeated sample: one computation, read twice
    assert set(tree_g) == set(ref_g) and len(tree_g) > 0
    for name, g in ref_g.items():
        assert g.abs().max() > 0, name
        assert torch.allclose(tree_g[name], g, atol=1e-5, rtol=1e-4), name


def test_tree_with_grammar_masks_matches_the_rows(tiny_peft_model):
    rows, completion = shared_rows(seed=3)
    ids, att, comp = batch(rows, completion)
    V = tiny_peft_model.get_base_model().lm_head.weight.shape[0]
    allowed = torch.zeros((2, V), dtype=torch.bool)
    allowed[0, :50] = True
    allowed[1, 100:] = True
    index = torch.full(ids.shape, -1, dtype=torch.long)
    index[0, 27], index[1, 27], index[4, 30] = 0, 1, 0  # rows 0 and 1 share the node, not the mask
    for b, t in ((0, 27), (4, 30)):
        ids[b, t] = 7  # a token inside mask 0
    ids[1, 27] = 200  # a token inside mask 1
    masks = VocabMasks(index, allowed)
    weights = comp.clone()
    tree_lp, tree_g = logps_and_grads(tiny_peft_model, ids, att, comp, "tree", weights, masks)
    rows_lp, rows_g = logps_and_grads(tiny_peft_model, ids, att, comp, "rows", weights, masks)
    assert torch.allclose(tree_lp, rows_lp, atol=1e-5, rtol=0)
    free = per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE, layout="rows").detach()
    assert tree_lp[0, 27] > free[0, 27]  # the mask renormalised over 50 ids
    for name, g in rows_g.items():
        assert torch.allclose(tree_g[name], g, atol=1e-5, rtol=1e-4), name


def test_tree_without_completion_tokens_stays_in_the_graph(tiny_peft_model):
    rows, _ = shared_rows()
    ids, att, comp = batch(rows, [[] for _ in rows])
    out = per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE, layout="tree")
    assert torch.equal(out, torch.zeros_like(out)) and out.requires_grad
    out.sum().backward()  # zero gradients, no error


def test_auto_takes_the_tree_only_where_it_encodes_fewer_tokens(tiny_peft_model, monkeypatch):
    used = []
    real = lp._tree_logps
    monkeypatch.setattr(lp, "_tree_logps", lambda *a, **k: used.append(True) or real(*a, **k))
    rows, completion = shared_rows()
    ids, att, comp = batch(rows, completion)
    per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE)
    assert used == [True]
    g = torch.Generator().manual_seed(5)  # rows with nothing in common: the tree would save nothing
    distinct = [torch.randint(5, 400, (30,), generator=g).tolist() for _ in range(4)]
    ids, att, comp = batch(distinct, [list(range(20, 30))] * 4)
    per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE)
    per_token_logps(tiny_peft_model, ids[:1], att[:1], comp[:1], TEMPERATURE)  # one row: nothing to share
    assert used == [True]
    monkeypatch.setattr(lp, "TREE_DEVICES", ())  # a device where the tree has not run (a GPU): not by default
    ids, att, comp = batch(*shared_rows())
    per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE)
    assert used == [True]
    per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE, layout="tree")  # asked for: still given
    assert used == [True, True]


def test_tree_cost_rule_by_hand():
    # 8 rows of 300 tokens sharing 200: 200 + 8 * 100 = 1000 tokens, plus 800 queries over 300 keys
    assert layout_cost(8, 300, 200, 576) == pytest.approx(1000 + 800 * 300 / 3456)
    assert tree_pays(400, layout_cost(8, 300, 200, 576), 576)  # 400 + 46 < 1069
    assert not tree_pays(1000, layout_cost(8, 300, 200, 576), 576)  # 1000 + 289 > 1069
    assert not tree_pays(MAX_TREE_NODES + 1, float("inf"), 576)


def test_tree_is_refused_where_it_would_not_be_exact(tiny_model_factory):
    model = tiny_model_factory()
    decoder = model.get_decoder()
    rows, completion = shared_rows()
    ids, att, comp = batch(rows, completion)
    assert tree_supported(decoder, att)
    left = torch.flip(att, dims=[1])  # left padding: the rows' positions are not their indices
    assert not tree_supported(decoder, left)
    with pytest.raises(ValueError, match="layout 'tree' needs"):
        per_token_logps(model, torch.flip(ids, dims=[1]), left, torch.flip(comp, dims=[1]), TEMPERATURE, layout="tree")
    decoder.config._attn_implementation = "flash_attention_2"  # ignores a 4D mask
    assert not tree_supported(decoder, att)
    decoder.config._attn_implementation = "sdpa"
    decoder.config.sliding_window = 16  # a window shorter than the rows: the packed mask would not apply it
    assert not tree_supported(decoder, att)
    with pytest.raises(ValueError, match="layout must be one of"):
        per_token_logps(model, ids, att, comp, TEMPERATURE, layout="packed")


def test_an_architecture_whose_mask_does_not_reach_attention_fails_the_check(tiny_model_factory, monkeypatch):
    model = tiny_model_factory()
    decoder = model.get_decoder()
    model.config._attn_implementation = "eager"
    assert tree_supported(decoder, torch.ones((2, 4), dtype=torch.long))  # eager gets an additive mask
    real = type(decoder).forward

    def causal_only(self, *args, attention_mask=None, **kwargs):  # a model that builds its own mask
        return real(self, *args, attention_mask=None, **kwargs)

    monkeypatch.setattr(type(decoder), "forward", causal_only)
    other = tiny_model_factory(seed=1).get_decoder().train()
    assert not tree_supported(other, torch.ones((2, 4), dtype=torch.long))
    assert all(m.training for m in other.modules())  # the check ran in eval mode and put the modes back


def test_an_architecture_that_raises_on_the_mask_falls_back_to_the_rows(tiny_tokenizer):
    from transformers import BloomConfig, BloomForCausalLM

    # ALiBi builds its bias from a 2D mask: a 4D one raises inside the model, so no tree, and no error
    model = BloomForCausalLM(BloomConfig(vocab_size=len(tiny_tokenizer), hidden_size=32, n_layer=2, n_head=4)).eval()
    rows, completion = shared_rows()
    ids, att, comp = batch(rows, completion)
    assert not tree_supported(model.get_decoder() if hasattr(model, "get_decoder") else model.transformer, att)
    auto = per_token_logps(model, ids, att, comp, TEMPERATURE)
    torch.testing.assert_close(auto, per_token_logps(model, ids, att, comp, TEMPERATURE, layout="rows"),
                               atol=1e-5, rtol=0)


def test_a_row_of_padding_only_is_left_to_the_rows(tiny_peft_model):
    rows, completion = shared_rows()
    ids, att, comp = batch(rows, completion)
    att[2], ids[2], comp[2] = 0, PAD, 0  # an empty row
    assert not tree_supported(lp.decoder_and_head(tiny_peft_model)[0], att)
    out = per_token_logps(tiny_peft_model, ids, att, comp, TEMPERATURE)  # auto: no error
    assert bool((out[2] == 0).all())


def test_no_tree_in_16_bits_and_the_answer_follows_the_dtype(tiny_model_factory):
    # in bf16 the check cannot tell rounding from a slightly wrong position bias (an ALiBi model in
    # bf16 passed a 10 % tolerance with log-probs 0.036 off), so 16-bit weights take the rows
    model = tiny_model_factory()
    decoder = model.get_decoder()
    att = torch.ones((2, 4), dtype=torch.long)
    assert tree_supported(decoder, att)
    model.to(torch.bfloat16)
    assert not tree_supported(decoder, att)
    model.to(torch.float32)
    assert tree_supported(decoder, att)
    assert set(lp._TREE_CHECKED[decoder]) == {("sdpa", torch.float32)}
