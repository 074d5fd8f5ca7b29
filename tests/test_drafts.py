"""Speculative decoding from a row's own context (selfrl/engines/drafts.py) and in the slot engine:
the lookup, the width rule, the verification by hand, and the engine sampling the same ids and
logprobs with drafts as without."""

from __future__ import annotations

import math
import threading

import pytest
import torch

from selfrl.engines.drafts import draft_width, lookup_draft, verify_drafts
from selfrl.engines.slots import SlotEngine
from tests.engine_backends import chat_prompts
from tests.test_engine_conformance import assert_matches_model, naive_logps


def test_lookup_takes_the_longest_tail_at_its_latest_occurrence():
    ids = [1, 2, 3, 4, 9, 2, 3, 7, 1, 2, 3]
    # the tail [1, 2, 3] occurs at 0; [2, 3] also at 5 (later), but the longest tail wins
    assert lookup_draft(ids, 3) == [4, 9, 2]
    assert lookup_draft(ids, 3, max_ngram=2) == [7, 1, 2]  # tails of at most 2: [2, 3] at 5 is the latest
    assert lookup_draft([4, 5, 4, 5, 4], 2) == [5, 4]  # the latest [5, 4] starts at 1 (overlaps the tail)
    assert lookup_draft([8, 8, 8], 5) == [8]  # what follows stops at the end of the ids
    assert lookup_draft([1, 2, 3, 4], 3) == []  # the last id never occurred before
    assert lookup_draft([1, 2, 1], 0) == [] and lookup_draft([1], 3) == []


def test_draft_width_keeps_a_pass_within_its_budget():
    assert [draft_width(r, 4, 16) for r in (0, 1, 2, 3, 4, 5, 8, 9)] == [0, 4, 4, 4, 3, 2, 1, 0]
    assert draft_width(1, 0, 16) == 0 and draft_width(1, 4, 0) == 0
    for rows in range(1, 40):
        w = draft_width(rows, 6, 24)
        assert w == 0 or rows * (1 + w) <= 24


def test_negative_draft_settings_are_refused(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True)
    for bad in ({"draft_ids": -1}, {"draft_budget": -1}):
        with pytest.raises(ValueError, match="draft_ids and draft_budget must be >= 0"):
            SlotEngine(model, tiny_tokenizer, driver="caller", **bad)


def _point_masses(rows: list[list[int]], V: int = 5) -> torch.Tensor:
    """(B, T, V) log-probabilities: all mass on the given id at each position."""
    logp = torch.full((len(rows), len(rows[0]), V), -math.inf)
    for i, ids in enumerate(rows):
        for j, t in enumerate(ids):
            logp[i, j, t] = 0.0
    return logp


def test_greedy_rows_keep_drafted_ids_while_they_are_the_argmax():
    # row 0: argmax 1, 2, 3; draft [1, 2] -> both kept, and the id after the whole draft (3)
    # row 1: argmax 0, 1, 1; draft [3, 1] -> the first choice (0) differs: only it is kept
    # row 2: argmax 4, 4, 0; draft [4] (shorter) -> 4 kept, then the choice at position 1 (4)
    # row 3: no draft -> one id, as a plain decoding step
    logp = _point_masses([[1, 2, 3], [0, 1, 1], [4, 4, 0], [2, 0, 0]])
    chosen = verify_drafts(logp, [[1, 2], [3, 1], [4], []], torch.ones(4, dtype=torch.bool), torch.ones(4))
    assert chosen == [[1, 2, 3], [0], [4, 4], [2]]


def test_sampled_rows_draw_one_number_per_kept_id_from_their_generator():
    # every position: ids 0 and 1 at probability 1/2 each; a row's id at a position is 0 when its
    # uniform number is below 1/2 (inverse CDF), and the row goes on while that id is the drafted one
    logp = torch.full((2, 4, 3), -math.inf)
    logp[..., :2] = math.log(0.5)
    seeds = [11, 12]
    g = [torch.Generator().manual_seed(s) for s in seeds]
    expect_u = [torch.rand(5, generator=torch.Generator().manual_seed(s)).tolist() for s in seeds]  # their numbers
    by_hand = [[0 if u < 0.5 else 1 for u in us[:4]] for us in expect_u]  # each row's ids, drawn one a position
    drafts = [by_hand[0][:3], [1 - by_hand[1][0]]]  # row 0's draft is what it draws; row 1's first drafted id is not
    chosen = verify_drafts(logp, drafts, torch.zeros(2, dtype=torch.bool), torch.ones(2), g)
    assert chosen[0] == by_hand[0]  # 3 drafted ids kept and the 4th drawn: 4 numbers
    assert chosen[1] == by_hand[1][:1]  # differs from its draft: 1 number
    # each generator moved by exactly the ids its row kept: the next number is the one after them
    assert float(torch.rand(1, generator=g[0])) == expect_u[0][4]
    assert float(torch.rand(1, generator=g[1])) == expect_u[1][1]


def test_a_nan_position_stops_a_row_and_a_nan_first_position_or_a_long_draft_is_refused():
    logp = _point_masses([[1, 2, 3]])
    logp[0, 2] = float("nan")  # after 2 drafted ids: the row keeps the two ids before it
    assert verify_drafts(logp, [[1, 2]], torch.ones(1, dtype=torch.bool), torch.ones(1)) == [[1, 2]]
    with pytest.raises(ValueError, match="longer than the pass allows"):
        verify_drafts(logp, [[1, 2, 3]], torch.ones(1, dtype=torch.bool), torch.ones(1))
    logp[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        verify_drafts(logp, [[1, 2]], torch.ones(1, dtype=torch.bool), torch.ones(1))


def _both(model, tok, run):
    """``run(engine)`` on an engine without drafts and one with; returns both results and the latter's engine."""
    plain, drafting = (SlotEngine(model, tok, driver="caller", draft_ids=d, draft_budget=16) for d in (0, 4))
    try:
        return run(plain), run(drafting), drafting
    finally:
        plain.close()
        drafting.close()


@pytest.mark.parametrize("greedy,temperature", [(True, 1.0), (False, 0.1), (False, 0.2), (False, 1.0)])
def test_drafts_sample_the_same_ids_and_logprobs(tiny_tokenizer, tiny_model_factory, greedy, temperature):
    # a tiny random model repeats itself at a low temperature, so its own context drafts it (at 1.0
    # nearly every draft is rejected: that changes nothing either); each row has its own seed
    model = tiny_model_factory(seed=2, lora=True)
    prompts = chat_prompts(tiny_tokenizer)

    def run(engine):
        futures = [engine.submit(p, 40, temperature, greedy=greedy, seed=7 + i) for i, p in enumerate(prompts)]
        return [f.result(timeout=120) for f in futures]

    plain, drafted, engine = _both(model, tiny_tokenizer, run)
    assert engine.draft_passes > 0 and engine.drafted_ids > 0
    if temperature < 1:  # drafts were kept: fewer passes than ids
        assert engine.accepted_ids > 0 and engine.steps < sum(len(g.token_ids) for g in drafted)
    assert [g.token_ids for g in drafted] == [g.token_ids for g in plain]
    for a, b in zip(drafted, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=2e-6)
    assert_matches_model(drafted, prompts, model, 1.0 if greedy else temperature, tiny_tokenizer.eos_token_id, 40)


def test_a_row_that_stops_inside_its_draft_ends_there_and_its_next_turn_continues_exactly(tiny_tokenizer,
                                                                                           tiny_model_factory):
    # a stop string met inside a kept draft ends the row at that id (the ids after it are dropped),
    # and the keys and values kept for its next turn are those of the ids it kept
    model = tiny_model_factory(seed=1, lora=True)
    prompt = chat_prompts(tiny_tokenizer)[0]
    plain = SlotEngine(model, tiny_tokenizer, driver="caller", draft_ids=0)
    free = plain.generate([prompt], 40, greedy=True)[0]
    plain.close()
    stop = tiny_tokenizer.decode(free.token_ids[20:22])  # two ids from late in a repeating greedy row

    def run(engine):
        first = engine.generate([prompt], 40, greedy=True, stop=[stop])[0]
        follow = prompt + first.token_ids + [tiny_tokenizer.eos_token_id] + free.token_ids[:5]
        second = engine.generate([follow], 12, greedy=True)[0]
        return first, follow, second, engine._continuations.hits

    (f0, _, s0, _), (f1, follow, s1, hits), engine = _both(model, tiny_tokenizer, run)
    assert f1.stopped and f1.token_ids == f0.token_ids and len(f1.token_ids) < 40
    assert hits == 1 and engine.accepted_ids > 0  # the second turn continued the kept row
    assert s1.token_ids == s0.token_ids
    torch.testing.assert_close(torch.tensor(s1.logprobs), naive_logps(model, follow, s1.token_ids, 1.0),
                               atol=1e-5, rtol=2e-6)


def test_a_generate_call_never_streams_padding_for_a_row_still_running(tiny_tokenizer, tiny_model_factory):
    # rows of one call advance apart (drafts; a row admitted after a slot frees): each row's ids
    # streamed by on_step are its final ones, never padding that a later id replaces
    model = tiny_model_factory(seed=1, lora=True)
    prompts = chat_prompts(tiny_tokenizer)
    for max_slots in (1, 64):
        engine = SlotEngine(model, tiny_tokenizer, driver="caller", max_slots=max_slots, draft_budget=16)
        seen = []
        gens = engine.generate(prompts, 24, greedy=True, on_step=lambda ids: seen.append(ids.clone()))
        assert seen and seen[-1].shape[1] == max(len(g.token_ids) for g in gens)
        for ids in seen:
            for i, g in enumerate(gens):
                k = min(ids.shape[1], len(g.token_ids))
                assert ids[i, :k].tolist() == g.token_ids[:k]
        engine.close()


def test_a_row_cancelled_while_it_streams_keeps_no_drafted_id_after_the_cancel(tiny_tokenizer, tiny_model_factory):
    # a client that cancels from its stream at n ids gets n ids, as with one id a pass (found by a fresh
    # user's test: with drafts the rest of the pass's kept ids were still appended and streamed)
    model = tiny_model_factory(seed=1, lora=True)
    prompt = chat_prompts(tiny_tokenizer)[0]
    for n in (12, 14, 16, 18):
        results = []
        for draft_ids in (0, 4):
            engine = SlotEngine(model, tiny_tokenizer, driver="caller", draft_ids=draft_ids)
            cancel, after = threading.Event(), []

            def stream(ids, cancel=cancel, after=after, n=n):
                if cancel.is_set():
                    after.append(len(ids))
                if len(ids) >= n:
                    cancel.set()

            g = engine.submit(prompt, 40, 0.1, seed=1, on_tokens=stream, cancel=cancel).result(timeout=60)
            assert g.cancelled and len(g.token_ids) == n and after == []
            results.append((g.token_ids, engine.accepted_ids))
            engine.close()
        assert results[0][0] == results[1][0]
    assert results[1][1] > 0  # the drafts were kept before the cancel
