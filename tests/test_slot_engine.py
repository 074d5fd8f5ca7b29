"""What the slot engine adds to the contract (tests/test_engine_conformance.py covers the
contract itself): continuous batching, slot reuse and compaction, shared prefixes,
the version gate, the sampling function, and the cache."""

from __future__ import annotations

import math
import os
import threading
import time

import pytest
import torch

from selfrl.chat.template import prompt_ids
from selfrl.engines.kvcache import SlotCache
from selfrl.engines.sampling import nucleus_mask, sample_tokens
from selfrl.engines.slots import SlotEngine, VersionGate
from tests.held_row import HeldRow
from tests.test_engine_conformance import assert_matches_model, naive_logps

LONG_SYSTEM = "You are a careful assistant. Use the calculator tool for any arithmetic, then give the final answer."


def prompts_with_system(tok, questions):
    return [prompt_ids(tok, [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": q}])
            for q in questions]


def test_more_requests_than_slots_reuse_freed_slots_exactly(tiny_tokenizer, tiny_model_factory):
    # 2 slots for 9 rows of different lengths: rows end at different steps, freed slots are
    # refilled mid-batch and the last row is moved into each hole; every logprob stays exact
    model = tiny_model_factory(eos_bias=2.5, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=2)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "What is 17+25?", "Add 1, 2, 3 and 4."]) * 3
    torch.manual_seed(4)
    gens = engine.generate(prompts, max_new_tokens=10, temperature=0.8)
    assert_matches_model(gens, prompts, model, 0.8, tiny_tokenizer.eos_token_id, 10)
    assert len({len(g.token_ids) for g in gens}) > 2
    assert engine.rows_done == 9 and len(engine._rows) == 0
    engine.close()


def test_a_request_joins_a_running_batch(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=-50.0, lora=True)  # no EOS: every row runs to its limit
    engine = SlotEngine(model, tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    held = HeldRow(at=3)
    long = engine.submit(prompt, 200, greedy=True, on_tokens=held)
    assert held.wait()  # the long row is decoding
    pending = engine.submit(prompt, 2, greedy=True)
    held.release()
    short = pending.result(timeout=60)
    assert not long.done()  # the short request did not wait for the long one
    full = long.result(timeout=120)
    assert short.token_ids == full.token_ids[:2]  # same prompt, greedy: the same first ids
    assert engine.steps < 200 + 5  # both rode the same steps; no second pass of 200 steps
    engine.close()


def test_shared_prefix_is_encoded_once_and_reused_exactly(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=3)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "What is 17+25?", "Add 1, 2, 3 and 4.", "Go"])
    torch.manual_seed(0)
    gens = engine.generate(prompts, 8, temperature=1.0)
    assert len(engine._prefixes) >= 1
    shared = len(engine._prefixes.items[-1][0])
    assert shared >= 16 and all(p[:shared] == prompts[0][:shared] for p in prompts)
    assert_matches_model(gens, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 8)
    # a later single request reuses the stored prefix, still exactly
    one = engine.submit(prompts[1], 8, temperature=1.0).result(timeout=60)
    assert_matches_model([one], prompts[1:2], model, 1.0, tiny_tokenizer.eos_token_id, 8)
    engine.close()


def test_an_update_in_place_drops_stored_prefixes(tiny_tokenizer, tiny_model_factory):
    # selfrl run trains the shared model in place: the next sample must use the new weights
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "What is 17+25?"])
    engine.generate(prompts, 4, greedy=True)
    assert len(engine._prefixes) >= 1
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn_like(p))
    gens = engine.generate(prompts, 6, temperature=0.9)
    assert_matches_model(gens, prompts, model, 0.9, tiny_tokenizer.eos_token_id, 6)
    engine.close()


def test_swap_waits_for_requests_in_flight(tiny_tokenizer, tiny_model_factory):
    from peft import get_peft_model_state_dict

    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    state = {k: torch.randn_like(v) for k, v in get_peft_model_state_dict(model).items()}
    running = engine.submit(prompt, 60, greedy=True)
    while engine.steps < 2:
        time.sleep(0.01)
    swapper = threading.Thread(target=engine.swap, args=(state, 1))
    swapper.start()
    gen = running.result(timeout=120)
    swapper.join(timeout=60)
    assert gen.adapter_version == 0 and len(gen.token_ids) == 60 and engine.version == 1
    after = engine.submit(prompt, 3, greedy=True).result(timeout=60)
    assert after.adapter_version == 1
    engine.close()


def test_mixed_sampling_settings_share_a_batch(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True)
    engine = SlotEngine(model, tiny_tokenizer)
    p = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    torch.manual_seed(1)
    futs = [engine.submit(p, 6, greedy=True), engine.submit(p, 6, temperature=0.5),
            engine.submit(p, 6, temperature=1.3, top_p=0.9)]
    greedy, cold, hot = [f.result(timeout=60) for f in futs]
    torch.testing.assert_close(torch.tensor(cold.logprobs), naive_logps(model, p, cold.token_ids, 0.5), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(hot.logprobs), naive_logps(model, p, hot.token_ids, 1.3), atol=1e-5, rtol=0)
    with torch.no_grad():
        first = model(input_ids=torch.tensor([p])).logits[0, -1].argmax().item()
    assert greedy.token_ids[0] == first
    engine.close()


def test_the_gate_owner_may_take_tickets():
    gate = VersionGate()
    with gate:
        gate.acquire_shared()  # the owner may sample on the version it holds
        gate.release_shared()
    assert gate.in_flight == 0


def test_close_fails_new_requests(tiny_tokenizer, tiny_model_factory):
    engine = SlotEngine(tiny_model_factory(lora=True), tiny_tokenizer)
    engine.close()
    assert not engine.health().ok
    with pytest.raises(RuntimeError, match="closed"):
        engine.generate([[1, 2, 3]], 2)


def test_nucleus_mask_and_sampling_by_hand():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.2, 0.2, 0.6]])
    assert nucleus_mask(probs, torch.tensor([0.5, 1.0])).tolist() == [[True, False, True], [False, False, False]]
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 3.0]])
    ids, logps = sample_tokens(logits, torch.tensor([0.5, 1.0]), torch.tensor([True, False]), torch.tensor([1.0, 1e-6]))
    assert ids.tolist() == [1, 2]  # greedy argmax; a tiny nucleus keeps only the top id
    expected = torch.log_softmax(logits, -1)[[0, 1], [1, 2]]  # greedy: temperature 1; row 2: temperature 1
    torch.testing.assert_close(logps, expected)


def test_cache_grows_without_losing_contents():
    cache = SlotCache(slots=2, capacity=4)
    k = torch.arange(2 * 3 * 4 * 5, dtype=torch.float).view(2, 3, 4, 5)  # (b, kv_heads, T, head_dim)
    cache.set_pass(slice(0, 2), 4, torch.arange(2)[:, None].expand(2, 4), torch.arange(4)[None].expand(2, 4))
    keys, _ = cache.update(k, k + 1, 0)
    assert torch.equal(keys, k)
    cache.ensure(5, 9)
    assert cache.slots >= 5 and cache.capacity >= 9
    assert torch.equal(cache.k[0][:2, :, :4], k) and cache.k[0][2:].abs().sum() == 0
    cache.move_row(1, 3, 4)
    assert torch.equal(cache.k[0][3, :, :4], k[1])
    # short of columns only, with 2 rows in use of 8 slots: those 2 kept, the slots cut to twice the 3 needed
    cache = SlotCache(slots=8, capacity=4)
    cache.set_pass(slice(0, 2), 4, torch.arange(2)[:, None].expand(2, 4), torch.arange(4)[None].expand(2, 4))
    cache.update(k, k + 1, 0)
    cache.ensure(3, 9, used=2)
    assert (cache.slots, cache.capacity) == (6, 9) and cache.k[0].shape == (6, 3, 10, 5)
    assert torch.equal(cache.k[0][:2, :, :4], k) and torch.equal(cache.v[0][:2, :, :4], k + 1)
    assert cache.k[0][2:].abs().sum() == 0 and cache.k[0][:2, :, 4:].abs().sum() == 0
    cache.ensure(7, 9, used=6)  # then short of rows: they grow by half
    assert cache.slots == 9 and torch.equal(cache.k[0][:2, :, :4], k)


def test_seeded_sampling_does_not_depend_on_batch_mates(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=4)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "What is 17+25?", "Add 1, 2, 3 and 4."])
    alone = engine.submit(prompts[1], 10, temperature=1.0, seed=42).result(timeout=60)
    crowd = [engine.submit(p, 10, temperature=1.0, seed=42 if i == 1 else i) for i, p in enumerate(prompts * 2)]
    assert crowd[1].result(timeout=60).token_ids == alone.token_ids  # same seed, other batch mates
    torch.manual_seed(5)
    a = engine.generate(prompts * 2, 10, temperature=1.0)
    torch.manual_seed(5)
    c = engine.generate(prompts * 2, 10, temperature=1.0)
    assert [g.token_ids for g in a] == [g.token_ids for g in c]
    assert len({tuple(g.token_ids) for g in a}) > 2  # rows draw different samples
    engine.close()


def test_seeded_rollouts_repeat_exactly(tiny_tokenizer, tiny_model_factory):
    from selfrl.rollout.agent import RolloutConfig, rollout
    from selfrl.core.tasks import Task
    from selfrl.core.tools import CALCULATOR

    model = tiny_model_factory(eos_bias=1.5, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=3)
    tasks = [Task.make("test", f"What is {i}+{i}?", str(2 * i)) for i in range(5)]
    cfg = RolloutConfig(max_new_tokens=8, temperature=1.0)
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        runs.append(rollout(engine, tasks, [t.id for t in tasks], [CALCULATOR], cfg))
    assert [t.token_ids for t in runs[0]] == [t.token_ids for t in runs[1]]
    assert [t.logprobs for t in runs[0]] == [t.logprobs for t in runs[1]]
    engine.close()


def test_a_cancelled_request_frees_its_slot_at_the_next_step(tiny_tokenizer, tiny_model_factory):
    # one slot: a long row holds it, a second waits; cancelling the first lets the second in at
    # once, and a request cancelled while queued resolves without ever being prefilled
    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, max_slots=1)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    gone, later = threading.Event(), threading.Event()
    long = engine.submit(prompt, 10_000, temperature=1.0, cancel=gone)
    waiting = engine.submit(prompt, 3, greedy=True)
    never = engine.submit(prompt, 3, greedy=True, cancel=later)
    while engine.steps < 3:
        time.sleep(0.01)
    later.set()
    assert never.result(timeout=60).cancelled and never.result().token_ids == []
    assert not waiting.done()  # still queued behind the long row
    steps = engine.steps
    gone.set()
    g = long.result(timeout=60)
    assert g.cancelled and not g.finished and 3 <= len(g.token_ids) == len(g.logprobs) < 10_000
    torch.testing.assert_close(torch.tensor(g.logprobs), naive_logps(model, prompt, g.token_ids, 1.0), atol=1e-5, rtol=0)
    assert waiting.result(timeout=60).token_ids and engine.steps - steps <= 5  # the slot was free at once
    assert engine.rows_cancelled == 2 and engine.health().detail.startswith("idle")
    engine.close()


def test_a_row_whose_grammar_breaks_fails_alone(tiny_tokenizer, tiny_model_factory):
    from selfrl.chat.constrain import json_constraint

    model = tiny_model_factory(eos_bias=-50.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer)
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    free = engine.submit(prompt, 8, greedy=True)
    req = engine._request(prompt, 8, 1.0, True, 1.0, None, None, None, 0, False, json_constraint(), None)

    class Refusing:  # the matcher refuses the second id the mask allowed
        def __init__(self, real):
            self.real, self.fed = real, 0

        def compute_bitmask(self):
            return self.real.compute_bitmask()

        def consume_token(self, t):
            self.fed += 1
            return self.fed < 2 and self.real.consume_token(t)

        def is_error(self):
            return self.fed >= 2

        def get_error(self):
            return "refused"

    req.grammar.matcher = Refusing(req.grammar.matcher)
    engine._enqueue([req])
    bad = req.future.result(timeout=60)  # the row ends there, its reason on its Generation (as the reference engine's)
    assert bad.grammar_error.endswith("broke the json grammar: refused") and not bad.finished
    assert len(bad.token_ids) == 2 and len(bad.constrained) == 2
    assert len(free.result(timeout=60).token_ids) == 8 and engine.health().ok
    engine.close()


def test_the_serve_path_gives_both_engines_the_same_rows(tiny_tokenizer, tiny_model_factory):
    """Jobs as ``selfrl serve`` makes them (stop strings, top logprobs, a grammar, a token
    limit per row, streamed ids), through the Batcher: the slot engine's rows equal the
    reference engine's (greedy), ids exactly and logprobs within 1e-5."""
    import copy

    from selfrl.chat.constrain import tool_call_constraint
    from selfrl.engines.reference import Engine
    from selfrl.serve.batcher import Batcher, Job

    model = tiny_model_factory(eos_bias=-2.0, lora=True)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "What is 17+25?", "Add 1, 2, 3 and 4."])
    full = Engine(copy.deepcopy(model), tiny_tokenizer).generate(prompts[:1], 12, greedy=True)[0]
    stop = tiny_tokenizer.decode(full.token_ids)[4:6]
    call = tool_call_constraint([("add", {"type": "object", "properties": {"a": {"type": "integer"}}})])
    out = {}
    for name, engine in [("reference", Engine(copy.deepcopy(model), tiny_tokenizer)),
                         ("slots", SlotEngine(copy.deepcopy(model), tiny_tokenizer))]:
        batcher = Batcher(engine, lambda version, fn: fn())
        streamed: dict[int, list] = {}
        jobs = [Job(prompts[0], 12, greedy=True, stop=(stop,)),
                Job(prompts[1], 7, greedy=True, top_logprobs=2),
                Job(prompts[2], 30, greedy=True, constraint=call),
                Job(prompts[1], 5, greedy=True, on_tokens=lambda ids: streamed.setdefault(3, []).append(ids))]
        out[name] = ([batcher.submit(j).result(timeout=120) for j in jobs], streamed)
        batcher.close()
        getattr(engine, "close", lambda: None)()
    (ref, ref_stream), (mine, my_stream) = out["reference"], out["slots"]
    assert ref[0].stopped and ref[0].token_ids == full.token_ids[:len(ref[0].token_ids)] < full.token_ids
    assert len(ref[1].token_ids) == 7 and len(ref[1].top_logprobs[0]) == 2 and ref[2].constrained
    for a, b in zip(mine, ref):
        assert (a.token_ids, a.stopped, a.finished, a.constrained) == (b.token_ids, b.stopped, b.finished, b.constrained)
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert (a.top_logprobs is None) == (b.top_logprobs is None)
    assert [[i for i, _ in alts] for alts in mine[1].top_logprobs] == [[i for i, _ in alts] for alts in ref[1].top_logprobs]
    assert my_stream[3][-1] == mine[3].token_ids  # streamed as decoded (the reference's stream stops one id short)
    assert ref_stream[3][-1] == ref[3].token_ids[:len(ref_stream[3][-1])]


def test_constrained_rollouts_on_the_slot_engine_train_with_ratio_one(tiny_tokenizer, tiny_model_factory):
    """``rollout.constrain = "tool_call"`` through the slot engine's pipelined turns (submit
    with a grammar): every turn a valid call, and the learner's replayed masks recompute
    the sampled logprobs exactly (TIS weight 1, mismatch KL 0)."""
    from selfrl.rollout.agent import rollout
    from selfrl.core.tasks import Task
    from tests.test_constrained_rollouts import _cfg, _step, _tools, _with_advantages

    policy = tiny_model_factory(seed=4, lora=True, default_init=True)
    engine = SlotEngine(policy, tiny_tokenizer)
    log = []
    torch.manual_seed(5)
    trajs = rollout(engine, [Task("t1", "test", "What is 17+25?", "42")] * 4, ["g"] * 4, _tools(log),
                    _cfg(max_turns=2, max_new_tokens=64))
    engine.close()
    assert len(log) >= 4 and all(isinstance(a, int) and isinstance(b, int) for a, b in log)  # valid calls, run
    assert all(len(t.constraints) == t.num_turns >= 1 for t in trajs)
    m = _step(policy, tiny_tokenizer, _with_advantages(trajs, [1.0, -1.0, 1.0, -1.0]))
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["mismatch_kl"] < 1e-8
    assert m["num_tokens"] > 0


def test_prefix_store_keeps_the_most_recent_entries_and_matches_the_longest():
    from selfrl.engines.kvcache import PrefixStore

    store = PrefixStore(entries=2, min_len=3)
    kv = ([torch.zeros(1)], [torch.ones(1)])
    store.add([1, 2, 3, 4], *kv)
    store.add([1, 2, 3, 4, 5, 6], *kv)
    assert len(store) == 2 and store
    assert store.match([1, 2, 3, 4, 5, 6, 7]) == (0, 6)  # the longest stored prefix
    assert store.match([1, 2, 3, 4, 5, 6]) == (0, 5)  # at most len - 1: the last id is prefilled
    assert store.match([1, 2, 9]) == (-1, 0)  # 2 shared ids are fewer than min_len
    assert store.use(1) == kv and store.items[0][0] == (1, 2, 3, 4)  # used: now the most recent
    store.add([7, 8, 9, 10], *kv)  # a third entry drops the least recently used ([1..6])
    assert [e[0] for e in store.items] == [(7, 8, 9, 10), (1, 2, 3, 4)]
    store.clear()
    assert not store and store.match([7, 8, 9, 10, 11]) == (-1, 0)


def test_a_prompt_repeated_in_one_admission_is_encoded_once(tiny_tokenizer, tiny_model_factory):
    # a GRPO batch: each task's prompt num_generations times; only the first of each is prefilled,
    # the others copy its keys, values and logits, and every row still samples the model exactly
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller", draft_ids=0)  # (1-id passes: counted below)
    a, b = prompts_with_system(tiny_tokenizer, ["What is 17+25?", "Add 1, 2, 3 and 4, then say the total."])
    prompts = [a, b, a, a, b, a]
    encoded = []
    hook = engine.sampling_model.register_forward_pre_hook(
        lambda mod, args, kw: encoded.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    torch.manual_seed(3)
    gens = engine.generate(prompts, 6, temperature=1.0)
    hook.remove()
    common = len(os.path.commonprefix([a, b]))
    # one pass for the shared system prompt, then one prefill of the 2 distinct prompts' own tokens
    # (left-padded to the longer), then 1-token decoding steps
    assert encoded[:2] == [(1, common), (2, max(len(a), len(b)) - common)]
    assert all(s[1] == 1 for s in encoded[2:])
    assert_matches_model(gens, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 6)
    assert len({tuple(g.token_ids) for g, p in zip(gens, prompts) if p == a}) > 1  # each row its own draws
    engine.close()


def test_repeated_prompts_sample_what_unshared_rows_sample(tiny_tokenizer, tiny_model_factory):
    # the copy is exact: rows with their own seeds draw the same tokens as with nothing shared
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    prompts = prompts_with_system(tiny_tokenizer, ["Hi", "Go"]) * 3
    out = []
    for share in (True, False):
        engine = SlotEngine(model, tiny_tokenizer, share_prefix=share, driver="caller")
        futures = [engine.submit(p, 6, temperature=1.0, seed=100 + i) for i, p in enumerate(prompts)]
        out.append([f.result(timeout=60) for f in futures])  # the caller's wait steps all six together
        engine.close()
    for x, y in zip(*out):
        assert x.token_ids == y.token_ids
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_continuation_store_matches_the_longest_stored_prefix_within_its_bytes():
    from selfrl.engines.kvcache import ContinuationStore, Kept

    def kv(n):  # one layer, 1 kv head, n positions of size 2: 4 * 2 * n bytes per tensor
        return Kept([torch.full((1, n, 2), float(n))], [torch.full((1, n, 2), -float(n))], n)

    store = ContinuationStore(max_bytes=2 * 8 * 40, min_len=3)  # room for 40 positions
    a = list(range(10, 30))  # 20 tokens
    store.add(a, kv(20))
    store.add(a[:12], kv(12))
    assert store.nbytes == 2 * 8 * 32 and len(store) == 2
    keys, values, n, start, lent = store.match(a + [7, 8])
    assert n == 20 and keys[0][0, 0, 0] == 20.0 and values[0][0, 0, 0] == -20.0 and (start, lent) == (0, None)
    assert store.match(a).length == 12  # an entry must leave the prompt a token of its own
    assert store.match(a[:12] + [99]).length == 12 and store.match([1, 2, 3, 4]) is None
    store.add(list(range(50, 60)), kv(10))  # 42 positions: the least recently used (a, 20) goes
    assert store.match(a + [7]).length == 12 and store.nbytes == 2 * 8 * 22
    store.add([1, 2], kv(2))  # under min_len: not kept
    store.add(list(range(100)), kv(100))  # larger than the whole store: not kept
    assert len(store) == 2 and store.lengths == {12: 1, 10: 1}
    store.clear()
    assert len(store) == 0 and store.nbytes == 0 and store.match(a + [7]) is None


def test_a_next_turn_prefills_only_what_was_appended_to_the_finished_row(tiny_tokenizer, tiny_model_factory):
    # a multi-turn rollout: the second turn's prompt is the first's, its sampled ids and a tool reply;
    # the finished row's keys and values (all but its last sampled id) are kept, so only that last id
    # and the reply are prefilled, and the second turn samples what an engine without the store samples
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    prompt = prompts_with_system(tiny_tokenizer, ["What is 17+25?"])[0]
    reply = tiny_tokenizer.encode("<tool_response>42</tool_response>", add_special_tokens=False)
    out = {}
    for kept in (2**30, 0):
        engine = SlotEngine(model, tiny_tokenizer, driver="caller", continuation_bytes=kept)
        encoded = []  # (a hook added later would count as a change of the model: everything kept forgotten)
        hook = engine.sampling_model.register_forward_pre_hook(
            lambda mod, args, kw: encoded.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
        first = engine.submit(prompt, 6, temperature=1.0, seed=5).result(timeout=60)
        second_prompt = prompt + first.token_ids + reply
        encoded.clear()
        second = engine.submit(second_prompt, 6, temperature=1.0, seed=6).result(timeout=60)
        hook.remove()
        out[kept] = (first, second, encoded[0], engine._continuations.hits)
        engine.close()
    (first, second, prefill, hits), (first0, second0, prefill0, hits0) = out[2**30], out[0]
    assert first.token_ids == first0.token_ids and second.token_ids == second0.token_ids
    torch.testing.assert_close(torch.tensor(second.logprobs), torch.tensor(second0.logprobs), atol=1e-5, rtol=0)
    assert prefill == (1, 1 + len(reply)) and hits == 1  # the last sampled id and the reply
    assert prefill0[1] > 1 + len(reply) and hits0 == 0  # without the store: from the stored system prompt on
    second_prompt = prompt + first.token_ids + reply
    assert_matches_model([second], [second_prompt], model, 1.0, tiny_tokenizer.eos_token_id, 6)


def test_kept_rows_are_forgotten_when_the_weights_change(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    first = engine.submit(prompt, 5, temperature=1.0, seed=1).result(timeout=60)
    assert len(engine._continuations) == 1
    with torch.no_grad():  # an update in place, as the learner makes
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(0.5)
    second_prompt = prompt + first.token_ids + [5, 6, 7]
    g = engine.submit(second_prompt, 5, temperature=1.0, seed=2).result(timeout=60)
    assert engine._continuations.hits == 0  # the kept row was of the old weights
    assert_matches_model([g], [second_prompt], model, 1.0, tiny_tokenizer.eos_token_id, 5)
    with pytest.raises(ValueError, match="continuation_bytes"):
        SlotEngine(model, tiny_tokenizer, continuation_bytes=-1)
    engine.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("greedy", [True, False])
def test_non_finite_logits_are_an_error_not_a_token(bad, greedy):
    logits = torch.zeros(2, 6)
    logits[1] = bad  # NaN or +inf everywhere, or -inf everywhere: nothing to draw from
    if bad == float("inf"):
        logits[1, 0] = bad  # one +inf logit: log_softmax gives NaN
    with pytest.raises(ValueError, match="NaN"):
        sample_tokens(logits, torch.tensor([0.7, 0.7]), torch.tensor([greedy, greedy]), torch.ones(2))
    ids, logps = sample_tokens(logits[:1], torch.tensor([0.7]), torch.tensor([greedy]), torch.ones(1))
    assert torch.isfinite(logps).all()  # the finite row alone is fine


def test_a_diverged_adapter_fails_the_request_instead_of_sampling_garbage(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(float("nan"))
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    for greedy in (False, True):
        with pytest.raises(ValueError, match="NaN"):
            engine.generate([prompt], 4, temperature=1.0, greedy=greedy)
    engine.close()


@pytest.mark.parametrize("merge_lora", [True, False])
def test_a_row_that_spans_a_weight_change_is_not_kept_for_its_next_turn(tiny_tokenizer, tiny_model_factory,
                                                                         merge_lora):
    # the LoRA moves in place while a row decodes (a learner on the shared model) and another request
    # joins (the engine sees the change and forgets what it kept); the row's keys and values mix both
    # versions, so its next turn must be prefilled again, and samples what the model now gives
    model = tiny_model_factory(lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="thread", merge_lora=merge_lora)
    prompt = prompts_with_system(tiny_tokenizer, ["What is 17+25?"])[0]
    other = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    joined = {}

    def on_tokens(ids):  # in the worker, between two steps
        if len(ids) == 3 and "r" not in joined:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.add_(0.5 * torch.randn_like(p))
            joined["r"] = engine.submit(other, 1, greedy=True)

    first = engine.submit(prompt, 10, greedy=True, on_tokens=on_tokens).result(timeout=60)
    joined["r"].result(timeout=60)
    assert len(first.token_ids) == 10  # (no EOS bias: the row ran past the change)
    second_prompt = prompt + first.token_ids + [5, 6, 7]
    second = engine.generate([second_prompt], 6, greedy=True)[0]
    assert engine._continuations.hits == 0
    assert_matches_model([second], [second_prompt], model, 1.0, tiny_tokenizer.eos_token_id, 6)
    engine.close()


@pytest.mark.parametrize("when", ["mid-row", "between turns"])
def test_a_frozen_base_weight_changed_in_place_is_seen_before_a_kept_row_is_used(tiny_tokenizer, tiny_model_factory,
                                                                                 when):
    # the fast look (every step, every finished row) reads every parameter's version counter, frozen
    # ones too: a next turn that joins a busy batch never loads keys and values of the old weights
    model = tiny_model_factory(lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="thread")
    norm = model.get_base_model().model.layers[0].input_layernorm.weight  # frozen, feeds the keys and values
    prompt = prompts_with_system(tiny_tokenizer, ["What is 17+25?"])[0]
    busy = prompts_with_system(tiny_tokenizer, ["Count to a thousand."])[0]

    def on_tokens(ids):
        if when == "mid-row" and len(ids) == 3:
            with torch.no_grad():
                norm.mul_(1.7)

    first = engine.submit(prompt, 8, greedy=True, on_tokens=on_tokens).result(timeout=60)
    running = engine.submit(busy, 60, greedy=True)  # keeps the engine busy: the next admission's look is fast
    if when == "between turns":
        with torch.no_grad():
            norm.mul_(1.7)
    second_prompt = prompt + first.token_ids + [5, 6, 7]
    second = engine.submit(second_prompt, 6, greedy=True).result(timeout=60)
    running.result(timeout=60)
    assert engine._continuations.hits == 0
    assert_matches_model([second], [second_prompt], model, 1.0, tiny_tokenizer.eos_token_id, 6)
    engine.close()


def test_a_row_whose_logits_break_fails_alone(tiny_tokenizer, tiny_model_factory, monkeypatch):
    import selfrl.engines.slotdecode as slots_module

    real = slots_module.next_token_logps

    def breaking(logits, temperature, greedy, allowed=None):  # the row sampled at 0.123 gets NaN logits
        out = real(logits, temperature, greedy, allowed)
        out[temperature == 0.123] = float("nan")
        return out

    monkeypatch.setattr(slots_module, "next_token_logps", breaking)
    model = tiny_model_factory(eos_bias=-5.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    prompt = prompts_with_system(tiny_tokenizer, ["Hi"])[0]
    good = engine.submit(prompt, 12, temperature=1.0, seed=1)
    bad = engine.submit(prompt, 12, temperature=0.123, seed=2)
    with pytest.raises(ValueError, match="NaN"):
        bad.result(timeout=60)
    g = good.result(timeout=60)
    assert len(g.token_ids) == 12 and all(math.isfinite(x) for x in g.logprobs)
    engine.close()


def test_a_temperature_too_small_for_fp32_is_refused_before_it_joins_a_batch(tiny_tokenizer, tiny_model_factory):
    from selfrl.config import ConfigError, load_config

    engine = SlotEngine(tiny_model_factory(lora=True), tiny_tokenizer, driver="caller")
    for t in (1e-300, 1e-40, 5e-5):
        with pytest.raises(ValueError, match="temperature must be >= 0.0001"):
            engine.submit([1, 2, 3], 4, temperature=t)
    assert engine.generate([[1, 2, 3]], 2, temperature=1e-4)[0].token_ids  # the smallest allowed
    engine.close()
    with pytest.raises(ConfigError, match="temperature must be >= 0.0001"):
        load_config(None, {"rollout.temperature": 1e-5})


def test_a_longer_common_prefix_is_encoded_from_the_stored_one(tiny_tokenizer, tiny_model_factory):
    # rows admitted together share more than the stored prefix (the system prompt): the longer common
    # prefix is stored too, encoded from the stored one on (its own tokens only), never from scratch
    model = tiny_model_factory(eos_bias=1.0, lora=True)
    engine = SlotEngine(model, tiny_tokenizer, driver="caller")
    a, b = prompts_with_system(tiny_tokenizer, ["What is 17+25?", "Add 1, 2, 3 and 4, then say the total."])
    shapes = []  # (a hook changes the weights' structure, which drops stored prefixes: added first)
    hook = engine.sampling_model.register_forward_pre_hook(
        lambda mod, args, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True)
    torch.manual_seed(0)
    engine.generate([a, b], 3, temperature=1.0)
    stored = engine._prefixes.match(a)[1]  # the system prompt's part
    shared = tiny_tokenizer(" Now think step by step and check every sum twice.", add_special_tokens=False)["input_ids"]
    second = [a + shared + [5], a + shared + [6, 7]]
    hint = len(a) + len(shared)
    assert hint - stored >= 16
    shapes.clear()
    gens = engine.generate(second, 3, temperature=1.0)
    hook.remove()
    assert shapes[0] == (1, hint - stored)  # the common prefix past the stored one
    assert shapes[1] == (2, 2)  # then each row's own tokens (left-padded)
    assert engine._prefixes.match(second[0])[1] == hint
    assert_matches_model(gens, second, model, 1.0, tiny_tokenizer.eos_token_id, 3)
    engine.close()
