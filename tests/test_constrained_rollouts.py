"""Grammar-constrained rollouts (``rollout.constrain = "tool_call"``) train: every turn is
a valid call by construction, the learner replays the grammar's masks, so the importance
ratio is exactly 1 for an unchanged policy, and an update moves the LoRA weights."""

import dataclasses

import pytest
import torch

from selfrl.chat.template import prompt_ids
from selfrl.config import RolloutConfig
from selfrl.chat.constrain import ConstraintError, GrammarMasks, replay_masks, tool_call_constraint, unpack_mask
from selfrl.engines.reference import Engine
from selfrl.rl.learner import Learner, TrainConfig
from selfrl.rl.batch import collate
from selfrl.rollout.agent import rollout
from selfrl.core.tasks import Task
from selfrl.chat.toolcall import parse_tool_calls
from selfrl.core.tools import Tool
from selfrl.core.trajectory import Trajectory

# small enums keep a random model's calls short (an unbounded integer can run past the token limit)
ADD = {"type": "object", "properties": {"a": {"type": "integer", "enum": [17, 25, 42]},
                                        "b": {"type": "integer", "enum": [17, 25, 42]}},
       "required": ["a", "b"], "additionalProperties": False}


def _tools(log):
    return [Tool("add", "Add two integers.", ADD, lambda a, b: log.append((a, b)) or str(a + b))]


def _cfg(**kw):
    return RolloutConfig(**{"max_turns": 1, "max_new_tokens": 40, "temperature": 0.8, "tools": [],
                            "constrain": "tool_call", **kw})


def _rollout(policy, tok, n=4, seed=5, **kw):
    torch.manual_seed(seed)
    task = Task("t1", "test", "What is 17+25?", "42")
    log = []
    return rollout(Engine(policy, tok), [task] * n, ["g"] * n, _tools(log), _cfg(**kw)), log


def test_replayed_masks_equal_the_masks_sampled_under(tiny_tokenizer, tiny_model):
    engine = Engine(tiny_model, tiny_tokenizer)
    c = tool_call_constraint([("add", ADD)])
    torch.manual_seed(1)
    prompt = prompt_ids(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    seen = {}
    original = GrammarMasks.__call__

    def spy(self, input_ids, scores):
        out = original(self, input_ids, scores)
        seen["masks"] = self.masks[0]
        return out

    GrammarMasks.__call__ = spy
    try:
        g = engine.generate([prompt], 40, temperature=0.8, constraints=[c])[0]
    finally:
        GrammarMasks.__call__ = original
    V = tiny_model.get_output_embeddings().weight.shape[0]
    replayed = replay_masks(c, g.token_ids, tiny_tokenizer, V, engine.eos_token_ids)  # (n, V)
    assert replayed.shape == (len(g.token_ids), V)
    for k, packed in enumerate(seen["masks"][:len(g.token_ids)]):
        assert torch.equal(replayed[k], unpack_mask(packed, V)), k
    assert (~replayed).any(dim=-1).all()  # every step of a call is restricted
    with pytest.raises(ConstraintError, match="not allowed"):
        bad = list(g.token_ids)
        bad[0] = int((~replayed[0]).nonzero()[0])
        replay_masks(c, bad, tiny_tokenizer, V, engine.eos_token_ids)


def test_constrained_rollout_records_valid_calls_and_their_spans(tiny_tokenizer, tiny_model):
    trajs, log = _rollout(tiny_model, tiny_tokenizer, max_turns=2, max_new_tokens=64)
    assert len(log) == 4 and all(isinstance(a, int) and isinstance(b, int) for a, b in log)  # valid calls, run
    for t in trajs:
        assert len(t.constraints) == t.num_turns == 2  # the turn after the tool's answer is constrained too
        first = t.constraints[0]
        assert first["kind"] == "tool_call" and first["start"] == t.prompt_len
        assert t.completion_mask[first["start"]:first["end"]] == [1] * (first["end"] - first["start"])  # trained
        asked = max(i for i, m in enumerate(t.messages) if m["role"] == "user")  # after the worked example
        said = [m for m in t.messages[asked:] if m["role"] == "assistant"]
        assert len(said) == 2
        for m in said:
            _, calls = parse_tool_calls(m["content"])
            assert len(calls) == 1 and calls[0].error is None and calls[0].name == "add"
        assert Trajectory.from_dict(t.to_dict()).constraints == t.constraints  # the store keeps them


def _with_advantages(trajs, values):
    out = []
    for t, a in zip(trajs, values):
        t = Trajectory.from_dict(t.to_dict())
        t.advantage = a
        out.append(t)
    return out


def _step(policy, tok, trajs, lr=0.0, replay=True):
    cfg = TrainConfig(beta=0.02, micro_batch_size=4, learning_rate=lr)
    learner = Learner(policy, cfg, 0.8, tok.pad_token_id, max_completion_length=40,
                      tokenizer=tok if replay else None)
    return learner.step(trajs).metrics()


def test_unchanged_policy_has_ratio_one_on_constrained_turns(tiny_tokenizer, tiny_model_factory):
    """The sampled (masked) logprobs equal the learner's replayed recomputation: TIS weight
    1, mismatch KL 0, KL to the reference 0 (the reference is masked the same way).
    Negative control: the same turns recomputed without the masks differ."""
    policy = tiny_model_factory(seed=4, lora=True, default_init=True)
    trajs, _ = _rollout(policy, tiny_tokenizer)
    batch = _with_advantages(trajs, [1.0, -1.0, 1.0, -1.0])
    m = _step(policy, tiny_tokenizer, batch)
    assert m["tis_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m["mismatch_kl"] < 1e-8
    assert abs(m["kl"]) < 1e-8 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m["num_tokens"] == sum(t.num_completion_tokens for t in batch) > 0
    unmasked = _with_advantages(trajs, [1.0, -1.0, 1.0, -1.0])
    for t in unmasked:
        t.constraints = []
    assert _step(policy, tiny_tokenizer, unmasked)["mismatch_kl"] > 1e-3


def test_a_fully_constrained_batch_moves_the_lora_weights(tiny_tokenizer, tiny_model_factory):
    policy = tiny_model_factory(seed=6, lora=True)
    trajs, _ = _rollout(policy, tiny_tokenizer, seed=6)
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    result = Learner(policy, TrainConfig(beta=0.02, micro_batch_size=4, learning_rate=1e-3), 0.8,
                     tiny_tokenizer.pad_token_id, 40, tokenizer=tiny_tokenizer).step(
        _with_advantages(trajs, [1.0, -1.0, 0.5, -0.5]))
    assert not result.skipped
    moved = sum(not torch.equal(before[n], p) for n, p in policy.named_parameters() if p.requires_grad)
    assert moved > 0


def test_constrained_trajectories_need_the_replay(tiny_tokenizer, tiny_model_factory):
    policy = tiny_model_factory(seed=4, lora=True)
    trajs, _ = _rollout(policy, tiny_tokenizer, n=2)
    batch = _with_advantages(trajs, [1.0, -1.0])
    with pytest.raises(ValueError, match="mask replay"):
        collate(batch, tiny_tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="no tokenizer"):
        _step(policy, tiny_tokenizer, batch, replay=False)


def test_an_engine_without_grammars_refuses_constrained_rollouts(tiny_tokenizer, tiny_model):
    class Plain:
        tokenizer, version, eos_token_ids = tiny_tokenizer, 0, [tiny_tokenizer.eos_token_id]

    with pytest.raises(ValueError, match="needs an engine with grammar constraints"):
        rollout(Plain(), [Task("t", "test", "q", "a")], ["g"], _tools([]), _cfg())
    with pytest.raises(ValueError, match="needs tools to call"):
        rollout(Engine(tiny_model, tiny_tokenizer), [Task("t", "test", "q", "a")], ["g"], [], _cfg())
    with pytest.raises(ValueError, match="constrain must be one of"):
        dataclasses.replace(_cfg(), constrain="json").check()


def test_a_grammar_that_fails_mid_turn_fails_its_trajectory_not_the_batch(tiny_tokenizer, tiny_model):
    """Old code: the ConstraintError ended the whole rollout batch."""
    from test_constrain import LATE_ENDLESS

    endless = Tool("endless", "A tool whose arguments never end.", LATE_ENDLESS, lambda **_: "")
    torch.manual_seed(5)
    task = Task("t1", "test", "What is 17+25?", "42")
    trajs = rollout(Engine(tiny_model, tiny_tokenizer), [task] * 2, ["g"] * 2, [endless], _cfg(max_new_tokens=64))
    for t in trajs:
        assert t.error.startswith("turn 1: the grammar failed: ") and "Too many items" in t.error, t.error
        assert t.truncated and t.num_turns == 1 and len(t.constraints) == 1
