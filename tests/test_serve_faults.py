"""The serve fault suite: a fault injected into the background learner under live traffic
(``SELFRL_FAULT``, as in ``selfrl run``) is caught by the same collapse rules, with zero
failed requests and no response naming a version that was not served.

``scripts/fault_suite.py`` (``run_serve_fault``, in ``scripts/fault_serve.py``) runs the
scenario: a tiny Phi served by uvicorn on loopback, three client threads sending rated chat
requests (every third one streamed) until the learner has made three updates; these tests
check its verdict and more of what it recorded.
"""

import sys
from pathlib import Path

import pytest
from serving import rated_turns

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import fault_runs  # noqa: E402
import fault_serve  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return fault_runs.save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def test_a_collapse_under_live_traffic_is_rolled_back_and_never_served(model_dir, tmp_path):
    out = fault_serve.run_serve_fault("noise@1", model_dir, tmp_path, timeout=300)
    assert out.recovered, (out.detail, out.notes)
    assert (out.failed_requests, out.bad_versions_served) == (0, 0)
    responses = out.responses
    assert out.requests == len(responses) >= 20 and all(r["status"] == 200 for r in responses)
    # update 0 made version 1 (promoted); update 1 (the noise) made version 2, rolled back by the KL rule
    collapse = next(e for e in out.events if e["kind"] == "collapse")
    assert collapse["data"]["iteration"] == 1 and collapse["data"]["rolled_back"] == [2]
    assert collapse["data"]["serving"] == 1 and out.versions[2] == "rolled_back"
    alarm = collapse["data"]["alarms"][0]
    assert alarm["rule"] == "kl" and alarm["value"] > alarm["threshold"] == 0.1
    # the same safer setting as run: learning rate x 0.5, beta x 2
    assert collapse["data"]["learning_rate"] == pytest.approx(5e-4) and collapse["data"]["beta"] == pytest.approx(0.1)
    served = {r["version"] for r in responses}
    assert 2 not in served and served <= {v for v, s in out.versions.items() if s in ("base", "promoted")}
    # requests in flight when the collapse was recorded finished on the version served then (1);
    # requests sent after it got that restored version, or a later promoted one, never 2
    t = collapse["time"]
    in_flight = [r for r in responses if r["sent"] < t < r["answered"]]
    after = [r for r in responses if r["sent"] > t]
    assert in_flight and {r["version"] for r in in_flight} == {1}
    assert after and all(r["version"] >= 1 and r["version"] != 2 for r in after)
    # learning went on from the restored champion: the next candidate's parent is version 1
    promoted_after = [e["data"]["version"] for e in out.events if e["kind"] == "promote" and e["time"] > t]
    assert promoted_after and promoted_after[0] == 3


def test_a_nan_loss_under_live_traffic_is_skipped_and_makes_no_version(model_dir, tmp_path):
    out = fault_serve.run_serve_fault("nan_loss@1", model_dir, tmp_path, timeout=300)
    assert out.recovered, (out.detail, out.notes)
    assert (out.failed_requests, out.bad_versions_served) == (0, 0) and out.requests >= 20
    skip = next(e for e in out.events if e["kind"] == "skip")
    assert skip["data"]["iteration"] == 1 and skip["data"]["reason"] == "not_finite"
    assert not any(e["kind"] == "collapse" for e in out.events)
    # versions 1 (update 0) and 2 (update 2): the skipped update numbered nothing
    assert out.versions[1] == "promoted" and out.versions[2] in ("promoted", "candidate", "rejected")


def test_bad_served_names_each_kind_of_bad_version():
    R = fault_serve.Response
    versions = {0: {"created_at": 0.0, "status": "base"}, 1: {"created_at": 10.0, "status": "promoted"},
                2: {"created_at": 20.0, "status": "rolled_back"}, 3: {"created_at": 30.0, "status": "promoted"}}
    timeline = [(0.0, 0), (12.0, 1), (32.0, 3)]
    ok = [R(1.0, 2.0, 200, 0), R(11.0, 13.0, 200, 0), R(11.0, 13.0, 200, 1), R(33.0, 34.0, 200, 3)]
    assert fault_serve.bad_served(ok, versions, timeline) == []
    bad = [R(21.0, 22.0, 200, 2), R(5.0, 9.0, 200, 1), R(31.0, 31.5, 200, 3), R(13.0, 14.0, 200, 0),
           R(1.0, 2.0, 200, 7)]
    assert fault_serve.bad_served(bad, versions, timeline) == [
        "response 0: version 2 is rolled_back", "response 1: version 1 did not exist",
        "response 2: version 3 was not yet served",
        "response 3: sent while version 1 served, answered by version 0",
        "response 4: version 7 did not exist"]
    named = [R(1.0, 2.0, 200, 0, id="a"), R(13.0, 14.0, 200, 1, id="b")]
    assert fault_serve.bad_served(named, versions, timeline, {"a": 0, "b": 1}) == []
    assert fault_serve.bad_served(named, versions, timeline, {"a": 0, "b": 0}) == [
        "response 1: names version 1, its turn was sampled on 0"]


def test_a_restart_keeps_the_collapse_budget_history_and_safer_setting(tiny_tokenizer, tiny_model_factory, tmp_path):
    # as run --resume does: before, a restarted server forgot its rollbacks and learned at the old rate
    import copy

    from selfrl.safety.collapse import CollapseStop
    from selfrl.serve.service import Service
    from serving import tiny_serve_config

    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.train.learning_rate, cfg.train.beta = 1e-2, 0.05
    cfg.collapse.max_kl, cfg.collapse.max_rollbacks = 1e-12, 1  # every candidate's KL fires the rule
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        info = service.learner.update(rated_turns(service))
        assert info["result"] == "rolled back (collapse)" and info["version"] == 1
        assert service.learner.learner.cfg.learning_rate == pytest.approx(5e-3)
    finally:
        service.close()
    again = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        learner = again.learner
        assert learner.updates == 1 and learner.cycle.budget.collapses == 1
        assert [(r.step, r.version) for r in learner.cycle.guard.history] == [(0, 0)]
        assert learner.learner.cfg.learning_rate == pytest.approx(5e-3)  # x 0.5 once, not reset to 1e-2
        assert learner.learner.cfg.beta == pytest.approx(0.1)
        info = learner.update(rated_turns(again))  # rollback 2 of 1 allowed: the budget is spent
        assert info["result"] == "rolled back (collapse)" and info["version"] == 2
        with pytest.raises(CollapseStop, match="2 collapse rollbacks exceed collapse.max_rollbacks = 1"):
            learner.update(rated_turns(again))
        metrics = {(m["step"], m["name"]) for m in again.store.metrics()}
        assert {(0, "train/entropy"), (1, "train/entropy"), (1, "sampled_version")} <= metrics
    finally:
        again.close()


def test_the_learner_backs_off_pauses_and_says_so_in_health_never_stopping(tiny_tokenizer, tiny_model_factory,
                                                                          tmp_path, monkeypatch):
    # before: with max_rollbacks = 1 the second collapse stopped the learner for good
    import copy

    import time

    from selfrl.serve.health import health
    from selfrl.serve.service import Service
    from serving import tiny_serve_config

    clock = type("Clock", (), {"t": 5000.0, "__call__": lambda self: self.t})()
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.train.learning_rate, cfg.train.beta = 1e-2, 0.05
    cfg.collapse.max_kl, cfg.collapse.max_per_window, cfg.collapse.cooldown_s = 1e-12, 1, 600.0
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model), clock=clock)
    try:
        learner = service.learner
        code, body, _ = health(service)
        assert (code, body) == (200, {"status": "ok", "served_version": 0})  # at the configured setting: unchanged
        assert service.status()["learner"]["backoff"]["level"] == 0
        assert learner.update(rated_turns(service))["result"] == "rolled back (collapse)"
        code, body, _ = health(service)
        b = body["backoff"]
        assert (code, b["backing_off"], b["level"], b["paused_until"]) == (200, True, 1, None)
        # each time beside its UTC ISO 8601 text (the fake clock's 5000 s: 1970-01-01 01:23:20)
        assert (b["paused_until_utc"], b["next_step_back_at"]) == (None, 5000.0 + cfg.collapse.stable_s)
        assert b["next_step_back_at_utc"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(b["next_step_back_at"]))
        assert (b["learning_rate"], b["beta"]) == pytest.approx((5e-3, 0.1))
        clock.t += 10
        assert learner.update(rated_turns(service))["result"] == "rolled back (collapse)"  # 2 > 1 in the window
        b = health(service)[1]["backoff"]
        assert (b["level"], b["paused_until"], b["paused_until_utc"]) == (2, 5010.0 + 600.0, "1970-01-01T01:33:30Z")
        assert service.status()["learner"]["backoff"]["paused_until"] == 5610.0
        assert service.status()["learner"]["backoff"]["paused_until_utc"] == "1970-01-01T01:33:30Z"
        pending, taken = rated_turns(service), []
        monkeypatch.setattr("selfrl.serve.background.records.ready", lambda *a: taken.append(1) or pending)
        assert not learner.tick() and taken == []  # the cool-down: no batch taken, the turns stay pending
        assert learner.update(pending)["result"].startswith("paused (collapse cool-down, 600 s left)")
        clock.t += 600
        assert learner.update(pending)["result"] == "rolled back (collapse)"  # learning again, never stopped
        assert learner.error is None and not learner.cycle.budget.stopped
        from selfrl.report.serve import write_serve_report

        text = write_serve_report(tmp_path / "report", service.store, "x").read_text()
        assert "3 collapse(s) rolled back" in text and "backing off: level 3, learning rate 0.00125, beta 0.4" in text
    finally:
        service.close()


def test_an_admin_rollback_under_live_traffic(tiny_tokenizer, tiny_model_factory, tmp_path):
    # v1 serves under traffic; POST /admin/rollback {"version": 0}: requests in flight finish on v1,
    # requests sent after the call returned get v0; nothing fails
    import threading
    import time

    import torch

    from selfrl.record.adapters import lora_state
    from selfrl.record import served as records
    from serving import API_KEY, add_version, http, running_server, tiny_serve_config

    model = tiny_model_factory(lora=True, eos_bias=1.0)
    cfg = tiny_serve_config(tmp_path / "run")
    v1 = {k: torch.randn_like(x) * 0.3 for k, x in lora_state(model).items()}
    responses, stop = [], threading.Event()
    with running_server(model, tiny_tokenizer, cfg) as (url, service):
        add_version(service, v1, 1, metrics={"val/success": 0.0})
        service.publish(1, v1, "test")
        users = [threading.Thread(target=fault_serve.traffic, args=(url, API_KEY, k, stop, responses))
                 for k in range(3)]
        for u in users:
            u.start()
        time.sleep(1.0)
        called = time.time()
        status, body = http("POST", url + "/admin/rollback", {"version": 0}, key=API_KEY)
        returned = time.time()
        time.sleep(1.0)
        stop.set()
        for u in users:
            u.join(timeout=60)
        with service.store.lock:
            statuses = {v["version"]: v["status"] for v in service.store.versions()}
            trajs = {t.id: t for t in service.store.trajectories()}
            ran_on = {r.id: trajs[records.find_response(service.store, r.id)["trajectory_id"]].adapter_version
                      for r in responses}
    assert status == 200 and body["served_version"] == 0 and statuses == {0: "base", 1: "rolled_back"}
    assert all(r.status == 200 and not r.error for r in responses), [r.error for r in responses if r.error]
    before = [r for r in responses if r.answered < called]
    after = [r for r in responses if r.sent > returned]
    in_flight = [r for r in responses if r.sent < returned and r.answered > called]
    assert len(before) >= 3 and {r.version for r in before} == {1}
    assert len(after) >= 3 and {r.version for r in after} == {0}  # new requests: the restored version
    assert {r.version for r in in_flight} <= {0, 1}
    # each response names the version its tokens were sampled with (the stored turn's), in flight too
    assert all(ran_on[r.id] == r.version for r in responses)
