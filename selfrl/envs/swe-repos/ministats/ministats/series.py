"""Operations on ordered series."""


def moving_average(xs, window):
    """Means of each run of ``window`` consecutive values."""
    if window < 1:
        raise ValueError("window must be positive")
    if window > len(xs):
        return []
    out = []
    total = sum(xs[:window])
    out.append(total / window)
    for i in range(window, len(xs)):
        total += xs[i] - xs[i - window]
        out.append(total / window)
    return out


def cumulative_sum(xs):
    """Running totals."""
    out = []
    total = 0
    for x in xs:
        total += x
        out.append(total)
    return out


def normalize(xs):
    """Scale values linearly onto [0, 1]; all zeros when every value is equal."""
    lo, hi = min(xs), max(xs)
    if hi == lo:
        return [0.0 for _ in xs]
    return [(x - lo) / (hi - lo) for x in xs]


def rank(xs):
    """1-based ranks; tied values share the lowest rank of their run."""
    order = sorted(xs)
    first = {}
    for i, x in enumerate(order):
        if x not in first:
            first[x] = i + 1
    return [first[x] for x in xs]
