"""What ``POST /v1/feedback`` makes of a message, and how every request body is typed.

* a comment alone judges nothing: the turn keeps its value (or stays without one), and the
  answer says so (old code: the turn's rating became 0.0, and an unrated turn got reward 0);
* a message that carries a correction is a corrected one (old code: ``{"correction": "42"}``
  stored 0.0);
* booleans and integers are not coerced (old code: ``"corrected": "yes"`` was -1, ``"record":
  "no"`` kept a turn out of the store, ``"choice": 1.0`` and ``"version": 1e3`` were taken);
* a body without ``Content-Type: application/json`` is told to set it;
* the admin routes name ``version`` (old code: a rollback to an unknown version named ``model``);
* an empty answer has ``content: ""`` (old code: null, which OpenAI sends only beside tool calls).
"""

from __future__ import annotations

import json
import sqlite3
import urllib.error
import urllib.request

import pytest

from selfrl.record import served as records
from selfrl.record.store import Store
from serving import API_KEY, CALC, http
from test_serve_e2e import script


def turn(client, content: str = "What is 6*7?") -> str:
    return client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": content}],
                                          max_tokens=2).id


def feedback(url, body):
    return http("POST", url + "/v1/feedback", body, key=API_KEY)


def held(service, response_id):
    """``(feedback, feedback_source, status)`` of the turn, and its feedback rows ``(value, corrected, comment)``."""
    with service.store.lock:
        row = records.find_response(service.store, response_id)
        rows = service.store.conn.execute("SELECT value, corrected, comment FROM feedback WHERE response_id = ? "
                                          "ORDER BY id", (response_id,)).fetchall()
    return (row["feedback"], row["feedback_source"], row["status"]), [tuple(r) for r in rows]


# ------------------------------------------------------------------ a comment alone


def test_a_comment_alone_keeps_the_rating_the_turn_holds(server, client):
    url, service = server
    rid = turn(client)
    assert feedback(url, {"response_id": rid, "rating": 1})[1]["reward"] == 1.0
    status, body = feedback(url, {"response_id": rid, "comment": "thanks"})
    assert status == 200, body
    assert body["reward"] is None and body["outcome"] == "comment_only"
    assert body["turns_updated"] == 0 and body["turns_too_late"] == 0
    assert body["reason"].endswith("it keeps its feedback value 1 (explicit)")
    assert "a comment alone is no judgement" in body["reason"]
    turn_row, rows = held(service, rid)
    assert turn_row == (1.0, "explicit", "pending")
    assert rows == [(1.0, 0, None), (None, 0, "thanks")]  # both stored, the comment without a value


def test_a_comment_alone_leaves_an_unrated_turn_without_a_value(server, client):
    url, service = server
    rid = turn(client, "What is 2+2?")
    status, body = feedback(url, {"response_id": rid, "comment": "hm", "correction": "  "})
    assert status == 200 and body["reward"] is None and body["outcome"] == "comment_only"
    assert body["reason"].endswith("it has no feedback value yet")
    assert body["correction"].startswith("recorded only: an empty answer")
    assert held(service, rid)[0] == (None, None, "pending")  # not made trainable with reward 0


# ------------------------------------------------------------------ a correction is a correction


@pytest.mark.parametrize("fix", [{"correction": "42"},
                                 {"correction_tool_calls": [{"name": "calculator",
                                                             "arguments": '{"expression": "6*7"}'}]}])
def test_a_message_that_carries_a_correction_counts_as_corrected(server, client, fix):
    url, service = server
    rid = turn(client)
    status, body = feedback(url, {"response_id": rid, **fix})
    assert status == 200 and body["reward"] == -1.0 and body["outcome"] in ("used", "queued")
    turn_row, rows = held(service, rid)
    assert turn_row[:2] == (-1.0, "explicit") and rows == [(-1.0, 1, None)]
    # a rating still wins over the -1 of a correction
    assert feedback(url, {"response_id": rid, "rating": 0.5, **fix})[1]["reward"] == 0.5


@pytest.mark.parametrize("body, param, phrase", [
    ({"corrected": False, "correction": "42"}, "corrected", "corrected is false, but the message carries a correction"),
    ({}, None, "the feedback says nothing"),
    ({"comment": "   "}, None, "the feedback says nothing"),
    ({"rating": None}, None, "the feedback says nothing"),
])
def test_feedback_that_contradicts_itself_or_says_nothing_is_refused(server, client, body, param, phrase):
    url, service = server
    rid = turn(client)
    status, out = feedback(url, {"response_id": rid, **body})
    assert status == 400 and out["error"]["param"] == param and phrase in out["error"]["message"], out
    assert held(service, rid) == ((None, None, "pending"), [])  # nothing stored


# ------------------------------------------------------------------ strict types


@pytest.mark.parametrize("route, body, param, wanted", [
    ("/v1/feedback", {"corrected": "yes"}, "corrected", 'true or false (a JSON boolean), got the string "yes"'),
    ("/v1/feedback", {"corrected": 1, "rating": 1}, "corrected", "true or false (a JSON boolean), got the number 1"),
    ("/v1/feedback", {"choice": "0", "rating": 1}, "choice", 'an integer, got the string "0"'),
    ("/v1/feedback", {"choice": 1.0, "rating": 1}, "choice", "an integer, got the number 1.0"),
    ("/v1/feedback", {"rating": "1"}, "rating", 'a number, got the string "1"'),
    ("/v1/chat/completions", {"record": "no"}, "record", 'true or false (a JSON boolean), got the string "no"'),
    ("/v1/chat/completions", {"stream": "false"}, "stream", 'true or false (a JSON boolean), got the string "false"'),
    ("/v1/chat/completions", {"n": 1.0}, "n", "an integer, got the number 1.0"),
    ("/v1/chat/completions", {"max_tokens": "2"}, "max_tokens", 'an integer, got the string "2"'),
    ("/v1/chat/completions", {"temperature": "0.5"}, "temperature", 'a number, got the string "0.5"'),
    ("/v1/responses", {"record": "no"}, "record", 'true or false (a JSON boolean), got the string "no"'),
    ("/v1/responses", {"max_output_tokens": 2.0}, "max_output_tokens", "an integer, got the number 2.0"),
    ("/admin/rollback", {"version": 1e3}, "version", "an integer, got the number 1000.0"),
    ("/admin/pin", {"version": "0"}, "version", 'an integer, got the string "0"'),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(server, client, route, body, param, wanted):
    url, service = server
    base = {"/v1/feedback": lambda: {"response_id": turn(client)},
            "/v1/chat/completions": lambda: {"model": "selfrl", "messages": [{"role": "user", "content": "x"}],
                                             "max_tokens": 2},
            "/v1/responses": lambda: {"model": "selfrl", "input": "x", "max_output_tokens": 2},
            "/admin/rollback": dict, "/admin/pin": dict}[route]()
    with service.store.lock:
        before = (service.store.count_trajectories(), service.store.conn.execute("SELECT COUNT(*) FROM feedback")
                  .fetchone()[0], service.pinned, service.engine.version)
    status, out = http("POST", url + route, {**base, **body}, key=API_KEY)
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["message"] == f"{param} must be {wanted}", out
    with service.store.lock:
        after = (service.store.count_trajectories(), service.store.conn.execute("SELECT COUNT(*) FROM feedback")
                 .fetchone()[0], service.pinned, service.engine.version)
    assert after == before  # nothing served, recorded, pinned or rolled back


def test_numbers_take_integers_and_the_right_types_still_pass(server, client):
    url, _ = server
    rid = turn(client)
    assert feedback(url, {"response_id": rid, "choice": 0, "rating": 1, "corrected": False})[0] == 200
    status, body = http("POST", url + "/v1/chat/completions", {"model": "selfrl", "messages": [
        {"role": "user", "content": "x"}], "max_tokens": 2, "temperature": 1, "top_p": 1, "record": False,
        "stream": False, "n": 1, "tools": [CALC], "tool_choice": "auto"})
    assert status == 200, body


def post_raw(url, data: bytes, content_type: str | None):
    headers = {"authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["content-type"] = content_type
    req = urllib.request.Request(url, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as f:
            return f.status, json.loads(f.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("route", ["/v1/feedback", "/v1/chat/completions", "/admin/pin"])
@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_sent_without_the_json_content_type_is_told_to_set_it(server, route, content_type):
    # what curl -d '{...}' sends: urllib, like curl, sends a form type when none is given
    url, _ = server
    status, out = post_raw(url + route, b'{"version": 0}', content_type)
    assert status == 400 and out["error"]["param"] is None
    assert out["error"]["message"] == ("the body must be a JSON object sent with Content-Type: application/json; "
                                       "it came with another content type")


@pytest.mark.parametrize("route", ["/v1/feedback", "/admin/pin"])
def test_a_body_sent_with_no_content_type_header_is_told_so(server, route):
    import http.client
    from urllib.parse import urlsplit
    url, _ = server
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    try:  # http.client, unlike urllib and curl -d, adds no Content-Type of its own
        conn.request("POST", route, body=b'{"version": 0}', headers={"authorization": f"Bearer {API_KEY}"})
        resp = conn.getresponse()
        status, out = resp.status, json.loads(resp.read())
    finally:
        conn.close()
    assert status == 400 and out["error"]["message"] == ("the body must be a JSON object sent with Content-Type: "
                                                         "application/json; it came with no Content-Type header")


@pytest.mark.parametrize("raw, says", [(b"[1]", "it is an array"), (b'"x"', "it is a string"), (b"", "it came empty")])
def test_a_json_body_that_is_no_object_says_so(server, raw, says):
    url, _ = server
    status, out = post_raw(url + "/admin/pin", raw, "application/json")
    assert status == 400 and out["error"]["message"] == ("the body must be a JSON object sent with Content-Type: "
                                                         f"application/json; {says}")


# ------------------------------------------------------------------ admin params


@pytest.mark.parametrize("route", ["/admin/pin", "/admin/rollback"])
def test_the_admin_routes_name_version_for_an_unknown_version(server, route):
    url, service = server
    status, out = http("POST", url + route, {"version": 99}, key=API_KEY)
    assert status == 404 and out["error"]["param"] == "version" and out["error"]["code"] == "model_not_found"
    assert out["error"]["message"] == "adapter version 99 does not exist"


# ------------------------------------------------------------------ empty answers


def test_an_empty_answer_has_empty_content_not_null(server, monkeypatch):
    url, service = server
    script(monkeypatch, service, "")  # the model ends its turn at once
    body = {"model": "selfrl", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}
    status, out = http("POST", url + "/v1/chat/completions", body)
    assert status == 200 and out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ""}
    # streamed: every content delta is a string, and they join to ""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 method="POST", headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as f:
        events = [json.loads(line[6:]) for line in f.read().decode().splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert all(isinstance(d["content"], str) for d in deltas if "content" in d)
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    # the answer sent back as the next turn's history is a valid assistant message (null was a 400)
    follow = {**body, "messages": [*body["messages"], out["choices"][0]["message"], {"role": "user", "content": "y"}]}
    assert http("POST", url + "/v1/chat/completions", follow)[0] == 200


# ------------------------------------------------------------------ stores written before


def test_a_store_whose_feedback_value_was_not_null_is_rebuilt_with_its_rows(tmp_path):
    store = Store(tmp_path / "selfrl.db")
    old = records.FEEDBACK_COLUMNS.replace("value       REAL,", "value       REAL NOT NULL,").replace(
        "    correction_calls TEXT,\n", "")
    with store.conn:
        store.conn.executescript(f"CREATE TABLE feedback {old};"
                                 "INSERT INTO feedback (id, response_id, choice, source, value, corrected, comment,"
                                 " created_at) VALUES (7, 'chatcmpl-a', 0, 'explicit', 1.0, 0, 'kept', 5.0);")
    records.init(store)
    columns = {r[1]: r[3] for r in store.conn.execute("PRAGMA table_info(feedback)")}
    assert columns["value"] == 0 and "correction_calls" in columns
    assert [tuple(r) for r in store.conn.execute("SELECT id, value, comment FROM feedback")] == [(7, 1.0, "kept")]
    with store.conn:
        store.conn.execute("INSERT INTO feedback (response_id, choice, source, value, corrected, created_at) "
                           "VALUES ('chatcmpl-a', 0, 'explicit', NULL, 0, 6.0)")
    assert store.conn.execute("SELECT MAX(id) FROM feedback").fetchone()[0] == 8  # ids go on from the old ones
    records.init(store)  # again: nothing to do
    assert store.conn.execute("SELECT COUNT(*) FROM feedback").fetchone()[0] == 2
    with pytest.raises(sqlite3.IntegrityError):  # the other constraints stay
        with store.conn:
            store.conn.execute("INSERT INTO feedback (response_id, choice, source, value, corrected, created_at) "
                               "VALUES ('x', 0, 'guess', NULL, 0, 6.0)")
    store.close()


def old_store(tmp_path) -> Store:
    """A store written when ``feedback.value`` was NOT NULL (and before ``correction_calls``)."""
    store = Store(tmp_path / "selfrl.db")
    old = records.FEEDBACK_COLUMNS.replace("value       REAL,", "value       REAL NOT NULL,").replace(
        "    correction_calls TEXT,\n", "")
    with store.conn:
        store.conn.executescript(f"CREATE TABLE feedback {old};" + records.SERVE_SCHEMA)
    return store


def test_the_rebuild_takes_back_the_value_0_an_old_store_gave_a_comment_alone(tmp_path):
    store = old_store(tmp_path)
    turns = [  # (turn, parent, status, feedback, source) as the old code left them
        ("rated", None, "pending", 0.5, "explicit"),
        ("parent", None, "pending", 0.0, "inherited"),  # implicit -1, then its next turn's comment
        ("comment", "parent", "pending", 0.0, "explicit"),
        ("rated_then_comment", None, "pending", 0.0, "explicit"),
        ("answer_42", None, "pending", 0.0, "explicit"),  # {"correction": "42"}: not a comment alone
        ("trained", None, "trained", 0.0, "explicit")]
    messages = [  # (turn, source, value, rating, correction, comment)
        ("rated", "explicit", 0.5, 0.5, None, None),
        ("parent", "implicit", -1.0, None, None, None),
        ("comment", "explicit", 0.0, None, None, "hm"),
        ("rated_then_comment", "explicit", 1.0, 1.0, None, None),
        ("rated_then_comment", "explicit", 0.0, None, None, "thanks"),
        ("answer_42", "explicit", 0.0, None, "42", None),
        ("trained", "explicit", 0.0, None, None, "old")]
    store.conn.execute("PRAGMA foreign_keys = OFF")  # turns without their trajectories: only the tables matter here
    with store.conn:
        for tid, parent, status, value, source in turns:
            store.conn.execute(
                "INSERT INTO served (trajectory_id, response_id, choice, conversation_id, parent_id, group_key,"
                " continuation, created_at, status, trained_in, feedback, feedback_source) VALUES"
                " (?, ?, 0, 'c', ?, 'g', ?, 1.0, ?, ?, ?, ?)",
                (tid, "r-" + tid, parent, "k-" + tid, status, 1 if status == "trained" else None, value, source))
        for i, (tid, source, value, rating, correction, comment) in enumerate(messages):
            store.conn.execute("INSERT INTO feedback (response_id, choice, source, value, rating, corrected, correction,"
                               " comment, created_at) VALUES (?, 0, ?, ?, ?, 0, ?, ?, ?)",
                               ("r-" + tid, source, value, rating, correction, comment, 2.0 + i))
    store.conn.execute("PRAGMA foreign_keys = ON")
    records.init(store)
    held = {r[0]: tuple(r[1:]) for r in store.conn.execute(
        "SELECT trajectory_id, feedback, feedback_source, status FROM served")}
    assert held == {"rated": (0.5, "explicit", "pending"),
                    "parent": (-1.0, "implicit", "pending"),  # its own implicit judgement again
                    "comment": (None, None, "pending"),  # no judgement: not trainable with reward 0
                    "rated_then_comment": (1.0, "explicit", "pending"),  # the rating stands
                    "answer_42": (0.0, "explicit", "pending"),
                    "trained": (0.0, "explicit", "trained")}  # what it was trained on, as history
    values = [tuple(r) for r in store.conn.execute("SELECT response_id, value, comment FROM feedback ORDER BY id")]
    assert values == [("r-rated", 0.5, None), ("r-parent", -1.0, None), ("r-comment", None, "hm"),
                      ("r-rated_then_comment", 1.0, None), ("r-rated_then_comment", None, "thanks"),
                      ("r-answer_42", 0.0, None), ("r-trained", None, "old")]
    info = records.find_response(store, "r-comment")
    assert records._unjudged(info)[1].endswith("it has no feedback value yet")
    store.close()


def test_the_rebuild_keeps_the_autoincrement_counter(tmp_path):
    store = old_store(tmp_path)
    with store.conn:
        for i in range(1, 13):
            store.conn.execute("INSERT INTO feedback (id, response_id, choice, source, value, corrected, created_at)"
                               " VALUES (?, 'r', 0, 'explicit', 1.0, 0, 1.0)", (i,))
        store.conn.execute("DELETE FROM feedback WHERE id > 10")  # the newest rows went (retention, a deletion)
    assert store.conn.execute("SELECT seq FROM sqlite_sequence WHERE name = 'feedback'").fetchone()[0] == 12
    records.init(store)
    with store.conn:
        ids = [store.conn.execute("INSERT INTO feedback (response_id, choice, source, value, corrected, created_at)"
                                  " VALUES ('r', 0, 'explicit', NULL, 0, 2.0)").lastrowid for _ in range(2)]
    assert ids == [13, 14]  # 11 and 12 were handed out once: never again
    assert store.conn.execute("SELECT COUNT(*) FROM sqlite_sequence WHERE name = 'feedback'").fetchone()[0] == 1
    store.close()
