"""Several scores of one trajectory made into one: judges and rule rewards as an ensemble,
their disagreement, and a rule reward as a cap (pure functions).

The ways to keep a learned reward honest that the field lists (reward-model ensembles by
mean or minimum, a rule-based floor) applied to judges: ``min`` pays only what every member
grants, so one lenient or fooled judge cannot lift a score; ``vote`` pays the share of members
that call the answer good. Members whose scores spread by more than ``[judge] disagreement``
mark the trajectory as disputed, and a disputed group can be held out of the update. A rule
reward used as the *floor* (the method's name; it acts as a ceiling on the score) caps the
combined score by its own value: a failed test (0) caps it at 0, whatever the judges say.
"""

from __future__ import annotations

from selfrl.config.judge import Combine


def combine(scores: list[float], rule: Combine, vote_threshold: float = 0.5) -> float:
    """One score in [0, 1] from the members' ``scores`` (each in [0, 1]).

    ``mean``: their mean; ``min``: the lowest; ``vote``: the share at least ``vote_threshold``.

    Raises:
        ValueError: no scores, or an unknown rule.

    >>> combine([0.9, 0.2], "mean"), combine([0.9, 0.2], "min"), combine([0.9, 0.2, 0.6], "vote")
    (0.55, 0.2, 0.6666666666666666)
    """
    if not scores:
        raise ValueError("combine needs at least one score")
    if rule == "mean":
        return sum(scores) / len(scores)
    if rule == "min":
        return min(scores)
    if rule == "vote":
        return sum(s >= vote_threshold for s in scores) / len(scores)
    raise ValueError(f"unknown combine rule {rule!r}; valid: mean, min, vote")


def spread(scores: list[float]) -> float:
    """``max - min`` of the members' scores (0 for one member).

    >>> spread([0.9, 0.2]), spread([0.4])
    (0.7, 0.0)
    """
    return max(scores) - min(scores) if scores else 0.0


def disputed(scores: list[float], threshold: float) -> bool:
    """Whether the members disagree: their :func:`spread` exceeds ``threshold``.

    >>> disputed([0.9, 0.2], 0.5), disputed([0.9, 0.6], 0.5)
    (True, False)
    """
    return spread(scores) > threshold


def cap(score: float, floor_value: float | None) -> float:
    """``score`` capped by the floor rule's value (None: the rule does not apply, no cap).

    >>> cap(0.9, 0.0), cap(0.9, 1.0), cap(0.9, None)
    (0.0, 0.9, 0.9)
    """
    return score if floor_value is None else min(score, floor_value)
