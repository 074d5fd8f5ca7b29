"""The serving report's learning account per family (selfrl.report.serve_families).

The store below is written by hand through the store's public API: two families of a
served run, versions 0 (base), 1 and 2 (promoted; 2 the champion) and 3 (rejected):

* ``math`` learned: held-out 2/12 (base) -> 6/12 -> 10/12 (champion), 9/12 (rejected), and one
  task it always fails answered differently from version 1 on;
  40 turns served (20 rated +, 10 rated -, 10 not rated), 36 trained over versions 1, 2 and 3,
  4 pending;
* ``calls`` did not move: held-out 5/20 with the same 20 answers at every version; 50 turns
  served (3 +, 35 -, 12 not rated), 40 trained (3 of them rated +) over versions 1 and 2,
  10 skipped: 4 too old, 1 in a skipped update, 5 with no reward.
"""

from __future__ import annotations

import itertools

import pytest

from selfrl.core.trajectory import Trajectory
from selfrl.record import served as records
from selfrl.record.store import Store
from selfrl.report.serve import write_serve_report
from selfrl.report.serve_families import (FamilyAccount, diagnose_family, families_section, family_accounts,
                                          smallest_detectable)

_ids = itertools.count()


def turn(s: Store, run: int, family: str, rating: float | None) -> Trajectory:
    """One served turn of ``family`` (group key: the family, as ``selfrl simulate`` sends it), rated ``rating``."""
    i = next(_ids)
    t = Trajectory(task_id=f"{family}:{i}", group_id=family, adapter_version=0, prompt_len=1, token_ids=[1, 2],
                   completion_mask=[0, 1], logprobs=[0.0, -1.0])
    records.add_turns(s, run, [records.ServedTurn(t, f"r{i}", 0, f"c{i}", family, f"k{i}", family=family)])
    if rating is not None:
        records.apply_feedback(s, f"r{i}", 0, "explicit", rating)
    return t


def mark(s: Store, trajs: list[Trajectory], status: str, version: int | None, reward: float | None = 0.5,
         too_old: bool = False) -> None:
    for t in trajs:
        t.reward = reward
        if too_old:
            t.reward_details = {"user_feedback": {"age": {"outcome": "too_old", "reason": "4 versions behind"}}}
    records.mark(s, trajs, status, version)


def build(db) -> None:
    s = Store(db)
    records.init(s)
    run = s.start_run({"serve": {"families": [{"name": "math"}, {"name": "calls"}], "train": {"learning_rate": 2e-5}}})
    solved = {0: 2, 1: 6, 2: 10, 3: 9}  # math tasks solved per version: the first k
    for v, (parent, status) in enumerate(((None, "base"), (0, "promoted"), (1, "promoted"), (2, "rejected"))):
        s.add_version(v, parent, f"/a/{v}", status, {})
        s.add_evaluation(v, [(f"math/{i}", i < solved[v], "right" if i < solved[v] else "wrong" if i < 11 or not v
                              else "wrong again") for i in range(12)]  # math/11: a new wrong answer from v1 on
                         + [(f"calls/{i}", i < 5, f"call {i}") for i in range(20)])
    # math: 20 +, 10 -, 10 unrated; trained 36: 12 in v1, 12 in v2, 12 in v3; 4 pending (unrated)
    m = [turn(s, run, "math", 1.0) for _ in range(20)] + [turn(s, run, "math", -1.0) for _ in range(10)] + [
        turn(s, run, "math", None) for _ in range(10)]
    for k, v in enumerate((1, 2, 3)):
        mark(s, m[12 * k:12 * k + 12], "trained", v)
    # calls: 3 +, 35 -, 12 unrated; trained 40 (3 +, 30 -, 7 unrated) in v1 and v2; skipped:
    # 4 too old (rated -), 1 in a skipped update (rated -), 5 with no reward (unrated)
    pos, neg, none = ([turn(s, run, "calls", r) for _ in range(k)] for r, k in ((1.0, 3), (-0.5, 35), (None, 12)))
    trained = pos + neg[:30] + none[:7]
    mark(s, trained[:20], "trained", 1)
    mark(s, trained[20:], "trained", 2)
    mark(s, neg[30:34], "skipped", None, too_old=True)
    mark(s, neg[34:], "skipped", None)
    mark(s, none[7:], "skipped", None, reward=None)
    s.close()


@pytest.fixture
def store(tmp_path):
    build(tmp_path / "selfrl.db")
    with Store(tmp_path / "selfrl.db", readonly=True) as s:
        yield s


def test_each_family_is_counted_from_the_store(store):
    math, calls = family_accounts(store)
    assert (math.family, math.served, math.positive, math.negative, math.unrated) == ("math", 40, 20, 10, 10)
    assert (math.trained, math.trained_positive, math.skipped) == (36, 20, {})
    assert (math.updates, math.updates_kept, math.groups) == (3, 2, 1)  # v3 was rejected: not in the champion
    assert (math.base, math.champion, math.changed, math.evaluated) == ((0, 2, 12), (2, 10, 12), 9, 4)
    assert math.difference[0] == pytest.approx(8 / 12) and math.difference[1] > 0 and math.learned
    assert (calls.family, calls.served, calls.positive, calls.negative, calls.unrated) == ("calls", 50, 3, 35, 12)
    assert (calls.trained, calls.trained_positive) == (40, 3)
    assert calls.skipped == {"too old": 4, "update skipped": 1, "no reward": 5}
    assert (calls.updates, calls.updates_kept) == (2, 2)
    assert (calls.base, calls.champion, calls.difference) == ((0, 5, 20), (2, 5, 20), (0.0, 0.0, 0.0))
    assert (calls.changed, calls.first_update, calls.before, calls.changed_since, calls.moved) == (0, 1, 0, 0, 0)
    assert not calls.learned


def test_the_diagnosis_names_why_a_family_did_not_learn(store):
    math, calls = family_accounts(store)
    assert diagnose_family(math).startswith("learned: 2/12 -> 10/12, +0.667 [")
    text = diagnose_family(calls, 2e-5)
    assert text.startswith("not above its base: almost no positive feedback: 3 of its 40 trained turns (8%) were "
                           "rated positively in one group")
    assert ("held-out answers unchanged: the champion (v2) answers all 20 held-out tasks as the base did (nor did "
            "any of the 4 evaluated versions answer differently)") in text
    assert "a higher learning rate (train.learning_rate = 2e-05), or task_key groups of the same task" in text
    for other in ("too few trained turns", "aged out", "no candidate was promoted", "too small", "fell", "learned"):
        assert other not in text


def test_the_serving_report_carries_the_table_and_the_diagnosis(store, tmp_path):
    text = write_serve_report(tmp_path / "report", store, "families").read_text()
    assert "## Learning per family" in text
    assert ("| math | 40 | 20 / 10 / 10 | 36 (20) | 0 | 3 (2) | 2/12 -> 10/12 (v2) | +0.667 [+0.388, +0.945] "
            "| 9 of 12 |") in text
    assert ("| calls | 50 | 3 / 35 / 12 | 40 (3) | 10: 5 no reward, 4 too old, 1 update skipped | 2 (2) "
            "| 5/20 -> 5/20 (v2) | +0.000 [+0.000, +0.000] | 0 of 20 |") in text
    assert "- **calls**: not above its base: almost no positive feedback" in text
    assert "- **math**: learned: 2/12 -> 10/12" in text


def acct(**kw) -> FamilyAccount:
    base = dict(family="f", served=100, positive=40, negative=40, unrated=20, trained=80, trained_positive=30,
                updates=4, updates_kept=4, groups=5, base=(0, 3, 12), champion=(4, 5, 12),
                difference=(2 / 12, -0.05, 0.38), changed=3, first_update=1, before=0, changed_since=3, moved=3,
                evaluated=5)
    return FamilyAccount(**{**base, **kw})


def test_a_gain_the_held_out_set_cannot_show_names_its_size():
    assert [smallest_detectable(n) for n in (1, 2, 5, 12, 48)] == [2, 2, 3, 4, 4]
    text = diagnose_family(acct())
    assert text == ("not above its base: held out too small to show this gain: n = 12, +0.167 [-0.050, +0.380]; "
                    "the smallest gain it can show is 4 of 12 tasks (+0.333): a larger val_size")


def test_other_causes_each_named():
    assert "too few trained turns (10, under 32)" in diagnose_family(acct(trained=10, trained_positive=5))
    assert "no candidate was promoted" in diagnose_family(acct(champion=(0, 3, 12), difference=(0.0, 0.0, 0.0)))
    aged = diagnose_family(acct(skipped={"too old": 90}))
    assert "90 of its turns aged out before an update took them" in aged
    never = diagnose_family(acct(trained=0, trained_positive=0, skipped={"too old": 60, "no reward": 40}))
    assert ("never trained: none of its 100 turns was trained on (skipped: 60 too old, 40 no reward); "
            "its ratings came after the learner had moved on: rate sooner, or raise "
            "learner.max_feedback_age_versions;") in never
    # turns that were in an update, skipped as a whole: not told to rate sooner (the review's soak smoke)
    flat = diagnose_family(acct(trained=0, trained_positive=0, skipped={"update skipped": 8}))
    assert "none of its 100 turns was trained on (skipped: 8 update skipped); the updates its turns were in " \
           "were skipped" in flat and "rate sooner" not in flat and "soon after" not in flat
    assert "held-out fell (-0.250" in diagnose_family(acct(difference=(-0.25, -0.45, -0.05)))
    assert diagnose_family(acct(base=(0, 12, 12))).startswith("the base already solves all 12 held-out tasks")
    assert diagnose_family(acct(base=None, evaluated=0)) == "no held-out verdict (no held-out set)"


def test_a_run_without_families_is_one_row(tmp_path):
    s = Store(tmp_path / "selfrl.db")
    records.init(s)
    run = s.start_run({"serve": {}})
    s.add_version(0, None, "/a/0", "base", {})
    s.add_evaluation(0, [("t1", False, "x"), ("t2", True, "y")])
    t = turn(s, run, "ignored", 1.0)
    with s.conn:
        s.conn.execute("UPDATE served SET family = NULL")
    mark(s, [t], "trained", None)
    [row] = family_accounts(s)
    assert (row.name, row.served, row.trained, row.base, row.champion, row.changed) == (
        "all traffic", 1, 1, (0, 1, 2), (0, 1, 2), 0)
    assert families_section(s)[4].startswith("| all traffic | 1 | 1 / 0 / 0 | 1 (1) | 0 | 0 (0) | 1/2 -> 1/2 (v0)")
    s.close()


def test_families_a_server_does_not_configure_are_capped_and_the_rest_summed(tmp_path):
    """Without [[families]] a client may send any metadata.family: the 20 with the most turns get
    a row each, the other families one summed row, and the report says so."""
    from selfrl.report.serve_families import MAX_FAMILY_ROWS

    s = Store(tmp_path / "selfrl.db")
    records.init(s)
    run = s.start_run({"serve": {}})
    s.add_version(0, None, "/a/0", "base", {})
    s.add_version(1, 0, "/a/1", "promoted", {})
    big = {f"big{i:02d}": 3 + i for i in range(MAX_FAMILY_ROWS)}  # 3..22 turns each: a row each
    small = [f"small{i:02d}" for i in range(30)]  # 2 turns each (one rated +, trained in v1): summed
    for family, n in big.items():
        for _ in range(n):
            turn(s, run, family, None)
    for family in small:
        mark(s, [turn(s, run, family, 1.0)], "trained", 1)
        mark(s, [turn(s, run, family, None)], "skipped", None, reward=None)
    for i in range(4):  # no family
        t = Trajectory(task_id=f"none:{i}", group_id="g", adapter_version=0, prompt_len=1, token_ids=[1, 2],
                       completion_mask=[0, 1], logprobs=[0.0, -1.0])
        records.add_turns(s, run, [records.ServedTurn(t, f"n{i}", 0, f"n{i}", "g", f"n{i}")])
    accounts = family_accounts(s)
    assert [a.family for a in accounts[:MAX_FAMILY_ROWS]] == sorted(big, key=lambda f: -big[f])
    assert [a.name for a in accounts[MAX_FAMILY_ROWS:]] == ["all traffic", "(30 other families)"]
    other = accounts[-1]
    assert (other.served, other.positive, other.unrated, other.trained, other.trained_positive) == (60, 30, 30, 30, 30)
    assert other.skipped == {"no reward": 30} and (other.updates, other.updates_kept, other.groups) == (1, 1, 30)
    text = "\n".join(families_section(s))
    s.close()
    assert len([r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| family")]) == 22
    assert "| (30 other families) | 60 | 30 / 0 / 30 | 30 (30) | 30: 30 no reward | 1 (1) |" in text
    assert ("The 20 families not in [[families]] with the most turns have a row each; the other 30 "
            "(metadata.family as clients sent it) are summed in the last row.") in text
