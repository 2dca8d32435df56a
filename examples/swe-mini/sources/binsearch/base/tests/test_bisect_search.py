from searching.bisect_search import find


def test_finds_the_first():
    assert find([1, 3, 5, 7], 1) == 0


def test_missing():
    assert find([1, 3, 5, 7], 4) == -1
