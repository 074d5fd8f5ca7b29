"""Clients that disconnect mid-generation: the row stops (its slot is free), and the
partial turn is recorded as cut off and never trained on."""

import http.client
import json
import time

import pytest

from selfrl.chat.template import prompt_ids
from selfrl.engines.reference import Engine
from selfrl.record import served as records
from serving import SERVE_ENGINES, running_server, serve_config

LIMIT = 900  # the tiny model never samples EOS (bias -30): a turn runs to its limit unless cut


def test_engine_stops_a_cancelled_row_and_keeps_the_others(tiny_tokenizer, tiny_model_factory):
    import threading

    engine = Engine(tiny_model_factory(eos_bias=-30.0), tiny_tokenizer)
    prompt = prompt_ids(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    gone, stay = threading.Event(), threading.Event()

    def on_step(ids):  # (B, k): before sampling id k + 1
        if ids.shape[1] == 5:
            gone.set()

    a, b = engine.generate([prompt, prompt], 12, on_step=on_step, cancel=[gone, stay])
    assert a.cancelled and not a.finished and len(a.token_ids) == len(a.logprobs) == 6  # the 6th was sampled
    assert not b.cancelled and len(b.token_ids) == 12 and a.finish_reason == "length"
    gone.set(), stay.set()
    c, d = engine.generate([prompt, prompt], 4, cancel=[gone, stay])  # set before the start
    assert len(c.token_ids) == len(d.token_ids) == 1 and c.cancelled and d.cancelled


@pytest.fixture(scope="module", params=SERVE_ENGINES)
def server(request, tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory(lora=True, eos_bias=-30.0)
    cfg = serve_config(tmp_path_factory.mktemp("disconnect"), request.param)
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        yield url, service


def _cut_turns(service, content, timeout=60.0):
    """The cut-off turns of the request whose user message is ``content``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with service.store.lock:
            rows = service.store.conn.execute("SELECT * FROM served WHERE status = 'skipped'").fetchall()
            trajs = {t.id: t for t in service.store.trajectories()}
        rows = [r for r in rows if trajs[r["trajectory_id"]].messages[-2]["content"] == content]
        if rows:
            return [(dict(r), trajs[r["trajectory_id"]]) for r in rows]
        time.sleep(0.05)
    raise AssertionError("no cut-off turn was recorded")


def _post(url, body):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    return conn


def _check_cut_off(service, content):
    [(row, traj)] = _cut_turns(service, content)
    n = traj.num_completion_tokens
    assert 0 < len(traj.token_ids) - traj.prompt_len < LIMIT  # stopped early: the slot was freed
    assert traj.truncated and traj.error == "client disconnected" and row["status"] == "skipped"
    assert n == len(traj.token_ids) - traj.prompt_len  # recorded as any turn: exact ids and logprobs
    deadline = time.monotonic() + 30
    while not service.engine.health().detail.startswith("idle"):  # nothing keeps decoding for the gone client
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with service.store.lock:
        ready = records.ready(service.store, wait_s=0.0, limit=100, now=time.time() + 1e6)
    assert traj.id not in {t.id for t, _ in ready}  # the learner never sees it


def test_a_stream_closed_mid_generation_is_cut_off(server):
    url, service = server
    conn = _post(url, {"model": "selfrl", "messages": [{"role": "user", "content": "tell me"}], "stream": True,
                       "max_tokens": LIMIT})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.fp.readline()  # the first event: decoding has begun
    conn.sock.close()
    conn.close()
    _check_cut_off(service, "tell me")


def test_a_waiting_non_streaming_client_that_leaves_is_cut_off(server):
    url, service = server
    conn = _post(url, {"model": "selfrl", "messages": [{"role": "user", "content": "tell me more"}],
                       "max_tokens": LIMIT})
    deadline = time.monotonic() + 30
    while not service.engine.health().detail.startswith("busy"):  # decoding has begun
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    conn.sock.close()
    conn.close()
    _check_cut_off(service, "tell me more")
