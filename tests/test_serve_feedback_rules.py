"""What ``POST /v1/feedback`` makes of a message, and how every request body is typed.

* booleans and integers are not coerced (old code: ``"corrected": "yes"`` was -1, ``"record":
  "no"`` kept a turn out of the store, ``"choice": 1.0`` and ``"version": 1e3`` were taken);
* a body without ``Content-Type: application/json`` is told to set it.
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


@pytest.mark.parametrize("raw, says", [(b"[1]", "it is an array"), (b'"x"', "it is a string"), (b"", "it came empty")])
def test_a_json_body_that_is_no_object_says_so(server, raw, says):
    url, _ = server
    status, out = post_raw(url + "/admin/pin", raw, "application/json")
    assert status == 400 and out["error"]["message"] == ("the body must be a JSON object sent with Content-Type: "
                                                         f"application/json; {says}")
