"""A collapse budget per window of time, not per run: back off, keep learning, step back.

The paper selfrl follows ran 240 hours of continuous learning and saw 7 collapses, each
rolled back; a service that learns for days must survive its collapses. A rule per run
(stop once the rollbacks exceed ``max_rollbacks``) would stop for good even where a lower
learning rate would have been stable; it is kept only on request (``stop_after`` below).
:class:`CollapseBudget` keeps the learner going instead:

* **Back off.** Each collapse moves one *level* down: level ``n`` is the configured
  ``(learning_rate, beta)`` passed ``n`` times through the rule of
  :func:`selfrl.safety.collapse.safer_setting` (``lr * lr_factor``, ``max(beta * beta_factor,
  beta_min)``), bounded below by ``lr_floor`` and above by ``beta_ceiling``. A setting is
  always recomputed from the configured one, so stepping back to level 0 gives the
  configured setting exactly, with no rounding drift.
* **Step back.** After a stable stretch (``stable_updates`` updates or ``stable_s``
  seconds since the last collapse or step, whichever comes first) it moves up one level.
* **Window budget.** Collapses are counted over a sliding window of ``window_s`` seconds;
  more than ``max_per_window`` in it starts a cool-down of ``cooldown_s`` seconds during
  which the learner does not update (:meth:`CollapseBudget.may_update`). A pause, never a stop.
* **Today's behaviour on request.** With ``stop_after = max_rollbacks`` the collapse that
  brings the count above it answers ``stop`` (the caller raises
  :class:`selfrl.safety.collapse.CollapseStop`), as ``CollapseGuard.over_budget`` did before.

The clock is injectable (seconds, ``time.time`` by default, so that ``state()`` can be shown
as wall-clock times in ``/health`` and the report). This module only decides; it does not
detect collapses (:mod:`selfrl.safety.collapse` does) nor apply the setting (the learner does).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from selfrl.core.wording import plural


@dataclass(frozen=True)
class BudgetPolicy:
    """The configured setting and how the budget moves away from it and back.

    Attributes:
        learning_rate: the configured learning rate (> 0), level 0.
        beta: the configured KL coefficient (>= 0), level 0.
        lr_factor: learning rate times this per level, in (0, 1] (``CollapseConfig.lr_factor``).
        beta_factor: beta times this per level, >= 1 (``CollapseConfig.beta_factor``) ...
        beta_min: ... and at least this once backing off (``CollapseConfig.beta_min``).
        lr_floor: the learning rate never goes below this (>= 0).
        beta_ceiling: beta never goes above this (>= beta).
        stable_updates: updates without a collapse that earn one step back (>= 1).
        stable_s: seconds without a collapse or step that earn one step back (> 0).
        window_s: the sliding window over which collapses are counted, seconds (> 0).
        max_per_window: collapses allowed in a window; one more starts the cool-down (>= 1).
        cooldown_s: the pause after the window budget is exceeded, seconds (>= 0).
        stop_after: None (never stop), or stop once collapses exceed this many (today's
            ``max_rollbacks``, >= 0).

    Raises:
        ValueError: a value out of its range.
    """

    learning_rate: float
    beta: float
    lr_factor: float = 0.5
    beta_factor: float = 2.0
    beta_min: float = 0.01
    lr_floor: float = 0.0
    beta_ceiling: float = 1.0
    stable_updates: int = 20
    stable_s: float = 3600.0
    window_s: float = 3600.0
    max_per_window: int = 3
    cooldown_s: float = 1800.0
    stop_after: int | None = None

    def __post_init__(self):
        checks = [(self.learning_rate > 0, "learning_rate must be > 0"), (self.beta >= 0, "beta must be >= 0"),
                  (0 < self.lr_factor <= 1, "lr_factor must be in (0, 1]"),
                  (self.beta_factor >= 1, "beta_factor must be >= 1"), (self.beta_min >= 0, "beta_min must be >= 0"),
                  (0 <= self.lr_floor <= self.learning_rate, "lr_floor must be in [0, learning_rate]"),
                  (self.beta_ceiling >= max(self.beta, self.beta_min), "beta_ceiling must be >= beta and beta_min"),
                  (self.stable_updates >= 1, "stable_updates must be >= 1"),
                  (self.stable_s > 0, "stable_s must be > 0"), (self.window_s > 0, "window_s must be > 0"),
                  (self.max_per_window >= 1, "max_per_window must be >= 1"),
                  (self.cooldown_s >= 0, "cooldown_s must be >= 0"),
                  (self.stop_after is None or self.stop_after >= 0, "stop_after must be None or >= 0")]
        bad = [msg for ok, msg in checks if not ok]
        if bad:
            raise ValueError("; ".join(bad))

    def setting(self, level: int) -> tuple[float, float]:
        """``(learning_rate, beta)`` at ``level`` (0: configured).

        >>> BudgetPolicy(1e-4, 0.0).setting(2)
        (2.5e-05, 0.02)
        """
        lr, beta = self.learning_rate, self.beta
        for _ in range(level):  # the rule of selfrl.safety.collapse.safer_setting, bounded
            lr, beta = max(lr * self.lr_factor, self.lr_floor), min(max(beta * self.beta_factor, self.beta_min),
                                                                  self.beta_ceiling)
        return lr, beta


def policy_from_config(cfg, learning_rate: float, beta: float) -> BudgetPolicy:
    """The :class:`BudgetPolicy` of a ``[collapse]`` table (:class:`selfrl.config.CollapseConfig`)
    around the configured ``learning_rate`` and ``beta`` (``[train]``); ``cfg.max_rollbacks``
    set is ``stop_after`` (today's stop, on request), unset never stops."""
    return BudgetPolicy(learning_rate, beta, cfg.lr_factor, cfg.beta_factor, cfg.beta_min, cfg.lr_floor,
                        max(cfg.beta_max, beta, cfg.beta_min), cfg.stable_updates, cfg.stable_s, cfg.window_s,
                        cfg.max_per_window, cfg.cooldown_s, cfg.max_rollbacks)


class Action(str, enum.Enum):
    BACKOFF = "backoff"  # keep learning at a safer setting
    PAUSE = "pause"  # the window budget is exceeded: no update until the cool-down ends
    STOP = "stop"  # stop_after mode only: the run stops with the best version served


@dataclass(frozen=True)
class BudgetDecision:
    """The answer to a collapse: the action, the setting to continue with, the end of a pause
    (clock seconds, None when not paused) and a reason a user can read."""

    action: Action
    learning_rate: float
    beta: float
    paused_until: float | None
    reason: str


@dataclass(frozen=True)
class BudgetState:
    """What ``/health`` and the report show. Times are clock seconds."""

    backing_off: bool
    level: int
    learning_rate: float
    beta: float
    collapses: int  # since the start
    collapses_in_window: int
    paused_until: float | None
    next_step_back_at: float | None  # clock time of the next step back (None at level 0) ...
    next_step_back_after_updates: int | None  # ... or after this many more updates, whichever comes first
    stopped: bool


class CollapseBudget:
    """Owns the backoff level, the collapse times of the window, the pause and the stable stretch."""

    def __init__(self, policy: BudgetPolicy, clock: Callable[[], float] = time.time):
        self.policy = policy
        self.clock = clock
        self.level = 0
        self.collapses = 0
        self.stopped = False
        self._window: deque[float] = deque()
        self._paused_until: float | None = None
        self._stable_since = clock()  # last collapse or step
        self._stable_updates = 0

    def _in_window(self, now: float) -> int:
        while self._window and self._window[0] <= now - self.policy.window_s:
            self._window.popleft()
        return len(self._window)

    def collapse(self, at: float | None = None) -> BudgetDecision:
        """Count one collapse (rolled back by the caller); the setting to continue with.
        ``at``: its clock time when replayed from a recorded event (default: now)."""
        p, now = self.policy, self.clock() if at is None else at
        self.collapses += 1
        self._window.append(now)
        if p.setting(self.level + 1) != p.setting(self.level):  # no level beyond the floor and the ceiling
            self.level += 1
        self._stable_since, self._stable_updates = now, 0
        lr, beta = p.setting(self.level)
        if p.stop_after is not None and self.collapses > p.stop_after:
            self.stopped = True
            return BudgetDecision(Action.STOP, lr, beta, None, f"stopped: {plural(self.collapses, 'collapse')}, more than "
                                  f"stop_after = {p.stop_after}; the best version stays served")
        n = self._in_window(now)
        if n > p.max_per_window:
            self._paused_until = now + p.cooldown_s
            self._stable_since = self._paused_until  # the stable stretch starts when learning resumes
            return BudgetDecision(Action.PAUSE, lr, beta, self._paused_until,
                                  f"paused for {p.cooldown_s:g} s: {n} collapses in the last {p.window_s:g} s, "
                                  f"more than {p.max_per_window}; then learning rate {lr:.3g}, beta {beta:.3g}")
        return BudgetDecision(Action.BACKOFF, lr, beta, None, f"backing off to level {self.level}: learning rate "
                              f"{lr:.3g}, beta {beta:.3g} ({n} of {p.max_per_window} collapses in the window)")

    def may_update(self) -> bool:
        """False while stopped or in a cool-down."""
        if self.stopped:
            return False
        return self._paused_until is None or self.clock() >= self._paused_until

    def update_done(self) -> tuple[float, float] | None:
        """Count one update without a collapse; the new ``(learning_rate, beta)`` when the
        stable stretch earned a step back toward the configured setting, else None."""
        now = self.clock()
        self._stable_updates += 1
        if self.level == 0 or self.stopped:
            return None
        if self._stable_updates >= self.policy.stable_updates or now - self._stable_since >= self.policy.stable_s:
            return self.step_back(now)
        return None

    def step_back(self, at: float) -> tuple[float, float]:
        """Move one level toward the configured setting at clock time ``at`` (by :meth:`update_done`,
        or replayed from a recorded step-back); the new ``(learning_rate, beta)``."""
        self.level = max(self.level - 1, 0)
        self._stable_since, self._stable_updates = at, 0
        return self.policy.setting(self.level)

    def updates_since(self, n: int) -> None:
        """On a restart: ``n`` updates have run without a collapse since the last collapse or step."""
        self._stable_updates = n

    def setting(self) -> tuple[float, float]:
        """The current ``(learning_rate, beta)``."""
        return self.policy.setting(self.level)

    def state(self) -> BudgetState:
        now = self.clock()
        lr, beta = self.setting()
        paused = self._paused_until if self._paused_until is not None and now < self._paused_until else None
        back = self.level > 0 and not self.stopped
        return BudgetState(self.level > 0, self.level, lr, beta, self.collapses, self._in_window(now), paused,
                           self._stable_since + self.policy.stable_s if back else None,
                           max(self.policy.stable_updates - self._stable_updates, 0) if back else None, self.stopped)
