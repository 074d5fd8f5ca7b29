"""The user simulator against a real ``selfrl serve`` in this process (tiny random model, the real
``openai`` client on loopback): what the store recorded is what the simulator reports it sent."""

from __future__ import annotations

import json
import math

import pytest

from selfrl.config.simulate import FamilySettings, PhaseSettings, SimulateConfig
from selfrl.simulate import FakeClock, Simulator
from selfrl.simulate.simulator import default_client
from serving import API_KEY, running_server, tiny_serve_config


@pytest.fixture(scope="module")
def simulated(tiny_tokenizer, tiny_model_factory, tmp_path_factory):
    model = tiny_model_factory(lora=True, eos_bias=3.0)
    cfg = tiny_serve_config(tmp_path_factory.mktemp("serve"))
    clock = FakeClock(1_700_000_000.0)  # one simulated time for the users and the server
    with running_server(model, tiny_tokenizer, cfg, clock=clock) as (url, service):
        sim_cfg = SimulateConfig(
            base_url=url, seed=11, max_requests=60, arrivals_per_hour=6.0, temperature=1.0,
            families=[FamilySettings("arithmetic", "chain_sum", users=4, max_turns=2, max_tokens=8),
                      FamilySettings("function_calling", "function_calling", {"categories": ["simple"]}, users=4,
                                     max_turns=1, max_tokens=8),
                      FamilySettings("web", "web", {"tier": "easy"}, users=4, max_turns=2, max_tokens=8)],
            phases=[PhaseSettings(2 * 3600.0, {"arithmetic": 1.0}),
                    PhaseSettings(4 * 3600.0, {"arithmetic": 1.0, "function_calling": 1.0, "web": 1.0})])
        sim_cfg.users.hostile_share, sim_cfg.users.flood_size = 0.5, 3
        sim_cfg.users.rating_p, sim_cfg.users.correction_p = 0.5, 0.5
        client = default_client(sim_cfg.validate(), API_KEY)
        assert client.reachable() is None
        out = tmp_path_factory.mktemp("sim")
        sim = Simulator(sim_cfg, client, clock=clock, log=out / "events.jsonl")
        summary = sim.run()
        client.close()
        yield service, sim, summary, out, url, clock


def test_the_store_holds_what_the_simulator_sent(simulated):
    service, sim, summary, _, _, _ = simulated
    reqs = [e for e in sim.events if e["event"] == "request"]
    assert summary["requests"]["total"] == len(reqs) == 60 and summary["stopped_by"] == "max_requests"
    chat_ok = {e["response_id"] for e in reqs if e["route"] == "chat" and e["status"] == 200}
    db = service.store.conn
    with service.store.lock:
        served = {r[0] for r in db.execute("SELECT response_id FROM served")}
        explicit = db.execute("SELECT response_id, rating, corrected, correction FROM feedback "
                              "WHERE source = 'explicit' ORDER BY id").fetchall()
        clients = {r[0] for r in db.execute("SELECT DISTINCT client FROM served")}
    assert served == chat_ok and len(chat_ok) == summary["http"]["chat"]["200"]
    accepted = [e for e in reqs if e["route"] == "feedback" and e["status"] == 200]
    assert len(explicit) == len(accepted) == summary["http"]["feedback"]["200"]
    assert [r[0] for r in explicit] == [e["response_id"] for e in accepted]
    bodies = iter(sim.sent_feedback)
    for row in explicit:  # each stored feedback is the body the simulator posted
        body = next(bodies)
        assert row[0] == body["response_id"] and bool(row[2]) == bool(body.get("corrected", False))
        assert (row[1] is None and "rating" not in body) or math.isclose(row[1], body["rating"])
        assert row[3] == body.get("correction")
    users = {e["user"] for e in reqs if e["route"] == "chat" and e["status"] == 200}
    assert len(clients) == len(users)  # one bearer token per user: the server tells them apart
    # this server does not learn: every judgement within max_feedback_age_s (7 days) is queued for a learner
    assert summary["feedback"]["outcomes"] == {"queued": len(accepted)}


def test_a_judgement_older_than_the_age_cutoff_comes_back_too_old(simulated, tmp_path):
    """The server reads the simulator's clock: a rating sent d simulated days after its answer is
    d days old for the server too, and past learner.max_feedback_age_s (7 days) it is only recorded."""
    service, _, _, _, url, clock = simulated
    assert service.cfg.learner.max_feedback_age_s == 7 * 86400.0
    cfg = SimulateConfig(base_url=url, seed=3, max_requests=400, arrivals_per_hour=2.0,
                         families=[FamilySettings("arithmetic", "chain_sum", users=4, max_turns=1, max_tokens=4)],
                         phases=[PhaseSettings(4 * 3600.0, {"arithmetic": 1.0})])
    cfg.users.hostile_share, cfg.users.rating_p, cfg.users.correction_p = 0.0, 1.0, 0.0
    cfg.users.min_delay_s, cfg.users.max_delay_s = 86400.0, 20 * 86400.0  # one to twenty days
    client = default_client(cfg.validate(), API_KEY)
    sim = Simulator(cfg, client, clock=clock)
    summary = sim.run()
    client.close()
    served_at = {e["response_id"]: e["t_sim"] for e in sim.events if e["event"] == "request" and e["route"] == "chat"
                 and e["status"] == 200}
    ratings = [e for e in sim.events if e["event"] == "request" and e["purpose"] == "rating"]
    assert summary["stopped_by"] == "done" and len(ratings) >= 4 and all(e["status"] == 200 for e in ratings)
    ages = [(e["t_sim"] - served_at[e["response_id"]]) / 86400.0 for e in ratings]
    assert [e["outcome"] for e in ratings] == ["too_old" if age > 7.0 else "queued" for age in ages]
    assert any(age > 7.0 for age in ages) and any(age < 7.0 for age in ages)
    assert summary["feedback"]["outcomes"] == {k: sum(e["outcome"] == k for e in ratings) for k in ("queued", "too_old")}
    with service.store.lock:  # too old: recorded all the same
        stored = service.store.conn.execute("SELECT COUNT(*) FROM feedback WHERE source = 'explicit' AND "
                                            "response_id IN (%s)" % ",".join("?" * len(ratings)),
                                            [e["response_id"] for e in ratings]).fetchone()[0]
    assert stored == len(ratings)


def test_families_metadata_phases_and_hostile_users_reach_the_server(simulated):
    service, sim, summary, out, _, _ = simulated
    assert set(summary["requests"]["chat_by_family_phase"]) >= {"arithmetic"}
    assert set(summary["requests"]["chat_by_family_phase"]["arithmetic"]) <= {"0", "1"}
    assert summary["http"]["server_errors"] == 0  # every hostile act got a 2xx or a 4xx
    served = {e["response_id"] for e in sim.events if e["event"] == "request" and e["route"] == "chat"
              and e["status"] == 200}
    hostile = [e for e in sim.events if e["event"] == "request" and e["purpose"].startswith("hostile:")]
    assert len(hostile) >= 5 and summary["hostile"]["users"] >= 2
    for e in hostile:  # refused when out of range or never served, accepted otherwise
        expected = 200 if e["route"] == "chat" else 400 if abs(e.get("rating", 0.0)) > 1 else \
            404 if e["response_id"] not in served else 200
        assert e["status"] == expected, e
    assert sum(e["status"] == 200 for e in hostile) < len(hostile)  # some acts were refused
    logged = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert logged == json.loads(json.dumps(sim.events))  # the JSONL log is every event
    turns = [e for e in logged if e["event"] == "request" and e["route"] == "chat"]
    assert {e["family"] for e in turns} <= {"arithmetic", "function_calling", "web"}


def test_the_command_writes_its_summary_and_log(simulated, tmp_path, monkeypatch, capsys):
    from selfrl.cli import main

    url = simulated[4]
    monkeypatch.setenv("SELFRL_API_KEY", API_KEY)
    assert main(["simulate", "--config", "configs/simulate.toml", "--base-url", url, "--max-requests", "6",
                 "--seed", "5", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert summary["requests"]["total"] == 6 == sum(e["event"] == "request" for e in events)
    assert summary["stopped_by"] == "max_requests" and events[-1] == {**events[-1], "event": "stop",
                                                                      "reason": "max_requests"}
    assert "requests: 6" in capsys.readouterr().out
    monkeypatch.setenv("SELFRL_API_KEY", "wrong-key")  # feedback would be refused: the command says so first
    assert main(["simulate", "--base-url", url, "--max-requests", "6", "--out", str(tmp_path / "b")]) == 2
