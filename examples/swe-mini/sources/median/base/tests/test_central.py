import pytest

from stats.central import mean, median


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_median_of_odd_count():
    assert median([3, 1, 2]) == 2


def test_median_of_nothing():
    with pytest.raises(ValueError):
        median([])
