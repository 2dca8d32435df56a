import pytest

from stats.central import mean, median


def test_mean():
    assert mean([1, 2, 3]) == 2


def test_median_of_odd_count():
    assert median([3, 1, 2]) == 2


def test_median_of_nothing():
    with pytest.raises(ValueError):
        median([])


def test_median_of_even_count():
    assert median([4, 1, 3, 2]) == 2.5
