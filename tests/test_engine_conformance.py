"""The contract of :class:`selfrl.engines.base.SamplingEngine`, run on every backend
listed in ``tests/engine_backends.py``.

Each test builds a tiny LoRA model, gives the backend its own deep copy, and
checks what the backend returns against the other copy: sampled logprobs against
a naive full-logits recomputation (within 1e-5 in fp32), greedy ids against the
argmax, stop strings and limits, and swaps (by state dict and by saved folder)
against the same adapter applied locally.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from selfrl.record import adapters
from selfrl.engines.base import EngineHealth, Generation, SamplingEngine
from tests.engine_backends import BACKENDS, UNAVAILABLE, chat_prompts, naive_logps

ATOL = 1e-5  # fp32: sampled logprobs equal the recomputed ones to this, plus RTOL of their size
# fp32 rounding grows with the logits: over 8 tiny models with random adapters (x 2 engines x 8 prompts)
# the largest gap was 1.34e-5 through MKL and 1.10e-5 through oneDNN (selfrl.model.matmul), never more than
# 1e-5 + 6.2e-7 |logprob|; a stale or wrong weight is 1e-2 to 3 nats off
RTOL = 2e-6

PARAMS = [pytest.param(name, id=name) for name in BACKENDS] + [
    pytest.param(name, id=name, marks=pytest.mark.skip(reason=why)) for name, why in UNAVAILABLE.items()
]


@pytest.fixture(params=PARAMS)
def backend(request):
    """``make(model, tokenizer, version=0)`` for one backend."""
    return BACKENDS.get(request.param)


def served(backend, model, tok, version: int = 0) -> SamplingEngine:
    """The backend over its own copy of ``model`` (so a test never sees shared weights move)."""
    return backend(copy.deepcopy(model), tok, version=version)


def assert_matches_model(gens: list[Generation], prompts, model, temperature: float, eos: int, limit: int) -> None:
    """Every generation is well formed and its logprobs are ``model``'s within ATOL + RTOL |logprob|."""
    for p, g in zip(prompts, gens, strict=True):
        assert len(g.token_ids) == len(g.logprobs) <= limit
        if g.finished and not g.stopped:
            assert g.token_ids[-1] == eos and eos not in g.token_ids[:-1] and g.finish_reason == "stop"
        elif not g.finished:
            assert eos not in g.token_ids and len(g.token_ids) == limit and g.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(g.logprobs), naive_logps(model, p, g.token_ids, temperature),
                                   atol=ATOL, rtol=RTOL)


def test_backend_satisfies_the_protocol(backend, tiny_tokenizer, tiny_model_factory):
    engine = served(backend, tiny_model_factory(lora=True), tiny_tokenizer, version=4)
    assert isinstance(engine, SamplingEngine)
    assert engine.version == 4 and engine.eos_token_ids == [tiny_tokenizer.eos_token_id]
    h = engine.health()
    assert isinstance(h, EngineHealth) and h.ok and h.version == 4 and h.backend


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_equal_recomputed(backend, tiny_tokenizer, tiny_model_factory, temperature):
    # the EOS bias ends some rows early while others sample on; lengths differ (padding in play)
    model = tiny_model_factory(eos_bias=3.0, lora=True)
    engine = served(backend, model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer) * 3  # (9,)
    torch.manual_seed(1)
    for _ in range(5):  # a remote backend samples unseeded: draw again until rows both end and run on
        gens = engine.generate(prompts, max_new_tokens=12, temperature=temperature)
        if any(g.finished for g in gens) and any(not g.finished for g in gens):
            break
    assert len(gens) == 9 and all(g.adapter_version == 0 for g in gens)
    assert any(g.finished for g in gens) and any(not g.finished for g in gens)
    assert_matches_model(gens, prompts, model, temperature, tiny_tokenizer.eos_token_id, 12)
    assert len({tuple(g.token_ids) for g in gens}) > 3  # it samples: not one continuation repeated


def test_one_prompt_and_unrelated_prompts(backend, tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(eos_bias=2.0, lora=True)
    engine = served(backend, model, tiny_tokenizer)
    torch.manual_seed(2)
    prompts = [torch.randint(0, 500, (n,)).tolist() for n in (1, 7, 30)]  # no shared prefix
    for batch in (prompts[:1], prompts):
        gens = engine.generate(batch, max_new_tokens=9, temperature=0.9)
        assert_matches_model(gens, batch, model, 0.9, tiny_tokenizer.eos_token_id, 9)


def test_greedy_is_argmax_and_deterministic(backend, tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True)
    engine = served(backend, model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer)
    torch.manual_seed(0)
    a = engine.generate(prompts, max_new_tokens=10, greedy=True)
    torch.manual_seed(123)
    b = engine.generate(prompts[::-1], max_new_tokens=10, greedy=True)[::-1]  # order and batch mates change nothing
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    for p, g in zip(prompts, a):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + g.token_ids])).logits[0, len(p) - 1:-1]  # (n, V)
        assert logits.argmax(-1).tolist() == g.token_ids
    assert_matches_model(a, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 10)  # temperature-1 logprobs


def test_finish_reasons(backend, tiny_tokenizer, tiny_model_factory):
    eos = tiny_tokenizer.eos_token_id
    gens = served(backend, tiny_model_factory(eos_bias=50.0, lora=True), tiny_tokenizer).generate(
        chat_prompts(tiny_tokenizer), max_new_tokens=8, temperature=1.0)
    assert all(g.token_ids == [eos] and g.finished and g.finish_reason == "stop" for g in gens)
    gens = served(backend, tiny_model_factory(eos_bias=-50.0, lora=True), tiny_tokenizer).generate(
        chat_prompts(tiny_tokenizer), max_new_tokens=5, temperature=1.0)
    assert all(len(g.token_ids) == 5 and not g.finished and g.finish_reason == "length" for g in gens)


def test_stop_string_cuts_after_the_completing_token(backend, tiny_tokenizer, tiny_model_factory):
    engine = served(backend, tiny_model_factory(lora=True, eos_bias=-5.0), tiny_tokenizer)
    prompt = chat_prompts(tiny_tokenizer)[:1]
    full = engine.generate(prompt, 16, greedy=True)[0]
    stop = tiny_tokenizer.decode(full.token_ids)[5:8]
    k = next(k for k in range(1, 17) if stop in tiny_tokenizer.decode(full.token_ids[:k]))
    cut = engine.generate(prompt, 16, greedy=True, stop=[stop])[0]
    assert cut.stopped and cut.finished and cut.finish_reason == "stop"
    assert cut.token_ids == full.token_ids[:k]
    torch.testing.assert_close(torch.tensor(cut.logprobs), torch.tensor(full.logprobs[:k]), atol=ATOL, rtol=0)
    none = engine.generate(prompt, 16, greedy=True, stop=["\x00never"])[0]
    assert not none.stopped and none.token_ids == full.token_ids


def test_top_p_tiny_samples_the_top_token(backend, tiny_tokenizer, tiny_model_factory):
    engine = served(backend, tiny_model_factory(lora=True), tiny_tokenizer)
    prompt = chat_prompts(tiny_tokenizer)[:1] * 6
    top = engine.generate(prompt[:1], 1, greedy=True)[0].token_ids
    torch.manual_seed(0)
    assert all(g.token_ids == top for g in engine.generate(prompt, 1, temperature=1.0, top_p=1e-6))


def _random_state(model, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: torch.randn_like(v) * 0.3 for k, v in get_peft_model_state_dict(model).items()}


def test_swap_by_state_dict_and_by_folder(backend, tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=1.0)
    engine = served(backend, model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer)
    v0 = {k: v.clone() for k, v in get_peft_model_state_dict(model).items()}
    before = engine.generate(prompts, 8, greedy=True)

    v1 = _random_state(model, 7)
    seconds = engine.swap(v1, 1)
    assert seconds >= 0.0 and engine.version == 1 and engine.health().version == 1
    set_peft_model_state_dict(model, v1)
    torch.manual_seed(3)
    gens = engine.generate(prompts, 8, temperature=0.8)
    assert all(g.adapter_version == 1 for g in gens)
    assert_matches_model(gens, prompts, model, 0.8, tiny_tokenizer.eos_token_id, 8)  # the new weights sampled

    v2 = _random_state(model, 8)
    set_peft_model_state_dict(model, v2)
    folder = adapters.save_version(model, tmp_path, 2)
    engine.swap(folder, 2)
    assert engine.version == 2
    greedy = engine.generate(prompts, 8, greedy=True)
    assert all(g.adapter_version == 2 for g in greedy)
    assert_matches_model(greedy, prompts, model, 1.0, tiny_tokenizer.eos_token_id, 8)

    engine.swap(v0, 0)
    back = engine.generate(prompts, 8, greedy=True)
    assert engine.version == 0 and [g.token_ids for g in back] == [g.token_ids for g in before]


def test_swap_of_a_mismatched_adapter_changes_nothing(backend, tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True)
    engine = served(backend, model, tiny_tokenizer, version=3)
    prompts = chat_prompts(tiny_tokenizer)
    before = engine.generate(prompts, 6, greedy=True)
    bad = _random_state(model, 9)
    bad.pop(next(iter(bad)))  # one tensor missing: the rest must not be copied either
    with pytest.raises(ValueError, match="version 4"):
        engine.swap(bad, 4)
    after = engine.generate(prompts, 6, greedy=True)
    assert engine.version == 3 and all(g.adapter_version == 3 for g in after)
    assert [g.token_ids for g in after] == [g.token_ids for g in before]
    for a, b in zip(after, before):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)


def test_bad_arguments_are_refused(backend, tiny_tokenizer, tiny_model_factory):
    engine = served(backend, tiny_model_factory(lora=True), tiny_tokenizer)
    for kwargs, match in [(dict(prompts=[]), "prompt"), (dict(prompts=[[1, 2], []]), "prompt"),
                          (dict(temperature=0.0), "temperature"), (dict(top_p=0.0), "top_p"),
                          (dict(top_p=1.5), "top_p"), (dict(max_new_tokens=0), "max_new_tokens")]:
        args = {"prompts": [[1, 2]], "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=match):
            engine.generate(**args)


def test_concurrent_callers_each_get_their_own_rows(backend, tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True, eos_bias=1.0)
    engine = served(backend, model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer)
    alone = [engine.generate([p], 10, greedy=True)[0].token_ids for p in prompts]
    out: dict[int, list[int]] = {}

    def call(i: int) -> None:
        out[i] = engine.generate([prompts[i]], 10, greedy=True)[0].token_ids

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [out[i] for i in range(len(prompts))] == alone


def test_on_step_streams_prefixes_of_the_result(backend, tiny_tokenizer, tiny_model_factory):
    engine = served(backend, tiny_model_factory(lora=True), tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer)
    seen: list[torch.Tensor] = []
    gens = engine.generate(prompts, 12, greedy=True, on_step=lambda ids: seen.append(ids.clone()))
    plain = engine.generate(prompts, 12, greedy=True)
    assert [g.token_ids for g in gens] == [g.token_ids for g in plain]  # observing changes nothing
    assert seen and seen[-1].shape[0] == len(prompts)
    for ids in seen:
        for i, g in enumerate(gens):
            k = min(ids.shape[1], len(g.token_ids))
            assert ids[i, :k].tolist() == g.token_ids[:k]


# ------------------------------------------------------------------ what the server asks of a backend
# Grammars, cancellation and top logprobs: each backend that declares or accepts them is
# checked against the reference engine (same weights) and against a naive recomputation.

def _needs(engine, what: str) -> None:
    import inspect

    if what in ("constraints", "cancel") and not getattr(engine, f"supports_{what}", False):
        pytest.skip(f"the {engine.name if hasattr(engine, 'name') else type(engine).__name__} backend has no {what}")
    if what not in inspect.signature(engine.generate).parameters:
        pytest.skip(f"{type(engine).__name__}.generate takes no {what}")


def _grammar_replay(model, tok, prompt, g, constraint, temperature: float) -> tuple[torch.Tensor, list[bool]]:
    """(n,) the masked distribution's logprob of each id of ``g``, replaying ``constraint`` on
    one unpadded row's full logits, and per id whether the mask removed any id."""
    import llguidance

    from selfrl.chat.constrain import grammar_tokenizer, unpack_mask

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + g.token_ids])).logits[0, len(prompt) - 1:-1].float()  # (n, V)
    V = logits.shape[-1]
    m = llguidance.LLMatcher(grammar_tokenizer(tok, V, [tok.eos_token_id]), constraint.grammar)
    out, flags = [], []
    for k, t in enumerate(g.token_ids):
        allowed = unpack_mask(m.compute_bitmask(), V)  # (V,)
        out.append(torch.log_softmax(logits[k].masked_fill(~allowed, float("-inf")) / temperature, -1)[t])
        flags.append(bool((~allowed).any()))
        if t != tok.eos_token_id:
            assert m.consume_token(t), "a sampled id broke the grammar"
    return torch.stack(out), flags


def test_constrained_rows_equal_the_reference_and_record_the_masked_distribution(backend, tiny_tokenizer,
                                                                                  tiny_model_factory):
    from selfrl.chat.constrain import json_constraint, tool_call_constraint
    from selfrl.engines.reference import Engine
    from selfrl.chat.toolcall import parse_tool_calls

    model = tiny_model_factory(lora=True)
    engine = served(backend, model, tiny_tokenizer)
    _needs(engine, "constraints")
    add = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
           "required": ["a", "b"], "additionalProperties": False}
    call, answer = tool_call_constraint([("add", add)]), json_constraint({"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"]})
    prompts = chat_prompts(tiny_tokenizer)
    constraints = [call, answer, None]
    reference = Engine(copy.deepcopy(model), tiny_tokenizer)
    mine = engine.generate(prompts, 40, greedy=True, constraints=constraints)
    ref = reference.generate(prompts, 40, greedy=True, constraints=constraints)
    for a, b in zip(mine, ref, strict=True):  # greedy: the same ids, flags and masked logprobs
        assert a.token_ids == b.token_ids and a.constrained == b.constrained and a.finished == b.finished
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=ATOL, rtol=0)
    assert mine[2].constrained is None and all(mine[0].constrained)
    torch.manual_seed(5)  # sampled: the recorded logprobs are the masked distribution's, flags its restrictions
    gens = engine.generate(prompts[:2] * 2, 64, temperature=0.8, constraints=[call, answer] * 2)
    for p, g, c in zip(prompts[:2] * 2, gens, [call, answer] * 2):
        lps, flags = _grammar_replay(model, tiny_tokenizer, p, g, c, 0.8)
        torch.testing.assert_close(torch.tensor(g.logprobs), lps, atol=ATOL, rtol=0)
        assert g.constrained == flags and any(flags)
        if g.finished and c is call:
            rest, calls = parse_tool_calls(tiny_tokenizer.decode(g.token_ids, skip_special_tokens=True))
            assert rest.strip() == "" and [x.name for x in calls] == ["add"] and calls[0].error is None


def test_a_cancelled_row_stops_at_the_next_step_and_keeps_its_ids(backend, tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True, eos_bias=-30.0)  # no EOS: rows run to their limit unless cut
    engine = served(backend, model, tiny_tokenizer)
    _needs(engine, "cancel")
    prompts = chat_prompts(tiny_tokenizer)[:2]
    gone, stay = threading.Event(), threading.Event()

    def on_step(ids):  # (B, k)
        if ids.shape[1] >= 3:
            gone.set()

    torch.manual_seed(6)
    a, b = engine.generate(prompts, 40, temperature=1.0, on_step=on_step, cancel=[gone, stay])
    assert a.cancelled and not a.finished and 3 <= len(a.token_ids) <= 5  # cut within a step or two
    assert not b.cancelled and len(b.token_ids) == 40
    assert_matches_model([b], prompts[1:], model, 1.0, tiny_tokenizer.eos_token_id, 40)
    torch.testing.assert_close(torch.tensor(a.logprobs), naive_logps(model, prompts[0], a.token_ids, 1.0),
                               atol=ATOL, rtol=0)  # what it sampled before the cut stays exact
    both = threading.Event()
    both.set()
    gens = engine.generate(prompts, 40, temperature=1.0, cancel=[both, both])  # set before the start
    assert all(g.cancelled and not g.finished and len(g.token_ids) <= 1 for g in gens)
    assert engine.generate(prompts, 3, greedy=True)[0].token_ids  # the engine serves on


def test_top_logprobs_equal_the_reference(backend, tiny_tokenizer, tiny_model_factory):
    from selfrl.chat.constrain import tool_call_constraint
    from selfrl.engines.reference import Engine

    model = tiny_model_factory(lora=True, eos_bias=1.0)
    engine = served(backend, model, tiny_tokenizer)
    _needs(engine, "top_logprobs")
    prompts = chat_prompts(tiny_tokenizer)
    reference = Engine(copy.deepcopy(model), tiny_tokenizer)
    k = 5
    mine = engine.generate(prompts, 10, greedy=True, top_logprobs=k)
    ref = reference.generate(prompts, 10, greedy=True, top_logprobs=k)

    def same(a, b, k):
        assert a.token_ids == b.token_ids and len(a.top_logprobs) == len(a.token_ids)
        for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True):
            assert len(x) == k and [i for i, _ in x] == [i for i, _ in y]
            torch.testing.assert_close(torch.tensor([v for _, v in x]), torch.tensor([v for _, v in y]),
                                       atol=ATOL, rtol=0)

    for a, b in zip(mine, ref, strict=True):
        same(a, b, k)
        assert a.top_logprobs[0][0][0] == a.token_ids[0]  # greedy: the most likely id is the one taken
    torch.manual_seed(7)  # sampled: the k most likely ids of log_softmax(logits / T), from a full recomputation
    for p, g in zip(prompts, engine.generate(prompts, 8, temperature=0.7, top_logprobs=k)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + g.token_ids])).logits[0, len(p) - 1:-1].float()  # (n, V)
        top = torch.log_softmax(logits / 0.7, -1).topk(k, dim=-1)  # (n, k)
        assert [[i for i, _ in alts] for alts in g.top_logprobs] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in alts] for alts in g.top_logprobs]), top.values,
                                   atol=ATOL, rtol=0)
    if getattr(engine, "supports_constraints", False):  # constrained rows: the masked distribution's top ids
        c = [tool_call_constraint([("add", {"type": "object"})])] * 2
        for a, b in zip(engine.generate(prompts[:2], 12, greedy=True, top_logprobs=3, constraints=c),
                        reference.generate(prompts[:2], 12, greedy=True, top_logprobs=3, constraints=c)):
            same(a, b, 3)


def test_streamed_step_logprobs_are_the_recorded_ones(backend, tiny_tokenizer, tiny_model_factory):
    engine = served(backend, tiny_model_factory(lora=True, eos_bias=1.0), tiny_tokenizer)
    _needs(engine, "step_logprobs")
    prompts = chat_prompts(tiny_tokenizer)
    seen = []
    torch.manual_seed(8)
    gens = engine.generate(prompts, 8, temperature=0.9, top_logprobs=2, step_logprobs=True,
                           on_step=lambda ids, lps, top: seen.append((ids.clone(), lps.clone(), top)))
    assert seen
    for ids, lps, top in seen:
        for i, g in enumerate(gens):
            n = min(ids.shape[1], len(g.token_ids))
            assert ids[i, :n].tolist() == g.token_ids[:n]
            torch.testing.assert_close(lps[i, :n], torch.tensor(g.logprobs[:n]), atol=ATOL, rtol=0)
            assert top[0][i, :n, :2].tolist() == [[a for a, _ in alts] for alts in g.top_logprobs[:n]]
