"""A run's timeline, read from its store: every logged value and every marked event,
placed on three x axes, for the overview and comparison figures (``selfrl.report.figures``).

The axes (:data:`Axis`):

* ``update``: updates applied when the value was measured. The rollout statistics of
  iteration ``s`` sit at ``s`` (sampled after ``s`` updates); a validation at the end
  of iteration ``s`` sits at ``s + 1``; the base model's validation at 0.
* ``rollouts``: trajectories stored up to and including the value's iteration (a
  validation logged before its iteration's update sits at the rollouts before it).
* ``elapsed``: seconds of recorded time since the run began. The time between two
  sessions (a run killed, then resumed the next day) is left out: each session's clock
  starts where the previous session's last record ended.

An event (promotion, rejection, rollback, collapse) sits where the curves were at its
time: its ``update`` and ``rollouts`` are interpolated in elapsed time between the
metric rows logged around it, so a promotion lands on the validation that decided it.

Stored event kinds are read through one table, :data:`EVENT_MARKS`; when the kinds
are renamed, only that table changes.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

import numpy as np

from selfrl.core.stats import wilson_interval
from selfrl.record.store import Store

Axis = Literal["update", "rollouts", "elapsed"]


class Mark(str, Enum):
    """What the figures mark on every panel."""

    PROMOTE = "promote"
    REJECT = "reject"
    ROLLBACK = "rollback"
    COLLAPSE = "collapse"


# Stored event kind -> mark. Kinds not listed (skip, hacking, resume, ...) are not marked.
EVENT_MARKS: dict[str, Mark] = {
    "promote": Mark.PROMOTE,
    "swap": Mark.PROMOTE,  # selfrl serve: a promoted version was swapped in (see load_timeline)
    "reject": Mark.REJECT,
    "rollback": Mark.ROLLBACK,
    "collapse": Mark.COLLAPSE,
    "collapse_stop": Mark.COLLAPSE,
}


def event_mark(kind: str, message: str) -> Mark | None:
    """The mark of a stored event, or None when it is not marked.

    Stores written before event kinds became an enum recorded a gate rejection of
    ``selfrl run`` as ``rollback`` ("version 3 rejected: ..."); it is read as a rejection.

    >>> event_mark("rollback", "version 3 rejected: held-out 0.1 < best 0.5 - 0.02").value
    'reject'
    >>> event_mark("skip", "update skipped") is None
    True
    """
    mark = EVENT_MARKS.get(kind)
    if mark is Mark.ROLLBACK and " rejected" in message:
        return Mark.REJECT
    return mark


@dataclass(frozen=True)
class Point:
    """One value at its place on the three axes."""

    update: float
    rollouts: float
    elapsed_s: float
    value: float

    def x(self, axis: Axis) -> float:
        """The coordinate on ``axis`` (``elapsed`` in seconds)."""
        return self.elapsed_s if axis == "elapsed" else getattr(self, axis)


@dataclass(frozen=True)
class HeldOut:
    """A held-out success rate ``k / n`` with its 95 % Wilson interval ``[low, high]``;
    ``k`` and ``n`` are None (and the interval NaN) when the held-out size is unknown."""

    at: Point
    k: int | None
    n: int | None
    low: float
    high: float


@dataclass(frozen=True)
class Event:
    """A marked event; ``at.value`` is NaN."""

    mark: Mark
    kind: str
    message: str
    at: Point


@dataclass
class Timeline:
    """Everything the overview figure of one run shows.

    Attributes:
        label: the run's name in legends.
        series: metric name -> its finite values in logging order.
        heldout: each held-out validation (the ``val/success`` rows) with its interval.
        base: the base model's (version 0) held-out result, or None.
        events: marked events in logging order.
        updates: iterations whose rollout statistics were logged (the largest such step + 1).
        rollouts: trajectories stored.
        elapsed_s: recorded seconds (sessions joined, see the module docstring).
    """

    label: str
    series: dict[str, list[Point]] = field(default_factory=dict)
    heldout: list[HeldOut] = field(default_factory=list)
    base: HeldOut | None = None
    events: list[Event] = field(default_factory=list)
    updates: int = 0
    rollouts: int = 0
    elapsed_s: float = 0.0

    def xy(self, name: str, axis: Axis) -> tuple[list[float], list[float]]:
        """``(xs, values)`` of metric ``name`` on ``axis`` (empty lists when never logged)."""
        points = self.series.get(name, [])
        return [p.x(axis) for p in points], [p.value for p in points]


def duration(seconds: float) -> str:
    """``"42 s"``, ``"6.1 min"`` or ``"2.3 h"``.

    >>> duration(42.0), duration(366.0), duration(8280.0)
    ('42 s', '6.1 min', '2.3 h')
    """
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


class SessionClock:
    """Recorded time: wall-clock seconds of each session, laid end to end.

    Args:
        starts: session id -> start time (epoch seconds).
        ends: session id -> time of its last record (missing: the session recorded nothing).
    """

    def __init__(self, starts: dict[int, float], ends: dict[int, float]):
        self.starts = dict(sorted(starts.items()))
        self.offsets: dict[int, float] = {}
        total = 0.0
        for run_id, start in self.starts.items():
            self.offsets[run_id] = total
            total += max(0.0, ends.get(run_id, start) - start)
        self.total_s = total

    def elapsed(self, run_id: int | None, t: float) -> float:
        """Seconds of recorded time at epoch time ``t`` of session ``run_id`` (None: the
        latest session that had started by ``t``)."""
        if not self.starts:
            return 0.0
        if run_id not in self.starts:
            started = [r for r, s in self.starts.items() if s <= t]
            run_id = started[-1] if started else next(iter(self.starts))
        return self.offsets[run_id] + max(0.0, t - self.starts[run_id])


def session_clock(store: Store, metrics: list[dict] | None = None, events: list[dict] | None = None,
                  trajs: list[dict] | None = None) -> SessionClock:
    """The :class:`SessionClock` of ``store``: each session ends at its last metric, event or
    trajectory. The rows may be passed when already read."""
    metrics = store.metrics() if metrics is None else metrics
    events = store.events() if events is None else events
    trajs = store.trajectory_index() if trajs is None else trajs
    ends: dict[int, float] = {}
    for run_id, t in ([(m["run_id"], m["wall_time"]) for m in metrics] + [(e["run_id"], e["time"]) for e in events]
                      + [(r["run_id"], r["created_at"]) for r in trajs]):
        if run_id is not None:
            ends[run_id] = max(ends.get(run_id, t), t)
    return SessionClock({r["id"]: r["created_at"] for r in store.runs()}, ends)


def load_timeline(store: Store, label: str) -> Timeline:
    """Read the timeline of every session in ``store`` (see the module docstring).

    Works on any store state: a run in progress, a killed run, a run with no update
    yet (then only the base validation, if any, is there).
    """
    metrics = store.metrics()
    events = store.events()
    trajs = store.trajectory_index()
    clock = session_clock(store, metrics, events, trajs)

    # rollouts stored up to and including each iteration
    per_iter: dict[int, int] = {}
    for r in trajs:
        per_iter[r["iteration"]] = per_iter.get(r["iteration"], 0) + 1
    iters = sorted(per_iter)
    cumulative = np.cumsum([per_iter[i] for i in iters]).tolist()

    def through(step: int) -> int:
        i = bisect.bisect_right(iters, step)
        return int(cumulative[i - 1]) if i else 0

    val_n = len(store.task_ids("val")) or len(store.evaluation(0)) or None
    tl = Timeline(label, rollouts=len(trajs), elapsed_s=clock.total_s)
    anchors: list[Point] = []  # every metric row's place, for the events
    rolled: set[tuple[int, int]] = set()  # (session, step) whose rollout statistics are logged
    for m in metrics:
        key = (m["run_id"], m["step"])
        if m["name"] == "reward/mean":
            rolled.add(key)
        step = m["step"]
        validation = m["name"].startswith("val/") or m["name"] == "time/validation_s"
        if validation and key not in rolled:  # before this iteration: the base model, or a resumed best version
            update, rollouts = step, through(step - 1)
        elif m["name"].startswith("val/"):  # validated after this iteration's update
            update, rollouts = step + 1, through(step)
        else:
            update, rollouts = step, through(step)
        value = math.nan if m["value"] is None else m["value"]
        point = Point(update, rollouts, clock.elapsed(m["run_id"], m["wall_time"]), value)
        anchors.append(point)
        if not math.isfinite(value):
            continue
        tl.series.setdefault(m["name"], []).append(point)
        if m["name"] == "val/success":
            tl.heldout.append(heldout_point(point, val_n))

    tl.updates = max((step for _, step in rolled), default=-1) + 1
    tl.base = base_result(store, val_n, tl.heldout)
    anchors.sort(key=lambda p: p.elapsed_s)
    # A server that records its promotions as 'promote' also records each swap that follows;
    # only in stores without 'promote' events (older servers) does a swap mark the promotion.
    swaps_promote = not any(e["kind"] == "promote" for e in events)
    for e in events:
        mark = event_mark(e["kind"], e["message"])
        if e["kind"] == "swap" and not swaps_promote:
            mark = None
        if mark is not None:
            tl.events.append(Event(mark, e["kind"], e["message"], place(clock.elapsed(e["run_id"], e["time"]), anchors)))
    return tl


def heldout_point(point: Point, n: int | None) -> HeldOut:
    """A held-out rate with its Wilson interval, ``k = round(rate * n)``."""
    if not n:
        return HeldOut(point, None, None, math.nan, math.nan)
    k = min(n, max(0, round(point.value * n)))
    low, high = wilson_interval(k, n)
    return HeldOut(point, k, n, low, high)


def base_result(store: Store, val_n: int | None, heldout: list[HeldOut]) -> HeldOut | None:
    """Version 0's held-out result: from its per-task evaluation when stored, else from
    its recorded ``val/success``; placed at the first validation (or at 0)."""
    base = next((v for v in store.versions() if v["version"] == 0), None)
    at = heldout[0].at if heldout else Point(0, 0, 0.0, math.nan)
    evaluation = store.evaluation(0)
    if evaluation:
        k, n = sum(evaluation.values()), len(evaluation)
        low, high = wilson_interval(k, n)
        return HeldOut(Point(at.update, at.rollouts, at.elapsed_s, k / n), k, n, low, high)
    if base is not None and isinstance(base["metrics"].get("val/success"), (int, float)):
        return heldout_point(Point(at.update, at.rollouts, at.elapsed_s, base["metrics"]["val/success"]), val_n)
    return None


def place(elapsed_s: float, anchors: list[Point]) -> Point:
    """Where the curves were at ``elapsed_s``: ``update`` and ``rollouts`` interpolated
    between the anchors (metric rows sorted by elapsed time) around it; held at the
    first or last anchor outside their range; 0 without anchors."""
    if not anchors:
        return Point(0, 0, elapsed_s, math.nan)
    ts = [a.elapsed_s for a in anchors]
    update = float(np.interp(elapsed_s, ts, [a.update for a in anchors]))
    rollouts = float(np.interp(elapsed_s, ts, [a.rollouts for a in anchors]))
    return Point(update, rollouts, elapsed_s, math.nan)
