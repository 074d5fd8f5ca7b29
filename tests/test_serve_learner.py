"""The background learner: feedback -> rewards -> update -> validated version served."""

import copy
import time

import pytest
import torch
from openai import OpenAI

from selfrl.record.adapters import lora_state
from selfrl.record import served as records
from selfrl.serve.feedback import served_rewards
from serving import API_KEY, http, running_server, tiny_serve_config


def test_feedback_trains_a_version_that_passes_the_gate_and_is_served(tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=2.0)  # A and B random: every tensor gets a gradient
    cfg = tiny_serve_config(tmp_path / "run", min_batch=8, max_batch=8, feedback_wait_s=600.0, poll_s=0.05)
    cfg.train.learning_rate = 1e-2
    # one step at 1e-2 moves the tiny random model about 0.5 nats per token from its reference,
    # on whichever engine sampled (0.52 on slots): at the collapse rule's default (0.5) this
    # test would be decided by the samples; the rule has its own tests (test_collapse.py)
    cfg.collapse.max_kl = 5.0
    before = lora_state(model)
    with running_server(model, tiny_tokenizer, cfg, learn=True) as (url, service):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        ids = []
        for i in range(8):
            r = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": f"q{i}"}],
                                               max_tokens=6, extra_body={"task_key": "arith"})
            ids.append(r.id)
        time.sleep(0.3)
        assert service.learner.updates == 0  # no reward yet, and the wait is long: nothing to train on
        for i, rid in enumerate(ids):
            assert http("POST", url + "/v1/feedback", {"response_id": rid, "rating": 1.0 if i % 2 else -1.0},
                        key=API_KEY)[0] == 200
        deadline = time.monotonic() + 60
        while service.engine.version == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service.engine.version == 1, service.status()
        assert service.learner.last["result"] == "promoted" and service.learner.last["with_signal"] == 8
        after = lora_state(service.engine.model)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert len(changed) == len(before)  # every LoRA tensor of the served model moved
        with service.store.lock:
            statuses = {records.find_response(service.store, rid)["status"] for rid in ids}
            trained = [t for t in service.store.trajectories() if t.reward is not None]
            versions = {v["version"]: v for v in service.store.versions()}
        assert statuses == {"trained"}
        assert sorted(t.rewards["user_feedback"] for t in trained) == [-1.0] * 4 + [1.0] * 4
        assert versions[1]["status"] == "promoted" and "val/success" in versions[1]["metrics"]
        new = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "q"}], max_tokens=2)
        assert new.model_extra["adapter_version"] == 1


def test_learner_scores_groups_by_task_key(tiny_tokenizer, tiny_model_factory, tmp_path):
    from selfrl.core.trajectory import ToolCallRecord, Trajectory

    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run")
    with running_server(model, tiny_tokenizer, cfg, learn=True) as (url, service):
        service.learner.stop()
        ok = ToolCallRecord("calculator", {}, "", True, "")
        bad = ToolCallRecord("calculator", {}, "", False, "", "x")
        tokens = {"token_ids": [1, 2], "completion_mask": [0, 1], "logprobs": [0.0, -1.0]}  # one sampled token
        batch = [
            (Trajectory("a", "", 0, **tokens), {"feedback": 1.0, "created_at": time.time(), "group_key": "g"}),
            (Trajectory("b", "", 0, tool_calls=[bad], **tokens), {"feedback": -1.0, "created_at": time.time(), "group_key": "g"}),
            (Trajectory("c", "", 0, tool_calls=[ok], **tokens), {"feedback": None, "created_at": time.time(), "group_key": "h"}),
            (Trajectory("d", "", 0, **tokens), {"feedback": None, "created_at": time.time(), "group_key": "h"}),
            # a turn with no sampled token: rated, but nothing to train on, so not in its group's statistics
            (Trajectory("e", "", 0, token_ids=[1, 2], completion_mask=[0, 0], logprobs=[0.0, 0.0]),
             {"feedback": 0.0, "created_at": time.time(), "group_key": "g"}),
        ]
        scored, unscored = service.learner.score(batch)
    # rewards: 1.0, -1.0 + 0.2 * 0 = -1.0, 0.2 * 1 = 0.2 (alone in its group), none, 0.0
    assert [t.reward for t in scored] == [1.0, -1.0, 0.2, 0.0] and [t.task_id for t in unscored] == ["d"]
    # (r - mean) / std, ddof 0, over {1, -1} (with "e" counted it would be {1, -1, 0}: +-1.22); a lone turn: 0
    assert [t.advantage for t in scored] == [1.0, -1.0, 0.0, None]
    assert served_rewards(None, 0.5, cfg.learner.reward_weights)[1] == 0.1


# ------------------------------------------------------------- issue 17, cases 4, 6 and 7


def record(service, trajs_and_keys):
    """Store served turns as the server does; returns the learner's batch of (trajectory, row)."""
    batch = []
    with service.store.lock:
        for t, key, feedback in trajs_and_keys:
            records.add_turn(service.store, service.run_id, t, t.id, 0, t.id, key, t.id)
            batch.append((t, {"feedback": feedback, "created_at": time.time(), "group_key": key}))
    return batch


def turn(i, group=None):
    from selfrl.core.trajectory import Trajectory

    return Trajectory(group or f"prompt:{i}", group or f"prompt:{i}", 0, prompt_len=3,
                      token_ids=[5, 6, 7, 10 + i, 11 + i], completion_mask=[0, 0, 0, 1, 1], logprobs=[0.0] * 5)


def test_no_group_of_two_is_named_with_its_fix(tiny_tokenizer, tiny_model_factory, tmp_path):
    # four turns without task_key, rewards +-1: the rewards spread, but every group has one turn
    from selfrl.serve.service import Service

    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, tiny_serve_config(tmp_path / "run", min_batch=4),
                      learner_model=copy.deepcopy(model))
    try:
        info = service.learner.update(record(service, [(turn(i), f"prompt:{i}", (-1.0) ** i) for i in range(4)]))
        assert info["reason"] == "no_group" and "no reward spread" not in info["result"]
        assert "no group had two or more samples" in info["result"]
        assert "task_key" in info["result"] and "n > 1" in info["result"]
        event = service.store.events()[-1]
        assert event["kind"] == "skip" and "task_key" in event["message"] and event["data"]["reason"] == "no_group"
        assert [v.version for v in service.ledger.all()] == [0]
    finally:
        service.close()


def test_late_feedback_revives_a_skipped_turn_and_says_when_it_changed_nothing(tiny_tokenizer, tiny_model_factory,
                                                                                tmp_path):
    # before: feedback on a turn skipped for want of a reward was only recorded, however young the turn
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run", feedback_wait_s=120.0)  # min_batch 32: no update in this test
    with running_server(model, tiny_tokenizer, cfg, learn=True) as (url, service):
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        first = client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": "q"}],
                                               max_tokens=3)
        second = client.chat.completions.create(model="selfrl", max_tokens=3, messages=[
            {"role": "user", "content": "q"}, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "and then?"}])
        with service.store.lock:  # the wait passed with no reward: the learner marked the first turn skipped
            row = records.find_response(service.store, first.id)
            traj = next(t for t in service.store.trajectories() if t.id == row["trajectory_id"])
            records.mark(service.store, [traj], "skipped", None)
        status, body = http("POST", url + "/v1/feedback", {"response_id": first.id, "rating": 1.0}, key=API_KEY)
        assert status == 200 and (body["outcome"], body["turns_updated"], body["turns_too_late"]) == ("used", 1, 0)
        assert body["reason"] == "used now at full weight: version 0 is still the current one"
        with service.store.lock:
            assert records.find_response(service.store, first.id)["status"] == "pending"  # trained at the next update
            records.mark(service.store, [traj], "trained", 1)  # now it was trained: a turn is never trained twice
        status, body = http("POST", url + "/v1/feedback", {"response_id": first.id, "rating": -1.0}, key=API_KEY)
        assert status == 200 and (body["outcome"], body["turns_updated"], body["turns_too_late"]) == ("too_old", 0, 1)
        assert body["reason"] == "only recorded: the turn was already trained on (version 1)"
        assert "came too late" in body["message"] and "changes no update" in body["message"]
        assert service.store.events()[-1]["kind"] == "late_feedback"
        # on the later turn: it is still pending and counts; the parent keeps its own explicit value
        status, body = http("POST", url + "/v1/feedback", {"response_id": second.id, "rating": -1.0}, key=API_KEY)
        assert status == 200 and (body["turns_updated"], body["turns_too_late"]) == (1, 0) and "message" not in body
        assert body["outcome"] == "used"
        with service.store.lock:
            assert records.find_response(service.store, second.id)["status"] == "pending"
            assert records.find_response(service.store, first.id)["feedback"] == -1.0


def test_serve_uses_init_adapter_as_the_kl_reference(tiny_tokenizer, tmp_path):
    # serve started from a saved adapter with beta 0.1: the first update's KL is 0, as in `selfrl run`
    from conftest import save_tiny_phi
    from peft import set_peft_model_state_dict

    from selfrl.model.load import build_policy
    from selfrl.serve.service import Service

    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.model.name, cfg.lora.r = str(save_tiny_phi(tmp_path / "model", tiny_tokenizer)), 4
    model, _ = build_policy(cfg)
    torch.manual_seed(0)
    set_peft_model_state_dict(model, {k: torch.randn_like(v) for k, v in lora_state(model).items()})
    model.save_pretrained(tmp_path / "sft")
    cfg.lora.init_adapter, cfg.train.beta = str(tmp_path / "sft"), 0.1
    model, tok = build_policy(cfg)
    service = Service(model, tok, cfg, learner_model=copy.deepcopy(model))
    try:
        ref = service.learner.learner.ref_state
        saved = lora_state(model)
        assert ref is not None and all(torch.equal(ref[k], saved[k]) for k in saved)
        batch = record(service, [(turn(i, "arith"), "arith", (-1.0) ** i) for i in range(4)])
        service.learner.update(batch)
        kl = [m["value"] for m in service.store.metrics() if m["name"] == "kl"]
        assert len(kl) == 1 and kl[0] == pytest.approx(0.0, abs=1e-6)  # the base as reference gives about 0.3
    finally:
        service.close()


def test_serve_runs_the_probe_detector_at_each_validation_as_run_does(tiny_tokenizer, tiny_model_factory, tmp_path):
    # detectors.names = ["probe_regression"] was ignored by serve's validation before: it scores the
    # source's probe tasks per version, logs hacking/probe_* and records hacking events, as in run
    from selfrl.serve.service import Service

    cfg = tiny_serve_config(tmp_path / "run")
    cfg.task.source, cfg.rollout.tools, cfg.rollout.max_turns = "webshop", [], 2
    cfg.detectors.names = ["probe_regression"]
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        service.learner.validate(0)
        metrics = {m["name"]: m["value"] for m in service.store.metrics()}
        n = len(service.learner.source.probe_tasks())
        assert "hacking/probe_score" in metrics and "hacking/probe_regression" in metrics
        assert metrics["hacking/probe_score"] * n == pytest.approx(round(metrics["hacking/probe_score"] * n))
    finally:
        service.close()


def test_a_flood_of_ratings_on_one_turn_is_trained_once_with_the_last_one(tiny_tokenizer, tiny_model_factory,
                                                                         tmp_path):
    # docs/reference/http-api.md, "Several ratings on one turn": every message is stored and answered,
    # the last explicit rating before the update is the turn's reward, the turn is one sample of one
    # update, and a rating after it is only recorded
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run", min_batch=2, max_batch=8, feedback_wait_s=600.0)
    cfg.collapse.max_kl = 5.0  # the tiny model's first step at the default learning rate is not what this tests
    with running_server(model, tiny_tokenizer, cfg, learn=True) as (url, service):
        service.learner.stop()  # the test runs the update itself, after the flood
        client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        a, b = (client.chat.completions.create(model="selfrl", messages=[{"role": "user", "content": q}],
                                               max_tokens=3, extra_body={"task_key": "k"}) for q in ("qa", "qb"))
        answers = [http("POST", url + "/v1/feedback", {"response_id": a.id, "rating": r}, key=API_KEY)
                   for r in (0.5, -1.0, 1.0, -0.25, 0.75)]
        assert [(code, body["outcome"], body["turns_updated"], body["reward"]) for code, body in answers] == [
            (200, "used", 1, r) for r in (0.5, -1.0, 1.0, -0.25, 0.75)]
        assert http("POST", url + "/v1/feedback", {"response_id": b.id, "rating": -1.0}, key=API_KEY)[0] == 200
        with service.store.lock:
            assert records.counts(service.store)["feedback_messages"] == 6  # every message kept
            assert records.find_response(service.store, a.id)["feedback"] == 0.75  # the last one
            batch = records.ready(service.store, cfg.learner.feedback_wait_s, cfg.learner.max_batch)
        assert len(batch) == 2  # one row per turn, however many ratings it got
        info = service.learner.update(batch)
        assert (info["turns"], info["scored"], info["with_signal"]) == (2, 2, 2)
        code, late = http("POST", url + "/v1/feedback", {"response_id": a.id, "rating": -1.0}, key=API_KEY)
        assert code == 200 and (late["outcome"], late["turns_updated"], late["turns_too_late"]) == ("too_old", 0, 1)
        with service.store.lock:
            row = records.find_response(service.store, a.id)
            trained = {t.id: t for t in service.store.trajectories()}[row["trajectory_id"]]
            assert records.counts(service.store)["feedback_messages"] == 7
        assert row["status"] == "trained" and trained.rewards["user_feedback"] == 0.75  # the late -1 changed nothing
