"""A correction's calls against the tools its turn could call (``ServedTurn.tools``,
:func:`selfrl.serve.corrections.offered_problem`): what the server records per turn, what the
learner leaves out, and what the feedback's answer says."""

from __future__ import annotations

import json
import sqlite3

import pytest

from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.serve.corrections import demonstrations
from serving import API_KEY, http, running_server, tiny_serve_config
from test_serve_corrections import CALL, TOOLS, WEIGHTS, eos, row, turn

OFFERED = [{"name": name, "parameters": schema} for name, schema in TOOLS]


@pytest.mark.parametrize("tools, calls, reason", [
    # before: each trained, on a turn decoded without a grammar, a call the model could never make there
    (OFFERED, [{"name": "rm_rf", "arguments": {}}],
     "correction_tool_calls[0] calls 'rm_rf', a tool its turn was not offered (offered: get_time, get_weather)"),
    ([], [CALL], "correction_tool_calls[0] calls 'get_weather', and its turn could call no tool"),
    (OFFERED, [CALL, {"name": "get_weather", "arguments": {"town": "Paris"}}],
     "correction_tool_calls[1].arguments: 'get_weather' is missing required argument(s): city"),
    (OFFERED, [{"name": "get_weather", "arguments": {"city": 7}}],
     "correction_tool_calls[0].arguments: argument 'city' of 'get_weather' must be string, got integer"),
])
def test_a_correction_calling_what_its_turn_could_not_is_left_out(tiny_tokenizer, tools, calls, reason):
    demos, skipped = demonstrations([(turn(tiny_tokenizer), {**row(), "tools": json.dumps(tools)})],
                                    {("r1", 0): ("", calls)}, tiny_tokenizer, eos(tiny_tokenizer), 7, 256, WEIGHTS)
    assert demos == [] and sum(skipped.values()) == 1 and next(iter(skipped)).startswith(reason), skipped


@pytest.mark.parametrize("tools", [json.dumps(OFFERED), None])  # None: a turn stored before tools were
def test_a_call_of_an_offered_tool_trains_and_unknown_tools_are_not_checked(tiny_tokenizer, tools):
    demos, skipped = demonstrations([(turn(tiny_tokenizer), {**row(), "tools": tools})], {("r1", 0): ("", [CALL])},
                                    tiny_tokenizer, eos(tiny_tokenizer), 7, 256, WEIGHTS)
    assert len(demos) == 1 and not skipped and demos[0].messages[-1]["tool_calls"] == [CALL]


def test_a_served_turn_records_the_tools_it_could_call_and_the_answer_says_a_call_is_not_one(
        tiny_tokenizer, tiny_model_factory, tmp_path):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": TOOLS[0][1]}}
    clock = {"type": "function", "function": {"name": "get_time", "parameters": TOOLS[1][1]}}
    cfg = tiny_serve_config(tmp_path / "tools", learn_from_corrections="all")
    with running_server(tiny_model_factory(lora=True), tiny_tokenizer, cfg) as (url, service):
        ids = {}
        for name, extra in [("auto", {"tools": [weather, clock]}), ("named", {"tools": [weather, clock], "tool_choice": {
                "type": "function", "function": {"name": "get_time"}}}), ("none", {"tools": [weather], "tool_choice": "none"}),
                            ("no tools", {})]:
            code, body = http("POST", url + "/v1/chat/completions", {
                "model": "selfrl", "messages": [{"role": "user", "content": "q"}], "max_tokens": 4, **extra}, key=API_KEY)
            assert code == 200, body
            ids[name] = body["id"]
        recorded = {name: json.loads(records.find_response(service.store, rid)["tools"]) for name, rid in ids.items()}
        assert [t["name"] for t in recorded["auto"]] == ["get_weather", "get_time"]
        assert recorded["auto"][0]["parameters"] == TOOLS[0][1]
        assert [t["name"] for t in recorded["named"]] == ["get_time"]  # tool_choice named it: that tool alone
        assert recorded["none"] == recorded["no tools"] == []
        answers = {}
        weather_call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
        for name, calls in [("auto", [{"name": "rm_rf", "arguments": "{}"}]), ("named", [weather_call]),
                            ("none", [weather_call]), ("auto-ok", [weather_call])]:
            code, body = http("POST", url + "/v1/feedback", {"response_id": ids[name.removesuffix("-ok")], "corrected": True,
                                                            "correction_tool_calls": calls}, key=API_KEY)
            assert code == 200, body  # the feedback itself is kept: the turn was wrong
            answers[name] = body["correction"]
        # before: "queued: ... trains it as a demonstration with its turn" for each
        assert answers["auto"] == ("recorded only: correction_tool_calls[0] calls 'rm_rf', a tool its turn was not "
                                   "offered (offered: get_time, get_weather)")
        assert answers["named"].startswith("recorded only: correction_tool_calls[0] calls 'get_weather', a tool its "
                                           "turn was not offered (offered: get_time)")
        assert answers["none"] == "recorded only: correction_tool_calls[0] calls 'get_weather', and its turn could call no tool"
        assert answers["auto-ok"].startswith("queued: this server does not learn")


def test_a_store_written_before_the_tools_column_gets_it_and_its_turns_are_not_checked(tmp_path):
    path = tmp_path / "old.sqlite"
    old = records.SERVE_SCHEMA.replace("    tools           TEXT,\n", "")
    assert old != records.SERVE_SCHEMA
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.executescript(old)
    conn.close()
    store = Store(path)
    records.init(store)
    assert "tools" in {r[1] for r in store.conn.execute("PRAGMA table_info(served)")}
    t = Trajectory("task", "g", 0, prompt_len=1, token_ids=[1, 2], completion_mask=[0, 1], logprobs=[0.0, -1.0])
    records.add_turn(store, store.start_run({}), t, "r1", 0, "c", "g", "k")  # add_turn: tools not known
    assert records.find_response(store, "r1")["tools"] is None
    store.close()


def test_a_name_that_imitates_an_offered_one_reads_apart_from_it():
    # before: "calls 'météo_天気', a tool its turn was not offered (offered: météo_天気)": the called name
    # was e + a combining accent, the offered one the composed é, and the two read the same
    from selfrl.serve.corrections import offered_problem

    offered = [{"name": "météo_天気", "parameters": {}}, {"name": "get\u200btime", "parameters": {}}]
    assert offered_problem([{"name": "me\u0301te\u0301o_天気", "arguments": {}}], offered) == (
        'correction_tool_calls[0] calls "me\\u0301te\\u0301o_天気", a tool its turn was not offered '
        '(offered: "get\\u200btime", météo_天気)')
    assert offered_problem([{"name": "météo_天気", "arguments": {}}], offered) is None

