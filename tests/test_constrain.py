"""Constrained decoding on the tiny random model: calls and JSON valid by construction,
the recorded logprobs are the masked (behaviour) distribution's, and the learner sees an
importance ratio of exactly 1 for an unchanged policy on constrained turns too."""

import json
import re

import llguidance
import pytest
import torch

from selfrl.chat.template import prompt_ids
from selfrl.chat.constrain import (
    ConstraintError,
    check_constraint,
    grammar_tokenizer,
    json_constraint,
    tool_call_constraint,
    unpack_mask,
)
from selfrl.engines.reference import Engine
from selfrl.serve.structured import request_constraint
from selfrl.chat.toolcall import parse_tool_calls
from selfrl.core.tools import Tool, validate_arguments
from selfrl.rl.learner import Learner, TrainConfig
from selfrl.core.trajectory import Trajectory

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                            "unit": {"type": "string", "enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"},
                                           "tag": {"enum": ["x", "y"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
TOOLS = [("add", ADD), ("get_weather", WEATHER)]


def _prompt(tok):
    return prompt_ids(tok, [{"role": "user", "content": "What is 17+25?"}])


def _tool(name, schema):
    return Tool(name, "", schema, lambda **_: "")


def test_required_tool_choice_gives_a_valid_call_in_every_row(tiny_tokenizer, tiny_model):
    engine = Engine(tiny_model, tiny_tokenizer)
    torch.manual_seed(0)
    gens = engine.generate([_prompt(tiny_tokenizer)] * 6, 96, constraints=[tool_call_constraint(TOOLS)] * 6)
    names = set()
    for g in gens:
        assert g.finished and g.token_ids[-1] in engine.eos_token_ids
        rest, calls = parse_tool_calls(tiny_tokenizer.decode(g.token_ids, skip_special_tokens=True))
        assert rest.strip() == "" and len(calls) == 1 and calls[0].error is None
        validate_arguments(_tool(calls[0].name, dict(TOOLS)[calls[0].name]), calls[0].arguments)
        names.add(calls[0].name)
        assert len(g.constrained) == len(g.token_ids) and all(g.constrained)  # every JSON step is restricted
    assert names <= {"add", "get_weather"}


def test_named_tool_choice_calls_only_that_function(tiny_tokenizer, tiny_model):
    engine = Engine(tiny_model, tiny_tokenizer)
    torch.manual_seed(1)
    gens = engine.generate([_prompt(tiny_tokenizer)] * 4, 96,
                           constraints=[tool_call_constraint(TOOLS, name="get_weather")] * 4)
    for g in gens:
        _, calls = parse_tool_calls(tiny_tokenizer.decode(g.token_ids, skip_special_tokens=True))
        assert [c.name for c in calls] == ["get_weather"]
        assert calls[0].arguments["city"] in ("Paris", "Oslo") and calls[0].arguments["unit"] in ("C", "F")


def test_json_schema_and_json_object_rows_beside_a_free_row(tiny_tokenizer, tiny_model):
    engine = Engine(tiny_model, tiny_tokenizer)
    torch.manual_seed(2)
    gens = engine.generate([_prompt(tiny_tokenizer)] * 3, 256,
                           constraints=[json_constraint(ANSWER), json_constraint(), None])
    assert gens[0].finished and gens[1].finished
    answer = json.loads(tiny_tokenizer.decode(gens[0].token_ids, skip_special_tokens=True))
    assert set(answer) == {"ok", "n", "tag"} and isinstance(answer["ok"], bool)
    assert isinstance(answer["n"], int) and answer["tag"] in ("x", "y")
    assert isinstance(json.loads(tiny_tokenizer.decode(gens[1].token_ids, skip_special_tokens=True)), dict)
    assert gens[2].constrained is None  # the free row is untouched


def test_recorded_logprobs_are_the_masked_distribution(tiny_tokenizer, tiny_model):
    """Replay the grammar on the sampled ids: each recorded logprob equals
    log_softmax(masked logits / T) from a fresh forward pass, and differs from the
    unmasked logprob wherever the mask removed mass."""
    engine, T = Engine(tiny_model, tiny_tokenizer), 0.8
    prompt, c = _prompt(tiny_tokenizer), tool_call_constraint(TOOLS)
    torch.manual_seed(3)
    g = engine.generate([prompt], 64, temperature=T, constraints=[c])[0]
    ids = torch.tensor([prompt + g.token_ids])
    with torch.no_grad():
        logits = tiny_model(ids).logits[0, len(prompt) - 1:-1].float() / T  # (N, V)
    V = logits.shape[-1]
    m = llguidance.LLMatcher(grammar_tokenizer(tiny_tokenizer, V, engine.eos_token_ids), c.grammar)
    masked, full = [], torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None]).squeeze(-1)
    for k, t in enumerate(g.token_ids):
        allowed = unpack_mask(m.compute_bitmask(), V)
        masked.append(torch.log_softmax(logits[k].masked_fill(~allowed, float("-inf")), -1)[t])
        m.consume_token(t)
    assert torch.allclose(torch.tensor(g.logprobs), torch.stack(masked), atol=1e-4)
    assert (torch.tensor(g.logprobs) - full).min() > 1e-3  # the masked distribution put more mass on each id


def _served(g, prompt, advantage):
    """A trajectory as ``selfrl serve`` records it (constrained ids out of the loss)."""
    trained = [0 if c else 1 for c in g.constrained] if g.constrained is not None else [1] * len(g.token_ids)
    t = Trajectory(task_id="t", group_id="t", adapter_version=0, prompt_len=len(prompt),
                   token_ids=prompt + g.token_ids, completion_mask=[0] * len(prompt) + trained,
                   logprobs=[0.0] * len(prompt) + g.logprobs)
    t.advantage = advantage
    return t


def test_importance_ratio_is_one_on_constrained_turns(tiny_tokenizer, tiny_model_factory):
    """Sampled logprobs against the learner's recomputation, unchanged policy: the TIS
    weight is exactly 1 and the mismatch KL 0 with a constrained turn in the batch, and
    would not be if its masked tokens entered the loss (the negative control)."""
    policy = tiny_model_factory(seed=4, eos_bias=2.5, lora=True, default_init=True)
    engine, T, prompt = Engine(policy, tiny_tokenizer), 0.7, _prompt(tiny_tokenizer)
    torch.manual_seed(4)
    c = tool_call_constraint(TOOLS, answer_schema=ANSWER)
    gens = engine.generate([prompt] * 4, 48, temperature=T, constraints=[c, c, None, None])
    assert all(gens[0].constrained) and gens[2].constrained is None
    trajs = [_served(g, prompt, a) for g, a in zip(gens, [1.0, -1.0, 1.0, -1.0])]
    assert trajs[0].num_completion_tokens == 0 and trajs[2].num_completion_tokens == len(gens[2].token_ids)

    def step(batch):
        cfg = TrainConfig(beta=0.0, micro_batch_size=4, learning_rate=0.0)
        out = Learner(policy, cfg, T, tiny_tokenizer.pad_token_id, max_completion_length=48).step(batch)
        flat = out.metrics() if hasattr(out, "metrics") else out  # a typed UpdateResult, or a dict
        return {k: float(v) for k, v in flat.items() if isinstance(v, (int, float))}

    m = step(trajs)
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["mismatch_kl"] < 1e-8
    leaky = [_served(g, prompt, a) for g, a in zip(gens, [1.0, -1.0, 1.0, -1.0])]
    for t in leaky[:2]:
        t.completion_mask = [0] * len(prompt) + [1] * (len(t.token_ids) - len(prompt))
    assert step(leaky)["mismatch_kl"] > 1e-3


def test_request_constraints_and_bad_schemas(tiny_tokenizer):
    assert request_constraint(TOOLS, "auto", None) is None
    assert request_constraint(TOOLS, "none", None) is None
    assert request_constraint([], None, {"type": "text"}) is None
    assert request_constraint([], None, {"type": "json_schema", "json_schema": {"schema": ANSWER}}).kind == "json"
    with pytest.raises(ValueError, match="not among"):
        tool_call_constraint(TOOLS, name="nope")
    bad = json_constraint({"type": "object", "properties": {"a": {"type": "no-such-type"}}})
    with pytest.raises(ConstraintError, match="cannot be compiled"):
        check_constraint(bad, tiny_tokenizer, len(tiny_tokenizer), [tiny_tokenizer.eos_token_id])


def test_a_backend_without_constraints_refuses_constrained_requests(tiny_tokenizer):
    """A backend without grammar support (no ``supports_constraints``): a tool_choice
    "required" request is a 501 that says so, never a silently unconstrained sample; free
    requests pass."""
    from types import SimpleNamespace

    from selfrl.serve.protocol import ChatCompletionRequest
    from selfrl.serve.errors import ApiError
    from selfrl.serve.turns import Turns

    holder = SimpleNamespace(engine=SimpleNamespace(name="plain"), tok=tiny_tokenizer)
    tool = {"type": "function", "function": {"name": "add", "parameters": ADD}}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                tool_choice="required")
    with pytest.raises(ApiError, match="plain engine cannot constrain decoding") as e:
        Turns.constraint_for(holder, req)
    assert e.value.status == 501 and e.value.param == "tool_choice"
    free = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=[tool])
    assert Turns.constraint_for(holder, free) is None


# A schema whose free string outlasts check_constraint's walk, then requires a value with no end
# (a "$ref" cycle through a required property): llguidance fails ("Too many items") only once the
# string is closed, mid-generation. Old code: the reference engine raised, failing every row of the
# batch (a 500 for each request in it); the slots engine failed the row with an exception.
CYCLE = {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}
LATE_ENDLESS = {"$defs": {"n": CYCLE}, "type": "object", "required": ["a", "b"],
                "properties": {"a": {"type": "string", "minLength": 12, "maxLength": 14}, "b": {"$ref": "#/$defs/n"}}}


@pytest.mark.parametrize("backend", ["reference", "slots"])
def test_a_grammar_that_fails_mid_generation_ends_its_own_row_only(tiny_tokenizer, tiny_model, backend):
    from selfrl.engines import make_engine

    late = json_constraint(LATE_ENDLESS)
    engine = make_engine(backend, tiny_model, tiny_tokenizer)
    try:
        check_constraint(late, tiny_tokenizer, tiny_model.get_output_embeddings().weight.shape[0],
                         engine.eos_token_ids)  # nothing to see up front
        torch.manual_seed(0)
        bad, free, good = engine.generate([_prompt(tiny_tokenizer)] * 3, 64,
                                          constraints=[late, None, json_constraint(ANSWER)])
    finally:
        if hasattr(engine, "close"):
            engine.close()
    assert "Too many items" in bad.grammar_error and not bad.finished and bad.finish_reason == "length"
    assert re.match(r'\{"a":"[^"]{12,14}"', tiny_tokenizer.decode(bad.token_ids))  # failed once "a" was closed
    assert not set(bad.token_ids) & set(engine.eos_token_ids)  # the end a failed row is given is not the model's
    assert len(bad.logprobs) == len(bad.constrained) == len(bad.token_ids)
    assert free.grammar_error is None and free.constrained is None and len(free.token_ids) > 0
    assert good.grammar_error is None and good.finished
    assert set(json.loads(tiny_tokenizer.decode(good.token_ids, skip_special_tokens=True))) == {"ok", "n", "tag"}


def test_the_call_grammar_lets_a_string_argument_hold_the_closing_tag(tiny_tokenizer):
    # the grammar reads the body as JSON, so "</tool_call>" inside a string does not end the call;
    # the parser agrees (selfrl.chat.toolcall.scan_blocks): one call with the whole string
    from selfrl.chat.constrain import replay_masks

    schema = {"type": "object", "properties": {"content": {"type": "string"}}, "required": ["content"]}
    text = '<tool_call>{"name":"write","arguments":{"content":"x </tool_call> y"}}</tool_call>'
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]
    vocab, eos = len(tiny_tokenizer), [tiny_tokenizer.eos_token_id]
    allowed = replay_masks(tool_call_constraint([("write", schema)]), ids, tiny_tokenizer, vocab, eos)  # (n, V)
    assert allowed[-1].sum() < vocab and allowed[-1, eos[0]]  # the end of turn comes only after the whole call
    _, calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls] == [("write", {"content": "x </tool_call> y"})]
