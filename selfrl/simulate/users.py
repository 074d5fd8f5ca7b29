"""Who talks to the server and how they judge: each conversation's plan, drawn from the seed.

**The plan** (:func:`plan`) of conversation ``k`` is everything random about it, drawn up
front from its own stream ``random.Random(f"selfrl-simulate:{seed}:{k}")`` in a fixed order,
so it never depends on what the model answers or how long the server takes: its family
(from the phase's weights), its user (one of the family's ``users``), the seed of its task,
whether the user misjudges (probability ``noise``), how the user reacts, the delay of the
reaction (log-uniform in ``[min_delay_s, max_delay_s]``) and, for a hostile user, what it
does instead. Whether a user is hostile is drawn once per user id
(``random.Random(f"selfrl-simulate:{seed}:user:{id}")``), so a hostile user stays hostile.

**Judging** (:func:`verdict`): the user's verdict is the environment's verifier, flipped
when the plan says the user misjudges. **Reacting** (:func:`reaction`): the draw ``u`` gives
an explicit rating when ``u < rating_p`` (+1 judged right, -1 judged wrong), a correction in
the next turn when ``u < rating_p + correction_p`` and the answer was judged wrong, and
silence otherwise (a user who judges the answer right has nothing to correct).

**Hostile users** (``hostile_share`` of the users) ask their task like anyone, then do one
of ``hostile_actions`` instead of judging: ``random_rating`` (a rating drawn uniformly from
[-1, 1], or one time in four out of range, which the server must refuse), ``flood``
(``flood_size`` random ratings on the same turn), ``replay_turn`` (the same completion
request sent again) or ``replay_feedback`` (an earlier feedback body sent again; a made-up
response id when none was sent yet).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

from selfrl.config.simulate import SimulateConfig
from selfrl.simulate.schedule import Schedule

Reaction = Literal["rating", "correction", "silence"]


@dataclass(frozen=True)
class Plan:
    """Everything random about one conversation (see the module docstring).

    Attributes:
        index: the conversation's number ``k`` (0 first).
        at_s: when it starts, simulated seconds from the simulator's start.
        phase: the index of the schedule's phase at ``at_s``.
        family, user: the family's name and the user's id (``<family>-<i>``).
        hostile: the user is hostile.
        task_seed: the seed the family's environment draws the task from (62 bits).
        misjudge: the user's verdict is the verifier's, flipped.
        draw: the uniform draw in [0, 1) that picks the reaction (:func:`reaction`).
        delay_s: simulated seconds from the answer to the reaction.
        hostile_action: what a hostile user does (None for the others).
        ratings: the ratings a hostile ``random_rating`` or ``flood`` sends.
        pick: which earlier feedback a ``replay_feedback`` sends again (a share of the history).
    """

    index: int
    at_s: float
    phase: int
    family: str
    user: str
    hostile: bool
    task_seed: int
    misjudge: bool
    draw: float
    delay_s: float
    hostile_action: str | None
    ratings: tuple[float, ...]
    pick: float


def is_hostile(seed: int, user: str, share: float) -> bool:
    """Whether user ``user`` is hostile (drawn once per user id from the seed)."""
    return random.Random(f"selfrl-simulate:{seed}:user:{user}").random() < share


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A draw whose logarithm is uniform in ``[log low, log high]`` (seconds to days alike).

    >>> low, high = 1.0, 1e4
    >>> all(low <= log_uniform(random.Random(i), low, high) <= high for i in range(100))
    True
    """
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def plan(cfg: SimulateConfig, schedule: Schedule, index: int, at_s: float) -> Plan:
    """The plan of conversation ``index`` starting at ``at_s`` (a pure function of its arguments)."""
    u = cfg.users
    rng = random.Random(f"selfrl-simulate:{cfg.seed}:{index}")
    family = schedule.family_at(at_s, rng)
    users = next(f.users for f in cfg.families if f.name == family)
    user = f"{family}-{rng.randrange(users)}"
    task_seed = rng.getrandbits(62)
    misjudge = rng.random() < u.noise
    draw = rng.random()
    delay = log_uniform(rng, u.min_delay_s, u.max_delay_s)
    hostile = is_hostile(cfg.seed, user, u.hostile_share)
    action = rng.choice(u.hostile_actions) if hostile else None
    ratings: tuple[float, ...] = ()
    if action == "random_rating":
        r = rng.uniform(-1.0, 1.0)
        ratings = (r if rng.random() >= 0.25 else math.copysign(rng.uniform(1.5, 5.0), r),)
    elif action == "flood":
        ratings = tuple(rng.uniform(-1.0, 1.0) for _ in range(u.flood_size))
    return Plan(index, at_s, schedule.phase_at(at_s), family, user, hostile, task_seed, misjudge, draw, delay,
                action, ratings, rng.random())


def verdict(correct: bool, p: Plan) -> bool:
    """The user's verdict: the verifier's, flipped when the plan says the user misjudges."""
    return correct != p.misjudge


def reaction(judged_right: bool, p: Plan, rating_p: float, correction_p: float) -> Reaction:
    """How the user reacts (see the module docstring).

    >>> p = Plan(0, 0.0, 0, "a", "a-0", False, 1, False, 0.5, 1.0, None, (), 0.0)
    >>> reaction(False, p, 0.4, 0.3), reaction(True, p, 0.4, 0.3), reaction(True, p, 0.6, 0.3)
    ('correction', 'silence', 'rating')
    """
    if p.draw < rating_p:
        return "rating"
    if p.draw < rating_p + correction_p and not judged_right:
        return "correction"
    return "silence"
