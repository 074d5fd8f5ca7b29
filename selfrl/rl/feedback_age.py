"""The age rule for delayed feedback: what a judgement that arrives late is worth now.

A user's judgement (a reward) may arrive seconds or days after the turn it judges. The
turn's exact token ids, the sampler's log-probs of its completion tokens (the behaviour
policy mu) and the adapter version that produced it are recorded, so the judgement can
still train the policy, if the policy has not moved too far since. :func:`decide_at`
returns one of three outcomes, each with a reason a user can read:

* ``used``: train on it now, with the importance weight ``weight``;
* ``queued``: the policy has moved and the turn's log-probs under the current version
  are not known yet; it waits for the learner to recompute them at its next update;
* ``too_old``: older than ``max_versions`` weight changes or ``max_age_s`` seconds (or
  sampled by a version this learner never held); only recorded, never trained.

Age in versions is counted in *weight changes* between the turn's version and the weights
the learner holds now, along the version tree (each version's parent is the weights it was
trained from): :func:`lineage_distance`. For a version the current weights descend from, these
are the updates on the way from it to them; a candidate that was rejected, or rolled back,
made no change that the current weights carry, so it never counts, and after a rollback to a
version its turns are fresh again. Not the difference of version numbers (a rejection puts the
champion's smaller number back in), nor the number of versions the learner loaded since
(:func:`versions_behind`, the staleness of rollouts in :mod:`selfrl.rollout.staleness`, where
the sampler itself loads every candidate).

The weight is the truncated importance ratio of the whole completion (Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"; truncation as
in Espeholt et al. 2018's IMPALA)::

    weight = min(exp(sum_t m_t * (logp_current_t - logp_behaviour_t)), tis_cap)

with ``m`` the completion mask. Departures from :mod:`selfrl.rl.off_policy`, and why:

* **Per sequence, not per token.** A judgement is one reward for the whole turn, so the
  question "how much is it worth now" has one answer per turn: the probability ratio of
  the turn's completion, which is the product of its token ratios. Its variance grows
  with length, which is what the cap bounds. The learner's per-token TIS
  (``TrainConfig.tis_cap``) already corrects each token of a trained sample against the
  same behaviour log-probs; a wiring must use this weight *instead of* that correction
  for a late sample (or only to choose used / queued / too_old), never multiply the two,
  which would count the version gap twice.
* The summed log-ratio is clamped to [-20, 20] before the exponential, as
  ``selfrl.rl.losses.LOG_RATIO_BOUND`` does for one token.
* When the policy has not moved (0 weight changes since the turn's version) the weight is
  exactly 1.0 and no log-probs are needed.
* Both log-prob sequences must be of one distribution (the same temperature and grammar).
  ``selfrl serve`` records turns at the client's temperature, so there the behaviour
  log-probs are the turn's version recomputed at ``learner.temperature``, not the recorded
  ones; where they are not available the weight cannot be computed and only the cutoffs apply.

Units: versions are counts of weight changes, times are seconds (any clock, the same for
both), log-probs are natural logs.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from selfrl.core.wording import plural

LOG_RATIO_BOUND = 20.0  # the same bound as selfrl.rl.losses.LOG_RATIO_BOUND, for a whole sequence


class Outcome(str, enum.Enum):
    """What a late judgement becomes."""

    USED = "used"
    QUEUED = "queued"
    TOO_OLD = "too_old"


@dataclass(frozen=True)
class AgePolicy:
    """The cutoffs and the cap of the age rule.

    Attributes:
        max_versions: at most this many weight changes since the turn's version (>= 0).
        max_age_s: at most this many seconds between the turn and now (> 0).
        tis_cap: the truncation C of the importance weight (> 0; 2.0 as verl and TRL).

    Raises:
        ValueError: a value out of its range.
    """

    max_versions: int = 4
    max_age_s: float = 7 * 24 * 3600.0
    tis_cap: float = 2.0

    def __post_init__(self):
        if self.max_versions < 0:
            raise ValueError(f"max_versions must be >= 0, got {self.max_versions}")
        if not self.max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0 seconds, got {self.max_age_s}")
        if not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0, got {self.tis_cap}")


@dataclass(frozen=True)
class AgeDecision:
    """The rule's answer: the outcome, the weight (``used`` only, else None), the turn's
    age in weight changes (``inf`` for a version never loaded) and in seconds, and the reason."""

    outcome: Outcome
    weight: float | None
    versions_behind: float
    age_s: float
    reason: str


def versions_behind(turn_version: int, loaded: Sequence[int]) -> float:
    """Weight changes of the learner since ``turn_version`` was last in it (the versions it loaded
    since, rejected ones included); ``inf`` if it never was (a turn of another run). The staleness
    of rollouts (:mod:`selfrl.rollout.staleness`); the age of late feedback counts along the
    version tree instead (:func:`lineage_distance`), where a rejected candidate changes nothing.

    Raises:
        ValueError: ``loaded`` is empty.

    >>> versions_behind(3, [0, 1, 2, 3, 1])  # 3 rejected, champion 1 back in: one change
    1
    """
    if not loaded:
        raise ValueError("no version was loaded yet")
    for k, v in enumerate(reversed(loaded)):
        if v == turn_version:
            return k
    return math.inf


def lineage_depths(current: int, parents: Mapping[int, int | None]) -> dict[int, int]:
    """``current`` and every version its weights descend from, each with the weight changes from
    it to ``current`` (0 for ``current``, 1 for its parent, ...); empty when ``current`` is not in
    ``parents`` (each version's parent, None for a base).

    >>> lineage_depths(4, {0: None, 1: 0, 2: 1, 3: 1, 4: 1})
    {4: 0, 1: 1, 0: 2}
    """
    depth: dict[int, int] = {}
    v: int | None = current
    while v is not None and v in parents and v not in depth:  # (a loop in bad links ends here)
        depth[v] = len(depth)
        v = parents[v]
    return depth


def lineage_distance(version: int, current: int, parents: Mapping[int, int | None],
                     depths: Mapping[int, int] | None = None, limit: float = math.inf) -> float:
    """Weight changes between ``version``'s weights and ``current``'s, along the version tree.

    Each version was trained from its parent, so the changes are the parent links from each of
    the two up to the nearest version both descend from, counted. For an ancestor of ``current``
    (a turn of the champion, or of an earlier champion) that is the updates along the lineage of
    the current weights: a rejected or rolled-back candidate is on no such path and never counts.
    A version off the lineage (a promoted version that was later rolled back) counts its own
    updates back to where the two lines part as well.

    Args:
        version: the version whose weights sampled the turn.
        current: the version whose weights the learner holds.
        parents: every version's parent (None for a base), e.g. from the version ledger.
        depths: :func:`lineage_depths` of ``current``, when already at hand (many turns, one tree).
        limit: follow ``version``'s parent links at most this many times (``inf`` beyond): the
            cost bound of :func:`versions_within`, which needs no count above its cutoff.

    Returns:
        a count of weight changes (0: the same weights), or ``inf`` when ``version`` or
        ``current`` is not in ``parents`` or the two share no ancestor.

    >>> parents = {0: None, 1: 0, 2: 1, 3: 1, 4: 1}  # 1 promoted, 2 rejected, 3 rolled back, 4 from 1
    >>> [lineage_distance(v, 4, parents) for v in (4, 1, 0, 2, 9)]
    [0, 1, 2, 2, inf]
    """
    depths = lineage_depths(current, parents) if depths is None else depths
    v, k, seen = version, 0, set()
    while v is not None and v in parents and v not in seen and k <= limit:
        if v in depths:
            return k + depths[v]
        seen.add(v)
        v, k = parents[v], k + 1
    return math.inf


def versions_within(current: int, parents: Mapping[int, int | None], max_versions: int) -> set[int]:
    """The versions whose turns the age rule may still train on: those at most ``max_versions``
    weight changes from ``current`` (:func:`lineage_distance`). A late judgement of such a turn is
    weighed by its version's log-probs, so these versions' weights must stay stored; a turn of any
    other version is ``too_old`` whatever its weights. Each version is followed up at most
    ``max_versions`` links, so a ledger of thousands of versions costs milliseconds.

    Args:
        current: the version whose weights the learner holds.
        parents: every version's parent (None for a base).
        max_versions: the cutoff in weight changes (``AgePolicy.max_versions``, >= 0).

    Raises:
        ValueError: ``max_versions`` < 0.

    >>> sorted(versions_within(4, {0: None, 1: 0, 2: 1, 3: 2, 4: 1, 5: 4}, 1))  # 0, 2: two changes; 3: three
    [1, 4, 5]
    """
    if max_versions < 0:
        raise ValueError(f"max_versions must be >= 0, got {max_versions}")
    depths = lineage_depths(current, parents)
    return {v for v in parents if lineage_distance(v, current, parents, depths, limit=max_versions) <= max_versions}


def sequence_weight(current_logps: Sequence[float], behaviour_logps: Sequence[float],
                    completion_mask: Sequence[int], cap: float) -> float:
    """``min(exp(sum of m * (current - behaviour)), cap)`` over one turn's tokens.

    Args:
        current_logps: (T,) log-probs of the turn's tokens under the current version.
        behaviour_logps: (T,) log-probs the sampler recorded (``Trajectory.logprobs``).
        completion_mask: (T,) 1 on completion tokens, 0 elsewhere (prompt, tool output).
        cap: the truncation C > 0.

    Raises:
        ValueError: lengths differ, ``cap`` not > 0, or a masked-in log-prob is NaN.

    >>> round(sequence_weight([-1.0, -1.0, -1.0], [-1.0, -2.0, -0.5], [1, 1, 1], 2.0), 4)  # exp(0 + 1 - 0.5)
    1.6487
    """
    if not cap > 0:
        raise ValueError(f"the cap must be > 0, got {cap}")
    if not len(current_logps) == len(behaviour_logps) == len(completion_mask):
        raise ValueError(f"lengths differ: {len(current_logps)} current, {len(behaviour_logps)} behaviour, "
                         f"{len(completion_mask)} mask")
    total = 0.0
    for cur, beh, m in zip(current_logps, behaviour_logps, completion_mask):
        if m:
            if math.isnan(cur) or math.isnan(beh):
                raise ValueError("a completion token's log-prob is NaN; the turn cannot be weighted")
            total += cur - beh
    total = min(max(total, -LOG_RATIO_BOUND), LOG_RATIO_BOUND)  # also maps -inf/+inf into the bound
    return min(math.exp(total), cap)


def decide_at(turn_version: int, behind: float, current: int, turn_time: float, now: float, policy: AgePolicy,
              current_logps: Sequence[float] | None = None, behaviour_logps: Sequence[float] | None = None,
              completion_mask: Sequence[int] | None = None) -> AgeDecision:
    """What a judgement of a turn is worth at ``now``.

    Args:
        turn_version: the adapter version that sampled the turn.
        behind: weight changes between its weights and the current ones (:func:`lineage_distance`;
            ``inf``: a version this learner never held).
        current: the version whose weights the learner holds (named in the reason).
        turn_time, now: seconds on one clock (``now`` injectable for tests and simulations).
        policy: the cutoffs and the cap.
        current_logps, behaviour_logps, completion_mask: (T,) each; the current log-probs
            are needed only when the policy has moved (else the turn is ``queued``).

    Raises:
        ValueError: ``now`` before ``turn_time``, or bad log-probs (see :func:`sequence_weight`).

    >>> decide_at(1, 2, 4, 100.0, 160.0, AgePolicy(max_versions=1)).reason
    'only recorded: the policy changed 2 times since version 1, more than max_versions = 1'
    """
    if now < turn_time:
        raise ValueError(f"the judgement is dated {turn_time - now:g} s before its turn; check the clocks")
    age, k = now - turn_time, behind
    if math.isinf(k):
        return AgeDecision(Outcome.TOO_OLD, None, k, age, f"only recorded: version {turn_version} was never "
                           "loaded by this learner")
    if age > policy.max_age_s:
        return AgeDecision(Outcome.TOO_OLD, None, k, age, f"only recorded: the turn is {age:.0f} s old, "
                           f"more than max_age_s = {policy.max_age_s:g}")
    if k > policy.max_versions:
        return AgeDecision(Outcome.TOO_OLD, None, k, age, f"only recorded: the policy changed {plural(k, 'time')} since "
                           f"version {turn_version}, more than max_versions = {policy.max_versions}")
    if k == 0:
        return AgeDecision(Outcome.USED, 1.0, k, age, f"used now at full weight: version {turn_version} is "
                           "still the current one")
    if current_logps is None:
        return AgeDecision(Outcome.QUEUED, None, k, age, f"queued: the policy changed {plural(k, 'time')} since version "
                           f"{turn_version}; waits for the learner to weigh it under version {current}")
    if behaviour_logps is None or completion_mask is None:
        raise ValueError("current log-probs given without the behaviour log-probs and the completion mask")
    w = sequence_weight(current_logps, behaviour_logps, completion_mask, policy.tis_cap)
    capped = " (capped)" if w == policy.tis_cap else ""
    return AgeDecision(Outcome.USED, w, k, age, f"used now with weight {w:.3g}{capped}: the policy changed "
                       f"{plural(k, 'time')} since version {turn_version}")
