import pytest

from ministats import moving_average, cumulative_sum, normalize, rank


def test_moving_average():
    assert moving_average([1, 2, 3, 4, 5], 2) == [1.5, 2.5, 3.5, 4.5]


def test_moving_average_whole():
    assert moving_average([2, 4, 6], 3) == [4.0]


def test_moving_average_too_long():
    assert moving_average([1, 2], 3) == []


def test_moving_average_bad_window():
    with pytest.raises(ValueError):
        moving_average([1, 2], 0)


def test_cumulative_sum():
    assert cumulative_sum([1, 2, 3]) == [1, 3, 6]


def test_normalize():
    assert normalize([2, 4, 6]) == [0.0, 0.5, 1.0]


def test_normalize_constant():
    assert normalize([3, 3]) == [0.0, 0.0]


def test_rank_ties():
    assert rank([30, 10, 20, 10]) == [4, 1, 3, 1]
