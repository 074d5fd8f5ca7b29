"""The background learner: feedback -> rewards -> update -> validated version served."""

import time

import torch
from openai import OpenAI

from selfrl.adapters import lora_state
from selfrl.serve import records
from selfrl.serve.feedback import served_rewards
from serving import API_KEY, http, running_server, tiny_serve_config


def test_feedback_trains_a_version_that_passes_the_gate_and_is_served(tiny_tokenizer, tiny_model_factory, tmp_path):
    model = tiny_model_factory(lora=True, eos_bias=2.0)  # A and B random: every tensor gets a gradient
    cfg = tiny_serve_config(tmp_path / "run", min_batch=8, max_batch=8, feedback_wait_s=600.0, poll_s=0.05)
    cfg.train.learning_rate = 1e-2
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
    from selfrl.trajectory import ToolCallRecord, Trajectory

    model = tiny_model_factory(lora=True, eos_bias=2.0)
    cfg = tiny_serve_config(tmp_path / "run")
    with running_server(model, tiny_tokenizer, cfg, learn=True) as (url, service):
        service.learner.stop()
        ok = ToolCallRecord("calculator", {}, "", True, "")
        bad = ToolCallRecord("calculator", {}, "", False, "", "x")
        tokens = {"token_ids": [1, 2], "completion_mask": [0, 1], "logprobs": [0.0, -1.0]}  # one sampled token
        batch = [
            (Trajectory("a", "", 0, **tokens), {"feedback": 1.0, "group_key": "g"}),
            (Trajectory("b", "", 0, tool_calls=[bad], **tokens), {"feedback": -1.0, "group_key": "g"}),
            (Trajectory("c", "", 0, tool_calls=[ok], **tokens), {"feedback": None, "group_key": "h"}),
            (Trajectory("d", "", 0, **tokens), {"feedback": None, "group_key": "h"}),
            # a turn with no sampled token: rated, but nothing to train on, so not in its group's statistics
            (Trajectory("e", "", 0, token_ids=[1, 2], completion_mask=[0, 0], logprobs=[0.0, 0.0]),
             {"feedback": 0.0, "group_key": "g"}),
        ]
        scored, unscored = service.learner.score(batch)
    # rewards: 1.0, -1.0 + 0.2 * 0 = -1.0, 0.2 * 1 = 0.2 (alone in its group), none, 0.0
    assert [t.reward for t in scored] == [1.0, -1.0, 0.2, 0.0] and [t.task_id for t in unscored] == ["d"]
    # (r - mean) / std, ddof 0, over {1, -1} (with "e" counted it would be {1, -1, 0}: +-1.22); a lone turn: 0
    assert [t.advantage for t in scored] == [1.0, -1.0, 0.0, None]
    assert served_rewards(None, 0.5, cfg.learner.reward_weights)[1] == 0.1
