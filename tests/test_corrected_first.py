"""Which ready turns an update takes first when the learner trains corrections as demonstrations
(``learner.learn_from_corrections``, :func:`selfrl.record.served.ready`'s ``corrected_first``)."""

from __future__ import annotations

import pytest
from test_late_feedback import Clock, EventLedger, store_turns

from selfrl.rl.feedback_age import AgePolicy
from selfrl.serve.late_feedback import FeedbackAges


@pytest.mark.parametrize("use, first", [("off", []), ("calls", ["c"]), ("all", ["c", "b"])])
def test_turns_with_a_correction_the_learner_trains_are_taken_first(tmp_path, use, first):
    # before: always the newest ready turns, whatever their feedback; in a 90-minute soak 170 of the
    # 239 call corrections were still waiting at the end, behind newer turns
    from selfrl.config.serve import LearnerSettings
    from selfrl.record import served as records
    from selfrl.record.store import Store
    from selfrl.serve.late_feedback import take_batch

    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    run = store.start_run({})
    ages = FeedbackAges(AgePolicy(max_versions=4, max_age_s=3600.0), EventLedger([(0, None)], 0), Clock(10_000.0))
    store_turns(store, run, {n: (0, 9_000.0 + 10 * i, 1.0) for i, n in enumerate("abcdef")})
    records.apply_feedback(store, "b", 0, "explicit", -1.0, corrected=True, correction="42")
    records.apply_feedback(store, "c", 0, "explicit", -1.0, corrected=True,
                           correction_calls=[{"name": "calculator", "arguments": {"expression": "6 * 7"}}])
    records.apply_feedback(store, "d", 0, "explicit", -1.0, corrected=True, correction="  ")  # says nothing
    lc = LearnerSettings(min_batch=2, max_batch=3, feedback_wait_s=60.0, max_feedback_age_versions=4,
                         max_feedback_age_s=3600.0, learn_from_corrections=use)
    batch = [t.id for t, _ in take_batch(store, ages, lc)]
    newest = [n for n in "fedcba" if n not in first]
    assert batch == (first + newest)[:3]
    with pytest.raises(ValueError, match="corrected_first must be"):
        records.ready(store, 60.0, 3, corrected_first="text")


def test_a_turn_whose_newest_correction_is_text_is_not_first_under_calls(tmp_path):
    # before: an older calls correction put it first, and demonstrations() (the newest correction, text) left it out
    from selfrl.record import served as records
    from selfrl.record.store import Store

    store = Store(tmp_path / "db.sqlite")
    records.init(store)
    store_turns(store, store.start_run({}), {n: (0, 9_000.0 + 10 * i, 1.0) for i, n in enumerate("abc")})
    records.apply_feedback(store, "a", 0, "explicit", -1.0, corrected=True,
                           correction_calls=[{"name": "calculator", "arguments": {"expression": "1+1"}}])
    records.apply_feedback(store, "a", 0, "explicit", -1.0, corrected=True, correction="2")
    assert records.corrections(store, [("a", 0)]) == {("a", 0): ("2", [])}
    take = lambda use: [t.id for t, _ in records.ready(store, 60.0, 3, now=10_000.0, order="newest",  # noqa: E731
                                                       corrected_first=use)]
    assert take("calls") == ["c", "b", "a"] and take("all") == ["a", "c", "b"]
