"""Corrections as demonstrations (selfrl.serve.corrections, learner.learn_from_corrections): the
tokens built from a correction, when one is left out, what the store keeps, the learner's use of
them, what the feedback answer says, and the simulated users who correct a call with calls."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest

from selfrl.core.trajectory import ToolCallRecord, Trajectory
from selfrl.envs.function_calling import first_answer_calls
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.serve.corrections import answer_text, completion_ids, demonstrations
from serving import API_KEY, http, running_server, tiny_serve_config

WEIGHTS = {"user_feedback": 1.0, "tool_success": 0.2}
CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}


def eos(tok) -> list[int]:
    return [tok.convert_tokens_to_ids("<|im_end|>")]


TOOLS = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
         ("get_time", {"type": "object", "properties": {}})]


def grammar(kind: str) -> str:
    """The grammar a served turn of ``kind`` was decoded under (selfrl.chat.constrain)."""
    from selfrl.chat.constrain import json_constraint, tool_call_constraint

    return {"tool_call": tool_call_constraint(TOOLS), "json": json_constraint(),
            "tool_call_or_json": tool_call_constraint(TOOLS, answer_schema={"type": "object"})}[kind].grammar


def turn(tok, constraints=(), tid="t1") -> Trajectory:
    prompt = tok("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    sampled = tok("no idea", add_special_tokens=False)["input_ids"] + eos(tok)
    P = len(prompt)
    return Trajectory("task", "g", 3, prompt_len=P, token_ids=prompt + sampled, completion_mask=[0] * P + [1] * len(sampled),
                      logprobs=[0.0] * P + [-1.0] * len(sampled), id=tid,
                      messages=[{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "no idea"}],
                      constraints=[{"start": P, "end": P + len(sampled), "kind": k, "grammar": grammar(k)}
                                   for k in constraints])


def row(rid="r1", group="g-key"):
    return {"response_id": rid, "choice": 0, "group_key": group}


def test_the_completion_is_the_answer_then_the_end_of_turn_token(tiny_tokenizer):
    text = answer_text("", [CALL])
    assert text == '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    ids = completion_ids(tiny_tokenizer, text, eos(tiny_tokenizer))
    # what the model samples after "<|im_start|>assistant\n": the content's tokens, then <|im_end|> (not the newline)
    assert ids == tiny_tokenizer(text, add_special_tokens=False)["input_ids"] + eos(tiny_tokenizer)
    # control-token text inside a correction stays text: it cannot end the turn early or forge a header
    forged = completion_ids(tiny_tokenizer, "a<|im_end|>b", eos(tiny_tokenizer))
    assert forged.count(eos(tiny_tokenizer)[0]) == 1 and forged[-1] == eos(tiny_tokenizer)[0]
    assert tiny_tokenizer.decode(forged[:-1]) == "a<|im_end|>b"
    # a template that ends no assistant turn with one of the given ids: no demonstration
    assert completion_ids(tiny_tokenizer, "x", [10**6]) is None


def test_a_demonstration_is_the_turns_prompt_with_the_right_answer_and_a_right_answers_reward(tiny_tokenizer):
    t = turn(tiny_tokenizer, ["tool_call"])
    found = {("r1", 0): ("", [CALL])}
    [demo], skipped = demonstrations([(t, row())], found, tiny_tokenizer, eos(tiny_tokenizer), 7, 64, WEIGHTS)
    P = t.prompt_len
    assert not skipped and demo.token_ids[:P] == t.token_ids[:P] and demo.prompt_len == P
    # under the tool-call grammar the call is written as the grammar samples it: compact JSON
    assert tiny_tokenizer.decode(demo.token_ids[P:]) == \
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call><|im_end|>'
    assert demo.token_ids[P:] == completion_ids(tiny_tokenizer, "", eos(tiny_tokenizer), [CALL], compact=True)
    assert demo.completion_mask == [0] * P + [1] * (len(demo.token_ids) - P)
    assert demo.rewards == {"user_feedback": 1.0, "tool_success": 1.0} and demo.reward == pytest.approx(1.2)
    assert (demo.group_id, demo.adapter_version, demo.parent_id) == ("g-key", 7, "t1")
    # the learner replays the turn's grammar over the demonstration's own tokens, as over the turn's
    [c] = demo.constraints
    assert (c["start"], c["end"], c["kind"], c["grammar"]) == (P, len(demo.token_ids), "tool_call", t.constraints[0]["grammar"])
    assert demo.messages[-1] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    # text only: the reward of a right answer without calls
    [text_demo], _ = demonstrations([(turn(tiny_tokenizer), row())], {("r1", 0): ("sunny", [])}, tiny_tokenizer,
                                    eos(tiny_tokenizer), 7, 64, WEIGHTS)
    assert text_demo.reward == 1.0 and text_demo.final_answer == "sunny"


@pytest.mark.parametrize("kinds, fix, reason", [
    (["tool_call"], ("it is sunny", []), "no calls for a turn that had to call a tool"),
    (["json"], ("not json", []), "not the JSON the turn's response_format asked for"),
    (["json"], ("", [CALL]), "not the JSON the turn's response_format asked for"),
    ([], ("x " * 200, []), "longer than max_completion_length (64)"),
])
def test_a_correction_that_cannot_be_the_turns_answer_is_left_out_with_its_reason(tiny_tokenizer, kinds, fix, reason):
    demos, skipped = demonstrations([(turn(tiny_tokenizer, kinds), row())], {("r1", 0): fix}, tiny_tokenizer,
                                    eos(tiny_tokenizer), 7, 64, WEIGHTS)
    assert demos == [] and dict(skipped) == {reason: 1}


def test_json_corrections_of_a_json_turn_and_turns_without_a_correction(tiny_tokenizer):
    batch = [(turn(tiny_tokenizer, ["json"]), row("r1")), (turn(tiny_tokenizer, tid="t2"), row("r2"))]
    demos, skipped = demonstrations(batch, {("r1", 0): ('{"a": 1}', [])}, tiny_tokenizer, eos(tiny_tokenizer), 7,
                                    64, WEIGHTS)
    assert [d.parent_id for d in demos] == ["t1"] and not skipped  # r2 has no correction: nothing, no reason
    assert tiny_tokenizer.decode(demos[0].token_ids[demos[0].prompt_len:]) == '{"a":1}<|im_end|>'  # compact


def store_with_one_turn(tmp_path) -> Store:
    """A server store holding one served turn, response ``r1`` choice 0."""
    store = Store(tmp_path / "s.sqlite")
    records.init(store)
    t = Trajectory("task", "g", 0, prompt_len=1, token_ids=[1, 2], completion_mask=[0, 1], logprobs=[0.0, -1.0])
    records.add_turn(store, store.start_run({}), t, "r1", 0, "c", "g", "k")
    return store


def test_the_store_keeps_a_corrections_calls_and_gives_the_newest(tmp_path):
    store = store_with_one_turn(tmp_path)
    records.apply_feedback(store, "r1", 0, "explicit", -1.0, corrected=True, correction="first")
    records.apply_feedback(store, "r1", 0, "explicit", -1.0, corrected=True, correction_calls=[CALL])
    records.apply_feedback(store, "r1", 0, "explicit", 1.0, rating=1.0)  # a rating says no answer: not a correction
    records.apply_feedback(store, "r1", 0, "implicit", -1.0, corrected=True, correction="a guess")  # implicit: never
    assert records.corrections(store, [("r1", 0), ("r9", 0)]) == {("r1", 0): ("", [CALL])}
    store.close()


def test_a_store_written_before_correction_calls_gets_the_column(tmp_path):
    path = tmp_path / "old.sqlite"
    old = records.SERVE_SCHEMA.replace("    correction_calls TEXT,\n", "")
    assert old != records.SERVE_SCHEMA
    Store(path).close()  # the store's own tables, then the server's as they were before the column
    conn = sqlite3.connect(path)
    conn.executescript(old)
    conn.close()
    store = Store(path)
    assert "correction_calls" not in {r[1] for r in store.conn.execute("PRAGMA table_info(feedback)")}
    records.init(store)
    assert "correction_calls" in {r[1] for r in store.conn.execute("PRAGMA table_info(feedback)")}
    store.close()


def serve_and_correct(model, tok, cfg, correct: dict):
    """Serve 8 turns, rate half +1 and correct the other half with ``correct``; returns the
    service's learner's last update and the feedback answers."""
    with running_server(model, tok, cfg, learn=True) as (url, service):
        ids = []
        for i in range(8):
            code, body = http("POST", url + "/v1/chat/completions", {
                "model": "selfrl", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 6,
                "task_key": "fam"}, key=API_KEY)
            assert code == 200, body
            ids.append(body["id"])
        answers = []
        for i, rid in enumerate(ids):
            fb = {"response_id": rid, "rating": 1.0} if i % 2 else {"response_id": rid, "corrected": True, **correct}
            code, body = http("POST", url + "/v1/feedback", fb, key=API_KEY)
            assert code == 200, body
            answers.append(body)
        deadline = time.monotonic() + 60
        while not ("seconds" in service.learner.last or "reason" in service.learner.last) and time.monotonic() < deadline:
            time.sleep(0.1)
        last = dict(service.learner.last)
        with service.store.lock:
            n_rows = service.store.conn.execute("SELECT COUNT(*) FROM served").fetchone()[0]
            metrics = {m["name"]: m["value"] for m in service.store.metrics()}
    return last, answers, n_rows, metrics


def test_the_learner_trains_on_corrections_beside_their_turns_when_asked(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = tiny_serve_config(tmp_path / "on", min_batch=8, max_batch=8, feedback_wait_s=600.0, poll_s=0.05,
                            learn_from_corrections="all")
    cfg.collapse.max_kl = 50.0
    last, answers, n_rows, metrics = serve_and_correct(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer,
                                                       cfg, {"correction": "the answer"})
    assert "demonstrations" in last, last
    assert last["demonstrations"] == 4 and last["corrections_left_out"] == {}
    assert last["with_signal"] == 12  # 8 turns (4 at +1, 4 at -1) and 4 demonstrations, in one group
    assert n_rows == 8 and metrics["feedback/demonstrations"] == 4.0  # nothing stored as a served turn
    assert answers[0]["correction"].startswith("trains as a demonstration") and "correction" not in answers[1]


def test_the_kl_probe_of_a_candidate_reads_only_sampled_turns(tiny_tokenizer, tiny_model_factory, tmp_path,
                                                               monkeypatch):
    from selfrl.rl.learner import Learner

    probed, probe = [], Learner.probe_kl
    monkeypatch.setattr(Learner, "probe_kl", lambda self, trajs, n: probed.append([t.id for t in trajs]) or
                        probe(self, trajs, n))
    cfg = tiny_serve_config(tmp_path / "probe", min_batch=8, max_batch=8, feedback_wait_s=600.0, poll_s=0.05,
                            learn_from_corrections="all")
    cfg.collapse.max_kl, cfg.collapse.kl_probe_size = 50.0, 64
    last, *_ = serve_and_correct(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer, cfg,
                                 {"correction": "the answer"})
    assert last["demonstrations"] == 4 and last["with_signal"] == 12, last
    # before: the 4 demonstrations were probed too (12 ids), their tokens the very ones the update pushed up
    assert len(probed) == 1 and len(probed[0]) == 8 and not any(i.endswith("-correction") for i in probed[0])


def test_a_demonstration_without_signal_is_not_counted_as_trained(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = tiny_serve_config(tmp_path / "flat", min_batch=8, max_batch=8, feedback_wait_s=600.0, poll_s=0.05,
                            learn_from_corrections="all")
    # every turn rated +1, the corrected ones too: each demonstration ties its group, so none trains
    last, answers, _, metrics = serve_and_correct(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer, cfg,
                                                  {"correction": "a better answer", "rating": 1.0})
    # before: {"demonstrations": 4, "corrections_left_out": {}}
    assert last["demonstrations"] == 0 and last["with_signal"] == 0, last
    assert last["corrections_left_out"] == {"no signal: its group's rewards were all equal": 4}


def test_without_the_setting_a_correction_is_recorded_and_says_so(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = tiny_serve_config(tmp_path / "off", min_batch=8, max_batch=8, feedback_wait_s=600.0, poll_s=0.05)
    cfg.collapse.max_kl = 50.0
    fix = {"correction_tool_calls": [{"name": "f", "arguments": json.dumps({"x": 1})}]}
    last, answers, _, metrics = serve_and_correct(tiny_model_factory(lora=True, eos_bias=2.0), tiny_tokenizer, cfg, fix)
    assert "demonstrations" not in last and last["with_signal"] == 8 and "feedback/demonstrations" not in metrics
    assert answers[0]["correction"].startswith("recorded only: learner.learn_from_corrections is off")


def test_a_correction_with_bad_calls_is_a_400_naming_the_field(tiny_tokenizer, tiny_model_factory, tmp_path):
    cfg = tiny_serve_config(tmp_path / "bad", learn_from_corrections="all")
    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, cfg) as (url, service):
        code, body = http("POST", url + "/v1/chat/completions", {
            "model": "selfrl", "messages": [{"role": "user", "content": "q"}], "max_tokens": 2}, key=API_KEY)
        rid = body["id"]
        for calls, says in [([{"name": "f", "arguments": "[1]"}], "JSON object"),
                            ([{"name": "f", "arguments": "{"}], "not JSON"),
                            ([{"name": "f", "arguments": "{}"}] * 17, "17"),
                            ([{"name": " ", "arguments": "{}"}], "correction_tool_calls[0].name is empty")]:
            code, body = http("POST", url + "/v1/feedback", {"response_id": rid, "corrected": True,
                                                            "correction_tool_calls": calls}, key=API_KEY)
            assert code == 400 and says in json.dumps(body), body
        # what the answer says is true of this server, which does not learn (before: "trains as a demonstration")
        answers = {}
        for name, fix in [("text", {"correction": "the answer"}), ("no calls", {"correction_tool_calls": []}),
                          ("blank", {"correction": "  "})]:
            code, body = http("POST", url + "/v1/feedback", {"response_id": rid, "corrected": True, **fix}, key=API_KEY)
            assert code == 200, body
            answers[name] = body["correction"]
        assert answers["text"] == ("queued: this server does not learn; a learning server on this run directory with "
                                   "learner.learn_from_corrections = 'all' trains it as a demonstration with its turn, "
                                   "unless it cannot be the turn's answer (its update says why)")
        # before: [] was stored as "[]" and trained an empty answer; a blank text was said to train
        assert answers["no calls"] == answers["blank"] == "recorded only: an empty answer (no text, no calls)"
        with service.store.lock:
            stored = service.store.conn.execute("SELECT correction_calls FROM feedback ORDER BY id").fetchall()
        assert [r[0] for r in stored] == [None, None, None]
        assert records.corrections(service.store, [(rid, 0)]) == {(rid, 0): ("the answer", [])}


def test_a_simulated_user_corrects_a_call_with_the_right_calls():
    from simulated import ScriptedServer

    from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig
    from selfrl.simulate import FakeClock, Simulator
    from selfrl.simulate.families import Family

    fc = Family(FamilySettings("fc", "function_calling", {"categories": ["simple"], "max_params": 3}, users=5))
    cfg = SimulateConfig(families=[fc.settings], phases=[PhaseSettings(86400.0, {"fc": 1.0})], arrivals_per_hour=3.0,
                         max_requests=200).validate()
    cfg.users.noise, cfg.users.rating_p, cfg.users.correction_p, cfg.users.hostile_share = 0.0, 0.0, 1.0, 0.0
    clock = FakeClock(0.0)
    server = ScriptedServer(clock)  # answers "I cannot tell.": always wrong, always corrected
    sim = Simulator(cfg, server, clock=clock, families={"fc": fc})
    sim.run()
    posts = [b for k, _, b in server.calls if k == "feedback"]
    asked = {e["response_id"]: e["conversation"] for e in sim.events if e["event"] == "outcome"}
    plans = {p.index: p for p in Simulator(cfg, ScriptedServer(), families={"fc": fc}).plans()}
    assert len(posts) >= 3 and all("correction" not in p for p in posts)
    for p in posts:  # the calls of the task's first possible answer, arguments as a JSON string
        task = fc.task(plans[asked[p["response_id"]]].task_seed)
        assert p["correction_tool_calls"] == [{"name": c["name"], "arguments": json.dumps(c["arguments"])}
                                              for c in first_answer_calls(task)] != []



@pytest.mark.parametrize("calls_first", [False, True])
def test_an_arithmetic_user_corrects_a_first_step_with_the_calculator_call(calls_first):
    from simulated import ScriptedServer

    from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig
    from selfrl.simulate import FakeClock, Simulator
    from selfrl.simulate.families import Family

    class Guesser(ScriptedServer):  # answers at once, without the calculator: always wrong
        def chat(self, user, body):
            return super().chat(user, {k: v for k, v in body.items() if k != "tools"})

    ar = Family(FamilySettings("ar", "arithmetic", {}, users=5))
    cfg = SimulateConfig(families=[ar.settings], phases=[PhaseSettings(86400.0, {"ar": 1.0})], arrivals_per_hour=3.0,
                         max_requests=200).validate()
    cfg.users.noise, cfg.users.rating_p, cfg.users.correction_p, cfg.users.hostile_share = 0.0, 0.0, 1.0, 0.0
    clock = FakeClock(0.0)
    server = ScriptedServer(clock, wrong=True) if calls_first else Guesser(clock)
    sim = Simulator(cfg, server, clock=clock, families={"ar": ar})
    sim.run()
    posts = [b for k, _, b in server.calls if k == "feedback"]
    asked = {e["response_id"]: e["conversation"] for e in sim.events if e["event"] == "outcome"}
    plans = {p.index: p for p in Simulator(cfg, ScriptedServer(), families={"ar": ar}).plans()}
    assert len(posts) >= 3
    for p in posts:
        task = ar.task(plans[asked[p["response_id"]]].task_seed)
        if calls_first:  # the turn after the calculator's result: its right answer is the number
            assert p["correction"] == task.answer and "correction_tool_calls" not in p
        else:  # before: a text correction, which learn_from_corrections = "calls" never trains
            expression = task.metadata["entry"]["metadata"]["expression"]
            assert "correction" not in p and p["correction_tool_calls"] == [
                {"name": "calculator", "arguments": json.dumps({"expression": expression})}]


def test_after_a_tool_result_the_right_answer_is_the_number_as_text():
    from selfrl.config.simulate import FamilySettings
    from selfrl.simulate.families import Family

    ar = Family(FamilySettings("ar", "arithmetic", {}, users=1))
    task = ar.task(5)
    expression = task.metadata["entry"]["metadata"]["expression"]
    first = [{"role": "system", "content": "s"}, {"role": "user", "content": "example"},
             {"role": "tool", "content": "47"}, {"role": "assistant", "content": "<answer>47</answer>"},
             {"role": "user", "content": task.question}, {"role": "assistant", "content": "<answer>3</answer>"}]
    assert ar.right_calls(task, first) == [{"name": "calculator", "arguments": {"expression": expression}}]
    called = first[:-1] + [{"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
                           {"role": "tool", "content": "4"}, {"role": "assistant", "content": "<answer>3</answer>"}]
    assert ar.right_calls(task, called) == []
    failed = called[:-2] + [{"role": "tool", "content": "error: unknown tool 'add'; valid tools: calculator"},
                            {"role": "assistant", "content": "<answer>3</answer>"}]
    assert ar.right_calls(task, failed) == ar.right_calls(task, first)  # an error is no result: call it again
    wrapped = called[:-2] + [{"role": "tool", "content": "<tool_response>\nerror: arguments are not JSON\n</tool_response>"},
                             {"role": "assistant", "content": "<answer>3</answer>"}]
    assert ar.right_calls(task, wrapped) == ar.right_calls(task, first)  # the tags around it: still an error
    worded = called[:-2] + [{"role": "tool", "content": "errors: 0; result 4"},
                            {"role": "assistant", "content": "<answer>3</answer>"}]
    assert ar.right_calls(task, worded) == []  # a result that begins "error" is a result (it read as an error)
    web = Family(FamilySettings("w", "web", {"tier": "easy"}, users=1))
    assert web.right_calls(web.task(0), first) == []  # no calculator expression: a text correction

def said(task):
    return [{"role": "system", "content": "s"}, {"role": "user", "content": task.question},
            {"role": "assistant", "content": "<answer>1</answer>"}]


@pytest.mark.parametrize("env, options", [("arithmetic", {"tool_choice": "none"}), ("rg:countdown", {}),
                                          ("rg:circuit_logic", {})])
def test_no_calculator_correction_where_the_calculator_is_not_the_right_step(env, options):
    # before: a calculator call for a prompt that offered no tools, for countdown (whose answer is the
    # expression itself) and for circuit_logic (a logic formula the calculator refuses)
    from selfrl.config.simulate import FamilySettings
    from selfrl.simulate.families import Family

    fam = Family(FamilySettings("x", env, {}, users=1, **options))
    task = fam.task(3)
    assert fam.right_calls(task, said(task)) == []


def test_an_empty_tool_result_is_no_answer():
    from selfrl.config.simulate import FamilySettings
    from selfrl.simulate.families import Family

    fam = Family(FamilySettings("x", "arithmetic", {}, users=1))
    task = fam.task(3)
    msgs = said(task)[:2] + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
                             {"role": "tool", "content": None}, {"role": "assistant", "content": "<answer>1</answer>"}]
    assert fam.right_calls(task, msgs) == [{"name": "calculator", "arguments": {
        "expression": task.metadata["entry"]["metadata"]["expression"]}}]


def test_an_update_of_demonstrations_alone_is_still_kl_probed():
    import types

    from selfrl.run.cycle import UpdateCycle
    from selfrl.serve.corrections import sampled_only

    demo = Trajectory("t", "g", 0, prompt_len=1, token_ids=[5, 6], completion_mask=[0, 1], logprobs=[0, -1],
                      id="x-correction")
    demo.advantage, seen = 1.0, []
    learner = types.SimpleNamespace(step=lambda trajs, on_micro_batch=None, lr_factor=1.0: types.SimpleNamespace(skipped=False),
                                    probe_kl=lambda trajs, n: seen.append([t.id for t in trajs]) or 0.1, model=None)
    cycle = types.SimpleNamespace(learner=learner, ledger=types.SimpleNamespace(save_candidate=lambda m, p: "v1"),
                                  collapse_cfg=types.SimpleNamespace(enabled=True, kl_probe_size=4))
    step = UpdateCycle.update(cycle, 0, [demo], 0, sampled=sampled_only([demo], [demo]))
    assert step.candidate_kl == 0.1 and seen == [["x-correction"]]  # before: nothing probed, no KL check


def one(tok, kinds, fix, max_len=256, context=None):
    return demonstrations([(turn(tok, kinds), row())], {("r1", 0): fix}, tok, eos(tok), 7, max_len, WEIGHTS,
                          context)


@pytest.mark.parametrize("kinds, fix, reason", [
    # before: each trained as a demonstration the turn's grammar could never have sampled
    (["tool_call_or_json"], ("it is sunny", []), "neither one tool call nor the JSON"),
    (["tool_call_or_json"], ("let me look", [CALL]), "neither one tool call nor the JSON"),
    (["tool_call"], ("let me look", [CALL]), "grammar would not let the model write it"),
    (["tool_call"], ("", [CALL, CALL]), "grammar would not let the model write it"),
    (["tool_call"], ("", [{"name": "rm_rf", "arguments": {}}]), "grammar would not let the model write it"),
    (["tool_call"], ("", [{"name": "get_weather", "arguments": {"town": "Paris"}}]), "grammar would not let"),
    (["json"], ("[1, 2]", []), "grammar would not let the model write it"),  # JSON, but not the object it asked
    # before: an empty answer (just the end-of-turn token) trained at reward +1
    ([], ("", []), "an empty answer"),
    ([], (" \n\t", []), "an empty answer"),
    # before: the markup in the text trained a call that no reward checked
    ([], ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []), "tool-call markup"),
    # before: a correction stored before NaN was refused (a 400 now) trained the text "NaN"
    (["tool_call"], ("", [{"name": "get_weather", "arguments": {"city": float("nan")}}]),
     "correction_tool_calls[0].arguments.city is not a finite number"),
    ([], ("", [CALL, {"name": "f", "arguments": {"x": [1, float("-inf")]}}]),
     "correction_tool_calls[1].arguments.x[1] is not a finite number"),
])
def test_a_correction_a_grammar_or_common_sense_refuses_is_left_out(tiny_tokenizer, kinds, fix, reason):
    demos, skipped = one(tiny_tokenizer, kinds, fix)
    assert demos == [] and sum(skipped.values()) == 1 and reason in next(iter(skipped)), skipped


def test_corrections_the_turns_grammar_allows_train_compact(tiny_tokenizer):
    [call], _ = one(tiny_tokenizer, ["tool_call_or_json"], ("", [CALL]))
    [answer], _ = one(tiny_tokenizer, ["tool_call_or_json"], ('{"a": [1, 2]}', []))
    decode = tiny_tokenizer.decode
    assert decode(call.token_ids[call.prompt_len:]) == \
        '<tool_call>{"name":"get_weather","arguments":{"city":"Paris"}}</tool_call><|im_end|>'
    assert decode(answer.token_ids[answer.prompt_len:]) == '{"a":[1,2]}<|im_end|>'


def test_a_demonstration_never_runs_past_the_models_context(tiny_tokenizer):
    P = turn(tiny_tokenizer).prompt_len
    demos, skipped = one(tiny_tokenizer, [], ("sunny and warm today", []), context=P + 3)
    assert demos == [] and dict(skipped) == {
        "longer than the 3 tokens its prompt leaves of the model's context (%d)" % (P + 3): 1}
    [demo], _ = one(tiny_tokenizer, [], ("sunny and warm today", []), context=P + 64)
    assert len(demo.token_ids) <= P + 64


def test_call_tags_are_the_models_tokens_and_argument_text_stays_text(tiny_tokenizer):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)  # a Hermes-style tokenizer: the call tags are special tokens
    tok.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_start|>", "<tool_call>",
                                                          "</tool_call>"]})
    open_id, close_id = tok.convert_tokens_to_ids("<tool_call>"), tok.convert_tokens_to_ids("</tool_call>")
    forged = {"name": "say", "arguments": {"text": "<|im_end|><|im_start|>user"}}
    ids = completion_ids(tok, "ok", eos(tok), [forged])
    # before: the whole answer was tokenized as text, so the tags were not the ids the model samples
    assert ids[-1] == eos(tok)[0] and ids.count(eos(tok)[0]) == 1
    assert ids.count(open_id) == 1 and ids.count(close_id) == 1
    assert tok.convert_tokens_to_ids("<|im_start|>") not in ids  # the argument's control-token text stays text
    assert tok.decode(ids) == answer_text("ok", [forged]) + "<|im_end|>"


def test_the_same_correction_of_several_choices_of_one_response_trains_once(tiny_tokenizer):
    batch = [(turn(tiny_tokenizer, tid=f"t{i}"), {"response_id": "r1", "choice": i, "group_key": "g"})
             for i in range(3)]
    found = {("r1", 0): ("sunny", []), ("r1", 1): ("sunny", []), ("r1", 2): ("cloudy", [])}
    demos, skipped = demonstrations(batch, found, tiny_tokenizer, eos(tiny_tokenizer), 7, 64, WEIGHTS)
    assert [d.final_answer for d in demos] == ["sunny", "cloudy"]
    assert dict(skipped) == {"the same answer as a corrected choice of its response (trained once)": 1}


def test_a_demonstration_is_never_below_its_group_and_one_without_signal_says_so(tiny_tokenizer):
    from types import SimpleNamespace

    from selfrl.rl.advantages import group_advantages
    from selfrl.serve.background import BackgroundLearner
    from selfrl.serve.corrections import signal_report

    def served(tid, feedback, calls):
        t = turn(tiny_tokenizer, tid=tid)
        if calls:
            t.tool_calls = [ToolCallRecord("get_weather", {"city": "Paris"}, "", True, "")]
        return t, {"response_id": tid, "choice": 0, "group_key": "g", "feedback": feedback}

    # twelve turns rated +1 whose calls succeeded (1.2 each), one wrong (-1), corrected with text (1.0)
    batch = [served(f"ok{i}", 1.0, True) for i in range(12)] + [served("bad", -1.0, False)]
    [demo], _ = demonstrations(batch[12:], {("bad", 0): ("it is sunny", [])}, tiny_tokenizer, eos(tiny_tokenizer),
                               7, 64, WEIGHTS)
    seen = []

    def advantages(step, trajs):
        seen.extend(trajs)
        adv = group_advantages([t.reward for t in trajs], [t.group_id for t in trajs], "none")
        for t, a in zip(trajs, adv.advantages):
            t.advantage = a

    fake = SimpleNamespace(cfg=SimpleNamespace(learner=SimpleNamespace(reward_weights=WEIGHTS)), updates=0,
                           cycle=SimpleNamespace(advantages=advantages))
    scored, _ = BackgroundLearner.score(fake, batch, [demo])
    assert [round(t.reward, 6) for t in scored] == [1.2] * 12 + [-1.0]
    # before: the demonstration kept 1.0, below its group's mean (14.4 / 14), and was pushed down
    assert demo.reward == pytest.approx(1.2) and demo in seen and demo.advantage > 0
    report = {"demonstrations": 1, "corrections_left_out": {}}
    assert signal_report(report, [demo]) == report
    demo.advantage = 0.0  # its group all equal: it trains nothing, and the update says so
    assert signal_report(report, [demo]) == {"demonstrations": 0, "corrections_left_out": {
        "no signal: its group's rewards were all equal": 1}}
    assert signal_report({}, []) == {}


def test_the_store_ignores_empty_corrections(tmp_path):
    store = store_with_one_turn(tmp_path)
    records.apply_feedback(store, "r1", 0, "explicit", -1.0, corrected=True, correction="the answer")
    records.apply_feedback(store, "r1", 0, "explicit", -1.0, corrected=True, correction_calls=[])  # before: won
    records.apply_feedback(store, "r1", 0, "explicit", -1.0, corrected=True, correction=" \n")
    assert records.corrections(store, [("r1", 0)]) == {("r1", 0): ("the answer", [])}
    store.close()


def test_a_replica_whose_use_of_corrections_is_not_its_owners_is_refused():
    from selfrl.config import ConfigError
    from selfrl.config.serve import LearnerSettings
    from selfrl.serve.replica import check_owner_age_rule

    owner = {"config": {"serve": {"replica": False, "learner": {"learn_from_corrections": "all"}}}}
    check_owner_age_rule(LearnerSettings(learn_from_corrections="all"), [owner], "runs/x")
    # before: the replica answered "recorded only: learn_from_corrections is off" and the owner trained it
    with pytest.raises(ConfigError, match="learner.learn_from_corrections = 'off' here, 'all' there"):
        check_owner_age_rule(LearnerSettings(), [owner], "runs/x")


def test_calls_only_leaves_text_corrections_out_and_says_so(tiny_tokenizer):
    # arithmetic's users correct with the final number alone, which trained on rewards answering without the
    # calculator; "calls" trains only corrections whose calls are the whole answer
    batch = [(turn(tiny_tokenizer, tid="t1"), row("r1")), (turn(tiny_tokenizer, tid="t2"), row("r2"))]
    found = {("r1", 0): ("47", []), ("r2", 0): ("", [CALL])}
    demos, skipped = demonstrations(batch, found, tiny_tokenizer, eos(tiny_tokenizer), 7, 64, WEIGHTS, use="calls")
    assert [d.parent_id for d in demos] == ["t2"]
    assert dict(skipped) == {'learner.learn_from_corrections = "calls" trains only corrections that carry the calls '
                             '(correction_tool_calls); "all" trains text too': 1}
    demos, skipped = demonstrations(batch, found, tiny_tokenizer, eos(tiny_tokenizer), 7, 64, WEIGHTS, use="all")
    assert [d.parent_id for d in demos] == ["t1", "t2"] and not skipped


def test_the_setting_takes_off_calls_or_all():
    from selfrl.config import ConfigError
    from selfrl.config.serve import LearnerSettings

    for ok in ("off", "calls", "all"):
        LearnerSettings(learn_from_corrections=ok).check()
    with pytest.raises(ConfigError, match="learn_from_corrections"):
        LearnerSettings(learn_from_corrections=True).check()

