import pytest

from batching.chunks import chunked


def test_even_split():
    assert chunked([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_bad_size():
    with pytest.raises(ValueError):
        chunked([1], 0)


def test_uneven_split_keeps_the_rest():
    assert chunked([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_size_larger_than_the_list():
    assert chunked([1, 2], 5) == [[1, 2]]
