"""The function-calling environment: BFCL data, per-task tools, AST match and partial credit."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from selfrl.envs.function_calling import LIVE_CATEGORIES, FunctionCallingEnv, _shots, canonical_calls, partial_score
from selfrl.envs.rewards import get_preset, score_group
from selfrl.rollout.agent import RolloutConfig, scripted_rollout

ENV = FunctionCallingEnv()
CFG = RolloutConfig(max_turns=2, tools=[])


def _by_id(bfcl_id: str):
    return next(t for ts in ENV.by_category.values() for t in ts if t.metadata["bfcl_id"] == bfcl_id)


def test_categories_sizes_and_held_out_mix():
    assert {c: len(v) for c, v in ENV.by_category.items()} == {
        "simple": 400, "multiple": 200, "parallel": 200, "parallel_multiple": 200, "irrelevance": 240}
    train, val = ENV.split(400, 96, 0, 0)
    assert Counter(t.metadata["category"] for t in val) == {
        "simple": 31, "irrelevance": 19, "multiple": 16, "parallel": 15, "parallel_multiple": 15}
    assert Counter(t.metadata["category"] for t in train) == {c: 80 for c in ENV.by_category}
    assert not {t.id for t in train} & {t.id for t in val}
    with pytest.raises(ValueError, match="unknown BFCL categories"):
        FunctionCallingEnv(categories=["simple", "live"])


def _score(task, calls):
    return ENV.score(task, json.dumps(calls))


def test_exact_ast_match_or_partial_credit_on_real_bfcl_answers():
    task = _by_id("simple_python_0")  # calculate_triangle_area(base=10, height=5, unit optional)
    gt, fns = task.metadata["ground_truth"], task.metadata["functions"]
    call = {"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}
    assert _score(task, [call]) == 1.0
    assert _score(task, [{**call, "arguments": {"base": 10, "height": 5, "unit": "units"}}]) == 1.0
    # the right name (0.5) and 2 of 3 arguments right (base; unit optional and left out)
    assert _score(task, [{**call, "arguments": {"base": 10, "height": 6}}]) == 0.5 + 0.5 * 2 / 3
    assert _score(task, [{**call, "arguments": {"base": 10.0, "height": 5}}]) == 0.9  # BFCL: a float is not an integer
    assert partial_score([{**call, "arguments": {"base": 10.0, "height": 5}}], gt, fns) == (True, 1.0)  # lenient
    assert _score(task, [{**call, "arguments": {"base": 10, "height": 5, "color": "red"}}]) < 1.0
    assert _score(task, [{"name": "other", "arguments": {}}]) == 0.0
    assert _score(task, [call, call]) < 1.0  # one call too many
    par = _by_id("parallel_0")  # two spotify.play calls, any order
    calls = [{"name": "spotify.play", "arguments": {"artist": "Maroon 5", "duration": 15}},
             {"name": "spotify.play", "arguments": {"artist": "taylor swift", "duration": 20}}]
    assert _score(par, calls) == 1.0


def test_scripted_calls_are_recorded_scored_and_agree():
    task = _by_id("simple_python_0")
    right = '<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}</tool_call>'
    wrong = '<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": 5, "height": 10}}</tool_call>'
    trajs = []
    for text in (right, right, wrong, "I cannot help."):
        trajs += scripted_rollout(lambda t, m, x=text: x, [task], [], CFG, ENV.make_env, group_ids=["g"])
    assert trajs[0].num_turns == 1 and trajs[0].env_state["calls"][0]["arguments"] == {"base": 10, "height": 5}
    score_group(trajs, task, ENV, get_preset("function_calling-partial"))
    # wrong: the right name (0.5) and 1 of 3 arguments right (unit, optional, left out): 0.5 + 0.5 / 3
    assert [t.reward for t in trajs] == [1.0, 1.0, 0.5 + 0.5 / 3, 0.0] and [t.correct for t in trajs] == [True, True, False, False]
    score_group(trajs, task, ENV, get_preset("function_calling-label-free"))
    assert [t.reward for t in trajs] == [1 / 3, 1 / 3, 0.0, 0.0]  # share of the 3 others with the same calls
    assert canonical_calls({"calls": []}) == "[]" and json.loads(ENV.trajectory_answer(trajs[3])) == []


def test_irrelevance_is_right_without_a_call():
    task = _by_id("irrelevance_0")
    assert task.metadata["ground_truth"] == [] and ENV.score(task, "[]") == 1.0
    assert ENV.score(task, json.dumps([{"name": "determine_body_mass_index", "arguments": {}}])) == 0.0


def test_one_turn_calls_are_parsed_from_the_text_and_scored():
    """With max_turns = 1 the call is written but never dispatched: the answer is read from the text."""
    task = _by_id("simple_python_0")
    text = '<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": 10, "height": 5}}</tool_call>'
    bad = '<tool_call>{"name": "calculate_triangle_area", "arguments": {"base": 10, </tool_call>'
    one_turn = RolloutConfig(max_turns=1, tools=[])
    [good] = scripted_rollout(lambda t, m: text, [task], [], one_turn, ENV.make_env)
    [broken] = scripted_rollout(lambda t, m: bad, [task], [], one_turn, ENV.make_env)
    assert good.env_state == {"calls": []} and good.tool_calls == []  # nothing ran
    assert ENV.score(task, ENV.trajectory_answer(good)) == 1.0
    assert ENV.trajectory_answer(broken) == "[]" and ENV.score(task, "[]") == 0.0


LIVE = FunctionCallingEnv(categories=list(LIVE_CATEGORIES))


def _live(bfcl_id: str):
    return next(t for ts in LIVE.by_category.values() for t in ts if t.metadata["bfcl_id"] == bfcl_id)


def test_live_categories_are_tasks_and_what_is_left_out_is_counted():
    assert {c: len(v) for c, v in LIVE.by_category.items()} == {
        "live_simple": 258, "live_multiple": 1053, "live_parallel": 16, "live_parallel_multiple": 24,
        "live_irrelevance": 871, "live_relevance": 16}
    assert LIVE.left_out == {"live_irrelevance": {"a conversation, not one request": 9, "no function offered": 4}}
    train, val = LIVE.split(400, 96, 0, 0)
    assert len(val) == 96 and not {t.id for t in train} & {t.id for t in val}
    assert ENV.left_out == {}  # the default categories lose nothing


def test_a_live_system_message_comes_before_the_request():
    task = _live("live_simple_257-137-1")
    assert task.question.startswith("call HANDOVER function to transfer the request if user asks a question.\n\n")
    assert task.question.endswith("Can you tell me what is the minimum package arrival time? ")


def test_live_answers_score_with_nested_values():
    """live_multiple_0-0-0 expects new_preferences as a dict of accepted values per key: the
    worked-example form of its answer (first value of each) passes BFCL's check."""
    task = _live("live_multiple_0-0-0")
    (answer,) = _shots([task])[1:2]
    calls = [json.loads(c.removesuffix("</tool_call>")) for c in answer["content"].split("<tool_call>")[1:]]
    assert isinstance(calls[0]["arguments"]["new_preferences"], dict)
    assert _score(task, calls) == 1.0


def test_live_relevance_is_right_with_a_call_and_gets_no_partial_credit():
    task = LIVE.by_category["live_relevance"][0]
    name = task.metadata["functions"][0]["name"]
    assert _score(task, [{"name": name, "arguments": {}}]) == 1.0
    assert _score(task, []) == 0.0  # not 0.9: no call is the one wrong answer


def test_shots_never_come_from_live_relevance():
    env = FunctionCallingEnv(categories=["live_relevance", "live_parallel"], shots=2)
    users = [m["content"] for m in env.demonstration if m["role"] == "user"]
    parallel = {t.question for t in load_bfcl_tasks("live_parallel")}
    assert len(users) == 2 and set(users) <= parallel
    with pytest.raises(ValueError, match="live_relevance has no possible answer"):
        FunctionCallingEnv(categories=["live_relevance"], shots=1)


def load_bfcl_tasks(category):
    return FunctionCallingEnv(categories=[category]).by_category[category]
