"""The collapse budget per window of time (selfrl.safety.collapse_budget), on a hand-driven clock."""

import pytest

from selfrl.safety.collapse import safer_setting
from selfrl.safety.collapse_budget import Action, BudgetPolicy, CollapseBudget
from selfrl.config import CollapseConfig


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def policy(**kw):
    base = dict(learning_rate=1e-4, beta=0.02, stable_updates=3, stable_s=600.0, window_s=3600.0,
                max_per_window=2, cooldown_s=900.0)
    return BudgetPolicy(**(base | kw))


def test_levels_follow_safer_setting():
    cfg = CollapseConfig()
    p = BudgetPolicy(1e-4, 0.0)
    assert p.setting(0) == (1e-4, 0.0)
    assert p.setting(1) == safer_setting(1e-4, 0.0, cfg) == (5e-05, 0.01)
    assert p.setting(2) == safer_setting(*safer_setting(1e-4, 0.0, cfg), cfg) == (2.5e-05, 0.02)


def test_collapse_backoff_recovery_by_steps_then_another_collapse():
    clock = Clock()
    b = CollapseBudget(policy(), clock)
    assert b.setting() == (1e-4, 0.02) and not b.state().backing_off

    d = b.collapse()  # level 1
    assert (d.action, d.learning_rate, d.beta, d.paused_until) == (Action.BACKOFF, 5e-05, 0.04, None)
    assert "level 1" in d.reason and "1 of 2 collapses" in d.reason
    clock.t += 60
    d = b.collapse()  # level 2, still within the window budget of 2
    assert (d.action, d.learning_rate, d.beta) == (Action.BACKOFF, 2.5e-05, 0.08)
    s = b.state()
    assert (s.backing_off, s.level, s.collapses_in_window) == (True, 2, 2)
    assert (s.next_step_back_at, s.next_step_back_after_updates) == (1060.0 + 600.0, 3)
    assert b.may_update()

    # stable stretch by updates: the 3rd update without a collapse steps back one level
    clock.t += 1
    assert b.update_done() is None and b.update_done() is None
    assert b.update_done() == (5e-05, 0.04)
    assert b.state().level == 1 and b.state().next_step_back_after_updates == 3
    # stable stretch by time: 600 s later one update is enough
    clock.t += 600
    assert b.update_done() == (1e-4, 0.02)  # exactly the configured setting again
    s = b.state()
    assert (s.backing_off, s.level, s.next_step_back_at, s.next_step_back_after_updates) == (False, 0, None, None)
    assert b.update_done() is None  # at level 0 nothing to step back to

    # another collapse after the window has slid past the first two: a plain backoff, not a pause
    clock.t += 3600
    d = b.collapse()
    assert (d.action, d.learning_rate, d.beta) == (Action.BACKOFF, 5e-05, 0.04)
    assert b.state().collapses == 3 and b.state().collapses_in_window == 1


def test_window_budget_exceeded_pauses_then_learning_resumes():
    clock = Clock()
    b = CollapseBudget(policy(), clock)
    b.collapse()
    clock.t += 100
    b.collapse()
    clock.t += 100
    d = b.collapse()  # 3 in the window > 2
    assert d.action == Action.PAUSE and d.paused_until == 1200.0 + 900.0
    assert (d.learning_rate, d.beta) == (1.25e-05, 0.16)
    assert "3 collapses in the last 3600 s" in d.reason
    assert not b.may_update() and b.state().paused_until == 2100.0
    clock.t = 2099.0
    assert not b.may_update()
    clock.t = 2100.0
    assert b.may_update() and b.state().paused_until is None and not b.stopped
    # the stable stretch starts when learning resumes
    assert b.state().next_step_back_at == 2100.0 + 600.0


def test_window_is_sliding():
    clock = Clock()
    b = CollapseBudget(policy(), clock)
    b.collapse()
    clock.t += 3000
    b.collapse()
    clock.t += 601  # the first collapse is now 3601 s old: out of the window
    assert b.collapse().action == Action.BACKOFF
    assert b.state().collapses_in_window == 2


def test_floor_and_ceiling_bound_the_backoff():
    b = CollapseBudget(policy(lr_floor=4e-5, beta_ceiling=0.05, max_per_window=10), Clock())
    settings = [b.collapse() for _ in range(4)]
    assert [(d.learning_rate, d.beta) for d in settings] == [(5e-05, 0.04), (4e-05, 0.05), (4e-05, 0.05),
                                                             (4e-05, 0.05)]
    assert b.level == 2  # no level beyond the bounds: one step back leaves the floor at once


def test_stop_after_reproduces_stop_after_max_rollbacks():
    # CollapseGuard stops once rollbacks > max_rollbacks: with 2, the 3rd collapse stops
    b = CollapseBudget(policy(stop_after=2, max_per_window=10), Clock())
    assert [b.collapse().action for _ in range(2)] == [Action.BACKOFF, Action.BACKOFF]
    d = b.collapse()
    assert d.action == Action.STOP and "3 collapses, more than stop_after = 2" in d.reason
    assert b.stopped and not b.may_update() and b.state().stopped
    d = CollapseBudget(policy(stop_after=0), Clock()).collapse()
    assert d.action == Action.STOP and d.reason.startswith("stopped: 1 collapse, more than stop_after = 0;")


def test_never_stops_without_stop_after():
    clock = Clock()
    b = CollapseBudget(policy(max_per_window=1, cooldown_s=10.0), clock)
    for _ in range(50):
        b.collapse()
        clock.t += 11
    assert not b.stopped and b.may_update()


def test_bad_policy_refused():
    with pytest.raises(ValueError, match="lr_factor"):
        policy(lr_factor=0.0)
    with pytest.raises(ValueError, match="max_per_window"):
        policy(max_per_window=0)
    with pytest.raises(ValueError, match="beta_ceiling"):
        policy(beta_ceiling=0.001)
