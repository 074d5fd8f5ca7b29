"""How stale a sample is, and which samples are trained (pure functions).

Staleness is counted in *weight changes of the learner*, not in version numbers: the
learner's weights go through a sequence of versions (``loaded``: every candidate it
saves, and the champion again after a rejection or a collapse rollback). A sample
drawn by version ``v`` has staleness ``k`` when the learner's weights changed ``k``
times since ``v`` was last in them. With no rejections this is ``current - v``, the
definition of ART, prime-rl and AReaL ("off by k steps"); after a rejection the
champion's number is smaller than the rejected candidate's, so subtracting numbers
would be wrong (negative) there.

Policy (our choice): a group older than ``max_staleness`` is **dropped**, whole (its
samples share one version: a group is sampled by one worker in one call), never
down-weighted; the groups kept are trained with the truncated importance correction
of :mod:`selfrl.rl.off_policy`, with the sampler's recorded log-probs as the behaviour
policy (``TrainConfig.tis_cap``; the learner always applies it). Dropping keeps the
bound a hard guarantee that the store can check; a down-weight would need a second
knob and still train on samples whose TIS weights are mostly at the cap.
"""

from __future__ import annotations

from selfrl.rl.feedback_age import versions_behind


def staleness(sampled_version: int, loaded: list[int]) -> float:
    """Weight changes of the learner since ``sampled_version`` was last loaded
    (:func:`selfrl.rl.feedback_age.versions_behind`).

    Args:
        sampled_version: the version whose weights sampled the group.
        loaded: versions the learner's weights held, oldest first; the last one is current.

    Returns:
        0 when the sampler's version is the current one, ``k`` after ``k`` changes;
        ``inf`` when the version was never in the learner (a sample from another run).

    Raises:
        ValueError: ``loaded`` is empty.

    >>> staleness(3, [0, 1, 2, 3])
    0
    >>> staleness(1, [0, 1, 2, 3])
    2
    >>> staleness(3, [0, 1, 2, 3, 1])  # 3 rejected, champion 1 back in: one change
    1
    """
    return versions_behind(sampled_version, loaded)


def within_bound(sampled_versions: list[int], loaded: list[int], max_staleness: int) -> list[bool]:
    """Which samples may be trained: staleness <= ``max_staleness``.

    Raises:
        ValueError: ``max_staleness`` < 0, or ``loaded`` is empty.

    >>> within_bound([3, 2, 1], [0, 1, 2, 3], 1)
    [True, True, False]
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return [staleness(v, loaded) <= max_staleness for v in sampled_versions]
