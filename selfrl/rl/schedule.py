"""The learning rate of each update of ``selfrl run``: a warmup, then constant, linear or cosine
decay over the run's updates (``train.lr_scheduler_type``, ``train.warmup_ratio``; the names of
TRL's and transformers' ``TrainingArguments``).

The factor multiplies the learning rate the learner holds (``train.learning_rate``, or the
collapse budget's backed-off rate): a schedule shapes a run, a backoff answers a collapse, and
both apply. ``selfrl serve`` learns with no last update to decay toward and refuses any schedule
but ``constant``.

After the warmup, the shapes are transformers' ``get_linear_schedule_with_warmup`` and
``get_cosine_schedule_with_warmup`` (one cosine half-period): with ``W = ceil(warmup_ratio x N)``
warmup updates of ``N`` (at most ``N - 1``: ``selfrl run`` refuses a ratio that leaves no update
after the warmup, and a single update runs at the full rate),
update ``i`` (0-based) has factor ``(i + 1) / (W + 1)`` while ``i < W``, then, with progress
``p = (i - W) / (N - W)``, 1 (``constant``), ``1 - p`` (``linear``) or ``(1 + cos(pi p)) / 2``
(``cosine``). The first update after the warmup has factor 1 and none reaches 0 (the last
one's is ``1 / (N - W)`` for ``linear``), so every update moves the weights. The warmup here
counts from ``1 / (W + 1)``, not 0: an update at rate 0 would save a candidate equal to its parent.

>>> [round(lr_factor("linear", i, 4), 3) for i in range(4)]
[1.0, 0.75, 0.5, 0.25]
>>> [round(lr_factor("cosine", i, 4, warmup_ratio=0.25), 3) for i in range(4)]
[0.5, 1.0, 0.75, 0.25]
"""

from __future__ import annotations

import math

SCHEDULES = ("constant", "linear", "cosine")


def warmup_updates(total: int, warmup_ratio: float) -> int:
    """Updates of the warmup: ``ceil(warmup_ratio x total)``, as transformers rounds it.

    >>> warmup_updates(16, 0.1), warmup_updates(16, 0.0)
    (2, 0)
    """
    return math.ceil(warmup_ratio * total)


def lr_factor(kind: str, update: int, total: int, warmup_ratio: float = 0.0) -> float:
    """The factor in (0, 1] of update ``update`` (0-based) of ``total``.

    Args:
        kind: one of :data:`SCHEDULES`.
        update: the update's index; one at or past ``total`` gets the last update's factor.
        total: the run's updates (``iterations``), >= 1.
        warmup_ratio: the share of ``total`` spent warming up, in [0, 1).

    Raises:
        ValueError: an unknown ``kind`` (the valid ones named), ``total`` < 1, ``update`` < 0 or
            ``warmup_ratio`` outside [0, 1).
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; valid: {', '.join(SCHEDULES)}")
    if total < 1 or update < 0 or not 0 <= warmup_ratio < 1:
        raise ValueError(f"need total >= 1, update >= 0 and 0 <= warmup_ratio < 1, got {total}, {update}, "
                         f"{warmup_ratio}")
    update = min(update, total - 1)
    warm = min(warmup_updates(total, warmup_ratio), total - 1)
    if update < warm:
        return (update + 1) / (warm + 1)
    progress = (update - warm) / (total - warm)
    if kind == "linear":
        return 1.0 - progress
    if kind == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0
