"""The age rule wired into `selfrl serve` (selfrl.serve.late_feedback): the learner's weight
history from the ledger, the cutoffs at the feedback and at the update, and the sequence weight
multiplied into a late turn's advantage, on a hand-computed case and through the real learner."""

import copy
import math
import time

import pytest

from selfrl.core.trajectory import Trajectory
from selfrl.rl.feedback_age import AgePolicy
from selfrl.serve.late_feedback import FeedbackAges, version_tree


class Clock:
    def __init__(self, t):
        self.t = t

    def __call__(self):
        return self.t


class FakeLedger:
    """Versions ``(version, parent)`` or ``(version, parent, status)`` in order, and the champion."""

    def __init__(self, rows, champion):
        self.rows, self.champion = rows, type("C", (), {"version": champion})

    def all(self):
        from selfrl.record.versions import VersionStatus

        return [type("V", (), {"version": r[0], "parent": r[1], "status": VersionStatus(r[2] if len(r) > 2 else
                                                                                           "promoted")})
                for r in self.rows]


def test_the_version_tree_is_read_from_the_ledger():
    # 1 promoted, 2 rejected (the weights go back to 1), 3 from 1 promoted, an admin rollback to 0
    assert version_tree(FakeLedger([(0, None), (1, 0), (2, 1), (3, 1)], 3)) == ({0: None, 1: 0, 2: 1, 3: 1}, 3)
    assert version_tree(FakeLedger([(0, None), (1, 0), (2, 1), (3, 1)], 0))[1] == 0
    assert version_tree(FakeLedger([(0, None)], 0)) == ({0: None}, 0)


def test_weight_changes_are_counted_along_the_lineage_not_the_versions_loaded():
    # 0 -> 1 promoted -> 2 (from 1) rejected -> 3 (from 1) promoted, then an admin rolls back to 1
    # (3 rolled_back) -> 4 (from 1) promoted; max_feedback_age_versions = 1. Counted by hand along the
    # parent links, the weights the learner holds (champion) and a turn of version 0, 1 or 3:
    #   champion 1 after 2's rejection:  0 is 1 change back (0 -> 1); 2 made no change that 1 carries
    #   champion 3:                      0 is 2 back (0 -> 1 -> 3), 1 is 1 back
    #   champion 1 after the rollback:   0 is 1 back again, 1 is 0 (fresh), 3 is 1 (3 -> 1, undone)
    #   champion 4:                      0 is 2 back, 1 is 1, 3 is 2 (back to 1, then on to 4)
    # Before, the count was the versions loaded since (history 0 1 2 1 3 1 4): a turn of 0 was 3 changes
    # back after 2's rejection and 5 after the rollback, so it was expired although 1 change back.
    rows = [(0, None), (1, 0), (2, 1, "rejected"), (3, 1, "rolled_back"), (4, 1)]
    clock, policy = Clock(10_000.0), AgePolicy(max_versions=1, max_age_s=3600.0)
    cases = [(3, 1, {0: 1, 1: 0}, {0, 1, 2}),  # rows, champion, changes back per turn version, versions kept
             (4, 3, {0: 2, 1: 1, 3: 0}, {1, 3}),
             (4, 1, {0: 1, 1: 0, 3: 1}, {0, 1, 2, 3}),
             (5, 4, {0: 2, 1: 1, 3: 2}, {1, 4})]
    for n, champion, behind, needed in cases:
        ages = FeedbackAges(policy, FakeLedger(rows[:n], champion), clock)
        turns = [(turn(f"v{v}", v, 1.0), {"created_at": 9_000.0}) for v in behind]
        kept, old = ages.split(turns)
        got = {t.adapter_version: t.reward_details["user_feedback"]["age"]["versions_behind"] for t, _ in old}
        assert got == {v: k for v, k in behind.items() if k > 1}, champion
        assert sorted(t.adapter_version for t, _ in kept) == sorted(v for v, k in behind.items() if k <= 1)
        assert {v: ages.at_feedback(v, 9_000.0)[0] for v in behind} == {
            v: "used" if k == 0 else "queued" if k == 1 else "too_old" for v, k in behind.items()}
        assert ages.needed() == needed  # retention keeps these versions' weights
    assert ages.at_feedback(0, 9_000.0)[1] == (
        "only recorded: the policy changed 2 times since version 0, more than max_versions = 1")
    # the update weighs the turn of 0 after the rollback (one change behind); 1's turn is the current one's
    ages = FeedbackAges(policy, FakeLedger(rows[:4], 1), clock)
    assert ages.behind([turn("a", 0, 1.0), turn("b", 1, 1.0)]).keys() == {0}


def test_a_chain_that_did_not_start_from_the_champion_is_not_the_weights_held():
    # gate.eval_every = 3: the champion 1 trained on into the chain 2, 3 (the learner holds 3); then an
    # admin rolls back to 0 (1 rolled_back): the learner goes back to 0 before its next update, so a turn
    # of 0 is fresh, not 3 changes back
    ledger = FakeLedger([(0, None), (1, 0), (2, 1, "candidate"), (3, 2, "candidate")], 1)
    ledger.chain_head = 3
    assert version_tree(ledger)[1] == 3
    ages = FeedbackAges(AgePolicy(max_versions=2), ledger, Clock(10_000.0))
    assert ages.at_feedback(1, 9_000.0)[0] == "queued" and ages.at_feedback(0, 9_000.0)[0] == "too_old"
    ledger.rows[1], ledger.champion = (1, 0, "rolled_back"), type("C", (), {"version": 0})
    assert version_tree(ledger)[1] == 0
    assert ages.at_feedback(0, 9_000.0)[0] == "used" and ages.at_feedback(1, 9_000.0)[0] == "queued"


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
    from selfrl.serve.feedback_request import FeedbackRequest
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
    from selfrl.serve.feedback_request import FeedbackRequest
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


class EventLedger(FakeLedger):
    """A :class:`FakeLedger` that keeps the events it is given."""

    def __init__(self, rows, champion):
        super().__init__(rows, champion)
        self.events = []

    def event(self, kind, message, data=None):
        self.events.append((kind.value, message, data))


def store_turns(store, run, spec):
    """Served turns ``{name: (version, created_at, feedback or None)}``, each its own response ``name``."""
    from selfrl.record import served as records

    for name, (version, created, value) in spec.items():
        t = Trajectory(name, "g", version, prompt_len=1, token_ids=[5, 6, 7], completion_mask=[0, 1, 1],
                       logprobs=[0.0, -1.0, -1.0], id=name)
        records.add_turns(store, run, [records.ServedTurn(t, name, 0, name, "g", name)], now=created)
        if value is not None:
            records.apply_feedback(store, name, 0, "explicit", value)


def test_the_batch_is_the_newest_eligible_turns_and_the_too_old_expire_while_awaited_turns_wait(tmp_path):
    # before: the batch was the oldest ready turns (b, a, c), two of them past the age rule, and the
    # rest of the backlog waited behind them; a learner behind its traffic trained on nothing fresh
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.record.store import Store
    from selfrl.serve.late_feedback import take_batch

    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    ledger = EventLedger([(0, None), (1, 0), (2, 1)], 2)  # weights 0 -> 1 -> 2
    clock = Clock(10_000.0)
    ages = FeedbackAges(AgePolicy(max_versions=1, max_age_s=3600.0), ledger, clock)
    lc = LearnerSettings(min_batch=2, max_batch=3, feedback_wait_s=60.0, max_feedback_age_versions=1,
                         max_feedback_age_s=3600.0)
    store_turns(store, run, {
        "b": (2, 5_000.0, 1.0),  # 5000 s old: past max_age_s
        "a": (0, 9_000.0, 1.0),  # 2 weight changes behind: past max_versions
        "c": (1, 9_100.0, -1.0), "d": (2, 9_200.0, None), "e": (2, 9_300.0, 1.0), "f": (1, 9_400.0, -1.0),
        "h": (0, 9_980.0, None),  # past max_versions, but its feedback may still come for 40 s: it waits
        "g": (2, 9_990.0, None),  # the newest turn, awaiting its feedback: not taken early
    })
    batch = take_batch(store, ages, lc)
    assert [t.id for t, _ in batch] == ["f", "e", "d"]  # newest first, within the age rule; d's wait is over
    status = {n: records.find_response(store, n)["status"] for n in "abcdefgh"}
    assert status == {"a": "skipped", "b": "skipped", "c": "pending", "d": "pending", "e": "pending",
                      "f": "pending", "g": "pending", "h": "pending"}
    stored = {t.id: t for t in store.trajectories()}
    assert set(stored) == set("abcdefgh")  # expiry changes the status only
    assert stored["a"].reward_details["user_feedback"]["age"]["reason"] == (
        "only recorded: the policy changed 2 times since version 0, more than max_versions = 1")
    assert stored["b"].reward_details["user_feedback"]["age"]["reason"] == (
        "only recorded: the turn is 5000 s old, more than max_age_s = 3600")
    [(kind, message, data)] = ledger.events
    assert kind == "expire" and data == {"reason": "too_old", "expired": 2, "versions": [0, 2]}
    assert message.startswith("expired: 2 turn(s) sampled by versions [0, 2] were past the age "
                              "rule (learner.max_feedback_age_versions = 1 weight changes, max_feedback_age_s = 3600)")
    # feedback on an expired turn is answered as the age rule answers it at an update
    applied = records.apply_feedback(store, "a", 0, "explicit", 1.0, age=ages.at_feedback)
    assert (applied.outcome, applied.reason, applied.updated) == (
        "too_old", "only recorded: the policy changed 2 times since version 0, more than max_versions = 1", 0)
    assert records.find_response(store, "a")["status"] == "skipped"

    # g's feedback arrives: the newest ready turn now; h's wait ends: it is expired at the next batch
    records.apply_feedback(store, "g", 0, "explicit", 1.0)
    clock.t = 10_041.0
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["g", "f", "e"]
    assert records.find_response(store, "h")["status"] == "skipped" and ledger.events[-1][2]["expired"] == 1
    lc.order = "oldest"  # arrival order, among the turns within the age rule
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["c", "d", "e"]


def test_turns_expired_only_by_changes_later_undone_come_back_and_expiry_follows_the_weights(tmp_path):
    # before: expiry ran only when an update was due, so a turn past the rule after a promotion was
    # counted pending until then; and a turn expired by weight changes a rollback undid stayed skipped
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.record.store import Store
    from selfrl.serve.late_feedback import take_batch

    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    ledger = EventLedger([(0, None), (1, 0)], 1)  # the learner holds 1 (trained from the base 0)
    clock = Clock(10_000.0)
    ages = FeedbackAges(AgePolicy(max_versions=1, max_age_s=3600.0), ledger, clock)
    lc = LearnerSettings(min_batch=8, max_batch=8, feedback_wait_s=60.0, max_feedback_age_versions=1,
                         max_feedback_age_s=3600.0)
    store_turns(store, run, {"a": (0, 9_000.0, 1.0), "b": (0, 9_100.0, -1.0), "c": (1, 9_200.0, 1.0),
                             "old": (0, 6_500.0, 1.0),  # within the hour now, 3500 s old
                             "cut": (0, 9_300.0, 1.0)})
    records.mark_cut_off(store, "cut", "the client disconnected")

    def status():
        return {n: records.find_response(store, n)["status"] for n in ("a", "b", "c", "old", "cut")}

    assert len(take_batch(store, ages, lc)) == 4 and not ledger.events  # 1 change back: within; no update due
    ledger.rows.append((2, 1))  # 2 promoted: 0 is 2 changes back; no update is due (4 ready < min_batch 8)
    ledger.champion = type("C", (), {"version": 2})
    clock.t = 10_200.0  # "old" is 3700 s old: past max_age_s too
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["c"]
    assert status() == {"a": "skipped", "b": "skipped", "c": "pending", "old": "skipped", "cut": "skipped"}
    assert records.counts(store)["pending"] == 1  # what /admin/status and the report show
    assert ledger.events[-1][2] == {"reason": "too_old", "expired": 3, "versions": [0]}
    assert len(take_batch(store, ages, lc)) == 1 and len(ledger.events) == 1  # nothing moved: nothing read again

    # an admin rolls back to 1 (2 rolled back): 0 is 1 change back again; a and b come back, their
    # decision dropped; "old" stays (past max_age_s), "cut" stays (cut off, never trained)
    ledger.rows[2], ledger.champion = (2, 1, "rolled_back"), type("C", (), {"version": 1})
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["c", "b", "a"]
    assert status() == {"a": "pending", "b": "pending", "c": "pending", "old": "skipped", "cut": "skipped"}
    kind, message, data = ledger.events[-1]
    assert (kind, data) == ("revive", {"revived": 2, "versions": [0]})
    assert message.startswith("2 turn(s) sampled by versions [0] are within the age rule again")
    stored = {t.id: t for t in store.trajectories()}
    assert "age" not in stored["a"].reward_details["user_feedback"]
    assert stored["old"].reward_details["user_feedback"]["age"]["outcome"] == "too_old"
    assert records.apply_feedback(store, "a", 0, "explicit", -1.0, age=ages.at_feedback).outcome == "queued"
    assert len(take_batch(store, ages, lc)) == 3 and len(ledger.events) == 2  # nothing moved since


def test_a_turn_awaiting_its_feedback_is_neither_taken_nor_expired(tmp_path):
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.record.store import Store
    from selfrl.serve.late_feedback import take_batch

    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    ledger = EventLedger([(0, None), (1, 0), (2, 1), (3, 2)], 3)
    ages = FeedbackAges(AgePolicy(max_versions=0, max_age_s=3600.0), ledger, Clock(10_000.0))
    lc = LearnerSettings(min_batch=2, max_batch=8, feedback_wait_s=120.0, max_feedback_age_versions=0)
    store_turns(store, run, {"x": (3, 9_950.0, 1.0), "y": (3, 9_960.0, -1.0),
                             "old": (0, 9_970.0, None), "new": (3, 9_990.0, None)})  # both within their 120 s
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["y", "x"]
    assert {records.find_response(store, n)["status"] for n in ("old", "new")} == {"pending"} and not ledger.events
    assert records.ready(store, 120.0, 8, now=10_000.0, order="newest") == take_batch(store, ages, lc)
    with pytest.raises(ValueError, match="order must be one of 'oldest', 'newest', got 'random'"):
        records.ready(store, 120.0, 8, order="random")


def test_the_served_learner_trains_on_the_newest_turns_within_the_age_rule(
        tiny_tokenizer, tiny_model_factory, tmp_path):
    # through BackgroundLearner.tick, on the real ledger: two promotions, then a backlog of three versions
    from selfrl.record import served as records
    from selfrl.serve.feedback_request import FeedbackRequest
    from selfrl.serve.service import Service
    from serving import rated_turns, tiny_serve_config

    clock = Clock(time.time())
    cfg = tiny_serve_config(tmp_path / "run", min_batch=4, max_batch=4, max_feedback_age_versions=1)
    cfg.train.learning_rate, cfg.gate.tolerance, cfg.collapse.max_kl = 1e-2, 1.0, 5.0  # every candidate promoted
    model = tiny_model_factory(lora=True, eos_bias=2.0)
    service = Service(model, tiny_tokenizer, cfg, learner_model=copy.deepcopy(model), clock=clock)
    try:
        learner = service.learner
        learner.ensure_champion_validated()
        for _ in range(2):
            assert learner.update(rated_turns(service))["result"] == "promoted"
        assert service.ledger.champion.version == 2
        t0 = clock()
        store_turns(service.store, service.run_id, {
            "v0a": (0, t0 + 1, 1.0), "v0b": (0, t0 + 2, -1.0),  # two weight changes behind: too old
            "v1a": (1, t0 + 3, 1.0), "v1b": (1, t0 + 4, -1.0), "v2a": (2, t0 + 5, 1.0), "v2b": (2, t0 + 6, -1.0),
            "v2c": (2, t0 + 7, 1.0), "wait": (2, t0 + 8, None)})  # the newest, awaiting its feedback
        clock.t = t0 + 10
        taken = []
        learner.update = lambda batch: taken.append([t.id for t, _ in batch]) or {}
        assert learner.tick()
        assert taken == [["v2c", "v2b", "v2a", "v1b"]]
        with service.store.lock:
            status = {n: records.find_response(service.store, n)["status"] for n in ("v0a", "v0b", "v1a", "wait")}
        assert status == {"v0a": "skipped", "v0b": "skipped", "v1a": "pending", "wait": "pending"}
        answer = service.feedback(FeedbackRequest(response_id="v0a", rating=1.0))
        assert answer["outcome"] == "too_old" and answer["reason"] == (
            "only recorded: the policy changed 2 times since version 0, more than max_versions = 1")
        [event] = [e for e in service.store.events() if e["kind"] == "expire"]
        assert event["data"] == {"reason": "too_old", "expired": 2, "versions": [0]}
    finally:
        service.close()


def test_a_replica_whose_age_rule_is_not_its_owners_is_refused(tmp_path):
    # before: a replica answered feedback, and left turns out for good, by its own [learner] age rule,
    # so with max_feedback_age_versions = 1 there it skipped turns its owner (4) would have trained
    from selfrl.config import ConfigError
    from selfrl.config.serve import LearnerSettings
    from selfrl.serve.replica import check_owner_age_rule

    owner = {"config": {"serve": {"replica": False, "learner": {"max_feedback_age_versions": 4,
                                                                "max_feedback_age_s": 3600.0,
                                                                "feedback_tis_cap": 2.0}}}}
    other = {"config": {"serve": {"replica": True, "learner": {"max_feedback_age_versions": 9}}}}
    same = LearnerSettings(max_feedback_age_versions=4, max_feedback_age_s=3600.0, min_batch=2, max_batch=2)
    check_owner_age_rule(same, [owner, other], "runs/x")  # another replica's values are not the owner's
    check_owner_age_rule(LearnerSettings(), [{"config": {"run": {}}}], "runs/x")  # no owner's start recorded
    with pytest.raises(ConfigError) as e:
        check_owner_age_rule(LearnerSettings(max_feedback_age_versions=1, max_feedback_age_s=3600.0),
                             [owner, other], "runs/x")
    assert str(e.value).endswith(
        "this replica's age rule is not its owner's (the last start of selfrl serve on runs/x): "
        "learner.max_feedback_age_versions = 1 here, 4 there; a replica answers feedback, and leaves turns too old "
        "to train out, by the age rule of the owner's learner, which trains its turns: set "
        "learner.max_feedback_age_versions = 4 in this replica's config (or restart the owner with this replica's "
        "values)")


def real_ledger(tmp_path, rows, champion):
    """A store with served-turn tables and a real :class:`Ledger` of ``rows`` ``(version, parent, status)``."""
    from selfrl.record import served as records
    from selfrl.record.store import Store
    from selfrl.record.versions import Champion, Ledger

    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    for v, parent, status in rows:
        store.add_version(v, parent, str(tmp_path / f"v{v}"), status, {})
    ledger = Ledger(store, run, tmp_path)
    ledger.champion = Champion(champion, None, {})
    return store, run, ledger


def test_turns_of_a_version_retention_pruned_do_not_come_back_when_it_is_within_the_rule_again(tmp_path):
    # before: version 1 (2 changes back from the champion 3) was out of the rule, so retention pruned its
    # folder; an admin's rollback to 2 put 1 within the rule again (1 change back), and its expired turns
    # came back as pending (a revive event), feedback on them answered "queued": never trainable, their
    # log-probs cannot be computed any more (the update found the weights gone and skipped them again)
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.serve.late_feedback import take_batch

    store, run, ledger = real_ledger(tmp_path, [(0, None, "base"), (1, 0, "promoted"), (2, 1, "promoted"),
                                                (3, 2, "promoted")], 3)
    clock = Clock(10_000.0)
    ages = FeedbackAges(AgePolicy(max_versions=1, max_age_s=3600.0), ledger, clock)
    lc = LearnerSettings(min_batch=8, max_batch=8, feedback_wait_s=60.0, max_feedback_age_versions=1,
                         max_feedback_age_s=3600.0)
    store_turns(store, run, {"a": (1, 9_000.0, 1.0), "b": (1, 9_100.0, -1.0), "c": (2, 9_200.0, 1.0)})
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["c"]  # a, b: 2 changes back, expired
    assert ages.needed() == {2, 3}
    ledger.mark_pruned(1, "deleted")  # retention: 1 is not needed
    store.set_version_status(3, "rolled_back")  # an admin rolls back to 2
    ledger.champion = type(ledger.champion)(2, None, {})
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["c"]
    assert {records.find_response(store, n)["status"] for n in "ab"} == {"skipped"}
    assert not [e for e in store.events() if e["kind"] == "revive"]
    assert ages.needed() == {2, 3}  # 0 and 1 have no weights to weigh a turn by; 3 (rolled back) is 1 change back
    outcome, reason = ages.at_feedback(1, 9_500.0)
    assert (outcome, reason) == ("too_old", "only recorded: the weights of version 1 are no longer stored "
                                            "(pruned by retention: deleted)")
    assert ages.at_feedback(2, 9_500.0)[0] == "used"


def test_a_turn_left_out_by_its_feedback_answer_comes_back_as_an_expired_one_does(tmp_path):
    # before: gate.eval_every = 2 (a chain's candidate 2 held), a turn of 0 awaiting its feedback was not
    # expired; its feedback, 2 changes back, was answered too_old and the turn skipped with no age decision
    # stored, so when the chain was rejected (0 one change back again) the expired turn x came back and w,
    # left out by the same changes, did not
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.serve.late_feedback import take_batch

    store, run, ledger = real_ledger(tmp_path, [(0, None, "base"), (1, 0, "promoted")], 1)
    clock = Clock(10_000.0)
    ages = FeedbackAges(AgePolicy(max_versions=1, max_age_s=3600.0), ledger, clock)
    lc = LearnerSettings(min_batch=8, max_batch=8, feedback_wait_s=60.0, max_feedback_age_versions=1,
                         max_feedback_age_s=3600.0)
    store_turns(store, run, {"x": (0, 9_000.0, 1.0), "w": (0, 9_990.0, None), "y": (1, 9_100.0, 1.0)})
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["y", "x"]
    store.add_version(2, 1, str(tmp_path / "v2"), "candidate", {})
    ledger.chain_head = 2  # the learner trains on from 2, unvalidated
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["y"]  # x expired; w still awaits its feedback
    clock.t = 10_010.0
    applied = records.apply_feedback(store, "w", 0, "explicit", 1.0, now=clock.t,
                                     age=lambda v, at: ages.at_feedback(v, at, note=True))
    assert (applied.outcome, applied.reason) == (
        "too_old", "only recorded: the policy changed 2 times since version 0, more than max_versions = 1")
    assert records.find_response(store, "w")["status"] == "skipped"
    [w] = [t for t in store.trajectories() if t.id == "w"]
    assert w.reward_details["user_feedback"]["age"]["versions_behind"] == 2
    store.set_version_status(2, "rejected")  # the chain is rejected: the learner holds 1 again
    ledger.chain_head = None
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["w", "y", "x"]
    assert [e["data"] for e in store.events() if e["kind"] == "revive"] == [{"revived": 2, "versions": [0]}]
    # a rule without the decision (two items) leaves the turn as before: a later feedback decides again
    clock.t = 10_020.0
    store_turns(store, run, {"z": (0, 10_015.0, None)})
    store.add_version(3, 1, str(tmp_path / "v3"), "candidate", {})
    ledger.chain_head = 3  # a new chain
    assert records.apply_feedback(store, "z", 0, "explicit", 1.0, now=clock.t, age=ages.at_feedback).outcome == "too_old"
    [z] = [t for t in store.trajectories() if t.id == "z"]
    assert "age" not in z.reward_details.get("user_feedback", {})


def test_after_a_restart_the_turns_a_lost_chain_expired_come_back_and_counts_start_from_the_champion(tmp_path):
    # pins: a kill -9 during a chain (gate.eval_every = 3); the restarted learner holds the champion 1
    # (the chain's candidates stay candidate), its first poll reads every version within the rule
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.record.versions import Champion, Ledger
    from selfrl.serve.late_feedback import take_batch

    store, run, ledger = real_ledger(tmp_path, [(0, None, "base"), (1, 0, "promoted"), (2, 1, "candidate"),
                                                (3, 2, "candidate")], 1)
    ledger.chain_head = 3
    ages = FeedbackAges(AgePolicy(max_versions=2, max_age_s=3600.0), ledger, Clock(10_000.0))
    lc = LearnerSettings(min_batch=8, max_batch=8, feedback_wait_s=60.0, max_feedback_age_versions=2,
                         max_feedback_age_s=3600.0)
    store_turns(store, run, {"x": (0, 9_000.0, 1.0), "y": (1, 9_100.0, -1.0)})
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["y"]  # 0 is 3 changes from 3: expired
    assert ages.needed() == {1, 2, 3}
    restarted = Ledger(store, store.start_run({}), tmp_path)  # the store read again; no chain
    restarted.champion = Champion(1, None, {})
    ages = FeedbackAges(AgePolicy(max_versions=2, max_age_s=3600.0), restarted, Clock(10_100.0))
    assert ages.needed() == {0, 1, 2, 3}  # 2 and 3 (never served) are 1 and 2 changes off the champion
    assert [t.id for t, _ in take_batch(store, ages, lc)] == ["y", "x"]
    assert records.find_response(store, "x")["status"] == "pending"
    assert ages.at_feedback(0, 9_000.0)[0] == "queued" and ages.at_feedback(1, 9_100.0)[0] == "used"
    [revive] = [e for e in store.events() if e["kind"] == "revive"]
    assert revive["data"] == {"revived": 1, "versions": [0]}
