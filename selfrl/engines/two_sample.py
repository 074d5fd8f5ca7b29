"""Two-sample tests: do two sets of samples come from the same distribution?

Used to compare what two sampling backends draw from the same model and prompts
(``tests/test_engine_parity.py``, ``benchmarks/bench_parity.py``). Pure Python, no
scipy. Every function returns a p-value: the probability, under the hypothesis that
both samples come from one distribution, of a statistic at least as extreme.

* :func:`chi_square_homogeneity` -- categorical samples (first tokens, lengths,
  turn counts): Pearson's chi-square on the 2 x k table, categories with an
  expected count under 5 pooled into one (Cochran's rule).
* :func:`mann_whitney` -- ordinal samples (lengths, distinct completions per group):
  the U test, normal approximation with the tie correction (Lehmann, *Nonparametrics*,
  1975, ch. 1).
* :func:`ks_uniform` -- one sample against Uniform(0, 1): Kolmogorov-Smirnov with the
  asymptotic distribution and Stephens' small-sample correction (Stephens 1970, JRSS B 32).
  With :func:`sampling_pit` it checks a sampler on its own: the randomized probability
  integral transforms of ids drawn one after another from known distributions are i.i.d.
  uniform (Brockwell 2007, "Universal residuals").
* :func:`chi2_sf` -- the chi-square survival function, from the regularized upper
  incomplete gamma function (Numerical Recipes, 3rd ed., section 6.2).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

MIN_EXPECTED = 5.0  # Cochran's rule: pool categories expected fewer times than this


@dataclass(frozen=True)
class TwoSampleResult:
    """A test statistic, its degrees of freedom (0 when not a chi-square) and its p-value."""

    statistic: float
    p_value: float
    df: int = 0


def _gamma_p_series(a: float, x: float) -> float:
    term = total = 1.0 / a
    for n in range(1, 10_000):
        term *= x / (a + n)
        total += term
        if abs(term) < abs(total) * 1e-15:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_q_fraction(a: float, x: float) -> float:
    tiny = 1e-300
    b = x + 1.0 - a
    c, d = 1.0 / tiny, 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X chi-square with ``df`` degrees of freedom.

    >>> round(chi2_sf(3.841458820694124, 1), 6)
    0.05
    >>> round(chi2_sf(18.307038053275146, 10), 6)
    0.05

    Raises:
        ValueError: ``df < 1``.
    """
    if df < 1:
        raise ValueError(f"chi2_sf needs df >= 1, got {df}")
    if x <= 0:
        return 1.0
    a, h = df / 2.0, x / 2.0
    return 1.0 - _gamma_p_series(a, h) if h < a + 1.0 else _gamma_q_fraction(a, h)


def chi_square_homogeneity(a: Sequence[Hashable], b: Sequence[Hashable],
                           min_expected: float = MIN_EXPECTED) -> TwoSampleResult:
    """Pearson's chi-square test that samples ``a`` and ``b`` of categories share one distribution.

    The 2 x k table of counts is tested against the expected counts under one pooled
    distribution; categories whose expected count is under ``min_expected`` in either
    sample are pooled into one (dropped when even the pool is under it). One category
    left: the statistic is 0 and the p-value 1.

    >>> chi_square_homogeneity(["x"] * 50 + ["y"] * 50, ["x"] * 50 + ["y"] * 50).p_value
    1.0
    >>> chi_square_homogeneity(["x"] * 80 + ["y"] * 20, ["x"] * 20 + ["y"] * 80).p_value < 1e-10
    True

    Raises:
        ValueError: an empty sample.
    """
    if not a or not b:
        raise ValueError("chi_square_homogeneity needs two non-empty samples")
    ca, cb = Counter(a), Counter(b)
    na, nb = len(a), len(b)
    n = na + nb
    cells: list[tuple[int, int]] = []
    pool = [0, 0]
    for key in set(ca) | set(cb):
        total = ca[key] + cb[key]
        if min(total * na / n, total * nb / n) < min_expected:
            pool[0] += ca[key]
            pool[1] += cb[key]
        else:
            cells.append((ca[key], cb[key]))
    if min(sum(pool) * na / n, sum(pool) * nb / n) >= min_expected:
        cells.append((pool[0], pool[1]))
    if len(cells) < 2:
        return TwoSampleResult(0.0, 1.0, 0)
    na_kept, nb_kept = sum(c[0] for c in cells), sum(c[1] for c in cells)
    n_kept = na_kept + nb_kept
    stat = 0.0
    for xa, xb in cells:
        total = xa + xb
        ea, eb = total * na_kept / n_kept, total * nb_kept / n_kept
        stat += (xa - ea) ** 2 / ea + (xb - eb) ** 2 / eb
    df = len(cells) - 1
    return TwoSampleResult(stat, chi2_sf(stat, df), df)


def combine_chi_square(results: Sequence[TwoSampleResult]) -> TwoSampleResult:
    """Independent chi-square tests as one: statistics and degrees of freedom add up.

    >>> round(combine_chi_square([TwoSampleResult(3.0, 0.0, 1), TwoSampleResult(0.841458820694124, 0.0, 1)]).p_value, 4)
    0.1465
    """
    stat = sum(r.statistic for r in results)
    df = sum(r.df for r in results)
    return TwoSampleResult(stat, chi2_sf(stat, df) if df else 1.0, df)


def mann_whitney(a: Sequence[float], b: Sequence[float]) -> TwoSampleResult:
    """Two-sided Mann-Whitney U test (normal approximation, tie-corrected); the statistic
    is U of ``a`` (pairs where ``a`` exceeds ``b``, ties counting one half).

    >>> mann_whitney([1, 2, 3, 4] * 10, [1, 2, 3, 4] * 10).p_value
    1.0
    >>> mann_whitney(list(range(30)), [x + 20 for x in range(30)]).p_value < 1e-6
    True

    Raises:
        ValueError: an empty sample.
    """
    if not a or not b:
        raise ValueError("mann_whitney needs two non-empty samples")
    na, nb = len(a), len(b)
    pooled = sorted([(x, 0) for x in a] + [(x, 1) for x in b])
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[k] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    rank_a = sum(r for r, (_, side) in zip(ranks, pooled) if side == 0)
    u = rank_a - na * (na + 1) / 2
    n = na + nb
    var = na * nb / 12 * ((n + 1) - ties / (n * (n - 1)))
    if var <= 0:
        return TwoSampleResult(u, 1.0)
    z = (u - na * nb / 2) / math.sqrt(var)
    return TwoSampleResult(u, min(1.0, math.erfc(abs(z) / math.sqrt(2))))


def ks_uniform(values: Sequence[float]) -> TwoSampleResult:
    """Kolmogorov-Smirnov test that ``values`` are a sample of Uniform(0, 1); the statistic is D.

    >>> ks_uniform([(i + 0.5) / 100 for i in range(100)]).p_value > 0.99
    True
    >>> ks_uniform([v / 200 for v in range(100)]).p_value < 1e-10
    True

    Raises:
        ValueError: no values.
    """
    if not values:
        raise ValueError("ks_uniform needs at least one value")
    xs = sorted(values)
    n = len(xs)
    d = max(max((i + 1) / n - x, x - i / n) for i, x in enumerate(xs))
    lam = (math.sqrt(n) + 0.12 + 0.11 / math.sqrt(n)) * d
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return TwoSampleResult(d, min(1.0, max(0.0, p)))


def sampling_pit(probs, ids, uniforms):
    """Randomized probability integral transforms of sampled ids: ``P(X > x) + U * P(X = x)``
    with the ids ordered by probability (larger first), one value per row; i.i.d. Uniform(0, 1)
    exactly when each id was drawn from its row's distribution.

    Args:
        probs: (n, V) float tensor, each row a distribution (the one the id should come from).
        ids: (n,) long tensor of the sampled ids.
        uniforms: (n,) float tensor of Uniform(0, 1) draws (fixed, for a repeatable test).

    Returns:
        (n,) float tensor in [0, 1].
    """
    p_x = probs.gather(-1, ids[:, None])  # (n, 1)
    above = (probs * (probs > p_x)).sum(-1)  # (n,) mass of the more probable ids
    return (above + uniforms * p_x.squeeze(-1)).clamp(0.0, 1.0)
