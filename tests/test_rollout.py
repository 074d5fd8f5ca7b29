import pytest
import torch

from selfrl.chat.template import prompt_ids, render
from selfrl.engines.reference import Engine, Generation
from selfrl.rl.logprobs import per_token_logps
from selfrl.rollout.agent import DEMONSTRATION, RolloutConfig, initial_messages, rollout
from selfrl.core.tasks import Task
from selfrl.chat.toolcall import format_tool_response, render_tools_prompt
from selfrl.core.tools import CALCULATOR

CALL_17_25 = '<tool_call>{"name": "calculator", "arguments": {"expression": "17+25"}}</tool_call>'
GLUED = (
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}'
    '{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
)
TASK = Task.make("test", "What is 17+25?", "42")


class ScriptedEngine(Engine):
    """An engine whose turns are preset texts: call ``k`` answers the active rows with ``script[k]``.

    Each turn is the text's ids plus EOS, cut at ``max_new_tokens`` (then unfinished);
    token ``j`` of a turn gets logprob ``-(j + 1) / 100`` so misplaced logprobs show.
    Every batch of prompts received is kept in ``calls``.
    """

    def __init__(self, model, tokenizer, script: list[list[str]]):
        super().__init__(model, tokenizer)
        self.script = script
        self.calls: list[list[list[int]]] = []

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False):
        texts = self.script[len(self.calls)]
        assert len(texts) == len(prompts), "script and active rows disagree"
        self.calls.append([list(p) for p in prompts])
        out = []
        for text in texts:
            ids = (turn_ids(self.tokenizer, text) + [self.tokenizer.eos_token_id])[:max_new_tokens]
            finished = ids[-1] == self.tokenizer.eos_token_id
            out.append(Generation(ids, scripted_logprobs(len(ids)), finished, self.version))
        return out


def plain_cfg(**kw) -> RolloutConfig:
    """The layout these tests spell out token by token: no demonstration, JSON tool schemas."""
    return RolloutConfig(demonstration=False, tools_prompt="json", **kw)


def turn_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def scripted_logprobs(n):
    return [-(j + 1) / 100 for j in range(n)]


def start_ids(tok, task=TASK, cfg=None):
    cfg = cfg or plain_cfg()
    return prompt_ids(tok, initial_messages(task, [CALCULATOR], cfg, tok))


def run(engine, cfg=None, tasks=(TASK,)):
    return rollout(engine, list(tasks), [f"g{i}" for i in range(len(tasks))], [CALCULATOR], cfg or plain_cfg())


def assert_invariants(traj, eos):
    """Token-level invariants every trajectory must satisfy."""
    traj.check()
    n = traj.prompt_len
    assert n > 0 and traj.completion_mask[:n] == [0] * n
    assert set(traj.completion_mask) <= {0, 1}
    for m, lp in zip(traj.completion_mask, traj.logprobs):
        assert lp == 0.0 if m == 0 else lp <= 0.0
    # one contiguous sampled segment per assistant turn, each ending in EOS unless cut off
    segments, start = [], None
    for t, m in enumerate(traj.completion_mask + [0]):
        if m and start is None:
            start = t
        if not m and start is not None:
            segments.append(traj.token_ids[start:t])
            start = None
    # the policy's turns are the assistant messages after the task (the last user message);
    # a demonstration's assistant messages come before it
    task_at = max(i for i, m in enumerate(traj.messages) if m["role"] == "user")
    assert len(segments) == traj.num_turns == sum(m["role"] == "assistant" for m in traj.messages[task_at:])
    for k, seg in enumerate(segments):
        last = k == len(segments) - 1
        if last and traj.truncated:
            assert eos not in seg
        else:
            assert seg[-1] == eos and eos not in seg[:-1]
    assert traj.num_completion_tokens == sum(len(s) for s in segments)


def test_tool_round_trip_then_answer(tiny_tokenizer, tiny_model):
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    engine = ScriptedEngine(tiny_model, tok, [[CALL_17_25], ["<answer>42</answer>"]])
    (traj,) = run(engine)

    prompt = start_ids(tok)
    turn1 = turn_ids(tok, CALL_17_25) + [eos]
    between = turn_ids(
        tok, "\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    turn2 = turn_ids(tok, "<answer>42</answer>") + [eos]
    assert traj.token_ids == prompt + turn1 + between + turn2
    assert traj.prompt_len == len(prompt)
    assert traj.completion_mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert traj.logprobs == (
        [0.0] * len(prompt) + scripted_logprobs(len(turn1)) + [0.0] * len(between) + scripted_logprobs(len(turn2))
    )
    # the model saw exactly the trajectory's own prefix at turn 2
    assert engine.calls == [[prompt], [prompt + turn1 + between]]

    (call,) = traj.tool_calls
    assert call.ok and call.name == "calculator" and call.arguments == {"expression": "17+25"}
    assert call.result == "42" and call.error is None
    assert traj.final_answer == "<answer>42</answer>"
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert traj.messages[0]["content"].endswith(render_tools_prompt([CALCULATOR], "json"))
    assert traj.messages[2]["content"] == CALL_17_25
    assert traj.messages[3]["content"] == "<tool_response>\n42\n</tool_response>"
    assert traj.num_turns == 2 and not traj.truncated and traj.tool_success_rate == 1.0
    assert traj.group_id == "g0" and traj.task_id == TASK.id and traj.adapter_version == 0
    # the token stream is the chat template's own rendering of the messages
    assert tok.decode(traj.token_ids) + "\n" == render(tok, traj.messages, add_generation_prompt=False)
    assert_invariants(traj, eos)


def test_demonstration_sits_between_system_and_user(tiny_tokenizer, tiny_model):
    tok = tiny_tokenizer
    cfg = RolloutConfig()  # the defaults of `selfrl run`: one demonstration, compact tool list
    assert cfg.demonstration and cfg.tools_prompt == "compact"
    msgs = initial_messages(TASK, [CALCULATOR], cfg, tok)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert msgs[1:-1] == DEMONSTRATION and msgs[1:-1] is not DEMONSTRATION
    assert msgs[0]["content"] == cfg.system_prompt + "\n\n" + render_tools_prompt([CALCULATOR], "compact")
    assert msgs[-1] == {"role": "user", "content": TASK.question}
    msgs[1]["content"] = "changed"  # the module-level example is copied, never shared
    assert DEMONSTRATION[0]["content"] != "changed"
    # without tools there is nothing to demonstrate
    assert [m["role"] for m in initial_messages(TASK, [], cfg, tok)] == ["system", "user"]

    # the rollout starts from exactly that prompt and appends the task's own turns after it
    engine = ScriptedEngine(tiny_model, tok, [["<answer>42</answer>"]])
    (traj,) = run(engine, cfg)
    assert engine.calls == [[prompt_ids(tok, msgs[:1] + DEMONSTRATION + msgs[-1:])]]
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant", "tool", "assistant", "user", "assistant"]
    assert traj.final_answer == "<answer>42</answer>" and traj.num_turns == 1
    assert tok.decode(traj.token_ids) + "\n" == render(tok, traj.messages, add_generation_prompt=False)
    assert_invariants(traj, tok.eos_token_id)


def test_end_of_turn_text_is_the_templates_eos_when_generation_config_lists_several(tiny_tokenizer, tiny_model):
    # Qwen2.5 / Llama-3 style: generation_config ends on several ids, the lowest of which
    # (<|endoftext|>) the chat template never writes after an assistant turn.
    tok = tiny_tokenizer
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    assert endoftext < tok.eos_token_id
    tiny_model.generation_config.eos_token_id = [tok.eos_token_id, endoftext]
    engine = ScriptedEngine(tiny_model, tok, [[CALL_17_25], ["<answer>42</answer>"]])
    (traj,) = run(engine)
    assert traj.num_turns == 2 and traj.tool_calls[0].result == "42"
    assert tok.decode(traj.token_ids) + "\n" == render(tok, traj.messages, add_generation_prompt=False)


@pytest.mark.parametrize(
    "bad_turn, why",
    [(GLUED, "expected one JSON object, found extra data"), (CALL_17_25.replace("calculator", "abacus"), "unknown tool")],
)
def test_failed_call_is_recorded_and_sent_back(tiny_tokenizer, tiny_model, bad_turn, why):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tiny_model, tok, [[bad_turn], ["<answer>2</answer>"]])
    (traj,) = run(engine)
    (call,) = traj.tool_calls
    assert not call.ok and why in call.error and call.result == f"error: {call.error}"
    assert traj.tool_success_rate == 0.0
    assert traj.messages[3] == {"role": "tool", "content": format_tool_response(call)}
    assert f"<tool_response>\nerror: {call.error}\n</tool_response>" in tok.decode(engine.calls[1][0])
    assert traj.num_turns == 2 and traj.final_answer == "<answer>2</answer>" and not traj.truncated
    assert_invariants(traj, tok.eos_token_id)


def test_truncated_turn_ends_the_trajectory_without_running_its_calls(tiny_tokenizer, tiny_model):
    tok = tiny_tokenizer
    text = CALL_17_25 + " and now a long afterthought that runs past the limit"
    limit = len(turn_ids(tok, CALL_17_25)) + 3
    engine = ScriptedEngine(tiny_model, tok, [[text], ["<answer>42</answer>"]])
    (traj,) = run(engine, plain_cfg(max_new_tokens=limit))
    assert traj.truncated and traj.num_turns == 1 and len(engine.calls) == 1
    assert traj.tool_calls == []
    assert traj.num_completion_tokens == limit
    assert traj.token_ids[-1] != tok.eos_token_id
    assert [m["role"] for m in traj.messages] == ["system", "user", "assistant"]
    assert traj.final_answer == tok.decode(traj.token_ids[traj.prompt_len:]).replace(CALL_17_25, "").strip()
    assert_invariants(traj, tok.eos_token_id)


@pytest.mark.parametrize("max_turns", [1, 2, 3])
def test_max_turns_is_respected(tiny_tokenizer, tiny_model, max_turns):
    tok = tiny_tokenizer
    engine = ScriptedEngine(tiny_model, tok, [[CALL_17_25]] * 5)  # a model that never stops calling
    (traj,) = run(engine, plain_cfg(max_turns=max_turns))
    assert len(engine.calls) == traj.num_turns == max_turns
    assert len(traj.tool_calls) == max_turns - 1  # the last turn's call could never be answered
    roles = [m["role"] for m in traj.messages]
    assert roles == ["system", "user"] + ["assistant", "tool"] * (max_turns - 1) + ["assistant"]
    assert not traj.truncated
    assert_invariants(traj, tok.eos_token_id)


def test_batch_rows_finish_independently(tiny_tokenizer, tiny_model):
    tok = tiny_tokenizer
    other = Task.make("test", "What is 2+2?", "4")
    engine = ScriptedEngine(tiny_model, tok, [[CALL_17_25, "<answer>4</answer>"], ["<answer>42</answer>"]])
    first, second = run(engine, tasks=(TASK, other))
    assert len(engine.calls[0]) == 2 and len(engine.calls[1]) == 1
    assert first.num_turns == 2 and first.final_answer == "<answer>42</answer>"
    assert second.num_turns == 1 and second.final_answer == "<answer>4</answer>" and second.tool_calls == []
    assert second.token_ids == start_ids(tok, other) + turn_ids(tok, "<answer>4</answer>") + [tok.eos_token_id]
    for traj in (first, second):
        assert_invariants(traj, tok.eos_token_id)


def test_real_tiny_model_rollout(tiny_tokenizer, tiny_model_factory):
    tok = tiny_tokenizer
    model = tiny_model_factory(seed=3, eos_bias=2.5, lora=True)
    engine = Engine(model, tok, version=5)
    cfg = plain_cfg(max_turns=2, max_new_tokens=16, temperature=0.8)
    tasks = [TASK, TASK, Task.make("test", "What is 2+2?", "4"), Task.make("test", "What is 2+2?", "4")]
    torch.manual_seed(0)
    trajs = rollout(engine, tasks, ["a", "a", "b", "b"], [CALCULATOR], cfg)
    assert len(trajs) == 4 and [t.group_id for t in trajs] == ["a", "a", "b", "b"]
    for task, traj in zip(tasks, trajs):
        assert_invariants(traj, tok.eos_token_id)
        assert traj.adapter_version == 5 and 1 <= traj.num_turns <= cfg.max_turns
        assert traj.token_ids[:traj.prompt_len] == start_ids(tok, task, cfg)
        assert traj.timings["generate"] > 0.0
        # the learner's recomputation at the sampling temperature gives back the sampled logprobs
        ids = torch.tensor([traj.token_ids])  # (1, T)
        mask = torch.tensor([traj.completion_mask])  # (1, T)
        with torch.no_grad():
            recomputed = per_token_logps(model, ids, torch.ones_like(ids), mask, cfg.temperature)[0]  # (T,)
        torch.testing.assert_close(recomputed, torch.tensor(traj.logprobs), atol=1e-4, rtol=0)
    assert any(t.num_completion_tokens > 1 for t in trajs)


class StoppingEngine(ScriptedEngine):
    """A scripted engine that honours ``stop`` as ``Engine.generate`` does: the turn is cut
    after the stop string, no EOS, ``stopped=True``."""

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False, stop=None):
        out = super().generate(prompts, max_new_tokens, temperature, greedy)
        for k, g in enumerate(out):
            text = self.script[len(self.calls) - 1][k]
            if stop and stop[0] in text:
                ids = turn_ids(self.tokenizer, text[:text.index(stop[0]) + len(stop[0])])
                out[k] = Generation(ids, scripted_logprobs(len(ids)), True, self.version, stopped=True)
        return out


def test_stop_at_tool_call_ends_the_turn_and_adds_the_end_of_turn(tiny_tokenizer, tiny_model):
    tok, eos = tiny_tokenizer, tiny_tokenizer.eos_token_id
    rambling = CALL_17_25 + "<tool_response>\n41\n</tool_response> so the answer is 41"  # a made-up tool reply
    engine = StoppingEngine(tiny_model, tok, [[rambling], ["<answer>42</answer>"]])
    (traj,) = run(engine, plain_cfg(stop_at_tool_call=True))
    prompt = start_ids(tok, cfg=plain_cfg(stop_at_tool_call=True))
    turn1 = turn_ids(tok, CALL_17_25)  # cut right after </tool_call>: the made-up reply never happened
    between = [eos] + turn_ids(
        tok, "\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    turn2 = turn_ids(tok, "<answer>42</answer>") + [eos]
    assert traj.token_ids == prompt + turn1 + between + turn2
    assert traj.completion_mask == [0] * len(prompt) + [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert traj.tool_calls[0].result == "42" and traj.final_answer == "<answer>42</answer>" and not traj.truncated
    assert tok.decode(traj.token_ids) + "\n" == render(tok, traj.messages, add_generation_prompt=False)


class TurnScriptEngine(Engine):
    """Answers each prompt by its task and turn: ``script[question][k]`` for the k-th turn (k =
    assistant turns so far in the prompt; no demonstration), whatever the batch; logprobs as
    in ScriptedEngine."""

    def __init__(self, model, tokenizer, script: dict[str, list[str]]):
        super().__init__(model, tokenizer)
        self.script = script
        self.order: list[str] = []  # questions in the order their turns were asked for

    def one(self, prompt, max_new_tokens) -> Generation:
        text = self.tokenizer.decode(prompt)
        q = next(q for q in self.script if q in text)
        self.order.append(q)
        ids = (turn_ids(self.tokenizer, self.script[q][text.count("<|im_start|>assistant") - 1])
               + [self.tokenizer.eos_token_id])[:max_new_tokens]
        return Generation(ids, scripted_logprobs(len(ids)), ids[-1] == self.tokenizer.eos_token_id, self.version)

    def generate(self, prompts, max_new_tokens, temperature=1.0, greedy=False):
        return [self.one(p, max_new_tokens) for p in prompts]


class SubmitScriptEngine(TurnScriptEngine):
    """The same answers through ``submit``: rollout takes its pipelined path."""

    def submit(self, prompt, max_new_tokens, temperature=1.0, greedy=False, top_p=1.0, stop=None, on_tokens=None,
               seed=None):
        from concurrent.futures import Future

        f = Future()
        f.set_result(self.one(prompt, max_new_tokens))
        return f


def test_pipelined_turns_give_the_same_trajectories_as_batched_turns(tiny_tokenizer, tiny_model):
    tok = tiny_tokenizer
    tasks = [Task.make("test", "What is 17+25?", "42"), Task.make("test", "What is 2+2?", "4"),
             Task.make("test", "What is 1+1?", "2")]
    script = {tasks[0].question: [CALL_17_25, "<answer>42</answer>"],  # tool, then answer
              tasks[1].question: ["<answer>4</answer>"],  # answers at once
              tasks[2].question: [CALL_17_25, CALL_17_25, "<answer>2</answer>"]}  # two calls, then answer
    cfg = plain_cfg(max_turns=3)
    out, turns = {}, {}
    for kind, cls in (("batched", TurnScriptEngine), ("pipelined", SubmitScriptEngine)):
        engine = cls(tiny_model, tok, script)
        calls = []
        out[kind] = rollout(engine, tasks, ["a", "b", "c"], [CALCULATOR], cfg, on_turn=lambda: calls.append(1))
        turns[kind] = (len(calls), len(engine.order))
    for b, p in zip(out["batched"], out["pipelined"]):
        assert_invariants(p, tok.eos_token_id)
        assert (p.token_ids, p.completion_mask, p.logprobs) == (b.token_ids, b.completion_mask, b.logprobs)
        assert (p.messages, p.num_turns, p.final_answer, p.truncated) == (b.messages, b.num_turns, b.final_answer,
                                                                          b.truncated)
    assert [t.num_turns for t in out["pipelined"]] == [2, 1, 3]
    assert turns["batched"] == turns["pipelined"] == (3, 6)  # 3 turn indices reached, 6 turns sampled


@pytest.mark.parametrize("cls", [TurnScriptEngine, SubmitScriptEngine], ids=["batched", "pipelined"])
def test_a_turn_that_does_not_fit_the_context_ends_the_trajectory_before_the_engine_is_asked(
        tiny_tokenizer, tiny_model, cls):
    tok = tiny_tokenizer
    tasks = [Task.make("test", "What is 17+25?", "42"), Task.make("test", "What is 2+2?", "4")]
    script = {tasks[0].question: [CALL_17_25, "<answer>42</answer>"], tasks[1].question: ["<answer>4</answer>"]}
    cfg = plain_cfg(max_turns=3, max_new_tokens=64)
    first = max(len(start_ids(tok, t, cfg)) for t in tasks)
    # room for either first turn, not for task 0's second (its call and tool reply come first)
    tiny_model.config.max_position_embeddings = first + 64
    engine = cls(tiny_model, tok, script)
    a, b = rollout(engine, tasks, ["a", "b"], [CALCULATOR], cfg)
    assert engine.order == [tasks[0].question, tasks[1].question]  # task 0's second turn was never asked for
    assert (a.num_turns, a.truncated, a.error, a.final_answer) == (1, True, None, None)
    assert [m["role"] for m in a.messages] == ["system", "user", "assistant", "tool"]
    assert (b.num_turns, b.truncated, b.error, b.final_answer) == (1, False, None, "<answer>4</answer>")
    a.check()
    # the stored ids end with the first turn, kept whole: the tool reply and the next turn's header
    # appended after it are dropped, so that the learner never runs past the context
    assert a.token_ids[a.completion_mask.index(1):] == turn_ids(tok, CALL_17_25) + [tok.eos_token_id]
    assert len(a.token_ids) <= tiny_model.config.max_position_embeddings
    assert len(a.completion_mask) == len(a.logprobs) == len(a.token_ids)


@pytest.mark.parametrize("cls", [TurnScriptEngine, SubmitScriptEngine], ids=["batched", "pipelined"])
def test_a_prompt_longer_than_the_context_fails_only_its_trajectory(tiny_tokenizer, tiny_model, cls):
    tok = tiny_tokenizer
    tasks = [Task.make("test", "What is 2+2? " + "Think about it. " * 40, "4"), Task.make("test", "What is 1+1?", "2")]
    script = {tasks[0].question: ["<answer>4</answer>"], tasks[1].question: ["<answer>2</answer>"]}
    cfg = plain_cfg(max_new_tokens=16)
    long, short = (len(start_ids(tok, t, cfg)) for t in tasks)
    assert long > short + 16
    tiny_model.config.max_position_embeddings = short + 16
    engine = cls(tiny_model, tok, script)
    a, b = rollout(engine, tasks, ["a", "b"], [CALCULATOR], cfg)
    assert engine.order == [tasks[1].question]
    assert a.num_turns == 0 and a.truncated
    assert a.error == (f"the prompt is {long} tokens; with rollout.max_new_tokens = 16 it exceeds the "
                       f"model's context of {short + 16} tokens")
    assert (b.num_turns, b.error, b.final_answer) == (1, None, "<answer>2</answer>")
