"""Set-like operations on closed intervals ``(start, end)`` with ``start <= end``."""


def overlaps(a, b):
    """True when the closed intervals share at least one point."""
    return a[0] <= b[1] and b[0] <= a[1]


def contains(interval, x):
    """True when ``x`` lies in the closed interval."""
    return interval[0] <= x <= interval[1]


def intersection(a, b):
    """The common part of two intervals, or None."""
    if not overlaps(a, b):
        return None
    return (max(a[0], b[0]), min(a[1], b[1]))


def merge(intervals):
    """Merge overlapping or touching intervals; the result is sorted."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total_length(intervals):
    """Number of integers covered by the union of the intervals."""
    return sum(end - start + 1 for start, end in merge(intervals))
