import pytest
import torch
from peft import get_peft_model_state_dict

from selfrl.engines.reference import Engine, Generation, eos_ids
from selfrl.rl.logprobs import per_token_logps
from tests.engine_backends import chat_prompts, naive_logps

def batched_logps(model, rows: list[tuple[list[int], list[int]]], temperature: float) -> list[torch.Tensor]:
    """``per_token_logps`` over right-padded (prompt, completion) rows; one (n_i,) tensor per row."""
    width = max(len(p) + len(c) for p, c in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # (B, T)
    attention = torch.zeros_like(input_ids)  # (B, T)
    completion = torch.zeros_like(input_ids)  # (B, T)
    for i, (p, c) in enumerate(rows):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        attention[i, :len(p) + len(c)] = 1
        completion[i, len(p):len(p) + len(c)] = 1
    with torch.no_grad():
        out = per_token_logps(model, input_ids, attention, completion, temperature, chunk_size=7)  # (B, T)
    return [out[i, len(p):len(p) + len(c)] for i, (p, c) in enumerate(rows)]


def assert_well_formed(gens: list[Generation], eos: int, max_new_tokens: int) -> None:
    for g in gens:
        assert len(g.token_ids) == len(g.logprobs) <= max_new_tokens
        assert all(lp <= 0.0 for lp in g.logprobs)
        if g.finished:
            assert g.token_ids[-1] == eos and eos not in g.token_ids[:-1]
        else:
            assert eos not in g.token_ids and len(g.token_ids) == max_new_tokens


# ------------------------------------------------------------------ per_token_logps


def test_per_token_logps_matches_naive_full_logits(tiny_peft_model):
    torch.manual_seed(0)
    rows = [
        (torch.randint(0, 500, (5,)).tolist(), torch.randint(0, 500, (9,)).tolist()),
        (torch.randint(0, 500, (11,)).tolist(), torch.randint(0, 500, (2,)).tolist()),
        (torch.randint(0, 500, (1,)).tolist(), torch.randint(0, 500, (14,)).tolist()),
    ]
    for temperature in (0.7, 1.0):
        got = batched_logps(tiny_peft_model, rows, temperature)
        for (p, c), g in zip(rows, got):
            torch.testing.assert_close(g, naive_logps(tiny_peft_model, p, c, temperature), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ generate


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_sampled_logprobs_equal_recomputed_logprobs(tiny_tokenizer, tiny_model_factory, temperature):
    # the EOS bias makes some rows end early while others go on: EOS logprobs are
    # checked, and so are rows that keep sampling beside finished (pad = EOS) rows.
    model = tiny_model_factory(eos_bias=3.0, lora=True)
    engine = Engine(model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer) * 2  # (6,) lengths differ: left padding in play
    torch.manual_seed(1)
    gens = engine.generate(prompts, max_new_tokens=12, temperature=temperature)
    assert_well_formed(gens, tiny_tokenizer.eos_token_id, 12)
    assert any(g.finished for g in gens) and any(len(g.token_ids) > 3 for g in gens)
    rows = [(p, g.token_ids) for p, g in zip(prompts, gens)]
    batched = batched_logps(model, rows, temperature)
    for (p, c), g, b in zip(rows, gens, batched):
        sampled = torch.tensor(g.logprobs)
        torch.testing.assert_close(sampled, naive_logps(model, p, c, temperature), atol=1e-4, rtol=0)
        torch.testing.assert_close(sampled, b, atol=1e-4, rtol=0)


def test_eos_is_kept_although_pad_is_eos(tiny_tokenizer, tiny_model_factory):
    eos = tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.pad_token_id == eos
    # EOS almost surely first: the whole turn is that one EOS, with logprob ~ 0
    engine = Engine(tiny_model_factory(eos_bias=50.0, lora=True), tiny_tokenizer)
    gens = engine.generate(chat_prompts(tiny_tokenizer), max_new_tokens=8, temperature=1.0)
    for g in gens:
        assert g.token_ids == [eos] and g.finished
        assert g.logprobs[0] == pytest.approx(0.0, abs=1e-4)
    # EOS likely somewhere: finished rows stop right after their first EOS, others run to the limit
    engine = Engine(tiny_model_factory(eos_bias=4.0, lora=True), tiny_tokenizer)
    torch.manual_seed(0)
    gens = engine.generate(chat_prompts(tiny_tokenizer) * 5, max_new_tokens=6, temperature=1.0)
    assert_well_formed(gens, eos, 6)
    assert {g.finished for g in gens} == {True, False}
    assert len({len(g.token_ids) for g in gens if g.finished}) > 1


def test_greedy_is_deterministic_and_argmax(tiny_tokenizer, tiny_peft_model):
    engine = Engine(tiny_peft_model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer)
    torch.manual_seed(0)
    a = engine.generate(prompts, max_new_tokens=10, greedy=True)
    torch.manual_seed(123)
    b = engine.generate(prompts, max_new_tokens=10, greedy=True)
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.logprobs for g in a] == [g.logprobs for g in b]
    for p, g in zip(prompts, a):
        ids = torch.tensor([p + g.token_ids])
        with torch.no_grad():
            logits = tiny_peft_model(input_ids=ids).logits[0, len(p) - 1:-1]  # (n, V)
        assert logits.argmax(-1).tolist() == g.token_ids
        # greedy records the temperature-1 logprob
        torch.testing.assert_close(torch.tensor(g.logprobs), naive_logps(tiny_peft_model, p, g.token_ids, 1.0), atol=1e-4, rtol=0)


def test_generate_rejects_bad_arguments(tiny_tokenizer, tiny_model):
    engine = Engine(tiny_model, tiny_tokenizer)
    with pytest.raises(ValueError):
        engine.generate([], 4)
    with pytest.raises(ValueError):
        engine.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([[1, 2]], 4, temperature=0.0)


def test_eos_ids_merge_tokenizer_and_generation_config(tiny_tokenizer, tiny_model):
    endoftext = tiny_tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tiny_model.generation_config.eos_token_id = [endoftext, tiny_tokenizer.eos_token_id]
    assert eos_ids(tiny_model, tiny_tokenizer) == sorted({endoftext, tiny_tokenizer.eos_token_id})


# ------------------------------------------------------------------ swap


def lora_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def all_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def logits_of(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).logits[0]  # (P, V)


def test_swap_changes_logits_and_version_and_back_exactly(tiny_tokenizer, tiny_peft_model):
    engine = Engine(tiny_peft_model, tiny_tokenizer, version=0)
    prompt = chat_prompts(tiny_tokenizer)[1]
    v0 = lora_state(tiny_peft_model)
    before = logits_of(tiny_peft_model, prompt)
    torch.manual_seed(7)
    v1 = {k: torch.randn_like(t) * 0.3 for k, t in v0.items()}

    seconds = engine.swap(v1, version=1)
    assert seconds >= 0.0 and engine.version == 1
    after = logits_of(tiny_peft_model, prompt)
    assert (after - before).abs().max() > 1e-3
    for k, t in get_peft_model_state_dict(tiny_peft_model).items():
        assert torch.equal(t, v1[k])
    assert all(g.adapter_version == 1 for g in engine.generate([prompt] * 2, max_new_tokens=3))

    engine.swap(v0, version=0)
    assert engine.version == 0
    assert torch.equal(logits_of(tiny_peft_model, prompt), before)
    assert engine.generate([prompt], max_new_tokens=3, greedy=True)[0].adapter_version == 0


def _renamed(sd):
    k = next(iter(sd))
    out = dict(sd)
    out[k.replace("lora_A", "lora_Z")] = out.pop(k)
    return out


def _missing(sd):
    return dict(list(sd.items())[1:])


def _extra(sd):
    return {**sd, "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32)}


def _reshaped(sd):
    k = next(iter(sd))
    return {**sd, k: torch.zeros(sd[k].shape[0] + 1, sd[k].shape[1])}


@pytest.mark.parametrize("corrupt", [_renamed, _missing, _extra, _reshaped])
def test_swap_rejects_a_mismatched_state_dict_and_changes_nothing(tiny_tokenizer, tiny_peft_model, corrupt):
    engine = Engine(tiny_peft_model, tiny_tokenizer, version=3)
    before = all_weights(tiny_peft_model)
    # every tensor that does match carries new values: a partial copy would show
    new = {k: torch.full_like(t, 0.5) for k, t in lora_state(tiny_peft_model).items()}
    with pytest.raises(ValueError, match="version 4"):
        engine.swap(corrupt(new), version=4)
    assert engine.version == 3
    after = all_weights(tiny_peft_model)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_on_step_streams_the_sampled_ids_and_changes_nothing(tiny_tokenizer, tiny_model_factory):
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    engine = Engine(model, tiny_tokenizer)
    prompts = chat_prompts(tiny_tokenizer)
    torch.manual_seed(3)
    plain = engine.generate(prompts, 12, temperature=0.9)
    seen = []
    torch.manual_seed(3)
    streamed = engine.generate(prompts, 12, temperature=0.9, on_step=lambda ids: seen.append(ids.clone()))
    assert [g.token_ids for g in streamed] == [g.token_ids for g in plain]  # observing changes no sample
    assert seen and [s.shape[1] for s in seen] == list(range(1, len(seen) + 1))
    last = seen[-1]
    for i, g in enumerate(streamed):  # every id seen so far is a prefix of the final row
        k = min(last.shape[1], len(g.token_ids))
        assert last[i, :k].tolist() == g.token_ids[:k]


def test_top_p_restricts_sampling_to_the_nucleus(tiny_tokenizer, tiny_peft_model):
    engine = Engine(tiny_peft_model, tiny_tokenizer)
    prompt = chat_prompts(tiny_tokenizer)[:1] * 8
    greedy = engine.generate(prompt[:1], 1, greedy=True)[0].token_ids
    torch.manual_seed(0)
    tiny = engine.generate(prompt, 1, temperature=1.0, top_p=1e-6)  # nucleus = the top token only
    assert all(g.token_ids == greedy for g in tiny)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(prompt, 1, top_p=0.0)


def test_swap_copies_straight_into_the_lora_parameters(tiny_tokenizer, tiny_peft_model):
    engine = Engine(tiny_peft_model, tiny_tokenizer)
    params = engine.lora_parameters()
    assert params.keys() == get_peft_model_state_dict(tiny_peft_model).keys()  # the fast path applies
    new = {k: torch.randn_like(v) for k, v in get_peft_model_state_dict(tiny_peft_model).items()}
    engine.swap(new, 5)
    after = get_peft_model_state_dict(tiny_peft_model)
    assert all(torch.equal(after[k], new[k]) for k in new) and engine.version == 5
    new[next(iter(new))] = new[next(iter(new))] + 1  # the engine keeps no reference to the caller's tensors
    assert not torch.equal(get_peft_model_state_dict(tiny_peft_model)[next(iter(new))], new[next(iter(new))])


def test_stop_cuts_after_the_token_that_completes_the_stop_string(tiny_tokenizer, tiny_model_factory):
    engine = Engine(tiny_model_factory(lora=True, eos_bias=-5.0), tiny_tokenizer)
    prompt = chat_prompts(tiny_tokenizer)[:1]
    full = engine.generate(prompt, 16, greedy=True)[0]
    text = tiny_tokenizer.decode(full.token_ids)
    stop = text[5:8]
    k = next(k for k in range(1, 17) if stop in tiny_tokenizer.decode(full.token_ids[:k]))
    cut = engine.generate(prompt, 16, greedy=True, stop=[stop])[0]
    assert cut.stopped and cut.finished and cut.token_ids == full.token_ids[:k] and cut.logprobs == full.logprobs[:k]
    none = engine.generate(prompt, 16, greedy=True, stop=["\x00never"])[0]
    assert not none.stopped and none.token_ids == full.token_ids
