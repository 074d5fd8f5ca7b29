"""``selfrl serve`` under attack (issue 12 cases 4-6): limits on the bytes actually read,
bounded parsing of every request value (no 5xx), and who may put an implicit reward
on a turn. The hostile corpus and the attacks come from ``scripts/abuse_suite.py`` and the
modules beside it (``abuse_corpus``, ``abuse_client``, ``abuse_attacks``)."""

import json
import sqlite3
import sys
from pathlib import Path

import pytest

from serving import API_KEY, http, running_server, tiny_serve_config

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import abuse_attacks as attacks  # noqa: E402
import abuse_client as client  # noqa: E402
import abuse_corpus  # noqa: E402
import abuse_suite as abuse  # noqa: E402

LIMIT = 256 * 1024


@pytest.fixture(scope="module")
def server(tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    cfg = tiny_serve_config(tmp_path_factory.mktemp("serve"))
    cfg.max_request_bytes = LIMIT
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service


def rows(service) -> dict[str, int]:
    return abuse.store_counts(service.run_dir / "selfrl.db")


def test_a_chunked_body_is_cut_at_the_limit_and_the_connection_closed(server):
    url, service = server
    before = rows(service)
    total = 32 << 20  # 128 times the limit
    status, sent, closed = client.send_chunked(url, total)
    assert status == 413 and closed  # refused, and the connection closed: the rest is never read
    assert sent < total // 2  # the server stopped reading (what was sent lies in socket buffers)
    status, sent, closed = client.send_chunked(url, total, content_length=total)
    assert status == 413 and closed and sent < total // 2  # a declared length over the limit
    assert rows(service) == before
    assert abuse.serving(url)


def test_a_body_under_the_limit_is_still_served_when_chunked(server):
    url, _ = server
    import socket

    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "selfrl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "record": False}).encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        for piece in (body[:10], body[10:]):
            s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        s.sendall(b"0\r\n\r\n")
        assert s.recv(4096).split(b" ")[1] == b"200"


def test_a_model_version_of_5000_digits_is_a_404_in_openais_shape(server):
    url, _ = server
    status, body = http("POST", url + "/v1/chat/completions", {
        "model": "selfrl@v" + "9" * 5000, "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and body["error"]["param"] == "model" and body["error"]["code"] == "model_not_found"


def test_no_request_of_the_hostile_corpus_gets_a_5xx_or_adds_a_row(server):
    url, service = server
    before = rows(service)
    corpus = abuse_corpus.hostile_requests()
    assert len(corpus) > 1500  # every route, every field, every value
    failures = []
    for method, path, raw, key in corpus:
        status, body = client.request(url, method, path, raw or None, API_KEY if key else None)
        if status >= 500 or status == 0:
            failures.append((status, path, raw[:120], body[:200]))
        elif status >= 400:  # every refusal has OpenAI's error shape
            err = json.loads(body)["error"]
            assert {"message", "type", "param", "code"} <= set(err), (path, raw[:80])
    assert failures == []
    after = rows(service)
    assert (after["trajectories"], after["served"], after["feedback"]) == \
        (before["trajectories"], before["served"], before["feedback"])
    assert abuse.store_problems(service.run_dir / "selfrl.db") == []
    http("POST", url + "/admin/unpin", {}, key=API_KEY)


def feedback_of(service, response_id):
    with sqlite3.connect(service.run_dir / "selfrl.db") as conn:
        return conn.execute("SELECT feedback, feedback_source FROM served WHERE response_id = ?",
                            (response_id,)).fetchone()


def test_an_implicit_correction_attaches_only_to_the_same_clients_turn(server):
    url, service = server
    q = [{"role": "user", "content": "What is 6*7?"}]
    status, victim = client.chat(url, q, "victim-token-0123456789", temperature=0, max_tokens=4)
    assert status == 200
    replay = q + [{"role": "assistant", "content": victim["choices"][0]["message"]["content"] or ""},
                  {"role": "user", "content": "No, that's wrong."}]
    for attacker in (None, "attacker-token-0123456789"):  # anonymous, or another client's token
        status, forged = client.chat(url, replay, attacker, max_tokens=2)
        assert status == 200
        assert feedback_of(service, victim["id"]) == (None, None)
        with sqlite3.connect(service.run_dir / "selfrl.db") as conn:  # nor is the replay linked to the victim
            parent = conn.execute("SELECT parent_id FROM served WHERE response_id = ?", (forged["id"],)).fetchone()
        assert parent == (None,)
    status, _ = client.chat(url, replay, "victim-token-0123456789", max_tokens=2)  # the victim itself
    assert status == 200 and feedback_of(service, victim["id"]) == (-1.0, "implicit")


def test_the_abuse_suite_lists_the_ledger_races_as_entries():
    names = {a.name: a for a in attacks.ATTACKS}
    for race in ("concurrent_pins", "rollback_during_update", "stray_adapter_folder"):
        assert race in names and (names[race].run is not None or names[race].pending)
    assert names["concurrent_pins"].run is not None and names["concurrent_pins"].pending is None  # runs by default
    for race in ("rollback_during_update", "stray_adapter_folder"):  # need a learner or a restart
        assert "tests/test_serve_versions.py" in names[race].pending
        outcome = abuse.run_attack(names[race], attacks.Target("http://127.0.0.1:9", Path("/nonexistent")))
        assert not outcome.tried  # a listed entry is reported, not run


def test_a_store_written_before_client_identities_gets_the_column_and_its_turns_are_never_continued(tmp_path):
    from selfrl.record import served as records
    from selfrl.record.store import Store

    old_schema = records.SERVE_SCHEMA.replace("    client          TEXT NOT NULL DEFAULT '',\n", "")
    assert old_schema != records.SERVE_SCHEMA
    store = Store(tmp_path / "selfrl.db")
    store.conn.execute("PRAGMA foreign_keys = OFF")  # a lone served row is enough here
    with store.conn:
        store.conn.executescript(old_schema)
        store.conn.execute("INSERT INTO served (trajectory_id, response_id, choice, conversation_id, group_key,"
                           " continuation, created_at, status) VALUES ('t', 'r', 0, 'c', 'g', 'k', 0, 'pending')")
    records.init(store)
    assert records.find_response(store, "r")["client"] == ""
    assert records.find_by_continuation(store, "k", "") is None  # an anonymous client continues nothing
    assert records.find_by_continuation(store, "k", "bearer:abc") is None  # nor does anyone else
    store.close()
