import pytest

from intervals import bisect_left, find_interval, clamp


def test_bisect_left_present():
    assert bisect_left([1, 3, 3, 5], 3) == 1


def test_bisect_left_absent():
    assert bisect_left([1, 3, 5], 4) == 2
    assert bisect_left([1, 3, 5], 9) == 3


def test_find_interval():
    spans = [(1, 3), (6, 8), (10, 12)]
    assert find_interval(spans, 7) == 1
    assert find_interval(spans, 6) == 1
    assert find_interval(spans, 12) == 2


def test_find_interval_gap():
    assert find_interval([(1, 3), (6, 8)], 4) == -1
    assert find_interval([(1, 3), (6, 8)], 0) == -1


def test_clamp():
    assert clamp(5, 1, 3) == 3
    assert clamp(-2, 1, 3) == 1
    assert clamp(2, 1, 3) == 2


def test_clamp_bad_bounds():
    with pytest.raises(ValueError):
        clamp(1, 3, 1)
