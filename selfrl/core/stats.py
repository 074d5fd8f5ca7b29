"""Confidence intervals for success rates, and for changes in them.

All functions are pure and work on counts or lists of booleans. Rates are
fractions in [0, 1]; differences are ``after - before`` in [-1, 1].

* :func:`wilson_interval` -- Wilson score interval for one binomial proportion
  (Wilson 1927; Agresti & Coull 1998, "Approximate is better than exact").
* :func:`paired_difference_ci` -- the same tasks solved before and after a
  change: normal approximation on the per-task differences.
* :func:`unpaired_difference_ci` -- two independent samples: Newcombe's hybrid
  score interval (Newcombe 1998, method 10).
"""

from __future__ import annotations

import math


def _check_z(z: float) -> None:
    """Raise ValueError unless ``z`` is a finite number >= 0 (a NaN or negative ``z`` gave an
    inverted or meaningless interval, silently)."""
    if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z < 0:
        raise ValueError(f"z must be a finite number >= 0 (1.96 for 95%), got {z!r}")


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion ``successes / n``.

    With ``p = k / n``::

        center = (p + z^2 / (2n)) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / (4 n^2))
        (low, high) = (center - half, center + half)

    Source: E. B. Wilson (1927), "Probable inference, the law of succession,
    and statistical inference", JASA 22(158). Unlike the Wald interval it stays
    inside [0, 1] and does not collapse to a point at 0 or n successes.

    Args:
        successes: number of successes ``k``, ``0 <= k <= n``.
        n: number of trials; ``n == 0`` gives the uninformative ``(0.0, 1.0)``.
        z: standard-normal quantile (1.96 for a two-sided 95% interval).

    Returns:
        ``(low, high)`` as fractions in [0, 1].

    Raises:
        ValueError: if ``n < 0``, ``successes`` is outside ``[0, n]``, or ``z`` is not a
            finite number >= 0.

    Counts of any size work (``1 / n`` is exact integer division, so ``n = 10**400``
    does not overflow a float conversion), and so does any finite ``z``.
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    _check_z(z)
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    inv_n = 1 / n
    z2n = z * z * inv_n  # z^2 / n; inf only for z > 1e154, where the interval is all of [0, 1]
    if not math.isfinite(z2n):
        return 0.0, 1.0
    denom = 1.0 + z2n
    center = (p + z2n / 2) / denom
    half = z / denom * math.sqrt(p * (1 - p) * inv_n + z2n * inv_n / 4)
    return max(0.0, center - half), min(1.0, center + half)


def paired_difference_ci(
    before: list[bool], after: list[bool], z: float = 1.96
) -> tuple[float, float, float]:
    """Mean change in success on the same tasks, with a normal-approximation CI.

    ``before[i]`` and ``after[i]`` are outcomes on the same task ``i``. With
    per-task differences ``d_i = after_i - before_i`` in {-1, 0, 1}::

        mean = sum(d) / n
        s^2  = sum((d_i - mean)^2) / (n - 1)        (sample variance)
        (low, high) = mean -/+ z * s / sqrt(n)

    clipped to [-1, 1]. This is the paired (one-sample on differences) Wald
    interval; pairing removes the between-task variance, so it is much tighter
    than comparing two independent rates when the tasks differ in difficulty.
    It is the normal approximation (z, not Student's t), so it is optimistic
    for small ``n``; when every ``d_i`` is equal the width is 0.

    Args:
        before: outcome per task before the change.
        after: outcome per task after the change, same order and length.
        z: standard-normal quantile (1.96 for 95%).

    Returns:
        ``(mean_difference, low, high)``. With ``n < 2`` the variance is
        undefined and the interval is ``(-1.0, 1.0)`` (mean 0.0 when ``n == 0``).

    Raises:
        ValueError: if the lists differ in length, or ``z`` is not a finite number >= 0.
    """
    if len(before) != len(after):
        raise ValueError(f"paired outcomes differ in length: {len(before)} before, {len(after)} after")
    _check_z(z)
    n = len(before)
    diffs = [float(bool(a)) - float(bool(b)) for b, a in zip(before, after)]
    mean = sum(diffs) / n if n else 0.0
    if n < 2:
        return mean, -1.0, 1.0
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1)
    half = z * math.sqrt(var / n)
    return mean, max(-1.0, mean - half), min(1.0, mean + half)


def unpaired_difference_ci(
    k1: int, n1: int, k2: int, n2: int, z: float = 1.96
) -> tuple[float, float, float]:
    """Difference of two independent proportions ``k2/n2 - k1/n1``, Newcombe's CI.

    Newcombe's hybrid score interval (R. G. Newcombe 1998, "Interval estimation
    for the difference between independent proportions", Statistics in
    Medicine 17, method 10) combines the two Wilson intervals
    ``(l1, u1)`` and ``(l2, u2)``; with ``p_i = k_i / n_i`` and ``d = p2 - p1``::

        low  = d - sqrt((p2 - l2)^2 + (u1 - p1)^2)
        high = d + sqrt((u2 - p2)^2 + (p1 - l1)^2)

    Unlike the Wald interval it behaves at rates near 0 or 1. Use
    :func:`paired_difference_ci` instead when both samples are the same tasks.

    Args:
        k1, n1: successes and trials of the first ("before") sample.
        k2, n2: successes and trials of the second ("after") sample.
        z: standard-normal quantile (1.96 for 95%).

    Returns:
        ``(difference, low, high)`` with the difference ``p2 - p1``.

    Raises:
        ValueError: if a sample is empty, a count is outside ``[0, n]``, or ``z`` is not a
            finite number >= 0.
    """
    if n1 <= 0 or n2 <= 0:
        raise ValueError(f"both samples need at least one trial, got n1={n1}, n2={n2}")
    l1, u1 = wilson_interval(k1, n1, z)
    l2, u2 = wilson_interval(k2, n2, z)
    p1, p2 = k1 / n1, k2 / n2
    d = p2 - p1
    low = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
    high = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
    return d, max(-1.0, low), min(1.0, high)
