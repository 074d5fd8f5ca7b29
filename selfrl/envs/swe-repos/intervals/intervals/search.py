"""Searching sorted data."""


def bisect_left(xs, x):
    """The first index ``i`` with ``xs[i] >= x`` in sorted ``xs`` (``len(xs)`` if none)."""
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def find_interval(intervals, x):
    """Index of the interval holding ``x`` among sorted, disjoint intervals, or -1."""
    starts = [s for s, _ in intervals]
    i = bisect_left(starts, x + 1) - 1
    if i >= 0 and intervals[i][1] >= x:
        return i
    return -1


def clamp(x, lo, hi):
    """``x`` limited to ``[lo, hi]``."""
    if lo > hi:
        raise ValueError("lo must not exceed hi")
    if x < lo:
        return lo
    if x > hi:
        return hi
    return x
