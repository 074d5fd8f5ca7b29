"""The age rule wired into `selfrl serve` (selfrl.serve.late_feedback): the learner's weight
history from the ledger, the cutoffs at the feedback and at the update, and the sequence weight
multiplied into a late turn's advantage, on a hand-computed case and through the real learner."""

import copy
import math
import time

import pytest

from selfrl.core.trajectory import Trajectory
from selfrl.rl.feedback_age import AgePolicy
from selfrl.serve.late_feedback import FeedbackAges, weight_history


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


class FakeLedger:
    """Versions ``(version, parent)`` in order and the champion."""

    def __init__(self, rows, champion):
        self.rows, self.champion = rows, type("C", (), {"version": champion})

    def all(self):
        return [type("V", (), {"version": v, "parent": p}) for v, p in self.rows]


def test_weight_history_rebuilt_from_the_ledger():
    # 1 promoted, 2 rejected (the weights go back to 1), 3 from 1 promoted, an admin rollback to 0
    assert weight_history(FakeLedger([(0, None), (1, 0), (2, 1), (3, 1)], 3)) == [0, 1, 2, 1, 3]
    assert weight_history(FakeLedger([(0, None), (1, 0), (2, 1), (3, 1)], 0)) == [0, 1, 2, 1, 3, 0]
    assert weight_history(FakeLedger([(0, None)], 0)) == [0]


def turn(tid, version, advantage):
    return Trajectory(tid, "g", version, prompt_len=1, token_ids=[5, 6, 7], completion_mask=[0, 1, 1],
                      logprobs=[0.0, -1.0, -1.0], reward=advantage, advantage=advantage)


def test_hand_computed_cutoffs_and_weights():
    # weights: 0 -> 1 -> 2 (champion 2); max 1 weight change, max 1 hour
    ledger = FakeLedger([(0, None), (1, 0), (2, 1)], 2)
    clock = Clock(10_000.0)
    ages = FeedbackAges(AgePolicy(max_versions=1, max_age_s=3600.0, tis_cap=2.0), ledger, clock)
    a, b, c, d, e = turn("a", 2, 0.5), turn("b", 1, 1.0), turn("c", 1, -1.0), turn("d", 0, 1.0), turn("e", 2, 1.0)
    rows = {"a": 9_000.0, "b": 9_500.0, "c": 9_900.0, "d": 9_990.0, "e": 10_000.0 - 3601.0}
    kept, old = ages.split([(t, {"created_at": rows[t.task_id]}) for t in (a, b, c, d, e)])
    assert [t.task_id for t, _ in kept] == ["a", "b", "c"]
    assert [(t.task_id, dec.outcome.value) for t, dec in old] == [("d", "too_old"), ("e", "too_old")]
    assert old[0][1].reason == "only recorded: the policy changed 2 times since version 0, more than max_versions = 1"
    assert old[1][1].reason == "only recorded: the turn is 3601 s old, more than max_age_s = 3600"
    assert d.reward_details["user_feedback"]["age"]["versions_behind"] == 2

    # at the update: copies carry the current weights' log-probs (0, -1, -1); version 1's are
    # b: (0, -2, -1.5): log-ratio (-1 + 2) + (-1 + 1.5) = 1.5, exp = 4.48 -> capped at 2.0
    # c: (0, -1, -1.2): log-ratio 0 + 0.2 = 0.2, exp = 1.2214
    then = {"b": [0.0, -2.0, -1.5], "c": [0.0, -1.0, -1.2]}
    asked = []

    def logps_under(version, turns):
        asked.append((version, [t.task_id for t in turns]))
        return [then[t.task_id] for t in turns]

    train = [Trajectory.from_dict(t.to_dict()) for t in (a, b, c)]
    metrics = ages.weigh(train, [a, b, c], logps_under)
    assert asked == [(1, ["b", "c"])]  # the current version's turn needs no extra pass
    assert [t.advantage for t in train] == pytest.approx([0.5, 2.0, -math.exp(0.2)])
    assert metrics == pytest.approx({"feedback/behind": 2.0, "feedback/weight_mean": (1.0 + 2.0 + math.exp(0.2)) / 3})
    assert b.reward_details["user_feedback"]["age"] == {"outcome": "used", "weight": 2.0}

    # a version whose weights are gone: its turns get weight 0 and say why
    def gone(version, turns):
        raise FileNotFoundError(f"version {version}")

    train = [Trajectory.from_dict(t.to_dict()) for t in (a, b)]
    ages.weigh(train, [a, b], gone)
    assert [t.advantage for t in train] == [0.5, 0.0]
    assert b.reward_details["user_feedback"]["age"]["outcome"] == "too_old"

    # at the feedback: used (the learner holds the version), queued (moved, within the cutoffs), too old
    assert ages.at_feedback(2, 9_000.0)[0] == "used"
    assert ages.at_feedback(1, 9_000.0) == ("queued", "queued: the policy changed 1 time since version 1; waits "
                                                      "for the learner to weigh it under version 2")
    assert ages.at_feedback(0, 9_000.0)[0] == "too_old"


def test_the_served_learner_drops_too_old_turns_weighs_late_ones_and_answers_feedback(
        tiny_tokenizer, tiny_model_factory, tmp_path):
    from selfrl.record import served as records
    from selfrl.serve.protocol import FeedbackRequest
    from selfrl.serve.service import Service
    from serving import rated_turns, tiny_serve_config

    clock = Clock(time.time())  # turns are stored at the clock's time; days pass without waiting
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4, max_feedback_age_s=86400.0)
    cfg.train.learning_rate, cfg.gate.tolerance = 1e-2, 1.0  # every candidate is promoted
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model), clock=clock)
    try:
        learner = service.learner
        learner.ensure_champion_validated()
        early, late = rated_turns(service), rated_turns(service)  # both sampled by version 0
        for t, row in early + late:
            row["created_at"] = clock()

        def feedback(t):
            return service.feedback(FeedbackRequest(response_id=t.id, rating=1.0))

        assert feedback(late[0][0])["outcome"] == "used"  # the learner still holds version 0
        assert learner.update(early)["result"] == "promoted" and service.ledger.champion.version == 1
        answer = feedback(late[1][0])
        assert (answer["outcome"], answer["turns_updated"]) == ("queued", 1)
        assert answer["reason"].startswith("queued: the policy changed 1 time since version 0")

        info = learner.update(late)  # one weight change behind: weighed under version 0's stored weights
        assert info["too_old"] == 0 and info["version"] == 2
        m = {r["name"]: r["value"] for r in service.store.metrics() if r["step"] == 1}
        assert m["feedback/behind"] == 4.0 and 0.0 < m["feedback/weight_mean"] <= 2.0 and m["feedback/too_old"] == 0

        stale = rated_turns(service)  # sampled by the served version, stored now
        clock.t += 2 * 86400.0  # two days later, beyond max_feedback_age_s = 1 day
        answer = feedback(stale[0][0])
        assert answer["outcome"] == "too_old" and "more than max_age_s = 86400" in answer["reason"]
        with service.store.lock:
            assert records.find_response(service.store, stale[0][0].id)["status"] == "skipped"  # never trained
        for _, row in stale:
            row["created_at"] = clock() - 2 * 86400.0
        info = learner.update(stale)  # a learner behind its traffic: the skip says so (it said "no group had reward spread")
        assert info["too_old"] == 4 and info["reason"] == "too_old" and info["result"].startswith("skipped")
        versions = sorted({t.adapter_version for t, _ in stale})
        assert f"4 turn(s) sampled by versions {versions} were past the age rule" in info["result"]
        assert "max_feedback_age_s = 86400" in info["result"] and "the learner is behind the traffic" in info["result"]
        skip = [e for e in service.store.events() if e["kind"] == "skip"][-1]
        assert skip["data"]["too_old"] == 4 and "no group had reward spread" not in skip["message"]
        with service.store.lock:
            assert {records.find_response(service.store, t.id)["status"] for t, _ in stale} == {"skipped"}
    finally:
        service.close()


def test_turns_whose_version_weights_are_gone_are_too_old_and_the_skip_says_so(
        tiny_tokenizer, tiny_model_factory, tmp_path):
    # before: they stayed in the batch with advantage 0 and the update was skipped as "no group
    # had reward spread", the cause nowhere
    from selfrl.record import served as records
    from selfrl.serve.protocol import FeedbackRequest
    from selfrl.serve.service import Service
    from serving import rated_turns, tiny_serve_config

    cfg = tiny_serve_config(tmp_path / "run", min_batch=4)
    cfg.train.learning_rate, cfg.gate.tolerance = 1e-2, 1.0  # every candidate is promoted
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model))
    try:
        learner = service.learner
        learner.ensure_champion_validated()
        early, late = rated_turns(service), rated_turns(service)  # both sampled by version 0
        assert learner.update(early)["result"] == "promoted"

        def gone(version, turns):
            raise FileNotFoundError(f"version {version}: no folder")

        learner._logps_under = gone
        flat = rated_turns(service)  # of version 1, all rated +1 in another group: no spread, no signal
        for t, row in flat:
            t.task_id = t.group_id = row["group_key"] = "flat"
            row["feedback"] = 1.0
        info = learner.update(late + flat)
        assert info["reason"] == "too_old" and info["too_old"] == 4 and info["with_signal"] == 0
        assert "no longer stored or cannot be read (versions [0])" in info["result"]
        skip = [e for e in service.store.events() if e["kind"] == "skip"][-1]
        assert skip["data"]["reason"] == "too_old" and "no group had reward spread" not in skip["message"]
        with service.store.lock:  # every turn of the batch is closed, none left pending to come back
            assert {records.find_response(service.store, t.id)["status"] for t, _ in late + flat} == {"skipped"}
        assert service.ledger.champion.version == 1  # nothing trained on a weight of 0
        answer = service.feedback(FeedbackRequest(response_id=late[0][0].id, rating=1.0))
        assert answer["outcome"] == "too_old" and "no longer stored" in answer["reason"]  # not brought back
        with service.store.lock:
            assert records.find_response(service.store, late[0][0].id)["status"] == "skipped"
    finally:
        service.close()
