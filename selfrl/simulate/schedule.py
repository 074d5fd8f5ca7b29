"""When conversations start and which family each one comes from.

The schedule is a list of phases, each ``(duration_s, {family: weight})``, laid end to end
from simulated time 0 (the simulator's start). Phase ``i`` holds the times
``[start_i, start_i + duration_i)``: a time on a boundary belongs to the phase that starts
there. Conversations arrive as a Poisson process of ``arrivals_per_hour`` (exponential
gaps), until the last phase ends; each draws its family from the weights of the phase it
arrives in (``random.choices``). Both are pure functions of their random streams, so one
seed gives one schedule.
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    """``duration_s`` simulated seconds in which family ``f`` arrives with weight ``weights[f]``."""

    duration_s: float
    weights: dict[str, float]


class Schedule:
    """Phases end to end (see the module docstring).

    >>> s = Schedule([Phase(10.0, {"a": 1.0}), Phase(5.0, {"a": 1.0, "b": 3.0})])
    >>> s.phase_at(0.0), s.phase_at(9.99), s.phase_at(10.0), s.phase_at(14.9), s.end_s
    (0, 0, 1, 1, 15.0)

    Raises:
        ValueError: no phase, a duration not above 0, or a phase whose weights are all 0.
    """

    def __init__(self, phases: list[Phase]):
        if not phases:
            raise ValueError("a schedule needs at least one phase")
        for i, p in enumerate(phases):
            if not p.duration_s > 0 or not any(w > 0 for w in p.weights.values()):
                raise ValueError(f"phase {i} needs duration_s > 0 and a weight above 0, got {p}")
        self.phases = list(phases)
        self.starts = [0.0, *itertools.accumulate(p.duration_s for p in phases)][:-1]
        self.end_s = self.starts[-1] + phases[-1].duration_s

    def phase_at(self, t: float) -> int:
        """The index of the phase holding simulated time ``t`` (seconds from the start).

        Raises:
            ValueError: ``t`` is before 0 or at/after the end.
        """
        if not 0 <= t < self.end_s:
            raise ValueError(f"time {t} is outside the schedule [0, {self.end_s})")
        return bisect.bisect_right(self.starts, t) - 1

    def family_at(self, t: float, rng: random.Random) -> str:
        """A family drawn from the weights of the phase at ``t`` (families of weight 0 never come)."""
        weights = self.phases[self.phase_at(t)].weights
        names = sorted(n for n, w in weights.items() if w > 0)
        return rng.choices(names, weights=[weights[n] for n in names])[0]

    def arrivals(self, per_hour: float, rng: random.Random) -> Iterator[float]:
        """Arrival times (seconds from the start, increasing) of a Poisson process of ``per_hour``
        per simulated hour, up to the end of the schedule."""
        t = 0.0
        while True:
            t += rng.expovariate(per_hour / 3600.0)
            if t >= self.end_s:
                return
            yield t
