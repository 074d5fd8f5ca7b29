import math

import pytest

from selfrl.core.stats import paired_difference_ci, unpaired_difference_ci, wilson_interval


def test_wilson_10_of_100():
    # p = 0.1, z^2 = 3.8416, z^2/n = 0.038416, denom = 1.038416
    # center = (0.1 + 0.019208) / 1.038416 = 0.114798
    # half   = 1.96 * sqrt(0.1*0.9/100 + 3.8416/40000) / 1.038416
    #        = 1.96 * sqrt(0.00099604) / 1.038416 = 1.96 * 0.0315601 / 1.038416 = 0.059569
    # -> (0.05523, 0.17437)
    low, high = wilson_interval(10, 100)
    assert low == pytest.approx(0.05523, abs=1e-4)
    assert high == pytest.approx(0.17437, abs=1e-4)


def test_wilson_2_of_5():
    # p = 0.4, z^2/n = 0.76832, denom = 1.76832, center = (0.4 + 0.38416) / 1.76832 = 0.44345
    # half = 1.96 * sqrt(0.048 + 0.038416) / 1.76832 = 1.96 * 0.293966 / 1.76832 = 0.32583
    # -> (0.11762, 0.76928)
    low, high = wilson_interval(2, 5)
    assert low == pytest.approx(0.11762, abs=1e-4)
    assert high == pytest.approx(0.76928, abs=1e-4)


def test_wilson_edges():
    # 0 successes: low = 0, high = z^2 / (n + z^2) = 3.8416 / 13.8416 = 0.277540
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.277540), abs=1e-5)
    # symmetric for n successes
    assert wilson_interval(10, 10) == pytest.approx((1 - 0.277540, 1.0), abs=1e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)
    with pytest.raises(ValueError):
        wilson_interval(-1, 2)


def test_wilson_matches_quadratic_roots():
    # Naive reference: the interval's ends solve (k/n - p)^2 = z^2 p (1 - p) / n for p.
    for k, n in [(1, 7), (13, 40), (99, 100)]:
        z2, ph = 1.96**2, k / n
        a, b, c = 1 + z2 / n, -(2 * ph + z2 / n), ph * ph
        disc = math.sqrt(b * b - 4 * a * c)
        assert wilson_interval(k, n) == pytest.approx(((-b - disc) / (2 * a), (-b + disc) / (2 * a)), abs=1e-12)


def test_paired_difference_hand_example():
    before = [False, False, True, True, False]
    after = [True, False, True, True, True]
    # d = [1, 0, 0, 0, 1], mean = 0.4
    # squared deviations: 0.36, 0.16, 0.16, 0.16, 0.36 -> sum 1.2, s^2 = 1.2 / 4 = 0.3
    # se = sqrt(0.3 / 5) = 0.244949, half = 1.96 * 0.244949 = 0.480100
    # -> (0.4, -0.080100, 0.880100)
    diff, low, high = paired_difference_ci(before, after)
    assert diff == pytest.approx(0.4)
    assert low == pytest.approx(-0.080100, abs=1e-5)
    assert high == pytest.approx(0.880100, abs=1e-5)


def test_paired_difference_small_and_degenerate():
    assert paired_difference_ci([], []) == (0.0, -1.0, 1.0)
    assert paired_difference_ci([False], [True]) == (1.0, -1.0, 1.0)
    # every task improved: zero variance, zero width
    assert paired_difference_ci([False] * 4, [True] * 4) == (1.0, 1.0, 1.0)
    # clipped to [-1, 1]
    _, low, high = paired_difference_ci([False, True, False], [True, True, True])
    assert -1.0 <= low and high <= 1.0
    with pytest.raises(ValueError):
        paired_difference_ci([True], [True, False])


def test_unpaired_newcombe_published_example():
    # Newcombe (1998), Table II example (56/70 vs 48/80), method 10: 0.0524 to 0.3339
    # for p1 - p2 = 0.2; we return p2 - p1, so the interval is mirrored.
    diff, low, high = unpaired_difference_ci(56, 70, 48, 80)
    assert diff == pytest.approx(-0.2)
    assert low == pytest.approx(-0.3339, abs=1e-4)
    assert high == pytest.approx(-0.0524, abs=1e-4)
    with pytest.raises(ValueError):
        unpaired_difference_ci(0, 0, 1, 2)


def test_intervals_of_huge_counts_do_not_overflow():
    # 1 / n and z^2 / n of an int beyond the float range raised OverflowError
    n = 10 ** 400
    assert wilson_interval(n, n) == (1.0, 1.0)
    assert wilson_interval(n // 2, n) == (pytest.approx(0.5), pytest.approx(0.5))
    assert unpaired_difference_ci(n // 4, n, n // 2, n) == (pytest.approx(0.25), pytest.approx(0.25),
                                                            pytest.approx(0.25))
    low, high = wilson_interval(3, 2 ** 62)
    assert 0 < low < 3 / 2 ** 62 < high < 1e-17


@pytest.mark.parametrize("z", [math.nan, math.inf, -1.96, "1.96"])
def test_a_z_that_is_not_a_finite_non_negative_number_is_refused(z):
    # a NaN z gave (0, 1) and a negative one an inverted interval, silently
    for call in (lambda: wilson_interval(5, 10, z), lambda: paired_difference_ci([True], [False], z),
                 lambda: unpaired_difference_ci(1, 3, 2, 3, z)):
        with pytest.raises(ValueError, match="z must be a finite number >= 0"):
            call()


def test_a_huge_z_gives_the_whole_range():
    assert wilson_interval(5, 10, 1e200) == (0.0, 1.0)
    assert paired_difference_ci([True, False], [False, True], 1e200)[1:] == (-1.0, 1.0)
