"""Central tendency and spread."""

import math


def mean(xs):
    """Arithmetic mean; ValueError on an empty sequence."""
    if not xs:
        raise ValueError("mean of empty data")
    return sum(xs) / len(xs)


def median(xs):
    """Middle value (mean of the two middle values for an even count)."""
    if not xs:
        raise ValueError("median of empty data")
    s = sorted(xs)
    n = len(s)
    mid = n // 2
    if n % 2 == 1:
        return s[mid]
    return (s[mid - 1] + s[mid]) / 2


def mode(xs):
    """Most common value; the smallest one on a tie."""
    if not xs:
        raise ValueError("mode of empty data")
    counts = {}
    for x in xs:
        counts[x] = counts.get(x, 0) + 1
    best = None
    for x in sorted(counts):
        if best is None or counts[x] > counts[best]:
            best = x
    return best


def variance(xs, sample=True):
    """Variance; the sample variance (n - 1) by default."""
    n = len(xs)
    if n < 2 and sample:
        raise ValueError("sample variance needs at least two values")
    m = mean(xs)
    ss = sum((x - m) ** 2 for x in xs)
    return ss / (n - 1) if sample else ss / n


def stdev(xs, sample=True):
    """Standard deviation (square root of ``variance``)."""
    return math.sqrt(variance(xs, sample))


def percentile(xs, p):
    """The p-th percentile (0..100) with linear interpolation between ranks."""
    if not 0 <= p <= 100:
        raise ValueError("p must be in [0, 100]")
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * p / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    frac = pos - lo
    return s[lo] + (s[hi] - s[lo]) * frac
