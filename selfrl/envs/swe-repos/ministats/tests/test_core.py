import pytest

from ministats import mean, median, mode, variance, stdev, percentile


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_empty():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd():
    assert median([5, 1, 3]) == 3


def test_median_even():
    assert median([4, 1, 3, 2]) == 2.5


def test_mode_tie_takes_smallest():
    assert mode([3, 1, 3, 1, 2]) == 1


def test_mode_single_winner():
    assert mode([2, 7, 7, 1]) == 7


def test_variance_sample():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9]) == pytest.approx(32 / 7)


def test_variance_population():
    assert variance([2, 4, 4, 4, 5, 5, 7, 9], sample=False) == 4.0


def test_variance_too_short():
    with pytest.raises(ValueError):
        variance([1])


def test_stdev_population():
    assert stdev([2, 4, 4, 4, 5, 5, 7, 9], sample=False) == 2.0


def test_percentile_ends():
    assert percentile([3, 1, 2], 0) == 1
    assert percentile([3, 1, 2], 100) == 3


def test_percentile_interpolates():
    assert percentile([10, 20, 30, 40], 50) == 25.0


def test_percentile_range():
    with pytest.raises(ValueError):
        percentile([1, 2], 101)
